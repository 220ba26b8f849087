"""The reproducibility contract (DESIGN.md §4): the same seed and global hyperparameters give the same
batches on any layout, and the same losses up to float reassociation in the learner's sums.

Each case trains twice with real subprocesses and compares the runs' per-update records
(`updates.jsonl`: batch fingerprint and losses) with cleanba/compare_runs.py's logic.
"""

import json
import os
import subprocess
import sys

import pytest
from helpers import ALGOS, BREAKOUT, CARTPOLE, REPO, read_scalars, train

from compare_runs import compare, load_run, within_tolerance

# Losses may differ by float reassociation only (sums split over devices, actor batches of other
# sizes). Tolerances (compare_runs.py), relative to each series' scale: 1e-5 for the value loss and
# entropy (measured ~1e-7); 1e-3 for the policy loss and approximate KL, means of near-cancelling
# terms, and for the total loss, which contains the policy loss (measured up to ~6e-5). See README,
# "Reproducibility".
COMPARED_UPDATES = 10

# 8 environments in total, 12 updates; each layout below splits the same global configuration.
CARTPOLE_8_ENVS = [*CARTPOLE, "--total-timesteps", 12 * 8 * 32]
each_algo = pytest.mark.parametrize("algo", ALGOS)


def assert_same_batches_close_losses(run_a, run_b, loss_updates=COMPARED_UPDATES):
    updates_a, updates_b = load_run(run_a)[1], load_run(run_b)[1]
    result = compare(updates_a, updates_b, COMPARED_UPDATES)
    assert result["updates"] == COMPARED_UPDATES
    assert result["first_fingerprint_mismatch"] is None, result
    for name, (difference, update) in compare(updates_a, updates_b, loss_updates)["max_relative_difference"].items():
        assert within_tolerance(name, difference), f"{name} differs by {difference:.2e} at update {update}"
    return result


@each_algo
def test_same_layout_twice_is_bitwise_identical(tmp_path, algo):
    flags = [*CARTPOLE_8_ENVS, "--num-actor-threads", 2]
    run_a, run_b = train(tmp_path / "a", *flags, algo=algo), train(tmp_path / "b", *flags, algo=algo)
    assert load_run(run_a)[1] == load_run(run_b)[1]  # every fingerprint and loss, bit for bit
    scalars_a, scalars_b = read_scalars(run_a), read_scalars(run_b)
    for tag in ["charts/episodic_return", "charts/episodic_length", "losses/loss", "losses/policy_loss",
                "losses/value_loss", "losses/entropy", "losses/approx_kl", "charts/learning_rate"]:
        assert scalars_a[tag] == scalars_b[tag], tag
    assert len({record["fingerprint"] for record in load_run(run_a)[1]}) == 12  # every batch is new data


@each_algo
def test_one_vs_two_learner_devices(tmp_path, algo):
    one = train(tmp_path / "one", *CARTPOLE_8_ENVS, "--num-actor-threads", 1, "--local-num-envs", 8,
                "--actor-device-ids", 0, "--learner-device-ids", 0, num_devices=3, algo=algo)
    two = train(tmp_path / "two", *CARTPOLE_8_ENVS, "--num-actor-threads", 1, "--local-num-envs", 8,
                "--actor-device-ids", 0, "--learner-device-ids", 1, 2, num_devices=3, algo=algo)
    assert load_run(two)[0]["layout"]["notation"] == "a0-l1,2-d1"
    assert_same_batches_close_losses(one, two)


@each_algo
def test_one_vs_two_actor_threads(tmp_path, algo):
    one = train(tmp_path / "one", *CARTPOLE_8_ENVS, "--num-actor-threads", 1, "--local-num-envs", 8, algo=algo)
    two = train(tmp_path / "two", *CARTPOLE_8_ENVS, "--num-actor-threads", 2, "--local-num-envs", 4, algo=algo)
    assert_same_batches_close_losses(one, two)


