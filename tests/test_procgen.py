"""Procgen (Cobbe et al., 2020), EnvPool's, with Qt 5's libraries from the locked PyQt5-Qt5 wheel (setup.sh): every
discrete-action script trains on a game's training levels, and cleanba/evaluate.py plays the saved model on levels the
run never saw."""

import os
import subprocess
import sys

from evaluate import UNSEEN_LEVELS
from helpers import REPO, finished_run, read_scalars, train

# A game per script, so that three of the sixteen are exercised; easy mode, as the generalisation protocol.
GAMES = {"ppo": "StarpilotEasy-v0", "impala": "BigfishEasy-v0", "pqn": "CoinrunEasy-v0"}
EVALUATE = os.path.join(REPO, "cleanba", "evaluate.py")


def evaluate(run_dir: str, *flags) -> subprocess.CompletedProcess:
    command = [sys.executable, EVALUATE, run_dir, *map(str, flags)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_procgen_trains_on_its_levels_and_plays_unseen_ones(algo, tmp_path):
    """A few updates on 10 training levels (from level 5) with each script's ResNet on 64x64 frames, then 2 episodes
    on unseen levels, logged apart from those on the training levels."""
    flags = ["--env-id", GAMES[algo], "--num-levels", 10, "--start-level", 5, "--local-num-envs", 4]
    flags += ["--num-actor-threads", 1, "--num-steps", 16, "--total-timesteps", 3 * 4 * 16, "--save-model"]
    flags += ["--num-minibatches", 4]
    if algo != "impala":  # one epoch: a CPU update unrolls its gradient steps, and each ResNet step adds to the compile
        flags += ["--update-epochs", 1]
    run_dir = train(tmp_path, *flags, algo=algo)
    run = finished_run(tmp_path)
    assert [record["update"] for record in run.records] == [1, 2, 3]
    assert (run.config["args"]["num_levels"], run.config["args"]["start_level"]) == (10, 5)
    unseen = evaluate(run_dir, "--levels", "unseen", "--episodes", 2)
    assert unseen.returncode == 0, unseen.stderr[-3000:]
    first_unseen = 5 + 10  # after the training levels, 5 to 14
    assert f"unseen levels: {first_unseen} to {first_unseen + UNSEEN_LEVELS - 1}\n" in unseen.stdout, unseen.stdout
    assert unseen.stdout.count(" on unseen levels: return ") == 2, unseen.stdout
    assert "mean return over 2 episodes on unseen levels: " in unseen.stdout
    scalars = read_scalars(run_dir)  # logged apart from the training levels' evaluation
    assert len(scalars["eval/unseen_levels_episodic_return"]) == 2 and "eval/episodic_return" not in scalars


def test_unseen_levels_need_a_run_that_left_some_out(sync_run):
    """A run that trained on every level (or on a game without levels) has none unseen: one line, exit status 2."""
    refused = evaluate(sync_run.path, "--levels", "unseen")
    assert refused.returncode == 2 and refused.stdout == "", refused.stderr
    env_id = sync_run.config["args"]["env_id"]
    expected = f"error: --levels unseen: the run trained on {env_id} with --num-levels 0, every level: none is unseen"
    assert refused.stderr.strip().splitlines() == [expected]
