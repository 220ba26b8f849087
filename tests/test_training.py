"""End-to-end tests of both training scripts, run as a user runs them."""

import dataclasses
import glob
import json
import os

import flax.serialization
import numpy as np
import pytest
from helpers import (ALGOS, BREAKOUT, CARTPOLE, CARTPOLE_SOLVE, check, load_script, only_run, read_scalars, run,
                     run_dirs, run_processes, script_env, solved_score, values)

each_algo = pytest.mark.parametrize("algo", ALGOS)


@each_algo
@pytest.mark.slow
def test_cartpole_learns(tmp_path, algo):
    check(run(tmp_path, *CARTPOLE_SOLVE[algo], algo=algo))
    returns = values(read_scalars(only_run(tmp_path)), "charts/episodic_return")
    assert solved_score(algo, returns) >= 450, returns
    assert returns[0] < 100, returns  # it learned: the first episodes were far from solved


@each_algo
@pytest.mark.parametrize("concurrency", [True, False])
def test_version_contract(tmp_path, algo, concurrency):
    """Read back from the events: the data of update u comes from policy max(1, u-1) with the Cleanba
    architecture (the actor skips fetching at iteration 2), from policy u without."""
    flags = [*CARTPOLE, "--num-actor-threads", "2", "--total-timesteps", 8 * 256]
    check(run(tmp_path, *flags, "--concurrency" if concurrency else "--no-concurrency", algo=algo))
    scalars = read_scalars(only_run(tmp_path))
    learner = values(scalars, "stats/learner_policy_version")
    actor = values(scalars, "stats/actor_policy_version")
    assert learner == list(range(1, 9))
    expected = [max(1, v - 1) for v in learner] if concurrency else learner
    assert actor == expected


@each_algo
def test_breakout_one_actor_two_learner_devices(tmp_path, algo):
    result = check(run(tmp_path, *BREAKOUT[algo], "--actor-device-ids", 0, "--learner-device-ids", 1, 2,
                       "--total-timesteps", 3 * 64, "--concurrency", num_devices=3, algo=algo))
    assert "layout a0-l1,2-d1 " in result.stdout
    scalars = read_scalars(only_run(tmp_path))
    losses = values(scalars, "losses/loss")
    assert len(losses) == 3 and np.all(np.isfinite(losses))
    assert values(scalars, "stats/update") == [1, 2, 3]


@each_algo
@pytest.mark.slow
def test_breakout_two_processes(tmp_path, algo):
    outputs = run_processes(tmp_path, *BREAKOUT[algo], "--total-timesteps", 3 * 128, algo=algo)
    assert "8 envs x 16 steps = 128 per update" in outputs[0]  # both processes' envs in one global batch
    scalars = read_scalars(only_run(tmp_path))  # only rank 0 writes logs
    assert values(scalars, "stats/update") == [1, 2, 3]
    assert np.all(np.isfinite(values(scalars, "losses/loss")))


@each_algo
def test_save_model_round_trip(tmp_path, algo):
    check(run(tmp_path, *CARTPOLE, "--total-timesteps", 4 * 256, "--save-model", "--eval-episodes", 3, algo=algo))
    run_dir = only_run(tmp_path)
    with open(os.path.join(run_dir, f"cleanba_{algo}.cleanba_model"), "rb") as f:
        params = flax.serialization.msgpack_restore(f.read())
    assert set(params) == {"torso", "actor", "critic"}
    kernel = params["actor"]["params"]["Dense_0"]["kernel"]
    assert kernel.shape == (64, 2) and np.all(np.isfinite(kernel))
    with open(os.path.join(run_dir, "config.json")) as f:
        assert json.load(f)["args"]["env_id"] == "CartPole-v1"
    eval_returns = values(read_scalars(run_dir), "eval/episodic_return")
    assert len(eval_returns) == 3 and all(1 <= r <= 500 for r in eval_returns)


@each_algo
def test_track_mirrors_the_logs_to_wandb_offline(tmp_path, algo):
    env = dict(script_env(), WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true")
    check(run(tmp_path, *CARTPOLE, "--total-timesteps", 2 * 256, "--track", env=env, algo=algo))
    runs = glob.glob(os.path.join(tmp_path, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(runs) == 1, os.listdir(tmp_path)
    with open(runs[0], "rb") as f:
        records = f.read()
    for tag in [b"losses/value_loss", b"charts/SPS", b"stats/learner_policy_version"]:  # from TensorBoard
        assert tag in records, tag


@each_algo
def test_help_lists_every_flag(tmp_path, algo):
    help_text = check(run(tmp_path, "--help", algo=algo)).stdout
    for field in dataclasses.fields(load_script(algo).Args):
        assert f"--{field.name.replace('_', '-')}" in help_text, field.name


BAD_INPUT = [
    (["--local-num-envs", 3, "--num-actor-threads", 1, "--learner-device-ids", 1, 2], "--local-num-envs"),
    (["--learner-device-ids", 0, 5], "--learner-device-ids"),
    (["--actor-device-ids", 7], "--actor-device-ids"),
    (["--env-id", "NoSuchGame-v5"], "--env-id"),
    (["--env-id", "Pendulum-v1"], "--env-id"),
    (["--total-timesteps", 1000], "--total-timesteps"),
    (["--local-num-envs", 0], "--local-num-envs"),
    (["--num-minibatches", -1], "--num-minibatches"),
    (["--num-actor-threads", 0], "--num-actor-threads"),
    (["--run-name", "../elsewhere"], "--run-name"),
]
ALGO_BAD_INPUT = {
    "ppo": [(["--num-steps", 10, "--num-minibatches", 3], "--num-minibatches"),
            (["--update-epochs", 0], "--update-epochs")],
    "impala": [(["--local-num-envs", 6, "--num-actor-threads", 1, "--num-minibatches", 4], "--num-minibatches")],
}


@pytest.mark.parametrize("algo, flags, flag", [(algo, flags, flag) for algo in ALGOS
                                                for flags, flag in BAD_INPUT + ALGO_BAD_INPUT[algo]])
def test_bad_input_is_refused(tmp_path, algo, flags, flag):
    result = run(tmp_path, "--env-id", "CartPole-v1", *flags, num_devices=3, timeout=60, algo=algo)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag} "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert run_dirs(tmp_path) == []
