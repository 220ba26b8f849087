"""The reproducibility contract (DESIGN.md §4): the same seed and global hyperparameters give the same batches on
any layout, and the same losses up to float reassociation in the learner's sums.

The runs are conftest.py's: each splits the same CartPole configuration (8 envs, 12 updates) over another
layout. They are compared with cleanba/compare_runs.py's logic on their per-update records (`updates.jsonl`:
batch fingerprint and losses). Tolerances (compare_runs.py), relative to each series' scale: 1e-5 for the value
loss and entropy (measured ~1e-7); 1e-3 for the near-cancelling policy loss, approximate KL and gradient norm,
and for the total loss, which contains the policy loss. See README, "Reproducibility".
"""

import os
import shutil
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest
from compare_runs import compare, within_tolerance
from helpers import (
    BREAKOUT,
    CARTPOLE,
    POLICY_GRADIENT,
    REPO,
    SCRIPTS,
    Run,
    check,
    finished_run,
    host_collate,
    load_checkpoint,
    load_script,
    run,
    run_processes,
    script_env,
    script_parts,
    stop_actors,
    trained,
)
from test_training import evaluate

COMPARED_UPDATES, ATARI_UPDATES = 10, 5


def assert_same_batches_close_losses(
    records_a, records_b, batch_updates=COMPARED_UPDATES, loss_updates=COMPARED_UPDATES
):
    result = compare(records_a, records_b, batch_updates)
    assert result["updates"] == batch_updates
    assert result["first_fingerprint_mismatch"] is None, result
    assert_close_losses(records_a, records_b, loss_updates)


def assert_close_losses(records_a, records_b, updates: int, context: str = ""):
    """Every loss series within compare_runs.py's tolerance over the first updates."""
    differences = compare(records_a, records_b, updates)["max_relative_difference"]
    assert set(differences) >= {"loss", "grad_norm"} and len(differences) >= 4  # PQN: loss, Q-values, targets too
    for name, (difference, update) in differences.items():
        assert within_tolerance(name, difference), f"{context}{name} differs by {difference:.2e} at update {update}"


def assert_bitwise_identical(a: Run, b: Run):
    """Every record of updates.jsonl (fingerprints, losses) and every logged metric but the timings, bit for bit."""
    assert b.records == a.records
    for tag, series in a.scalars.items():
        if not tag.startswith("stats/") and tag != "charts/SPS":
            assert b.scalars[tag] == series, tag


@pytest.mark.parametrize("algo", ["ppo"], indirect=True)
def test_same_layout_twice_is_bitwise_identical(sync_run, sync_rerun):
    """The sync run started over (--no-resume) with its own compilation cache, now warm: every fingerprint, loss
    and logged metric bit for bit, and the cache's compiled programs compute what a compilation does. (Each script's
    runs are compared bit for bit with the Cleanba architecture below, whose threads overlap; the cache is the same
    code in every script: PPO runs it.)"""
    _, rerun = sync_rerun
    assert_bitwise_identical(sync_run, rerun)
    assert len({record["fingerprint"] for record in sync_run.records}) == 12  # every batch is new data
    cache = os.path.join(os.path.dirname(sync_run.path), ".compilation_cache")  # the default: runs/.compilation_cache
    assert len(os.listdir(cache)) >= 3


def compare_runs(*args: str) -> subprocess.CompletedProcess:  # cleanba/compare_runs.py, as users run it
    command = [sys.executable, os.path.join(REPO, "cleanba", "compare_runs.py"), *args]
    return subprocess.run(command, capture_output=True, text=True)


