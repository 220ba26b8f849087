"""Failure semantics (DESIGN.md §8): failures stop the run quickly and loudly, preemption checkpoints
and resumes, a corrupt checkpoint is never read, a non-finite loss stops training.

Faults are injected with the scripts' documented test hook CLEANBA_FAULT=<actor|learner|nan>@<update>.
"""

import json
import os
import signal
import time

import flax.serialization
import numpy as np
import pytest
from helpers import (ALGOS, CARTPOLE, CARTPOLE_SOLVE, check, free_port, only_run, read_scalars, run, run_dirs,
                     script_env, session_processes, solved_score, start, timed_output, values)

LONG_CARTPOLE = [*CARTPOLE, "--total-timesteps", 2_000_000, "--log-frequency", 50]
each_algo = pytest.mark.parametrize("algo", ALGOS)


def run_with_fault(cwd, fault, *flags, algo, timeout=90):
    env = dict(script_env(), CLEANBA_FAULT=fault)
    proc = start(cwd, *flags, env=env, algo=algo)
    return proc, proc.communicate(timeout=timeout)[0]  # a hang fails the test with TimeoutExpired


def wait_for_updates(run_dir_parent, count, proc, timeout=120):
    """Blocks until the run's updates.jsonl has `count` lines (a resumed run starts with the lines it keeps)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        path = os.path.join(run_dir_parent, "runs")
        logs = [os.path.join(path, d, "updates.jsonl") for d in os.listdir(path)] if os.path.isdir(path) else []
        if logs and os.path.exists(logs[0]) and sum(1 for _ in open(logs[0])) >= count:
            return
        time.sleep(0.2)
    raise TimeoutError(f"fewer than {count} updates after {timeout}s")


def load_checkpoint(run_dir):
    with open(os.path.join(run_dir, "checkpoint.msgpack"), "rb") as f:
        return flax.serialization.msgpack_restore(f.read())


@each_algo
@pytest.mark.parametrize("where", ["actor", "learner"])
def test_thread_failure_stops_the_run(tmp_path, algo, where):
    """Exit status 1 within 30 s of the failure, its traceback printed once with the thread's name, and no
    process of the run left behind."""
    proc = start(tmp_path, *LONG_CARTPOLE, "--num-actor-threads", 2, algo=algo,
                 env=dict(script_env(), CLEANBA_FAULT=f"{where}@3"))
    lines = timed_output(proc, timeout=120)
    exited = time.time()
    output = "".join(line for _, line in lines)
    assert proc.returncode == 1, output[-3000:]
    failed = next(arrived for arrived, line in lines if line.startswith(f"CLEANBA_FAULT: {where} fault at update 3"))
    assert exited - failed < 30, f"exited {exited - failed:.1f}s after the failure"
    assert output.count("Traceback") == 1, output
    assert f"injected {where} failure at update 3" in output
    assert f"error in thread {'actor-0-' if where == 'actor' else 'MainThread'}" in output
    assert session_processes(proc.pid) == []


@each_algo
def test_sigterm_checkpoints_and_the_same_command_resumes(tmp_path, algo):
    flags = [*CARTPOLE_SOLVE[algo], "--concurrency", "--checkpoint-interval", 0]
    proc = start(tmp_path, *flags, algo=algo)
    wait_for_updates(tmp_path, 120, proc)
    proc.send_signal(signal.SIGTERM)
    sent = time.time()
    output = proc.communicate(timeout=30)[0]
    assert time.time() - sent < 30
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "stopped by SIGTERM after update" in output and "run the same command to resume" in output
    run_dir = only_run(tmp_path)
    interrupted = load_checkpoint(run_dir)["update"]
    assert interrupted >= 120

    proc = start(tmp_path, *flags, algo=algo)  # the same command
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output[-3000:]
    assert f"resuming from {run_dir[len(str(tmp_path)) + 1:]}/checkpoint.msgpack after update {interrupted}" in output
    assert only_run(tmp_path) == run_dir

    with open(os.path.join(run_dir, "updates.jsonl")) as f:
        records = [json.loads(line) for line in f]
    with open(os.path.join(run_dir, "config.json")) as f:
        layout = json.load(f)["layout"]
    num_updates, batch_size = layout["num_updates"], layout["batch_size"]
    assert [r["update"] for r in records] == list(range(1, num_updates + 1))  # no gap, no repeat
    versions = [r["data_version"] for r in records]  # the version contract restarts with the pipeline
    assert versions[interrupted] == interrupted + 1
    assert versions[interrupted + 1:] == list(range(interrupted + 1, num_updates))

    scalars = read_scalars(run_dir)
    steps = [step for step, _ in scalars["charts/learning_rate"]]
    assert steps == sorted(set(steps)) and steps[-1] == num_updates * batch_size
    for step, lr in scalars["charts/learning_rate"]:  # the schedule continued where it stopped
        assert lr == pytest.approx(1e-3 * (1 - step / (num_updates * batch_size)), abs=1e-7)
    after_resume = [r for step, r in scalars["charts/episodic_return"] if step > interrupted * batch_size]
    assert solved_score(algo, after_resume) >= 450, after_resume  # the band of an uninterrupted run


@each_algo
def test_run_name_and_no_resume(tmp_path, algo):
    """--run-name picks the directory; the same command again finds the run finished; --no-resume starts
    it over, without the old run's checkpoint or logged points."""
    flags = [*CARTPOLE, "--total-timesteps", 2 * 256, "--run-name", "mine"]
    check(run(tmp_path, *flags, algo=algo))
    run_dir = str(tmp_path / "runs" / "mine")
    assert run_dirs(tmp_path) == [run_dir] and load_checkpoint(run_dir)["update"] == 2
    again = check(run(tmp_path, *flags, algo=algo))
    assert "run mine already finished 2 updates; nothing to do" in again.stdout, again.stdout
    over = check(run(tmp_path, *flags, "--no-resume", algo=algo))
    assert "resuming" not in over.stdout and "update 2/2" in over.stdout, over.stdout
    with open(os.path.join(run_dir, "updates.jsonl")) as f:
        assert [json.loads(line)["update"] for line in f] == [1, 2]
    assert values(read_scalars(run_dir), "stats/update") == [1, 2]


