"""Gymnasium environments (DESIGN.md §6): any Gymnasium id, a user's `module:Env-v0` included, trains in the three
scripts under every contract EnvPool's environments have: it learns, the same command gives the same run, layouts give
the same batches, SIGTERM checkpoints and the command resumes, evaluate.py plays and records it, and what cannot work
is refused in one line. The user's environments are tests/user_envs.py, copied into each run's working directory."""

import json
import os
import re
import shutil
import signal

import imageio.v3 as imageio
import jax
import numpy as np
import pytest
import tyro
from helpers import (
    CARTPOLE_SOLVE,
    REPO,
    check,
    finished_run,
    lingering_processes,
    load_script,
    only_run,
    read_scalars,
    run,
    run_processes,
    script_env,
    start,
)
from test_training import evaluate, run_evaluate

USER_ENVS = os.path.join(REPO, "tests", "user_envs.py")
# Seeker: a Dict of an image and a vector, episodes cut by a time limit at 50 steps; 8 envs in all, 4 updates.
SEEKER = "--env-id user_envs:Seeker-v0 --num-steps 16 --num-minibatches 2 --total-timesteps 512 --log-frequency 1"
SEEKER = [*SEEKER.split(), "--layout-free-group-size", 2]
# The example of examples/catch.py's docstring and the Environments page.
CATCH = "--env-id examples.catch:Catch-v0 --local-num-envs 8 --num-actor-threads 1 --num-steps 32"
CATCH = [*CATCH.split(), "--total-timesteps", 100_000]


def user_dir(path) -> str:
    """A working directory with the user's module in it."""
    os.makedirs(path, exist_ok=True)
    shutil.copy(USER_ENVS, path)
    return str(path)


@pytest.mark.slow
def test_gymnasium_cartpole_learns_and_resumes_after_sigterm(tmp_path):
    """Gymnasium's CartPole-v1 through the Gymnasium path (forced: EnvPool has the id too) at the README's settings:
    stopped by SIGTERM at update 120 (a checkpoint, exit 143), resumed by the same command, solved; its model plays."""
    flags = [*CARTPOLE_SOLVE["ppo"], "--env-backend", "gymnasium", "--checkpoint-interval", 0, "--save-model"]
    proc = start(tmp_path, *flags, env={**script_env(), "CLEANBA_FAULT": "sigterm@120"})
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM after update 120" in output, output[-3000:]
    assert not lingering_processes([proc.pid])  # the environments' worker processes ended with the run
    proc = start(tmp_path, *flags)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0 and "after update 120" in output, output[-3000:]
    assert not lingering_processes([proc.pid])
    run = finished_run(tmp_path)
    assert [r["update"] for r in run.records] == list(range(1, run.config["layout"]["num_updates"] + 1))
    returns = [value for _, value in run.scalars["charts/episodic_return"]]
    assert returns[0] < 100 and np.mean(returns[-3:]) >= 450, returns
    assert np.mean(evaluate(run.path, 3)) >= 300


def test_a_users_environment_is_the_same_run_on_any_layout(tmp_path):
    """A user's module's environment (a Dict of an image and a vector) trains; the same command twice gives the same
    updates.jsonl and metrics; with --layout-free-group-size, 1 or 2 actor threads and 1 or 2 processes give the same
    run bit for bit (each environment seeded by its global index, its actions keyed by it)."""

    def seeker_run(name, *layout, processes=1):
        cwd = user_dir(tmp_path / name)
        if processes == 1:
            return finished_run(cwd, check(run(cwd, *SEEKER, *layout)).stdout)
        run_processes(cwd, *SEEKER, *layout, num_processes=processes)
        return finished_run(cwd)

    two_threads = seeker_run("two_threads", "--local-num-envs", 4)
    assert [r["update"] for r in two_threads.records] == [1, 2, 3, 4]
    assert sum(r["episodes"][0] for r in two_threads.records) == 8  # each env's episode cut at 50 steps
    again = seeker_run("again", "--local-num-envs", 4)
    assert again.records == two_threads.records
    for tag, series in two_threads.scalars.items():
        if not tag.startswith("stats/") and tag != "charts/SPS":
            assert again.scalars[tag] == series, tag
    one_thread = seeker_run("one_thread", "--local-num-envs", 8, "--num-actor-threads", 1)
    assert one_thread.records == two_threads.records
    two_processes = seeker_run("two_processes", "--local-num-envs", 4, "--num-actor-threads", 1, processes=2)
    assert two_processes.records == two_threads.records