def test_the_batch_goes_from_actors_to_learners_without_the_host_and_trains_the_same(algo):
    """2 actor threads on device 0, the learner on devices 1 and 2: the batch is gathered device to device (nothing
    fetched to the host), a block on each learner device, and the update on it is the one on the batch gathered on the
    host as before, bit for bit: the same record for updates.jsonl, the same new parameters."""
    script = load_script(algo)
    layout = ["--num-actor-threads", 2, "--actor-device-ids", 0, "--learner-device-ids", 1, 2]
    args, cfg, _, networks, state = script_parts(script, *CARTPOLE, *layout, "--total-timesteps", 2 * 256)
    actors = script.Actors(args, cfg, networks, 0, threading.Event())
    try:
        actors.publish(state.params, 1)
        rollouts = actors.collect()
    finally:
        stop_actors(actors)
    with jax.transfer_guard_device_to_host("disallow"):
        batch = script.collate(rollouts, cfg)
    for leaf in jax.tree.leaves(batch):
        assert [shard.device for shard in leaf.addressable_shards] == cfg.learner_devices
    update_fn = script.make_update(args, cfg, networks)
    on_devices, record = script.learn(update_fn, state, batch, 1, 0)
    via_host, host_record = script.learn(update_fn, state, host_collate(rollouts, 2), 1, 0)
    assert record == host_record and record["episodes"][0] > 0
    host_leaves = jax.tree.leaves(script.to_host(via_host))
    for leaf, host_leaf in zip(jax.tree.leaves(script.to_host(on_devices)), host_leaves, strict=True):
        np.testing.assert_array_equal(leaf, host_leaf)


def test_compare_runs_never_calls_nothing_the_same(sync_run, tmp_path):
    """--updates 0, or a run stopped before its first update: one line and exit status 2, not SAME."""
    empty = tmp_path / "stopped-at-start-up"
    empty.mkdir()
    shutil.copy(os.path.join(sync_run.path, "config.json"), empty)
    (empty / "updates.jsonl").write_text("")
    for args in [(sync_run.path, sync_run.path, "--updates", "0"), (sync_run.path, str(empty))]:
        result = compare_runs(*args)
        assert result.returncode == 2 and result.stdout == "" and result.stderr.count("\n") == 1, result.stderr


def test_cleanba_architecture_twice_is_bitwise_identical(cleanba_run, cleanba_rerun):
    """The actor overlaps the learner, one version behind: thread timing decides when each runs, never what
    they compute, so the same configuration gives the same bits; compare_runs.py says so and exits 0."""
    assert [record["data_version"] for record in cleanba_run.records][:3] == [1, 1, 2]
    assert_bitwise_identical(cleanba_run, cleanba_rerun)
    result = compare_runs(cleanba_run.path, cleanba_rerun.path)
    assert result.returncode == 0 and "identical" in result.stdout, result.stdout


def test_one_vs_two_actor_threads(sync_run, one_thread_run):
    assert sync_run.config["layout"]["actor_threads_per_device"] == 2
    assert_same_batches_close_losses(one_thread_run.records, sync_run.records)


def test_one_vs_two_learner_devices(one_thread_run, two_learners_run):
    assert two_learners_run.config["layout"]["notation"] == "a0-l1,2-d1"
    assert_same_batches_close_losses(one_thread_run.records, two_learners_run.records)


@pytest.mark.slow
def test_one_vs_two_processes(algo, two_processes_run, request):
    """Two processes against one thread of all 8 envs; IMPALA's runs with an LSTM (conftest.py), whose replay from
    recorded core states then spans processes too. (PPO's and PQN's feed-forward runs cover the rest: the code that
    makes one batch of every process's rollouts is the same in every script.)"""
    if algo == "impala":
        reference, compared = request.getfixturevalue("lstm_runs")["one_thread"], 8  # every update, as test_memory
    else:
        reference, compared = request.getfixturevalue("one_thread_run"), COMPARED_UPDATES
    assert two_processes_run.config["layout"]["processes"] == 2
    assert two_processes_run.config["args"]["lstm_size"] == (8 if algo == "impala" else 0)
    assert "8 envs x 32 steps = 256 per update" in two_processes_run.output  # both processes' envs in one batch
    assert_same_batches_close_losses(reference.records, two_processes_run.records, compared, compared)


# --layout-free-group-size on CartPole, 24 envs x 32 steps, 10 updates (PPO with an LSTM per tower, IMPALA with the
# Cleanba architecture and groups of 1 env: its minibatches hold 4 of a device's envs on the spread layout).
LAYOUT_FREE = "--env-id CartPole-v1 --num-steps 32 --learning-rate 1e-3 --log-frequency 1 --total-timesteps 7680"
LAYOUT_FREE_FLAGS = {
    "ppo": "--layout-free-group-size 2 --lstm-size 8 --critic-core --num-minibatches 4 --save-model",
    "impala": "--layout-free-group-size 1 --num-minibatches 2",
    "pqn": "--layout-free-group-size 2",
}