@each_algo
def test_interrupted_checkpoint_writes_are_never_read(tmp_path, algo):
    """Signals and kills land at arbitrary moments of a run that checkpoints after every update, then the
    process dies between writing a checkpoint and renaming it into place (CLEANBA_FAULT=checkpoint@K);
    every restart must resume from a complete checkpoint."""
    flags = [*LONG_CARTPOLE, "--checkpoint-interval", 1, "--total-timesteps", 300 * 8 * 32]
    rng = np.random.default_rng(0)
    resumed_from = []
    for round_index, kill in enumerate([signal.SIGKILL, signal.SIGTERM, signal.SIGKILL]):
        proc = start(tmp_path, *flags, algo=algo)
        wait_for_updates(tmp_path, (resumed_from[-1] if resumed_from else 0) + 20, proc)  # 20 new updates
        time.sleep(rng.uniform(0, 0.5))
        proc.send_signal(kill)
        if kill == signal.SIGTERM:
            time.sleep(0.01)
            proc.send_signal(signal.SIGTERM)  # a second signal while the checkpoint is being written
        output = proc.communicate(timeout=30)[0]
        assert proc.returncode == (-signal.SIGKILL if kill == signal.SIGKILL else 128 + signal.SIGTERM), output
        if round_index and "resuming from" not in output:
            raise AssertionError(output[-3000:])
        resumed_from.append(load_checkpoint(only_run(tmp_path))["update"])
    died_at = resumed_from[-1] + 10
    proc, output = run_with_fault(tmp_path, f"checkpoint@{died_at}", *flags, algo=algo)
    assert proc.returncode == 137, output[-3000:]
    assert os.path.exists(os.path.join(only_run(tmp_path), "checkpoint.msgpack.tmp"))  # the unrenamed write
    assert load_checkpoint(only_run(tmp_path))["update"] == died_at - 1
    resumed_from.append(died_at - 1)
    proc = start(tmp_path, *flags, algo=algo)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0 and f"after update {resumed_from[-1]}" in output, output[-3000:]
    assert load_checkpoint(only_run(tmp_path))["update"] == 300
    assert resumed_from == sorted(resumed_from)


@each_algo
def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, algo):
    proc, output = run_with_fault(tmp_path, "nan@6", *LONG_CARTPOLE, "--checkpoint-interval", 1, algo=algo)
    assert proc.returncode == 1
    assert "non-finite loss (nan) at update 6" in output
    assert "last good checkpoint is the one after update 5" in output
    checkpoint = load_checkpoint(only_run(tmp_path))
    assert checkpoint["update"] == 5
    leaves = [np.asarray(x) for x in flax.traverse_util.flatten_dict(checkpoint["state"]["params"]).values()]
    assert all(np.all(np.isfinite(leaf)) for leaf in leaves)


@each_algo
@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_killing_one_process_stops_the_other(tmp_path, algo, victim):
    """Bound: the survivor exits non-zero within a few seconds when its peer's process is gone (the
    collective's connection breaks), and within --heartbeat-timeout when the peer hangs instead."""
    flags = [*LONG_CARTPOLE, "--num-actor-threads", 1, "--distributed", "--coordinator-address",
             f"127.0.0.1:{free_port()}", "--num-processes", 2, "--heartbeat-timeout", 10]
    procs = [start(tmp_path, *flags, "--process-id", rank, algo=algo) for rank in (0, 1)]
    wait_for_updates(tmp_path, 20, procs[0])
    procs[victim].kill()
    killed = time.time()
    survivor = procs[1 - victim]
    output = survivor.communicate(timeout=60)[0]
    assert survivor.returncode != 0, output[-3000:]
    assert time.time() - killed < 10 + 5, "the survivor outlived the heartbeat bound"
    procs[victim].wait()