@each_algo
@pytest.mark.slow
def test_one_vs_two_processes(tmp_path, algo):
    one = train(tmp_path / "one", *CARTPOLE_8_ENVS, "--num-actor-threads", 1, "--local-num-envs", 8, algo=algo)
    two = train(tmp_path / "two", *CARTPOLE_8_ENVS, "--num-actor-threads", 1, "--local-num-envs", 4,
                num_processes=2, algo=algo)
    assert load_run(two)[0]["layout"]["processes"] == 2
    assert_same_batches_close_losses(one, two)


@each_algo
@pytest.mark.slow
def test_atari_one_vs_two_learner_devices(tmp_path, algo):
    """Identical batches for 10 updates; losses within tolerance for the first 2: the first update from
    the same parameters, and the next after one step from parameters that differ only by the first
    update's reassociation. Before Breakout's first reward many gradient components are near-cancelling
    sums, and the optimisers' early steps (Adam's m/sqrt(v) is about sign(g)) turn their reassociation
    noise into lr-sized parameter differences, so from the third update the losses drift apart (by up to
    ~2e-5 of their scale here) while the data stay the same."""
    # The smallest batches that still split over 2 devices: PPO one env per device (minibatches split
    # time), IMPALA 2 envs per device (its 2 minibatches split envs).
    envs, steps = {"ppo": (2, 16), "impala": (4, 8)}[algo]
    flags = [*BREAKOUT[algo], "--local-num-envs", envs, "--num-steps", steps,
             "--total-timesteps", COMPARED_UPDATES * envs * steps]
    one = train(tmp_path / "one", *flags, "--learner-device-ids", 0, num_devices=3, algo=algo)
    two = train(tmp_path / "two", *flags, "--learner-device-ids", 1, 2, num_devices=3, algo=algo)
    assert_same_batches_close_losses(one, two, loss_updates=2)


@each_algo
def test_cleanba_architecture_vs_synchronous(tmp_path, algo):
    """Both follow their version contract. From update 2 on, the Cleanba actor's policy is one version
    older, so the learner sees other behaviour log-probabilities and its losses differ at every update.
    Both actors sample with the same per-(env, step) keys, so while the two policies are still close
    they can pick the same actions; once the trajectories part they stay apart. compare_runs.py reports
    the difference and exits 1."""
    cleanba = train(tmp_path / "cleanba", *CARTPOLE_8_ENVS, "--concurrency", algo=algo)
    synchronous = train(tmp_path / "sync", *CARTPOLE_8_ENVS, "--no-concurrency", algo=algo)
    records_cleanba, records_sync = load_run(cleanba)[1], load_run(synchronous)[1]
    assert [r["data_version"] for r in records_cleanba] == [1] + list(range(1, 12))
    assert [r["data_version"] for r in records_sync] == list(range(1, 13))
    assert records_cleanba[0] == records_sync[0]  # both learners start from p1's data
    assert all(a["approx_kl"] != b["approx_kl"] and a["loss"] != b["loss"]
               for a, b in zip(records_cleanba[1:], records_sync[1:]))
    same_batches = [a["fingerprint"] == b["fingerprint"] for a, b in zip(records_cleanba, records_sync)]
    assert False in same_batches, "the two architectures collected the same trajectories throughout"
    first_difference = same_batches.index(False)
    assert not any(same_batches[first_difference:]), same_batches

    tool = os.path.join(REPO, "cleanba", "compare_runs.py")
    result = subprocess.run([sys.executable, tool, cleanba, synchronous], capture_output=True, text=True)
    assert result.returncode == 1 and "first differ at update" in result.stdout, result.stdout
    result = subprocess.run([sys.executable, tool, cleanba, cleanba], capture_output=True, text=True)
    assert result.returncode == 0 and "identical" in result.stdout, result.stdout


@each_algo
def test_layout_is_recorded(tmp_path, algo):
    run_dir = train(tmp_path, *CARTPOLE, "--total-timesteps", 256, "--actor-device-ids", 1,
                    "--learner-device-ids", 0, 2, num_devices=3, algo=algo)
    with open(os.path.join(run_dir, "config.json")) as f:
        layout = json.load(f)["layout"]
    assert layout["notation"] == "a1-l0,2-d1" and layout["processes"] == 1
    assert layout["learner_devices"] == ["cpu:0", "cpu:2"] and layout["num_envs"] == 8