def test_layout_free_runs_are_the_same_on_every_layout(tmp_path, algo):
    """With --layout-free-group-size every sum over envs is made of groups computed with the same shapes and added in
    global env order, and the actors act group by group: 1 actor thread of 1 EnvPool (compiled with it) and learner
    device, 3 threads of 2 EnvPools each (stepped in turns, as on a GPU) with the learner on 3 devices, and 2
    processes, give the same run bit for bit (every fingerprint, loss and logged metric). PPO's: an LSTM per tower."""
    flags = [*LAYOUT_FREE.split(), *LAYOUT_FREE_FLAGS[algo].split()]
    for name in ("one", "spread"):
        os.makedirs(tmp_path / name)
    one = trained(*flags, "--local-num-envs", 24, "--num-actor-threads", 1, algo=algo)(tmp_path / "one")
    spread = [
        *flags,
        "--local-num-envs",
        8,
        "--num-actor-threads",
        3,
        "--env-pools",
        2,
        "--learner-device-ids",
        0,
        1,
        2,
    ]
    assert_bitwise_identical(one, trained(*spread, num_devices=3, algo=algo)(tmp_path / "spread"))
    assert len({record["fingerprint"] for record in one.records}) == 10
    processes = [*flags, "--local-num-envs", 12, "--num-actor-threads", 1]
    two_processes = run_processes(tmp_path / "processes", *processes, algo=algo)[0]
    two_processes = finished_run(tmp_path / "processes", two_processes)
    assert two_processes.config["layout"]["processes"] == 2
    assert_bitwise_identical(one, two_processes)
    if algo == "ppo":  # evaluate.py plays a run of recurrent towers (that it runs; what it scores is not checked)
        assert len(evaluate(one.path, 2)) == 2


def test_a_logged_value_that_is_not_part_of_a_mean_reads_the_same_on_any_layout(tmp_path):
    """A researcher logs a value from the loss that is not a local part of a global mean (a KL coefficient, say) in the
    loss's second dict, as the modifying guide says (here in a copy of cleanba_ppo.py): on 1 learner device, on 2, and
    on 2 with layout-free groups, it reads what it is (summed like the losses, it read twice as much on 2 devices)."""
    with open(SCRIPTS["ppo"]) as f:
        source = f.read()
    assert source.count("return loss, (means, {})") == 1
    copy = tmp_path / "ppo_with_a_coefficient.py"
    copy.write_text(source.replace("return loss, (means, {})", 'return loss, (means, {"kl_coef": jnp.float32(0.25)})'))
    layouts = {"one": ["0"], "two": ["0", "1"], "two_in_groups": ["0", "1", "--layout-free-group-size", "2"]}
    for name, layout in layouts.items():
        os.makedirs(tmp_path / name)
        command = [sys.executable, str(copy), *map(str, CARTPOLE), "--total-timesteps", "768", "--learner-device-ids"]
        check(
            subprocess.run([*command, *layout], cwd=tmp_path / name, env=script_env(2), capture_output=True, text=True)
        )
        records = finished_run(tmp_path / name).records
        assert [record["losses"]["kl_coef"] for record in records] == [0.25, 0.25, 0.25], name


def test_cleanba_architecture_vs_synchronous(sync_run, cleanba_run):
    """Both follow their version contract. From update 2 on, the Cleanba actor's policy is one version
    older, so the learner sees other behaviour log-probabilities and its losses differ at every update.
    Both actors sample with the same per-(env, step) keys, so while the two policies are still close
    they can pick the same actions; once the trajectories part they stay apart. compare_runs.py, told
    --different-configs (the two differ by --concurrency), reports the difference and exits 1."""
    records_cleanba, records_sync = cleanba_run.records, sync_run.records
    assert [r["data_version"] for r in records_cleanba] == [1] + list(range(1, 12))
    assert [r["data_version"] for r in records_sync] == list(range(1, 13))
    assert records_cleanba[0] == records_sync[0]  # both learners start from p1's data
    for a, b in zip(records_cleanba[1:], records_sync[1:], strict=True):
        assert a["losses"]["loss"] != b["losses"]["loss"]
    same_batches = [a["fingerprint"] == b["fingerprint"] for a, b in zip(records_cleanba, records_sync, strict=True)]
    assert False in same_batches, "the two architectures collected the same trajectories throughout"
    first_difference = same_batches.index(False)
    assert not any(same_batches[first_difference:]), same_batches

    result = compare_runs(cleanba_run.path, sync_run.path, "--different-configs")
    assert result.returncode == 1 and "first differ at update" in result.stdout, result.stdout
    assert "different configurations: concurrency True vs False" in result.stdout


