"""Failure semantics (DESIGN.md §8): failures stop the run quickly and loudly, a corrupt checkpoint is never
read, a non-finite loss stops training, the run name and --no-resume do what they say. Preemption and resume
are tested with the learning run (test_training.py).

Faults are injected by tests/with_fault.py (CLEANBA_FAULT=<actor|learner|nan|sigterm|checkpoint>@<update>).
"""

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import flax.serialization
import numpy as np
import pytest
import soak
import tyro
from conftest import SYNC_FLAGS
from helpers import (
    BREAKOUT,
    CARTPOLE,
    SCRIPTS,
    command,
    free_port,
    load_checkpoint,
    load_module,
    load_script,
    only_run,
    read_scalars,
    run,
    run_dirs,
    script_env,
    session_processes,
    start,
    timed_output,
    values,
    wait_for_updates,
)
from soak_task import with_file_size_limit

LONG_CARTPOLE = [*CARTPOLE, "--total-timesteps", 2_000_000, "--log-frequency", 50]
CHECKPOINT_FILES = ["checkpoint.msgpack", "checkpoint.1.msgpack"]  # the newest first (--keep-checkpoints 2)


def run_with_fault(cwd, fault, *flags, algo, timeout=90):
    proc = start(cwd, *flags, env=dict(script_env(), CLEANBA_FAULT=fault), algo=algo)
    return proc, proc.communicate(timeout=timeout)[0]  # a hang fails the test with TimeoutExpired


@pytest.mark.parametrize("where", ["actor", "learner"])
def test_thread_failure_stops_the_run(tmp_path, where):
    """Exit status 1 within 30 s of the failure, its traceback printed once with the thread's name, and no
    process of the run left behind. The threads, the fault hook and the way a failure stops them are the same code
    in every script (tests/test_scripts.py); IMPALA, whose actors run a version ahead of its learner, runs it."""
    proc = start(
        tmp_path,
        *LONG_CARTPOLE,
        "--num-actor-threads",
        2,
        algo="impala",
        env=dict(script_env(), CLEANBA_FAULT=f"{where}@3"),
    )
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


@pytest.mark.parametrize("algo", ["ppo"], indirect=True)
def test_run_name_and_no_resume(sync_run, sync_rerun):
    """--run-name picks the directory; the same command again finds the run finished; --no-resume starts it
    over in the same directory, without the old run's checkpoint or logged points. (The run directory's code is the
    same in every script, tests/test_scripts.py: PPO runs it.)"""
    again, over = sync_rerun
    assert sync_run.path.endswith(os.path.join("runs", "sync"))
    assert "run sync already finished 12 updates; nothing to train" in again, again
    assert "resuming" not in over.output and "update 12/12" in over.output, over.output
    assert over.path.endswith(os.path.join("runs", "sync")) and load_checkpoint(over.path)["update"] == 12
    assert [record["update"] for record in over.records] == list(range(1, 13))
    assert values(over.scalars, "stats/update") == list(range(1, 13))


def copy_of_ppo(directory, *changes: tuple[str, str]) -> str:
    """A researcher's copy of cleanba_ppo.py, under the same name in another directory, with text replaced."""
    with open(SCRIPTS["ppo"]) as f:
        source = f.read()
    for old, new in changes:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "cleanba_ppo.py"), "w") as f:
        f.write(source)
    return os.path.join(directory, "cleanba_ppo.py")


CLIP_COEF = "    clip_coef: Algorithm[float] = 0.1  # PPO's surrogate clipping coefficient\n"
NEW_FLAG = (CLIP_COEF, CLIP_COEF + "    clip_vloss: Algorithm[bool] = False  # clip the value loss (a new flag)\n")


