"""End-to-end tests of cleanba/cleanba_ppo.py, run as a user runs it."""

import json
import os

import flax.serialization
import numpy as np
import pytest
from helpers import BREAKOUT, CARTPOLE, check, only_run, read_scalars, run, run_dirs, run_processes, values

# CartPole-v1 is solved (mean return >= 450 of a 500 cap) within this budget: 300k steps, ~30 s here.
CARTPOLE_SOLVE = ["--env-id", "CartPole-v1", "--local-num-envs", "8", "--num-actor-threads", "1",
                  "--num-steps", "128", "--learning-rate", "1e-3", "--clip-coef", "0.2",
                  "--total-timesteps", "300000", "--log-frequency", "10"]


@pytest.mark.slow
def test_cartpole_learns(tmp_path):
    check(run(tmp_path, *CARTPOLE_SOLVE))
    returns = values(read_scalars(only_run(tmp_path)), "charts/episodic_return")
    assert np.mean(returns[-3:]) >= 450, returns
    assert returns[0] < 100, returns  # it learned: the first episodes were far from solved


@pytest.mark.parametrize("concurrency", [True, False])
def test_version_contract(tmp_path, concurrency):
    """Read back from the events: the data of update u comes from policy max(1, u-1) with the Cleanba
    architecture (the actor skips fetching at iteration 2), from policy u without."""
    flags = [*CARTPOLE, "--num-actor-threads", "2", "--total-timesteps", 8 * 256]
    check(run(tmp_path, *flags, "--concurrency" if concurrency else "--no-concurrency"))
    scalars = read_scalars(only_run(tmp_path))
    learner = values(scalars, "stats/learner_policy_version")
    actor = values(scalars, "stats/actor_policy_version")
    assert learner == list(range(1, 9))
    expected = [max(1, v - 1) for v in learner] if concurrency else learner
    assert actor == expected


def test_breakout_one_actor_two_learner_devices(tmp_path):
    result = check(run(tmp_path, *BREAKOUT, "--actor-device-ids", 0, "--learner-device-ids", 1, 2,
                       "--total-timesteps", 3 * 32, "--concurrency", num_devices=3))
    assert "layout a0-l1,2-d1 " in result.stdout
    scalars = read_scalars(only_run(tmp_path))
    losses = values(scalars, "losses/loss")
    assert len(losses) == 3 and np.all(np.isfinite(losses))
    assert values(scalars, "stats/update") == [1, 2, 3]


@pytest.mark.slow
def test_breakout_two_processes(tmp_path):
    outputs = run_processes(tmp_path, *BREAKOUT, "--total-timesteps", 3 * 64)
    assert "4 envs x 16 steps = 64 per update" in outputs[0]  # both processes' envs in one global batch
    scalars = read_scalars(only_run(tmp_path))  # only rank 0 writes logs
    assert values(scalars, "stats/update") == [1, 2, 3]
    assert np.all(np.isfinite(values(scalars, "losses/loss")))


def test_save_model_round_trip(tmp_path):
    check(run(tmp_path, *CARTPOLE, "--total-timesteps", 4 * 256, "--save-model", "--eval-episodes", 3))
    run_dir = only_run(tmp_path)
    with open(os.path.join(run_dir, "cleanba_ppo.cleanba_model"), "rb") as f:
        params = flax.serialization.msgpack_restore(f.read())
    assert set(params) == {"torso", "actor", "critic"}
    kernel = params["actor"]["params"]["Dense_0"]["kernel"]
    assert kernel.shape == (64, 2) and np.all(np.isfinite(kernel))
    with open(os.path.join(run_dir, "config.json")) as f:
        assert json.load(f)["args"]["env_id"] == "CartPole-v1"
    eval_returns = values(read_scalars(run_dir), "eval/episodic_return")
    assert len(eval_returns) == 3 and all(1 <= r <= 500 for r in eval_returns)


@pytest.mark.parametrize("flags, flag", [
    (["--local-num-envs", 3, "--num-actor-threads", 1, "--learner-device-ids", 1, 2], "--local-num-envs"),
    (["--num-steps", 10, "--num-minibatches", 3], "--num-minibatches"),
    (["--learner-device-ids", 0, 5], "--learner-device-ids"),
    (["--actor-device-ids", 7], "--actor-device-ids"),
    (["--env-id", "NoSuchGame-v5"], "--env-id"),
    (["--total-timesteps", 1000], "--total-timesteps"),
    (["--local-num-envs", 0], "--local-num-envs"),
    (["--num-minibatches", -1], "--num-minibatches"),
    (["--update-epochs", 0], "--update-epochs"),
    (["--num-actor-threads", 0], "--num-actor-threads"),
    (["--env-id", "Pendulum-v1"], "--env-id"),
])
def test_bad_input_is_refused(tmp_path, flags, flag):
    result = run(tmp_path, "--env-id", "CartPole-v1", *flags, num_devices=3, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag} "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert run_dirs(tmp_path) == []
