"""A chaos soak: a 2-process --distributed run is hit again and again by faults from a seeded random schedule and run
again after each (as a SLURM requeue would, or a user), until it finishes; then what it wrote is checked.

    .venv/bin/python tests/soak.py --algo ppo --faults 60 --seed 1 --dir /tmp/soak --out docs/results/soak
    .venv/bin/python tests/soak.py --slurm ...   # the run as a SLURM job, on a one-node cluster started here

Locally, each attempt's 2 processes start here, each in a session of its own. With --slurm the run is what users
submit: cleanba/launch.py --slurm's batch job, 2 tasks under srun (tests/soak_task.py starts each, with the
attempt's fault on process 0, and keeps its output); the template requeues it after a preemption (143) and a lost
process (75, 137; 3 restarts at most), the soak lets the requeued job start at once (SLURM holds it back two
minutes), and submits the job again once the template gives up (after Ctrl-C, or the 3 restarts), as a user would.
srun's status is the highest of its tasks': when process 0 alone fails (74, 137, or 1) and the other exits 75, the
job is requeued as for a lost process; when both exit 1 (a non-finite state), it ends, and the soak submits it again.
A preemption is scancel --signal=TERM to the job's steps, as SLURM's own; the checks are the same, plus the job's
requeue where the template says.

The faults. Each of those that end an attempt lands at a random moment (after 1 to 2 checkpoint intervals of new
updates, or at a checkpoint); the process it hits (process 0 but for lose-process) exits as it says, the other as for a
lost process (75, in one line naming the lost one and the last checkpoint) unless a stop signal reached both, or
(non-finite) it stopped too:
    preempt             SIGTERM to every process of the job (SLURM's preemption): 143 each, a checkpoint written
    interrupt           SIGINT to every process (Ctrl-C): 130 each, a checkpoint written
    lose-process        SIGKILL to one process and its supervisor (a lost node)
    kill-in-checkpoint  process 0 dies while it writes a checkpoint (tests/with_fault.py's checkpoint@K, between the
                        write and the rename: 137), then SIGKILL to every other process
    failed-write        process 0 runs under a file-size limit smaller than a checkpoint: its next checkpoint fails
                        (74, one line; drawn while updates.jsonl stays below the limit)
    torn-journal        process 0 dies half-way through writing an update's record to updates.jsonl (torn@K: 137)
    full-journal        the disk fills while process 0 writes an update's record, half of it written (journal@K: 74,
                        one line naming updates.jsonl)
    full-events         the disk fills under TensorBoard's event file once an update is logged (events@K: 74, one line
                        naming the event files, at that update or at the next points logged)
    non-finite          the optimiser's state becomes infinite in an update (inf@K: 1, one line naming the update,
                        what is non-finite and the last good checkpoint); the processes check the state together, so
                        the other process exits 1 in the same line (naming no part: they are process 0's) or, if it
                        finds process 0 gone first, 75
between two attempts:
    corrupt-cut         the newest checkpoint is cut short (when an intact one is behind it)
    corrupt-flip        one bit of the newest checkpoint is flipped (likewise)
and during an attempt, which goes on:
    second-copy         the same command started again (2 processes, here, as a user would beside the job) once the
                        attempt owns the run directory, in an attempt that a stop signal or a lost process ends
                        afterwards: each of its processes is refused in one line (process 0's naming the attempt's
                        process 0, the other's "its process 0 was refused"), exit status 73, and prints nothing else;
                        the run directory keeps its files as they were (the lock, config.json; no event file of its own)
                        and updates.jsonl every record it held; the attempt's processes all run on.

The checks, after each attempt and once the run has finished:
    - each attempt's processes ended with the documented exit status and, on stderr, at most the documented line;
      no process of an attempt (or of a second copy) is left; nothing is written outside the run directory;
    - each attempt resumed from the newest intact checkpoint (a corrupt one named in one line), and healed
      updates.jsonl to what that checkpoint covers: the records after it (a torn one included) dropped in one line
      that counts them, none missing; a torn or full journal leaves a line cut short;
    - a non-finite state is never checkpointed: every intact checkpoint holds finite numbers, the newest is the one the
      line names, and the update that went non-finite is not in updates.jsonl;
    - updates.jsonl holds every update from 1 to the last once, in order; TensorBoard each logged step once;
    - the updates lost to each fault are at most what the checkpoint policy allows: none to a stop signal or a second
      copy, one --checkpoint-interval to a lost process, a process that died or failed (kill, torn or full journal,
      full event file, failed checkpoint, non-finite state), and one more with a corrupt checkpoint after it;
    - updates.jsonl equals, bit for bit, that of a replay: the same command stopped cleanly (SIGTERM once the update is
      logged) after each update the chaotic run resumed from, and run again (EnvPool cannot save its environments, so a
      run that was never interrupted would differ).

A tool of the tests (tests/test_failures.py runs a short soak) and of benchmark.sh's soak grid.
"""

import argparse
import contextlib
import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import NamedTuple

import flax.serialization
import flax.traverse_util
import numpy as np
from helpers import REPO, SCRIPTS, free_port, lingering_processes, read_scalars
from slurm_cluster import slurm_cluster
from soak_task import with_file_size_limit