@pytest.mark.slow
def test_atari_layouts(tmp_path):
    """Breakout-v5 with the ResNet in one configuration on two layouts with the same actor thread of 2 envs: the learner
    on the actor's device, and the learner on two other devices (one env each), whose update reduces over both. (An
    actor's network evaluates the batch of one thread's envs, and a ResNet's output depends by ~1e-6 on the batch size:
    so both layouts act on the same batches. Two processes are compared on CartPole, whose learner is the same code.)
    Identical batches for 5 updates; losses within tolerance for the first 2: the first update from the same
    parameters, the next after one step from parameters that differ only by the first update's reassociation. Before
    Breakout's first reward many gradient components are near-cancelling sums, and the optimisers' early steps (Adam's
    m/sqrt(v) is about sign(g)) turn their reassociation noise into lr-sized parameter differences, so from the third
    update the losses drift apart (by up to ~2e-5 of their scale here) while the data stay the same. The ResNet and
    the actors are the same code in every script; PPO runs it (each script's learner is compared across layouts on
    CartPole)."""
    flags = [*BREAKOUT, "--total-timesteps", ATARI_UPDATES * 2 * 16, "--local-num-envs", 2, "--num-actor-threads", 1]
    layouts = {"one": [], "two_learners": ["--learner-device-ids", 1, 2]}
    records = {}
    for name, layout in layouts.items():
        os.makedirs(tmp_path / name)
        output = check(run(tmp_path / name, *flags, *layout, num_devices=3)).stdout
        assert f"layout {'a0-l1,2-d1' if layout else 'a0-l0-d1'}, " in output
        records[name] = finished_run(tmp_path / name).records
        assert [r["update"] for r in records[name]] == list(range(1, ATARI_UPDATES + 1))
        assert all(np.isfinite(list(r["losses"].values())).all() for r in records[name])
    assert_same_batches_close_losses(records["one"], records["two_learners"], ATARI_UPDATES, loss_updates=2)


@pytest.mark.parametrize("algo", POLICY_GRADIENT, indirect=True)
def test_continuous_control_across_layouts(continuous_runs):
    """HalfCheetah-v4 (a Gaussian policy; observations and rewards normalised by running statistics) in one
    configuration on three layouts (conftest.py). The learner on 1 or 2 devices acts on the same batch (the same
    parameters and per-(env, step) keys) and updates on it up to float reassociation. An actor thread of 4 envs
    evaluates the network on a batch of another size than one of 8 (XLA's results differ in the last bit), so
    its batch differs in the last bits of the actions, and its update agrees within the same tolerances. The
    statistics are global (summed over devices and processes), so every layout ends with the same ones. A
    second batch would part on every layout: a Gaussian sample moves with any change of its mean (a categorical
    sample rarely does), and MuJoCo's dynamics amplify that."""
    runs = continuous_runs
    for layout in runs.values():
        assert [record["data_version"] for record in layout.records] == [1]
    assert runs["one_thread"].records[0]["fingerprint"] == runs["two_learners"].records[0]["fingerprint"]
    reference = load_checkpoint(runs["one_thread"].path)["state"]["params"]
    # Every env's every step (HalfCheetah's episodes last 1,000 steps: no reset step to leave out).
    assert [round(float(reference[stats]["count"])) for stats in ("obs_stats", "return_stats")] == [8 * 32] * 2
    for name in ("two_threads", "two_learners"):
        assert_close_losses(runs["one_thread"].records, runs[name].records, updates=1, context=f"{name}: ")
        params = load_checkpoint(runs[name].path)["state"]["params"]
        for stats in ("obs_stats", "return_stats"):
            ours, theirs = params[stats], reference[stats]
            shift = np.max(np.abs(ours["mean"] - theirs["mean"]) / np.sqrt(theirs["var"]))  # in standard deviations
            assert ours["count"] == theirs["count"] and shift < 1e-4, f"{name}: {stats} mean moved {shift:.1e}"
            np.testing.assert_allclose(ours["var"], theirs["var"], rtol=1e-4, err_msg=f"{name}: {stats}")