@pytest.mark.parametrize("algo", ["impala", "pqn"], indirect=True)
def test_impala_and_pqn_train_gymnasium_cartpole(tmp_path, algo):
    """IMPALA and PQN train Gymnasium's CartPole-v1 through the Gymnasium path: every update recorded, episodes ended
    and logged from the episodes themselves (CartPole's returns are their lengths)."""
    flags = "--env-id CartPole-v1 --env-backend gymnasium --local-num-envs 4 --num-steps 32 --log-frequency 1"
    check(run(tmp_path, *flags.split(), "--total-timesteps", 10 * 256, algo=algo))
    run_dir = only_run(tmp_path)
    with open(os.path.join(run_dir, "updates.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["update"] for r in records] == list(range(1, 11))
    episodes, returns, lengths = np.sum([r["episodes"] for r in records], axis=0)
    assert episodes > 10 and returns == lengths
    assert read_scalars(run_dir)["charts/episodic_return"]


def test_the_example_environment_learns_and_plays_in_a_video(tmp_path):
    """examples/catch.py's documented command learns Catch (a random policy's return is about -6 of 10) and its model
    plays in cleanba/evaluate.py, recorded as a video of the frames the environment renders."""
    shutil.copytree(os.path.join(REPO, "examples"), tmp_path / "examples")
    check(run(tmp_path, *CATCH, "--save-model"))
    run_dir = only_run(tmp_path)
    returns = [value for _, value in read_scalars(run_dir)["charts/episodic_return"]]
    assert returns[0] < 0 and returns[-1] >= 8, returns
    result = run_evaluate(run_dir, "--episodes", 1, "--video", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    [video] = os.listdir(os.path.join(run_dir, "videos"))
    played = re.fullmatch(r"eval-seed1-episode0-return([0-9.]+)\.mp4", video)
    assert played and float(played[1]) >= 8, video
    frames = imageio.imread(os.path.join(run_dir, "videos", video), index=None)
    assert frames.shape == (91, 160, 80, 3)  # the reset and 90 steps, each 10 x 5 cells of 16 pixels


def test_an_environment_that_fails_while_training_ends_the_run_in_one_line(tmp_path):
    """An environment's exception in a worker process: exit 1, the error in one line naming the environment, the call
    and where it was raised; no traceback, and no process of the run left behind."""
    cwd = user_dir(tmp_path)
    proc = start(cwd, "--env-id", "user_envs:FailsOnStep-v0", "--local-num-envs", 2, "--num-steps", 8)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 1, output[-3000:]
    error = r"error: --env-id user_envs:FailsOnStep-v0: step raised RuntimeError \(.*/user_envs.py:[0-9]+\): "
    errors = [line for line in output.splitlines() if line.startswith("error")]  # (each actor thread's envs fail)
    assert errors and all(re.fullmatch(f"{error}the simulator lost its connection", line) for line in errors), output
    assert "Traceback" not in output and "second line" not in output
    assert not lingering_processes([proc.pid])


@pytest.mark.parametrize(
    "env_id, refusal",
    [
        ("no_such_module:Env-v0", "cannot make it: ModuleNotFoundError: No module named 'no_such_module'"),
        ("user_envs:NoSuchEnv-v0", "cannot make it: NameNotFound: Environment `NoSuchEnv` doesn't exist"),
        ("user_envs:FailsOnReset-v0", "cannot make it: ValueError: the simulator's licence server is unreachable"),
        ("user_envs:TupleObservations-v0", "not Tuple(Discrete(3), Discrete(3))"),
        ("user_envs:MultiDiscreteActions-v0", "not MultiDiscrete([2 2])"),
    ],
)
def test_a_gymnasium_environment_that_cannot_train_is_refused(tmp_path, monkeypatch, env_id, refusal, algo):
    """Before anything is created: one line naming --env-id and what is wrong (the environment's own error)."""
    monkeypatch.chdir(user_dir(tmp_path))
    script = load_script(algo)
    with pytest.raises(script.ConfigError, match=re.escape(f"--env-id {env_id}: ")) as refused:
        script.check_args(tyro.cli(script.Args, args=["--env-id", env_id]))
    assert refusal in str(refused.value) and "\n" not in str(refused.value)
    assert not os.path.exists("runs")


def test_a_refusal_as_a_user_sees_it(tmp_path):
    """Exit status 2, one line, no run directory; an EnvPool backend for a Gymnasium id is refused too."""
    cwd = user_dir(tmp_path)
    result = run(cwd, "--env-id", "user_envs:FailsOnReset-v0")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and not os.path.exists(f"{cwd}/runs")
    assert result.stderr.startswith("error: --env-id user_envs:FailsOnReset-v0: cannot make it: ValueError")
    result = run(cwd, "--env-id", "user_envs:Seeker-v0", "--env-backend", "envpool")
    assert result.returncode == 2 and "is not an EnvPool environment" in result.stderr


def test_the_networks_read_gymnasium_images():
    """EnvPool's frames are channels first, Gymnasium's images usually last: the ResNet sees the same pixels. A Dict's
    small image (Seeker's 6 x 6) keeps features in the MLP's CNN (MiniGrid's 7 x 7 cell ids keep their own layers)."""
    script = load_script("ppo")
    resnet = script.ResNet()
    first = np.random.default_rng(0).integers(0, 256, (2, 3, 12, 12), dtype=np.uint8)
    last = np.moveaxis(first, 1, -1)
    params = resnet.init(jax.random.key(0), first)
    np.testing.assert_allclose(resnet.apply(params, first)[0], resnet.apply(params, last)[0], rtol=1e-5, atol=1e-6)
    mlp = script.MLP((0, 0), cell_ids=False)
    obs = dict(image=np.zeros((2, 6, 6, 3), np.uint8), position=np.zeros((2, 2), np.float32))
    first_layer = jax.tree.leaves(mlp.init(jax.random.key(0), obs)["params"]["Dense_0"])[-1]  # (inputs, units)
    assert first_layer.shape[0] > 2  # the image's features, and the position's 2


def test_capture_video_is_refused_for_what_the_backend_cannot_render(monkeypatch, tmp_path):
    """--capture-video asks the backend the run uses: Gymnasium's CartPole renders only with pygame, not installed."""
    monkeypatch.chdir(tmp_path)
    script = load_script("ppo")
    flags = ["--env-id", "CartPole-v1", "--env-backend", "gymnasium", "--capture-video"]
    with pytest.raises(script.ConfigError, match="--capture-video: CartPole-v1: Gymnasium cannot render it"):
        script.check_args(tyro.cli(script.Args, args=flags))