# TensorBoard's reader warns of each purge a resume made: expected here, where every attempt's resume purges.
logging.getLogger("tensorboard").setLevel(logging.ERROR)
# Faults that end an attempt: the soak's signals, then tests/with_fault.py's on process 0 (and a file-size limit).
SIGNAL_FAULTS = ["preempt", "interrupt", "lose-process"]
PROCESS_FAULTS = [*SIGNAL_FAULTS, "kill-in-checkpoint", "failed-write"]
PROCESS_FAULTS += ["torn-journal", "full-journal", "full-events", "non-finite"]
CHECKPOINT_FAULTS = ["corrupt-cut", "corrupt-flip"]  # between two attempts
SECOND_COPY = "second-copy"  # during an attempt, which goes on
FAULTS = PROCESS_FAULTS + CHECKPOINT_FAULTS + [SECOND_COPY]
WITH_FAULT = {"kill-in-checkpoint": "checkpoint", "torn-journal": "torn", "full-journal": "journal"}
WITH_FAULT.update({"full-events": "events", "non-finite": "inf"})  # tests/with_fault.py's names
# Exit statuses (the Failures guide and its exit statuses table).
STOPPED = {"preempt": 128 + signal.SIGTERM, "interrupt": 128 + signal.SIGINT}
LOST_PROCESS = 75  # cleanba/supervise.py: another process of the run was lost
WRITE_FAILED = 74  # a checkpoint, updates.jsonl or an event file could not be written
KILLED = 137  # tests/with_fault.py's checkpoint@K and torn@K: the process exits as SIGKILL would leave it
FAILED = 1  # a non-finite state
IN_USE = 73  # another copy of the command owns the run directory
COPY_UPDATES = 10  # updates an attempt may log while a second copy starts and is refused (the run is made longer)
PROCESSES = 2
ENVS = 4  # per process
STEPS = 32
BATCH = PROCESSES * ENVS * STEPS  # environment steps per update
LOG_FREQUENCY = 5
ATTEMPT_TIMEOUT = 240  # seconds: an attempt that takes longer hangs (it fails the soak)


class Attempt(NamedTuple):
    """One start of the run's processes and how it ended."""

    fault: str | None  # the process fault of this attempt (None: it runs to the end)
    corrupted: str | None  # a checkpoint fault applied before it
    resumed_from: int  # the update its checkpoint follows (0: a fresh start)
    reached: int  # the last update in updates.jsonl when it ended
    seconds: float
    copied: bool = False  # a second copy of the command was started (and refused) while it ran


def checkpoint_paths(run_dir: str) -> list[str]:  # the newest first (--keep-checkpoints 2, the default)
    return [os.path.join(run_dir, "checkpoint.msgpack"), os.path.join(run_dir, "checkpoint.1.msgpack")]


def intact_update(path: str) -> int | None:
    """The update of the checkpoint at `path` if it exists and its checksum holds."""
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        digest, _, contents = f.read().partition(b"\n")
    if hashlib.sha256(contents).hexdigest().encode() != digest:
        return None
    return int(flax.serialization.msgpack_restore(contents)["update"])


def newest_intact(run_dir: str) -> int:
    """The update the next attempt must resume from: that of the newest intact checkpoint (0: none)."""
    for path in checkpoint_paths(run_dir):
        if (update := intact_update(path)) is not None:
            return update
    return 0


def lines_in(path: str) -> int:  # as the scripts count them (the last one maybe cut short)
    if not os.path.exists(path):
        return 0
    with open(path, errors="replace") as f:
        return len(f.readlines())