def refusal(result) -> str:
    """The one line a refused run prints (exit status 2, no traceback)."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stdout, result.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("algo", ["ppo"], indirect=True)
def test_a_new_flag_keeps_runs_and_an_unusable_checkpoint_is_refused(sync_run, tmp_path, monkeypatch):
    """A copy of the script with a new Algorithm field at its default names runs as before and resumes their
    checkpoints (made before the field existed); the field at another value is refused on that run. A checkpoint cut
    short, one of another script and one of other networks are refused in one line, exit 2, nothing written."""
    copy = copy_of_ppo(tmp_path / "copy", NEW_FLAG)
    flags = ["--env-id", "CartPole-v1", "--compilation-cache-dir", "None"]
    original, copied = load_script("ppo"), load_module(copy)
    monkeypatch.chdir(tmp_path)  # start_up looks for runs/ here (none)
    assert (
        original.start_up(tyro.cli(original.Args, args=flags))[1]
        == copied.start_up(tyro.cli(copied.Args, args=flags))[1]
    )
    changed = copied.start_up(tyro.cli(copied.Args, args=[*flags, "--clip-vloss"]))[1]
    assert changed != original.start_up(tyro.cli(original.Args, args=flags))[1]

    cwd = tmp_path / "run"
    shutil.copytree(f"{os.path.dirname(os.path.dirname(sync_run.path))}-as-it-ended", cwd)
    command = [sys.executable, copy, *map(str, SYNC_FLAGS)]
    again = subprocess.run(command, cwd=cwd, env=script_env(), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "run sync already finished 12 updates" in again.stdout, again.stderr[-3000:]
    other_value = subprocess.run(
        [*command, "--clip-vloss"], cwd=cwd, env=script_env(), capture_output=True, text=True, timeout=120
    )
    assert refusal(other_value).startswith(
        "error: --run-name sync has a checkpoint of another configuration: clip_vloss (False, now True)"
    )

    path = os.path.join(cwd, "runs", "sync", "checkpoint.msgpack")
    wider = copy_of_ppo(
        tmp_path / "wider", ("nn.Dense(128 if self.q_network else 64,", "nn.Dense(128 if self.q_network else 96,")
    )
    other_networks = subprocess.run(
        [sys.executable, wider, *map(str, SYNC_FLAGS)],
        cwd=cwd,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "holds other networks or optimiser state; --no-resume starts the run over" in refusal(other_networks)
    other_script = run(cwd, *SYNC_FLAGS, algo="impala")
    assert "exp_name ('cleanba_ppo', now 'cleanba_impala')" in refusal(other_script)
    with open(path, "rb") as f:
        whole = f.read()
    with open(path, "wb") as f:
        f.write(whole[: len(whole) // 2])  # as an interrupted copy between clusters leaves it
    files = sorted(str(p) for p in cwd.rglob("*") if ".compilation_cache" not in str(p))
    cut_short = run(cwd, *SYNC_FLAGS, shared_cache=False)
    assert refusal(cut_short).startswith(
        "error: --run-name sync: runs/sync/checkpoint.msgpack is cut short or changed ("
    )
    assert sorted(str(p) for p in cwd.rglob("*") if ".compilation_cache" not in str(p)) == files


def test_a_stop_signal_during_start_up_ends_in_one_line(tmp_path):
    """SIGTERM to the process group, as SLURM and `timeout` send it (it reaches XLA's compiler processes too), while
    the actors start and compile, before the first update: the usual one line and exit status, no thread's
    traceback, no checkpoint, no process left behind."""
    proc = start(tmp_path, *BREAKOUT, "--local-num-envs", 2, "--num-actor-threads", 1, "--total-timesteps", 320)
    for line in proc.stdout:
        if line.startswith("devices:"):  # the run directory is made; the actors start next
            break
    os.killpg(proc.pid, signal.SIGTERM)
    output = proc.communicate(timeout=30)[0]
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert output.strip() == "stopped by SIGTERM during start-up, before update 1: nothing new to save", output
    assert not list(tmp_path.rglob("checkpoint.msgpack*"))
    assert session_processes(proc.pid) == []


def test_ctrl_c_while_the_checkpoint_is_read_ends_in_one_line(tmp_path):
    """Ctrl-C earlier still, while the run's checkpoint is read (a FIFO here, which holds the run there until this
    test writes the checkpoint into it): the same one line and exit status once the start-up ends, no traceback, and
    the run's records as they were."""
    flags = [*CARTPOLE, "--num-actor-threads", 1, "--run-name", "early", "--total-timesteps", 4 * 32 * 10]
    proc, output = run_with_fault(tmp_path, "sigterm@1", *flags, algo="ppo")
    assert proc.returncode == 128 + signal.SIGTERM, output
    checkpoint = tmp_path / "runs" / "early" / "checkpoint.msgpack"
    contents = checkpoint.read_bytes()
    checkpoint.unlink()
    os.mkfifo(checkpoint)
    proc = start(tmp_path, *flags)
    try:
        deadline = time.time() + 120
        while True:  # a FIFO opens for writing once a reader has it open: then the run is reading the checkpoint
            try:
                fifo = os.open(checkpoint, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, proc.communicate(timeout=30)[0]
                time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        os.set_blocking(fifo, True)
        with contextlib.suppress(BrokenPipeError), os.fdopen(fifo, "wb") as writer:  # broken: the signal killed it
            writer.write(contents)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:  # a failure above: nothing is left running
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGINT, output
    assert output.strip().splitlines()[-1] == "stopped by SIGINT during start-up, before update 2: nothing new to save"
    assert "Traceback" not in output, output
    assert updates_logged(tmp_path / "runs" / "early") == [1]
    assert session_processes(proc.pid) == []


def test_interrupted_checkpoint_writes_are_never_read(tmp_path):
    """Signals and kills land at arbitrary moments of a run that checkpoints after every update, then the
    process dies between writing a checkpoint and renaming it into place (CLEANBA_FAULT=checkpoint@K);
    every restart must resume from a complete checkpoint. The checkpoint code is the same in both scripts
    (tests/test_scripts.py); PPO runs it here."""
    # Room for the fault after the signals' rounds, however late a loaded machine lets this test send them.
    total_updates = 300
    flags = [*LONG_CARTPOLE, "--num-actor-threads", 1, "--checkpoint-interval", 1]
    flags += ["--total-timesteps", total_updates * 4 * 32]
    rng = np.random.default_rng(0)
    resumed_from = []
    for round_index, kill in enumerate([signal.SIGKILL, signal.SIGTERM]):
        proc = start(tmp_path, *flags)
        wait_for_updates(tmp_path, (resumed_from[-1] if resumed_from else 0) + 20, proc)  # 20 new updates
        time.sleep(rng.uniform(0, 0.5))
        proc.send_signal(kill)
        if kill == signal.SIGTERM:
            time.sleep(0.01)
            proc.send_signal(signal.SIGTERM)  # a second one soon after (wherever it lands): still one clean stop
        output = proc.communicate(timeout=30)[0]
        assert proc.returncode == (-signal.SIGKILL if kill == signal.SIGKILL else 128 + signal.SIGTERM), output
        if round_index and "resuming from" not in output:
            raise AssertionError(output[-3000:])
        resumed_from.append(load_checkpoint(only_run(tmp_path))["update"])
    died_at = resumed_from[-1] + 10
    proc, output = run_with_fault(tmp_path, f"checkpoint@{died_at}", *flags, algo="ppo")
    assert proc.returncode == 137 and f"checkpoint.msgpack after update {resumed_from[-1]} " in output, output[-3000:]
    assert os.path.exists(os.path.join(only_run(tmp_path), "checkpoint.msgpack.tmp"))  # the unrenamed write
    assert load_checkpoint(only_run(tmp_path))["update"] == died_at - 1
    resumed_from.append(died_at - 1)
    proc = start(tmp_path, *flags)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0 and f"after update {resumed_from[-1]}" in output, output[-3000:]
    assert load_checkpoint(only_run(tmp_path))["update"] == total_updates
    assert resumed_from == sorted(resumed_from)
    assert len(run_dirs(tmp_path)) == 1


def test_checkpoints_by_time_alone(tmp_path):
    """With --checkpoint-interval 0 a run checkpoints every --checkpoint-minutes (here 1.2 s) while it trains, not only
    when it stops: checkpoints of later and later updates come while the run goes on."""
    flags = [*LONG_CARTPOLE, "--num-actor-threads", 1, "--checkpoint-interval", 0, "--checkpoint-minutes", 0.02]
    proc = start(tmp_path, *flags)
    written = []  # the updates of the checkpoints seen, in order
    try:
        wait_for_updates(tmp_path, 1, proc)
        run_dir = only_run(tmp_path)
        deadline = time.time() + 60
        while len(written) < 2 and time.time() < deadline:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            if os.path.exists(os.path.join(run_dir, "checkpoint.msgpack")):
                update = load_checkpoint(run_dir)["update"]
                if update not in written:
                    written.append(update)
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert len(written) == 2 and 0 < written[0] < written[1], written


CHECKPOINTED = [*CARTPOLE, "--num-actor-threads", 1, "--checkpoint-interval", 4]


def updates_logged(run_dir) -> list[int]:
    with open(os.path.join(run_dir, "updates.jsonl")) as f:
        return [json.loads(line)["update"] for line in f]


def test_a_changed_checkpoint_is_passed_over_for_the_one_before(tmp_path):
    """One bit flipped in the newest checkpoint (a storage or copy error) fails its checksum: the run names it in one
    line and resumes from the one before (--keep-checkpoints 2, the default), then redoes the updates in between,
    each logged once. The checkpoint code is the same in every script (tests/test_scripts.py); PPO runs it here."""
    flags = [*CHECKPOINTED, "--total-timesteps", 16 * 4 * 32]
    proc, output = run_with_fault(tmp_path, "sigterm@10", *flags, algo="ppo")
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    run_dir = only_run(tmp_path)
    assert [load_checkpoint(run_dir, name)["update"] for name in CHECKPOINT_FILES] == [10, 8]
    with open(os.path.join(run_dir, "checkpoint.msgpack"), "r+b") as f:
        f.seek(os.path.getsize(f.name) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
    proc = start(tmp_path, *flags)
    output = proc.communicate(timeout=300)[0]
    name = os.path.relpath(run_dir, tmp_path)
    passed_over = f"{name}/checkpoint.msgpack is cut short or changed (its SHA-256 checksum does not match): "
    passed_over += f"renamed *.unusable, resuming from {name}/checkpoint.1.msgpack, the newest usable checkpoint"
    assert proc.returncode == 0 and output.count(passed_over) == 1 and "after update 8 " in output, output[-3000:]
    assert updates_logged(run_dir) == list(range(1, 17))
    assert [load_checkpoint(run_dir, name)["update"] for name in CHECKPOINT_FILES] == [16, 12]
    assert os.path.exists(os.path.join(run_dir, "checkpoint.msgpack.unusable"))  # set aside, never moved back


def test_a_failed_checkpoint_write_stops_in_one_line_and_keeps_the_ones_before(tmp_path):
    """A checkpoint that cannot be written (here a file-size limit; a full disk or a quota alike) stops the run at once:
    one line naming the file and the OS error, exit status 74 (EX_IOERR), the checkpoints before it unchanged. The same
    command, once it can write, resumes from them."""
    flags = [*CHECKPOINTED, "--total-timesteps", 12 * 4 * 32]
    proc, output = run_with_fault(tmp_path, "sigterm@6", *flags, algo="ppo")
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    run_dir = only_run(tmp_path)
    written = {}
    for name in CHECKPOINT_FILES:
        with open(os.path.join(run_dir, name), "rb") as f:
            written[name] = f.read()
    limit = len(written["checkpoint.msgpack"]) // 2  # the logs of 12 updates stay far below it
    unlimited = command("ppo", [*flags, "--compilation-cache-dir", "None"], shared_cache=False)  # it writes there too
    limited = subprocess.run(
        with_file_size_limit(unlimited, limit),
        cwd=tmp_path,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    name = os.path.relpath(run_dir, tmp_path)
    expected = f"error: writing {name}/checkpoint.msgpack.tmp after update 8 failed ([Errno 27] File too large); "
    expected += "the checkpoints written before are intact: run the same command to resume"
    assert limited.returncode == 74 and limited.stderr.strip().splitlines() == [expected], limited.stderr[-3000:]
    for name, contents in written.items():
        with open(os.path.join(run_dir, name), "rb") as f:
            assert f.read() == contents, name
    resumed = run(tmp_path, *flags)
    assert resumed.returncode == 0 and "after update 6 " in resumed.stdout, resumed.stderr[-3000:]
    assert updates_logged(run_dir) == list(range(1, 13))


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, algo):
    flags = [*LONG_CARTPOLE, "--num-actor-threads", 1, "--checkpoint-interval", 1]
    proc, output = run_with_fault(tmp_path, "nan@6", *flags, algo=algo)
    assert proc.returncode == 1
    assert "non-finite loss (nan) at update 6" in output
    assert "last good checkpoint is the one after update 5" in output
    checkpoint = load_checkpoint(only_run(tmp_path))
    assert checkpoint["update"] == 5
    leaves = [np.asarray(x) for x in flax.traverse_util.flatten_dict(checkpoint["state"]["params"]).values()]
    assert all(np.all(np.isfinite(leaf)) for leaf in leaves)


@pytest.mark.slow
@pytest.mark.parametrize(
    "algo, victim, how", [("ppo", 0, "killed"), ("ppo", 1, "hung"), ("impala", 1, "killed"), ("impala", 0, "hung")]
)
def test_a_lost_process_is_reported_in_one_line(tmp_path, algo, victim, how):
    """Process 0 and process 1 of a 2-process run, each lost once with each script: killed (its node's processes gone:
    the collective's connection breaks) or hung (SIGSTOP: a node that stops answering, found by the heartbeats). The
    survivor exits with status 75 within seconds, or within --heartbeat-timeout, and its stderr is one line naming the
    lost process, the update reached and the checkpoint to resume from: no Python or C++ trace."""
    flags = [*CARTPOLE, "--total-timesteps", 2_000_000, "--num-actor-threads", 1, "--checkpoint-interval", 10]
    flags += ["--distributed", "--coordinator-address", f"127.0.0.1:{free_port()}", "--num-processes", 2]
    # A kill is found by the broken connection, long before the heartbeats' 30 s; a hang by the heartbeats' 10 s.
    heartbeat_timeout = 30 if how == "killed" else 10
    flags += ["--heartbeat-timeout", heartbeat_timeout]
    procs = [
        subprocess.Popen(
            command(algo, [*flags, "--process-id", rank], shared_cache=True),
            cwd=tmp_path,
            env=script_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    survivor = procs[1 - victim]
    try:
        wait_for_updates(tmp_path, 20, procs[0])
        os.killpg(procs[victim].pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)  # the script and its child
        lost = time.time()
        stderr = survivor.communicate(timeout=60)[1]
        exited = time.time() - lost
    finally:
        os.killpg(procs[victim].pid, signal.SIGKILL)
        procs[victim].wait()
    # Seconds: within a third of the heartbeats' timeout (the broken connection; beside the suite's other tests it has
    # taken over 5 s), or within the timeout and 5 s.
    bound = 10 if how == "killed" else heartbeat_timeout + 5
    assert survivor.returncode == 75 and exited < bound, (survivor.returncode, exited, stderr[-3000:])
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr[-3000:]
    expected = rf"error: lost process {victim} \(host {re.escape(socket.gethostname())}\) after update (\d+); "
    expected += r"the last checkpoint \((runs/.+/checkpoint.msgpack)\) is after update (\d+): run the same command, "
    expected += r"or requeue the SLURM job, to resume from it \(CLEANBA_VERBOSE=1: JAX's error\)"
    assert (match := re.fullmatch(expected, lines[0])), lines[0]
    update, checkpoint, checkpoint_update = match.groups()
    # At least update 19: the survivor logged update 20, whose end (the processes agree to go on) needs the lost one.
    # Process 1 knows process 0 wrote a checkpoint once an update after it is done (--checkpoint-interval 10).
    written = int(update) // 10 * 10 if victim else (int(update) - 1) // 10 * 10
    assert int(update) >= 19 and int(checkpoint_update) == written
    assert os.path.exists(tmp_path / checkpoint)


# The short soaks' faults: on SLURM (the template's requeues, and a submission after Ctrl-C), and here (the rest).
SHORT_SOAKS = [
    pytest.param(
        "slurm", ["lose-process", "preempt", "corrupt-cut", "failed-write", "interrupt"], marks=pytest.mark.slurm
    ),
    pytest.param("local", ["kill-in-checkpoint", "lose-process", "interrupt"], marks=pytest.mark.slow),
]


@pytest.mark.parametrize("launcher, schedule", SHORT_SOAKS)
def test_a_short_soak_loses_nothing(tmp_path, request, launcher, schedule):
    """A 2-process IMPALA run hit by faults of several kinds, started again after each until it finishes (tests/soak.py,
    whose long versions benchmark.sh soak and soak-slurm run): on SLURM as users run it (cleanba/launch.py --slurm,
    the template's --requeue: requeued or submitted again), or by the local launcher. Each fault ends in its exit
    statuses and one line, the job is requeued where the template says, nothing is left running or written outside
    the run directory, each attempt resumes from the newest intact checkpoint, every update is logged once and the
    updates lost stay within the checkpoint policy, and updates.jsonl equals bit for bit that of a replay stopped
    cleanly at the same updates."""
    slurm = request.getfixturevalue("slurm") if launcher == "slurm" else None
    result = soak.soak("impala", str(tmp_path), faults=len(schedule), seed=2, schedule=schedule, slurm=slurm)
    assert result["faults_by_kind"] == {kind: 1 for kind in schedule}, result
    process_faults = [kind for kind in schedule if kind in soak.PROCESS_FAULTS]
    assert result["attempts"] == len(process_faults) + 1 and len(result["lost_updates"]) == len(process_faults), result
    if slurm:  # requeued after the first three; Ctrl-C (130) ends the job, which is submitted again
        assert result["requeues"] == 3 and result["submissions"] == 2, result


# The run directory's integrity (DESIGN.md §8): one owner, a journal that heals, nothing non-finite kept, writes that
# fail in one line. The run directory's code is the same in every script (tests/test_scripts.py): PPO runs it.
SHORT = [*CHECKPOINTED, "--total-timesteps", 16 * 4 * 32]  # 16 updates, a checkpoint every 4


def run_faulty(cwd, fault: str, *flags) -> subprocess.CompletedProcess:
    """The script under tests/with_fault.py, its stdout and stderr apart."""
    args = command("ppo", flags, shared_cache=True)
    args.insert(1, os.path.join(os.path.dirname(__file__), "with_fault.py"))
    env = dict(script_env(), CLEANBA_FAULT=fault)
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def stderr_line(result: subprocess.CompletedProcess, status: int) -> str:
    """The one line a run that ends with `status` prints on stderr (the fault hook's announcement aside)."""
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("CLEANBA_FAULT: ")]
    assert result.returncode == status and len(lines) == 1, (result.returncode, result.stderr[-3000:])
    return lines[0]


def test_a_second_copy_of_the_command_is_refused_and_the_first_runs_on(tmp_path):
    """The same command twice in one run directory (a double submit): the second is refused in one line naming the
    holder, exit status 73, and writes nothing; the first runs on and logs every update once."""
    flags = [*LONG_CARTPOLE, "--num-actor-threads", 1, "--checkpoint-interval", 10_000]  # no file comes meanwhile
    first = start(tmp_path, *flags)
    try:
        wait_for_updates(tmp_path, 5, first)
        run_dir = only_run(tmp_path)
        before = sorted(os.listdir(run_dir))
        second = run(tmp_path, *flags, timeout=120)
        holder = f"pid {first.pid} on {socket.gethostname()}"
        assert stderr_line(second, 73) == (
            f"error: {os.path.relpath(run_dir, tmp_path)} is in use by another copy of this command ({holder}): "
            "wait for it to end or stop it; another --run-name starts another run"
        )
        assert second.stdout == "" and sorted(os.listdir(run_dir)) == before
        wait_for_updates(tmp_path, 10, first)
    finally:
        first.send_signal(signal.SIGTERM)
        output = first.communicate(timeout=60)[0]
    assert first.returncode == 128 + signal.SIGTERM, output[-3000:]
    stopped = int(re.search(r"stopped by SIGTERM after update (\d+)", output).group(1))
    assert updates_logged(run_dir) == list(range(1, stopped + 1))


@pytest.mark.parametrize("fault", ["journal", "events", "torn"])
def test_a_full_disk_or_a_kill_under_the_logs_and_the_run_resumes_whole(tmp_path, fault):
    """The disk fills while updates.jsonl gets update 5's record (half of the line is written) or under TensorBoard's
    event file (its writer thread, a moment later): one line naming the file, exit status 74; or the process dies
    half-way through that line (exit 137, as SIGKILL). The same command then resumes from the checkpoint of update 4,
    drops what the journal holds after it (the torn line included) in one line, and logs every update exactly once, in
    updates.jsonl and in TensorBoard."""
    failed = run_faulty(tmp_path, f"{fault}@5", *SHORT)
    run_dir = os.path.relpath(only_run(tmp_path), tmp_path)
    file = "events.out.tfevents.*" if fault == "events" else "updates.jsonl"
    expected = rf"error: writing {re.escape(run_dir)}/{re.escape(file)} after update [5-7] failed \(\[Errno 28\] "
    expected += r"No space left on device\); the checkpoints written before are intact: run the same command to resume"
    if fault == "torn":
        assert failed.returncode == 137, failed.stderr[-3000:]
    else:
        assert re.fullmatch(expected, stderr_line(failed, 74))
    if fault != "events":
        with open(os.path.join(tmp_path, run_dir, "updates.jsonl")) as f:
            assert not f.read().endswith("\n")  # the torn line
    resumed = run(tmp_path, *SHORT)
    assert resumed.returncode == 0 and resumed.stderr == "", resumed.stderr[-3000:]
    assert re.search(r"updates.jsonl: dropped \d+ of \d+ lines \(after update 4, ", resumed.stdout), resumed.stdout
    assert "after update 4 " in resumed.stdout
    assert updates_logged(only_run(tmp_path)) == list(range(1, 17))
    assert values(read_scalars(only_run(tmp_path)), "stats/update") == list(range(1, 17))


def rewrite_checkpoint(path: str, change):
    """A checkpoint changed and written with its checksum, as a run would have written it."""
    checkpoint = load_checkpoint(os.path.dirname(path), os.path.basename(path))
    change(checkpoint)
    contents = flax.serialization.msgpack_serialize(checkpoint)
    with open(path, "wb") as f:
        f.write(hashlib.sha256(contents).hexdigest().encode() + b"\n" + contents)


def test_a_non_finite_state_stops_in_one_line_and_is_never_kept(tmp_path):
    """An update whose losses are finite but whose state is not (the optimiser's, here): one line naming the update
    and what went non-finite, exit status 1; the checkpoints kept are finite and no model is saved. A checkpoint that
    holds non-finite values (one written before the check existed) is passed over for the one before, in one line."""
    failed = run_faulty(tmp_path, "inf@7", *SHORT, "--checkpoint-interval", 2, "--save-model")
    line = stderr_line(failed, 1)
    assert line.startswith("error: non-finite values after update 7: opt_state/") and " values)" in line, line
    assert line.endswith("; the last good checkpoint is the one after update 6"), line
    run_dir = only_run(tmp_path)
    assert [load_checkpoint(run_dir, name)["update"] for name in CHECKPOINT_FILES] == [6, 4]
    for name in CHECKPOINT_FILES:
        leaves = flax.traverse_util.flatten_dict(load_checkpoint(run_dir, name)["state"]).values()
        assert all(np.all(np.isfinite(leaf)) for leaf in leaves), name
    assert not [name for name in os.listdir(run_dir) if name.endswith(".cleanba_model")]

    def poison(checkpoint):
        critic = checkpoint["state"]["params"]["critic"]["params"]
        critic["bias"] = np.full_like(critic["bias"], np.inf)

    rewrite_checkpoint(os.path.join(run_dir, "checkpoint.msgpack"), poison)
    resumed = run(tmp_path, *SHORT, "--checkpoint-interval", 2)
    name = os.path.relpath(run_dir, tmp_path)
    passed_over = f"{name}/checkpoint.msgpack holds non-finite values: params/critic/params/bias (1 of 1 values): "
    passed_over += f"renamed *.unusable, resuming from {name}/checkpoint.1.msgpack, the newest usable checkpoint"
    assert resumed.returncode == 0 and passed_over in resumed.stdout, resumed.stdout[-3000:] + resumed.stderr
    assert f"resuming from {name}/checkpoint.1.msgpack after update 4 " in resumed.stdout
    assert updates_logged(run_dir) == list(range(1, 17))


def test_no_resume_leaves_nothing_of_the_old_run_and_any_older_checkpoint_is_a_fallback(tmp_path):
    """A run keeping 3 checkpoints, stopped; its newest corrupted: the same command with --keep-checkpoints 1 resumes
    from the one before and says which file it loaded. --no-resume with --keep-checkpoints 1 then removes every
    checkpoint of the old run, so the plain command later resumes the new run, never the abandoned one."""
    flags = [*SHORT, "--checkpoint-interval", 2]
    stopped = run_faulty(tmp_path, "sigterm@8", *flags, "--keep-checkpoints", 3)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    run_dir = only_run(tmp_path)
    name = os.path.relpath(run_dir, tmp_path)
    with open(os.path.join(run_dir, "checkpoint.msgpack"), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)
    fell_back = run_faulty(tmp_path, "sigterm@9", *flags, "--keep-checkpoints", 1)
    assert fell_back.returncode == 128 + signal.SIGTERM, fell_back.stderr[-3000:]
    assert f"resuming from {name}/checkpoint.1.msgpack after update 6 " in fell_back.stdout, fell_back.stdout
    over = run_faulty(tmp_path, "sigterm@3", *flags, "--keep-checkpoints", 1, "--no-resume")
    assert over.returncode == 128 + signal.SIGTERM and "resuming" not in over.stdout, over.stdout + over.stderr
    assert [n for n in os.listdir(run_dir) if n.endswith(".msgpack")] == ["checkpoint.msgpack"]
    resumed = run(tmp_path, *flags)
    assert resumed.returncode == 0 and f"resuming from {name}/checkpoint.msgpack after update 3 " in resumed.stdout
    assert updates_logged(run_dir) == list(range(1, 17))


def test_a_model_that_cannot_be_written_is_written_by_the_same_command_later(tmp_path):
    """The model's write fails at the run's end (here its path is taken by a directory; a full disk alike): one line,
    exit status 74, no model cut short. The same command, once it can write, finds the run finished and saves the
    model from its last checkpoint, which evaluate.py then plays."""
    flags = [*SHORT, "--save-model"]
    run_dir = os.path.join(tmp_path, "runs", "taken")
    os.makedirs(os.path.join(run_dir, "cleanba_ppo.cleanba_model"))
    failed = run(tmp_path, *flags, "--run-name", "taken")
    line = stderr_line(failed, 74)
    assert line.startswith("error: writing runs/taken/cleanba_ppo.cleanba_model.tmp after update 16 failed (")
    os.rmdir(os.path.join(run_dir, "cleanba_ppo.cleanba_model"))
    again = run(tmp_path, *flags, "--run-name", "taken")
    assert again.returncode == 0 and "run taken already finished 16 updates" in again.stdout, again.stderr[-3000:]
    assert "model saved to runs/taken/cleanba_ppo.cleanba_model" in again.stdout
    with open(os.path.join(run_dir, "cleanba_ppo.cleanba_model"), "rb") as f:
        saved = flax.serialization.msgpack_restore(f.read())
    checkpoint = load_checkpoint(run_dir)["state"]["params"]
    flat = flax.traverse_util.flatten_dict
    assert all(np.array_equal(flat(saved)[k], flat(checkpoint)[k]) for k in flat(checkpoint))