def updates_logged(run_dir: str) -> list[int]:
    path = os.path.join(run_dir, "updates.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["update"] for line in f if line.endswith("\n")]


def write_log(log_prefix: str, codes: list[int], stdout: list[list[str]], stderr: list[list[str]]):
    """<log_prefix>.log: each process's exit status and output, for a look at an attempt after the soak."""
    with open(f"{log_prefix}.log", "w") as f:
        for rank in range(PROCESSES):
            f.write(f"== process {rank}: exit {codes[rank]}\n-- stdout\n")
            f.writelines(stdout[rank])
            f.write("-- stderr\n")
            f.writelines(stderr[rank])


class Processes:
    """The run's processes of one attempt, each in a session of its own, their output kept line by line."""

    def __init__(self, cwd: str, algo: str, flags: list[str], log_prefix: str, rank_0_fault=None, file_limit=None):
        port = free_port()
        self.procs = []
        self.stdout = [[] for _ in range(PROCESSES)]
        self.stderr = [[] for _ in range(PROCESSES)]
        self.readers = []
        self.log_prefix = log_prefix
        for rank in range(PROCESSES):
            distributed = ["--distributed", "--coordinator-address", f"127.0.0.1:{port}"]
            distributed += ["--num-processes", str(PROCESSES), "--process-id", str(rank)]
            command = [sys.executable, SCRIPTS[algo], *flags, *distributed]
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            env.pop("CLEANBA_FAULT", None)
            if rank == 0 and rank_0_fault:  # with_fault.py runs the script's main() itself (no supervisor)
                command.insert(1, os.path.join(REPO, "tests", "with_fault.py"))
                env["CLEANBA_FAULT"] = rank_0_fault
            if rank == 0 and file_limit:
                command = with_file_size_limit(command, file_limit)
            proc = subprocess.Popen(
                command,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            self.procs.append(proc)
            for stream, lines in ((proc.stdout, self.stdout[rank]), (proc.stderr, self.stderr[rank])):
                reader = threading.Thread(target=lambda stream=stream, lines=lines: lines.extend(stream), daemon=True)
                reader.start()
                self.readers.append(reader)

    def started(self) -> bool:  # process 0 printed its run line: updates.jsonl is this attempt's
        return any(line.startswith("run ") for line in self.stdout[0])

    def signal_all(self, signum):
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signum)

    def ended(self) -> bool:  # a process of the attempt has exited
        return any(proc.poll() is not None for proc in self.procs)

    def kill(self, rank: int):  # the process and its supervisor: a lost node
        os.killpg(self.procs[rank].pid, signal.SIGKILL)

    def holds(self, pid: int) -> bool:  # `pid` is a process of this attempt's process 0 (its session)
        with contextlib.suppress(ProcessLookupError):
            return os.getsid(pid) == self.procs[0].pid
        return False

    def wait_for_rank_0(self):
        self.procs[0].wait(timeout=ATTEMPT_TIMEOUT)

    def wait(self, timeout: float) -> list[int]:
        deadline = time.time() + timeout
        for proc in self.procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self.signal_all(signal.SIGKILL)
                raise AssertionError(f"{self.log_prefix}: a process still runs after {timeout} s") from None
        for reader in self.readers:
            reader.join(timeout=10)
        left = lingering_processes([proc.pid for proc in self.procs])  # killed ones may still be ending
        assert not left, f"{self.log_prefix}: processes left running: {left}"
        codes = [proc.returncode for proc in self.procs]
        write_log(self.log_prefix, codes, self.stdout, self.stderr)
        return codes


class SlurmAttempt:
    """One start of the SLURM job's tasks (tests/soak_task.py runs each): to the soak what Processes is locally. A
    task's processes (supervisor and script; not the wrapper, which records their status) carry the attempt's name."""

    def __init__(self, job, name: str, log_prefix: str):
        self.job = job
        self.name = name
        self.log_prefix = log_prefix
        self.files = os.path.join(job.attempts, name)

    def read(self, rank: int, kind: str) -> list[str]:
        path = f"{self.files}.rank{rank}.{kind}"
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return f.readlines()

    @property
    def stdout(self) -> list[list[str]]:
        return [self.read(rank, "out") for rank in range(PROCESSES)]

    @property
    def stderr(self) -> list[list[str]]:
        return [self.read(rank, "err") for rank in range(PROCESSES)]

    def status(self, rank: int) -> int | None:
        lines = self.read(rank, "status")
        return int(lines[0]) if lines else None

    def started(self) -> bool:
        return any(line.startswith("run ") for line in self.read(0, "out"))

    def ended(self) -> bool:
        return any(self.status(rank) is not None for rank in range(PROCESSES))

    def pids(self, rank: int | None = None) -> list[int]:
        marker = f"CLEANBA_SOAK_ATTEMPT={self.files}".encode()  # this soak's attempt: its directory and name
        task = f"SLURM_PROCID={rank}".encode()
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = f.read().split(b"\0")
            except OSError:  # it exited meanwhile
                continue
            if marker in environ and (rank is None or task in environ):
                found.append(int(pid))
        return found

    def signal_all(self, signum):
        if signum == signal.SIGKILL:
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
            return
        # SLURM's preemption: the signal to the job's steps (scancel's default), the batch script sees srun's status.
        scancel = ["scancel", f"--signal={signal.Signals(signum).name[3:]}", self.job.job_id]
        subprocess.run(scancel, env=self.job.env, check=True, capture_output=True)

    def kill(self, rank: int):  # a lost node: the task's supervisor and script
        for pid in self.pids(rank):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def holds(self, pid: int) -> bool:  # `pid` is a process of this attempt's process 0 (its task)
        return pid in self.pids(0)

    def wait_for_rank_0(self):
        deadline = time.time() + ATTEMPT_TIMEOUT
        while self.status(0) is None:
            assert time.time() < deadline, f"{self.log_prefix}: process 0 still runs"
            time.sleep(0.05)

    def wait(self, timeout: float) -> list[int]:
        deadline = time.time() + timeout
        while any(self.status(rank) is None for rank in range(PROCESSES)):
            if time.time() > deadline:
                self.signal_all(signal.SIGKILL)
                raise AssertionError(f"{self.log_prefix}: a task still runs after {timeout} s")
            time.sleep(0.1)
        left = self.pids()
        assert not left, f"{self.log_prefix}: processes left running: {left}"
        codes = [self.status(rank) for rank in range(PROCESSES)]
        write_log(self.log_prefix, codes, self.stdout, self.stderr)
        return codes


class SlurmJob:
    """The soak's run as users run it on SLURM: cleanba/launch.py --slurm's batch job (its template: --requeue, and a
    requeue of its own after exit 143, or 75/137 up to 3 restarts), 2 tasks of tests/soak_task.py. Each attempt is
    a start of the job: the first, a requeue (SLURM holds a requeued job back two minutes; the soak lets it start), or,
    once the template gave up requeuing, a new submission, as a user would make."""

    FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}

    def __init__(self, env: dict, work: str, directory: str, algo: str, flags: list[str], seed: int):
        self.env = env
        self.work = work
        self.attempts = os.path.abspath(os.path.join(directory, "attempts"))  # the tasks run in `work`
        self.logs = os.path.abspath(os.path.join(directory, "slurm-logs"))
        os.makedirs(self.attempts, exist_ok=True)
        task = [sys.executable, os.path.join(REPO, "tests", "soak_task.py"), self.attempts]
        task += [sys.executable, SCRIPTS[algo], *flags, "--distributed"]
        grid = ["--slurm", "--ntasks-per-node", str(PROCESSES), "--env-ids", "CartPole-v1", "--seeds", str(seed)]
        self.submit = [sys.executable, os.path.join(REPO, "cleanba", "launch.py"), *grid, "--log-dir", self.logs]
        self.submit += ["--", *task]
        self.job_id = None
        self.restarts = 0  # of the job: its SLURM_RESTART_COUNT
        self.submissions = 0
        self.requeues = 0

    def state(self) -> str:  # "" once the job has left the queue
        query = ["squeue", "--noheader", "--jobs", self.job_id, "--states", "all", "--format", "%T"]
        for _ in range(30):  # slurmctld busy: ask again
            result = subprocess.run(query, env=self.env, capture_output=True, text=True)
            if result.returncode == 0 or "Invalid job id" in result.stderr:
                return result.stdout.strip()
            time.sleep(1)
        raise AssertionError(f"squeue failed: {result.stderr}")

    def start(self, log_prefix: str, rank_0_fault=None, file_limit=None) -> SlurmAttempt:
        name = os.path.basename(log_prefix)
        with open(os.path.join(self.attempts, "attempt.json.tmp"), "w") as f:
            json.dump(dict(name=name, rank_0_fault=rank_0_fault, file_limit=file_limit), f)
        os.replace(os.path.join(self.attempts, "attempt.json.tmp"), os.path.join(self.attempts, "attempt.json"))
        if self.job_id is None or self.state() in self.FINAL | {""}:
            submitted = subprocess.run(self.submit, cwd=self.work, env=self.env, capture_output=True, text=True)
            assert submitted.returncode == 0, f"{log_prefix}: the job was not submitted: {submitted.stderr}"
            self.job_id = re.search(r"submitted array job (\d+)", submitted.stdout).group(1)
            self.restarts = 0
            self.submissions += 1
        else:  # requeued, and held (settle): now, once its old credential is revoked (a start within that second fails)
            time.sleep(2)
            for change in (["update", f"JobId={self.job_id}_0", "StartTime=now"], ["release", f"{self.job_id}_0"]):
                subprocess.run(["scontrol", *change], env=self.env, check=True, capture_output=True)
            self.restarts += 1
        return SlurmAttempt(self, name, log_prefix)

    def settle(self, codes: list[int], where: str):
        """After an attempt: the job is requeued (pending) or over, as the template says for srun's status, the highest
        of its tasks' (`codes`, checked against the fault's documented ones after): 143 always, 75 and 137 3 times."""
        status = max(128 - code if code < 0 else code for code in codes)
        requeued = status == STOPPED["preempt"] or (status in (LOST_PROCESS, KILLED) and self.restarts < 3)
        deadline = time.time() + 60
        while (state := self.state()) not in (self.FINAL | {"", "PENDING"}):
            assert time.time() < deadline, f"{where}: the job is {state}"
            time.sleep(0.2)
        assert (state == "PENDING") == requeued, f"{where}: the job is {state or 'gone'} ({self.restarts} restarts)"
        if requeued:  # held until start(): SLURM's own hold of a requeued job (~2 minutes) may be over before then
            subprocess.run(["scontrol", "hold", f"{self.job_id}_0"], env=self.env, check=True, capture_output=True)
        self.requeues += requeued


def wait_for_update(processes: "Processes | SlurmAttempt", run_dir: str, update: int, timeout: float = ATTEMPT_TIMEOUT):
    """Blocks until this attempt has logged `update` (or a process has exited, which fails the soak)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if processes.ended():
            raise AssertionError(f"{processes.log_prefix}: a process exited before update {update}")
        if processes.started() and (logged := updates_logged(run_dir)) and logged[-1] >= update:
            return
        time.sleep(0.02)
    raise AssertionError(f"{processes.log_prefix}: update {update} not reached in {timeout} s")


def wait_for_started(processes: "Processes | SlurmAttempt", timeout: float = ATTEMPT_TIMEOUT):
    """Blocks until process 0 has printed its run line: it owns the run directory (or a process exited: it fails)."""
    deadline = time.time() + timeout
    while not processes.started():
        assert not processes.ended(), f"{processes.log_prefix}: a process exited before the run started"
        assert time.time() < deadline, f"{processes.log_prefix}: the run did not start in {timeout} s"
        time.sleep(0.02)


def corrupt(path: str, how: str, rng: np.random.Generator):
    size = os.path.getsize(path)
    if how == "corrupt-cut":
        os.truncate(path, int(rng.integers(0, size)))
        return
    position = int(rng.integers(0, size))
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)[0]
        f.seek(position)
        f.write(bytes([byte ^ (1 << int(rng.integers(0, 8)))]))


def one_line(lines: list[str], pattern: str, where: str) -> re.Match:
    """The one line a process printed on stderr, which must match `pattern`."""
    assert len(lines) == 1, f"{where}: stderr is not one line:\n{''.join(lines)[-3000:]}"
    match = re.fullmatch(pattern, lines[0].rstrip("\n"))
    assert match, f"{where}: unexpected line {lines[0]!r}"
    return match


def check_lost_line(processes: "Processes | SlurmAttempt", survivor: int, lost: int, run_dir: str, name: str):
    """The survivor's one line names the lost process and the last checkpoint it knows to be written: process 0 the
    newest; another process may not know of one process 0 wrote at the update it was lost (the line's update)."""
    pattern = rf"error: lost process {lost} \(host \S+\) after update (\d+); the last checkpoint \(runs/{name}/"
    pattern += r"checkpoint\.msgpack\) is after update (\d+): run the same command, or requeue the SLURM job, to "
    pattern += r"resume from it \(CLEANBA_VERBOSE=1: JAX's error\)"
    where = f"{processes.log_prefix}, process {survivor}"
    reached, named = map(int, one_line(processes.stderr[survivor], pattern, where).groups())
    newest = newest_intact(run_dir)
    assert named == newest or (survivor and named < newest == reached), f"{where}: names checkpoint {named}"


def stderr_of(processes: "Processes | SlurmAttempt", rank: int) -> list[str]:
    """What a process printed on stderr, aside from tests/with_fault.py's announcement of its fault and the progress
    lines that cleanba/supervise.py reads (with_fault.py runs the script without it)."""
    return [line for line in processes.stderr[rank] if not line.startswith(("CLEANBA_FAULT: ", "cleanba-progress "))]


def torn(run_dir: str) -> bool:  # updates.jsonl ends in a line cut short
    with open(os.path.join(run_dir, "updates.jsonl"), "rb") as f:
        return not f.read().endswith(b"\n")


def finite_checkpoints(run_dir: str) -> bool:  # every intact checkpoint holds finite numbers only
    for path in checkpoint_paths(run_dir):
        if intact_update(path) is None:
            continue
        with open(path, "rb") as f:
            state = flax.serialization.msgpack_restore(f.read().partition(b"\n")[2])["state"]
        leaves = flax.traverse_util.flatten_dict(state, sep="/").values()
        if not all(np.all(np.isfinite(leaf)) for leaf in leaves if np.issubdtype(np.asarray(leaf).dtype, np.number)):
            return False
    return True


KEPT = "the checkpoints written before are intact: run the same command to resume"


def check_ending(fault, codes, processes: "Processes | SlurmAttempt", run_dir: str, name: str, at: int):
    """The exit statuses and lines the Failures guide documents for `fault`."""
    where = processes.log_prefix
    stdout = "".join(processes.stdout[0])
    if fault in STOPPED:
        assert codes == [STOPPED[fault]] * PROCESSES, f"{where}: exit statuses {codes}"
        signame = "SIGTERM" if fault == "preempt" else "SIGINT"
        stopped = re.findall(rf"^stopped by {signame} after update (\d+) ", stdout, re.M)
        assert len(stopped) == 1 and intact_update(checkpoint_paths(run_dir)[0]) == int(stopped[0]), where
        for rank in range(PROCESSES):
            assert not processes.stderr[rank], f"{where}: process {rank}'s stderr: {processes.stderr[rank][-5:]}"
    elif fault == "lose-process":
        survivor = 1 - at
        assert codes[at] == -signal.SIGKILL and codes[survivor] == LOST_PROCESS, f"{where}: exit statuses {codes}"
        check_lost_line(processes, survivor, at, run_dir, name)
    elif fault == "kill-in-checkpoint":
        # Process 0 died before the rename; the others were killed by the soak (or found process 0 lost first).
        assert codes[0] == KILLED and all(c in (-signal.SIGKILL, LOST_PROCESS) for c in codes[1:]), codes
        assert os.path.exists(checkpoint_paths(run_dir)[0] + ".tmp"), f"{where}: no interrupted write"
        assert newest_intact(run_dir) < at, f"{where}: the checkpoint of update {at} was renamed into place"
    elif fault == "failed-write":
        assert codes == [WRITE_FAILED, LOST_PROCESS], f"{where}: exit statuses {codes}"
        pattern = rf"error: writing runs/{name}/checkpoint\.msgpack\.tmp after update {at} failed \(\[Errno 27\] File "
        pattern += rf"too large\); {KEPT}"
        one_line(processes.stderr[0], pattern, f"{where}, process 0")
        check_lost_line(processes, 1, 0, run_dir, name)
    elif fault == "torn-journal":  # process 0 died half-way through update `at`'s record: a lost process to the other
        assert codes == [KILLED, LOST_PROCESS], f"{where}: exit statuses {codes}"
        assert not stderr_of(processes, 0), f"{where}: process 0's stderr: {processes.stderr[0][-5:]}"
        last = (updates_logged(run_dir) or [0])[-1]
        assert torn(run_dir) and last == at - 1, f"{where}: no torn record of update {at}"
        check_lost_line(processes, 1, 0, run_dir, name)
    elif fault in ("full-journal", "full-events"):  # the disk filled under updates.jsonl or an event file
        assert codes == [WRITE_FAILED, LOST_PROCESS], f"{where}: exit statuses {codes}"
        file = "updates\\.jsonl" if fault == "full-journal" else "events\\.out\\.tfevents\\.\\*"
        pattern = rf"error: writing runs/{name}/{file} after update (\d+) failed \(\[Errno 28\] No space left on "
        pattern += rf"device\); {KEPT}"
        failed = int(one_line(stderr_of(processes, 0), pattern, f"{where}, process 0").group(1))
        if fault == "full-journal":  # half of the record written
            assert failed == at and torn(run_dir), f"{where}: update {failed}'s record, torn: {torn(run_dir)}"
        else:  # the writer thread fails at the next points it writes: update `at`'s, or the next logged ones
            assert at <= failed <= at + LOG_FREQUENCY, f"{where}: failed after update {failed}, not {at} or soon after"
        assert newest_intact(run_dir) < (at if fault == "full-journal" else failed + 1), f"{where}: a checkpoint after"
        check_lost_line(processes, 1, 0, run_dir, name)
    elif fault == "non-finite":  # update `at` made the optimiser's state infinite: the run stops before it is kept
        # The check of the state is the processes' together: the other process stops in the same line, exit status 1
        # (the non-finite parts are process 0's alone: it names none), unless it finds process 0 gone first (75).
        assert codes[0] == FAILED and codes[1] in (FAILED, LOST_PROCESS), f"{where}: exit statuses {codes}"
        pattern = rf"error: non-finite values after update {at}: (.*); the last good checkpoint is the one after "
        pattern += r"update (\d+)"
        parts, good = one_line(stderr_of(processes, 0), pattern, f"{where}, process 0").groups()
        assert parts.startswith("opt_state/") and int(good) == newest_intact(run_dir) < at, f"{where}: {parts}, {good}"
        assert finite_checkpoints(run_dir), f"{where}: a checkpoint holds non-finite values"
        assert (updates_logged(run_dir) or [0])[-1] == at - 1, f"{where}: update {at} was logged"
        if codes[1] == FAILED:
            one_line(processes.stderr[1], pattern.replace("(.*)", "()").replace(r"(\d+)", good), f"{where}, process 1")
        else:
            check_lost_line(processes, 1, 0, run_dir, name)
    else:
        assert codes == [0] * PROCESSES, f"{where}: exit statuses {codes}"
        for rank in range(PROCESSES):
            assert not processes.stderr[rank], f"{where}: process {rank}'s stderr: {processes.stderr[rank][-5:]}"


def check_second_copy(processes: "Processes | SlurmAttempt", work: str, algo: str, flags: list[str], name: str):
    """A second copy of the command, started while the attempt runs (a double submit, or a user's): refused in one
    line per process, exit status 73, nothing written; the attempt goes on. Returns the updates it lost (none)."""
    run_dir = os.path.join(work, "runs", name)
    with open(os.path.join(run_dir, "lock")) as f:
        holder = f.read().strip()
    pid = int(re.fullmatch(r"pid (\d+) on \S+", holder).group(1))
    assert processes.holds(pid), f"{processes.log_prefix}: the lock names {holder}, not the attempt's process 0"

    def files():  # what the run directory holds, the attempt's checkpoints and logs aside (each event file's size)
        found = {}
        for entry in sorted(os.listdir(run_dir)):
            path = os.path.join(run_dir, entry)
            if entry.startswith("events."):
                found[entry] = os.path.getsize(path)
            elif not re.fullmatch(r"checkpoint(\.1)?\.msgpack(\.tmp)?|updates\.jsonl", entry):
                with open(path, "rb") as f:
                    found[entry] = f.read()
        return found

    before, logged = files(), updates_logged(run_dir)
    copy = Processes(work, algo, flags, f"{processes.log_prefix}-second-copy")
    codes = copy.wait(ATTEMPT_TIMEOUT)
    where = f"{processes.log_prefix}-second-copy"
    assert codes == [IN_USE] * PROCESSES, f"{where}: exit statuses {codes}"
    ways_out = "wait for it to end or stop it; another --run-name starts another run"
    for rank, who in enumerate([re.escape(holder), r"its process 0 was refused"]):
        pattern = rf"error: runs/{name} is in use by another copy of this command \({who}\): {ways_out}"
        one_line(copy.stderr[rank], pattern, f"{where}, process {rank}")
        printed = [line for line in copy.stdout[rank] if not line.startswith("[Gloo] ")]  # gloo's: it connected
        assert not printed, f"{where}: process {rank}'s stdout: {printed[-5:]}"
    assert not processes.ended(), f"{processes.log_prefix}: the attempt ended beside the second copy"
    # The same files, the lock and config.json unchanged; the attempt's event files grown, or one more of its own: after
    # each checkpoint it goes on in a file named by the checkpoint's update (a second copy never gets that far).
    after = files()
    added = sorted(after.keys() - before.keys())
    assert before.keys() <= after.keys(), f"{where}: the run directory held {sorted(before)}, now {sorted(after)}"
    assert all(re.fullmatch(r"events\.out\.tfevents\..*\.\d{9}", entry) for entry in added), f"{where}: {added}"
    for entry, was in before.items():
        assert after[entry] >= was if entry.startswith("events.") else after[entry] == was, f"{where}: {entry} changed"
    return len(set(logged) - set(updates_logged(run_dir)))


def check_journal_healed(processes: "Processes | SlurmAttempt", name: str, lines: int, start: int):
    """The resume kept updates.jsonl's records up to its checkpoint's update and dropped the rest (records of updates
    it redoes, a torn line) in one line; none is missing."""
    stdout = "".join(processes.stdout[0])
    where = processes.log_prefix
    line = rf"^runs/{name}/updates\.jsonl: dropped (\d+) of (\d+) lines \(after update (\d+), repeated or cut short\)$"
    dropped = re.findall(line, stdout, re.M)
    expected = [(str(lines - start), str(lines), str(start))] if lines > start else []
    assert dropped == expected, f"{where}: journal healed as {dropped}, not {expected}"
    assert "updates.jsonl has no record" not in stdout, f"{where}: updates.jsonl lost records"


def run_name(algo: str, seed: int) -> str:
    return f"soak-{algo}-{seed}"


def flags_of(algo: str, seed: int, updates: int, interval: int, cache: str) -> list[str]:
    """A small CartPole run: 2 processes x 1 actor thread x 4 envs x 32 steps, a checkpoint every `interval` updates."""
    flags = f"--env-id CartPole-v1 --local-num-envs {ENVS} --num-actor-threads 1 --num-steps {STEPS}"
    flags += f" --log-frequency {LOG_FREQUENCY} --seed {seed} --total-timesteps {updates * BATCH}"
    flags += f" --checkpoint-interval {interval}"
    flags += f" --checkpoint-minutes 1000 --heartbeat-timeout 10 --run-name {run_name(algo, seed)}"
    return [*flags.split(), "--compilation-cache-dir", cache]


def attempt_fault(kind: str, start: int, interval: int, run_dir: str, rng) -> tuple[int, dict]:
    """When the fault lands (the update) and how the attempt's processes start for it."""
    due = (start // interval + 1) * interval  # the attempt's first periodic checkpoint
    if kind == "kill-in-checkpoint":
        at = due + interval * int(rng.integers(0, 2))
        return at, dict(rank_0_fault=f"checkpoint@{at}")
    if kind in WITH_FAULT:  # at an update after 1 to 2 intervals' worth, on process 0
        at = start + int(rng.integers(1, 2 * interval + 1))
        return at, dict(rank_0_fault=f"{WITH_FAULT[kind]}@{at}")
    if kind == "failed-write":  # a limit just below a checkpoint's size, above what the logs reach
        assert journal_fits(run_dir, start, interval), "updates.jsonl would reach the file-size limit"
        return due, dict(file_limit=checkpoint_size(run_dir) - 1)
    return start + int(rng.integers(1, 2 * interval + 1)), {}


def checkpoint_size(run_dir: str) -> int | None:  # that of an intact checkpoint (they all have the same size)
    for path in checkpoint_paths(run_dir):
        if intact_update(path) is not None:
            return os.path.getsize(path)
    return None


def journal_fits(run_dir: str, start: int, interval: int) -> bool:
    """A file-size limit just below a checkpoint's size leaves room for updates.jsonl up to the attempt's first
    checkpoint (IMPALA's CartPole checkpoint holds ~230 updates' records): a failed write is the checkpoint's."""
    if not (size := checkpoint_size(run_dir)) or not start:
        return False
    logged = os.path.getsize(os.path.join(run_dir, "updates.jsonl"))
    return logged / start * (start + interval + 1) < 0.9 * (size - 1)


def can_corrupt(run_dir: str) -> bool:  # the newest and the one behind it intact: the resume has one to fall back to
    return all(intact_update(path) is not None for path in checkpoint_paths(run_dir))


def next_faults(rng, run_dir: str, interval: int, remaining: int, copies: int, schedule: list[str] | None) -> tuple:
    """(A checkpoint fault to apply before the next attempt, or None; whether a second copy of the command starts
    while it runs; the attempt's process fault, or None: it runs to the end), from the schedule in order (a second copy
    before a fault the soak itself lands: a stop signal or a lost process), else drawn among those that can happen
    now, with at most `copies` second copies."""
    if schedule is not None:
        corruption = schedule.pop(0) if schedule and schedule[0] in CHECKPOINT_FAULTS else None
        assert corruption is None or can_corrupt(run_dir), f"{corruption} without two intact checkpoints"
        copy = bool(schedule) and schedule[0] == SECOND_COPY and bool(schedule.pop(0))
        kind = schedule.pop(0) if schedule else None
        assert not copy or kind in SIGNAL_FAULTS, f"a second copy before {kind}, not one of {SIGNAL_FAULTS}"
        return corruption, copy, kind
    corruption = None
    if remaining and can_corrupt(run_dir) and rng.random() < len(CHECKPOINT_FAULTS) / len(FAULTS):
        corruption = str(rng.choice(CHECKPOINT_FAULTS))
        remaining -= 1
    if not remaining:
        return corruption, False, None
    start = newest_intact(run_dir)  # (or an older one, after a corruption: less of updates.jsonl kept)
    possible = [kind for kind in PROCESS_FAULTS if kind != "failed-write" or journal_fits(run_dir, start, interval)]
    kind = str(rng.choice(possible))
    # A second copy in about a tenth of the faults: in 40% of the attempts a stop signal or lost process ends.
    copy = kind in SIGNAL_FAULTS and remaining >= 2 and copies > 0 and rng.random() < 0.4
    return corruption, copy, kind


def soak(algo: str, directory: str, faults: int, seed: int, schedule: list[str] | None = None, slurm=None) -> dict:
    """Runs the soak in `directory` (work/: the run's working directory; logs/: each attempt's output) and checks it;
    returns its figures. `schedule`: the faults in order (else `faults` of them drawn at random). `slurm`: the
    environment of a SLURM cluster's commands, to run the job there (else the processes start here)."""
    directory = os.path.abspath(directory)  # the processes run in work/: a relative path would point inside it
    rng = np.random.default_rng(seed)
    interval = 2
    # Enough for every fault to land before the end: each lands within two intervals of where its attempt starts, and
    # an attempt moves the start ~2 updates on (a fault that lands later fails the soak, in a line that says so).
    # A second copy takes seconds to start and be refused, while the attempt goes on: COPY_UPDATES more for each.
    copies = schedule.count(SECOND_COPY) if schedule else faults // 10
    updates = 3 * (faults + 3) + COPY_UPDATES * copies
    work = os.path.join(directory, "work")
    logs = os.path.join(directory, "logs")
    os.makedirs(work, exist_ok=True)
    os.makedirs(logs, exist_ok=True)
    cache = os.environ.get("CLEANBA_TEST_COMPILATION_CACHE", os.path.join(directory, "compilation-cache"))
    flags = flags_of(algo, seed, updates, interval, cache)
    name = run_name(algo, seed)
    run_dir = os.path.join(work, "runs", name)
    attempts = []
    lost = []  # (the previous attempt's fault, a corruption after it, updates lost, the policy's bound)
    started = time.time()
    schedule = list(schedule) if schedule else None
    job = SlurmJob(slurm, work, directory, algo, flags, seed) if slurm else None
    while True:
        done = sum(bool(a.fault) + bool(a.corrupted) + a.copied for a in attempts)
        copies_left = copies - sum(a.copied for a in attempts)
        corrupted, copied, kind = next_faults(rng, run_dir, interval, faults - done, copies_left, schedule)
        if corrupted:
            corrupt(checkpoint_paths(run_dir)[0], corrupted, rng)
        start = newest_intact(run_dir)
        journal_lines = lines_in(os.path.join(run_dir, "updates.jsonl"))  # what the resume heals
        at, options = attempt_fault(kind, start, interval, run_dir, rng) if kind else (None, {})
        if kind and at >= updates:
            raise AssertionError(f"the run ends before its {len(attempts) + 1}th fault ({kind})")
        prefix = os.path.join(logs, f"attempt-{len(attempts) + 1:03d}-{kind or 'end'}")
        begun = time.time()
        processes = job.start(prefix, **options) if job else Processes(work, algo, flags, prefix, **options)
        victim = None
        if copied:  # once the attempt owns the run directory; its fault lands after the copy was refused
            wait_for_started(processes)
            lost.append((SECOND_COPY, None, check_second_copy(processes, work, algo, flags, name), 0))
            at = max(at, (updates_logged(run_dir) or [start])[-1] + 1)
            if at >= updates:
                raise AssertionError(f"the run ends before its {len(attempts) + 1}th attempt's fault ({kind})")
        if kind in SIGNAL_FAULTS:
            wait_for_update(processes, run_dir, at)
            time.sleep(float(rng.uniform(0, 0.2)))  # somewhere inside the next update
            if kind == "lose-process":
                victim = int(rng.integers(0, PROCESSES))
                processes.kill(victim)
            else:
                processes.signal_all(signal.SIGTERM if kind == "preempt" else signal.SIGINT)
        elif kind == "kill-in-checkpoint":
            processes.wait_for_rank_0()
            processes.signal_all(signal.SIGKILL)  # everything else of the job goes with it
        codes = processes.wait(ATTEMPT_TIMEOUT)
        if job:
            job.settle(codes, prefix)
        resumed = re.findall(r"^resuming from \S+ after update (\d+) ", "".join(processes.stdout[0]), re.M)
        resumed_from = int(resumed[0]) if resumed else 0
        assert resumed_from == start, f"{prefix}: resumed from update {resumed_from}, not {start}, the newest intact"
        if corrupted:
            passed_over = f"runs/{name}/checkpoint.msgpack is cut short or changed"
            assert "".join(processes.stdout[0]).count(passed_over) == 1, f"{prefix}: the passed-over line is missing"
        check_journal_healed(processes, name, journal_lines, start)
        if attempts:
            previous = attempts[-1]
            bound = {"preempt": 0, "interrupt": 0}.get(previous.fault, interval) + (interval if corrupted else 0)
            lost.append((previous.fault, corrupted, previous.reached - resumed_from, bound))
            assert previous.reached - resumed_from <= bound, f"{prefix}: {lost[-1]}"
        check_ending(kind, codes, processes, run_dir, name, victim if kind == "lose-process" else at)
        logged = updates_logged(run_dir)
        reached = logged[-1] if logged else 0
        attempts.append(Attempt(kind, corrupted, resumed_from, reached, time.time() - begun, copied))
        if kind is None:
            break
    chaotic_seconds = time.time() - started
    check_records(run_dir, updates)
    assert sorted(os.listdir(work)) == ["runs"] and os.listdir(os.path.join(work, "runs")) == [name], os.listdir(work)
    replay_seconds = replay(algo, directory, flags, name, [a.resumed_from for a in attempts], run_dir)
    kinds = [a.fault for a in attempts if a.fault] + [a.corrupted for a in attempts if a.corrupted]
    kinds += [SECOND_COPY for a in attempts if a.copied]
    return dict(
        algo=algo,
        launcher="SLURM (cleanba/launch.py --slurm)" if job else "local",
        submissions=job.submissions if job else None,
        requeues=job.requeues if job else None,
        seed=seed,
        updates=updates,
        checkpoint_interval=interval,
        attempts=len(attempts),
        faults=len(kinds),
        faults_by_kind={kind: kinds.count(kind) for kind in FAULTS if kind in kinds},
        fault_kinds=FAULTS,  # the soak's kinds (a soak of other kinds is not merged with this one's figures)
        lost_updates=[dict(fault=f, corrupted=c, lost=n, bound=b) for f, c, n, b in lost],
        resumed_from=[a.resumed_from for a in attempts],
        chaotic_seconds=round(chaotic_seconds, 1),
        replay_seconds=round(replay_seconds, 1),
    )


def check_records(run_dir: str, updates: int):
    """Every update once in updates.jsonl, in order; every logged step once in TensorBoard (as it shows them)."""
    logged = updates_logged(run_dir)
    assert logged == list(range(1, updates + 1)), f"updates.jsonl: {logged}"
    for tag, points in read_scalars(run_dir).items():
        steps = [step for step, _ in points]
        assert steps == sorted(set(steps)), f"TensorBoard's {tag}: steps {steps}"
    steps = [step for step, _ in read_scalars(run_dir)["stats/update"]]
    every = sorted({*range(LOG_FREQUENCY, updates + 1, LOG_FREQUENCY), updates})  # and at the end
    assert steps == [update * BATCH for update in every], f"TensorBoard's updates logged at steps {steps}"


def lineage(resume_points: list[int]) -> list[int]:
    """The resume points the finished run descends from: a resume from an older checkpoint than the previous one's
    (after a corrupt checkpoint) drops the attempts that started after it."""
    chain = []
    for point in resume_points:
        while chain and chain[-1] > point:
            chain.pop()
        if not chain or chain[-1] != point:
            chain.append(point)
    return chain


def replay(algo: str, directory: str, flags: list[str], name: str, resume_points: list[int], run_dir: str) -> float:
    """The same command stopped cleanly at the chaotic run's resume points (in its lineage) and run again: its
    updates.jsonl must equal the chaotic run's, bit for bit."""
    started = time.time()
    work = os.path.join(directory, "replay")
    os.makedirs(work, exist_ok=True)
    points = lineage(resume_points)
    for stop in [*points[1:], None]:
        prefix = os.path.join(directory, "logs", f"replay-{stop or 'end'}")
        processes = Processes(work, algo, flags, prefix, rank_0_fault=f"sigterm@{stop}" if stop else None)
        codes = processes.wait(ATTEMPT_TIMEOUT)
        assert codes == ([STOPPED["preempt"]] * PROCESSES if stop else [0] * PROCESSES), f"{prefix}: {codes}"
    with open(os.path.join(run_dir, "updates.jsonl")) as f:
        chaotic = f.read()
    with open(os.path.join(work, "runs", name, "updates.jsonl")) as f:
        replayed = f.read()
    assert chaotic == replayed, "the chaotic run's updates.jsonl differs from its replay's"
    return time.time() - started


def markdown(results: list[dict]) -> str:
    """Two tables: each script's soak, then the updates lost to each kind of fault against the policy's bound."""
    lines = [
        "| script | faults | attempts | SLURM job: requeued, submitted | updates | wall time (run, replay) | by kind |"
    ]
    lines.append("|---|---|---|---|---|---|---|")
    for r in results:
        by_kind = ", ".join(f"{kind} {count}" for kind, count in r["faults_by_kind"].items())
        wall = f"{r['chaotic_seconds'] / 60:.1f} min, {r['replay_seconds'] / 60:.1f} min"
        job = f"{r['requeues']}, {r['submissions']}" if r.get("submissions") else "- (local)"
        lines.append(f"| {r['algo']} | {r['faults']} | {r['attempts']} | {job} | {r['updates']} | {wall} | {by_kind} |")
    lines += ["", "| script | fault (then a corrupt checkpoint) | times | updates lost: max (mean) | bound |"]
    lines.append("|---|---|---|---|---|")
    for r in results:
        by_fault = {}
        for entry in r["lost_updates"]:
            fault = f"{entry['fault']}, then {entry['corrupted']}" if entry["corrupted"] else entry["fault"]
            by_fault.setdefault(fault, (entry["bound"], []))[1].append(entry["lost"])
        for fault, (bound, lost) in sorted(by_fault.items()):
            lines.append(f"| {r['algo']} | {fault} | {len(lost)} | {max(lost)} ({np.mean(lost):.1f}) | {bound} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algo", nargs="+", default=["impala", "ppo", "pqn"], choices=["ppo", "impala", "pqn"])
    parser.add_argument("--faults", type=int, default=60, help="faults per script, drawn from the kinds above")
    parser.add_argument("--seed", type=int, default=1, help="the schedule's seed and the run's")
    parser.add_argument("--dir", required=True, help="where the runs and each attempt's output go")
    out = "write soak.json and soak.md here (--slurm: soak_slurm.*), with the other scripts' figures there"
    parser.add_argument("--out", default=None, help=out)
    parser.add_argument("--slurm", action="store_true", help="run the job on a one-node SLURM cluster started here")
    parser.add_argument("--schedule", nargs="+", choices=FAULTS, default=None, help="these faults in order instead")
    args = parser.parse_args()
    results = []
    with slurm_cluster(os.path.join(args.dir, "slurm-cluster")) if args.slurm else contextlib.nullcontext() as env:
        for algo in args.algo:
            faults = len(args.schedule) if args.schedule else args.faults  # the run's length follows from them
            result = soak(algo, os.path.join(args.dir, algo), faults, args.seed, args.schedule, slurm=env)
            print(json.dumps(result), flush=True)
            results.append(result)
    print(markdown(results))
    if args.out:  # with the figures there of the other scripts, from a soak of the same kinds
        os.makedirs(args.out, exist_ok=True)
        name = "soak_slurm" if args.slurm else "soak"
        with contextlib.suppress(FileNotFoundError), open(os.path.join(args.out, f"{name}.json")) as f:
            results += [r for r in json.load(f) if r.get("fault_kinds") == FAULTS and r["algo"] not in args.algo]
        results.sort(key=lambda r: ["impala", "ppo", "pqn"].index(r["algo"]))
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
            json.dump(results, f, indent=2)
        with open(os.path.join(args.out, f"{name}.md"), "w") as f:
            f.write(markdown(results))


if __name__ == "__main__":
    main()
