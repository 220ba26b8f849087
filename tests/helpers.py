"""Runs the training scripts as a user does (a subprocess with real flags) and reads back their logs."""

import fcntl
import functools
import glob
import importlib.util
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import threading
import time
from typing import NamedTuple

import flax.serialization
import jax
import numpy as np
import tyro

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "cleanba"))

from events import read_events, read_scalars  # noqa: E402, F401 (for the tests)

SCRIPTS = {algo: os.path.join(REPO, "cleanba", f"cleanba_{algo}.py") for algo in ("ppo", "impala", "pqn")}

ALGOS = list(SCRIPTS)
# What a policy's distribution makes possible: continuous actions (a Gaussian), log-probabilities to replay.
POLICY_GRADIENT = ["ppo", "impala"]

# Small, fast settings shared by the tests; each test adds what it is about. With the default 2 actor
# threads, CARTPOLE has 8 envs of 32 steps: 256 per update.
CARTPOLE = "--env-id CartPole-v1 --local-num-envs 4 --num-steps 32 --log-frequency 1".split()
# Breakout for PPO: rollouts of 16 steps, 2 minibatches (along time), one epoch.
BREAKOUT = "--env-id Breakout-v5 --num-steps 16 --num-minibatches 2 --update-epochs 1".split()
# CartPole-v1 is solved (mean return >= 450 of a 500 cap) within these budgets, ~10-15 s each alone here: PPO 300k
# steps; IMPALA 500k steps with 16 envs, gradient norms clipped at 10 and V-trace's lambda 0.95 (the settings
# of benchmark.sh's laptop grid, which keep it from losing the task after solving it: see the README).
CARTPOLE_SOLVE = {
    "ppo": "--env-id CartPole-v1 --local-num-envs 8 --num-actor-threads 1 --num-steps 128 --learning-rate 1e-3 "
    "--clip-coef 0.2 --total-timesteps 300000 --log-frequency 10",
    "impala": "--env-id CartPole-v1 --local-num-envs 16 --num-actor-threads 1 --num-steps 20 --learning-rate 1e-3 "
    "--max-grad-norm 10 --vtrace-lambda 0.95 --total-timesteps 500000 --log-frequency 50",
    # PQN: the README's (CleanRL's pqn.py settings, 4 envs x 128 steps, 4 minibatches x 4 epochs, RAdam 2.5e-4,
    # epsilon annealed over half the run, but to 0.01, not 0.05), ~35 s here.
    "pqn": "--env-id CartPole-v1 --local-num-envs 4 --num-actor-threads 1 --num-steps 128 --num-minibatches 4 "
    "--update-epochs 4 --learning-rate 2.5e-4 --end-e 0.01 --exploration-fraction 0.5 --total-timesteps 500000 "
    "--log-frequency 10",
}
CARTPOLE_SOLVE = {algo: flags.split() for algo, flags in CARTPOLE_SOLVE.items()}
# A dict observation (image, direction, mission) and a recurrent policy.
MINIGRID_LSTM = "--env-id MiniGrid-MemoryS7-v0 --lstm-size 16"
# CartPole with an LSTM: episodes end every ~20 steps, inside PPO's chunks of 8 steps and IMPALA's unrolls of 32.
CARTPOLE_LSTM = "--env-id CartPole-v1 --lstm-size 8 --num-steps 32 --num-minibatches 4 --no-concurrency".split()


def script_env(num_devices: int | None = None) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if num_devices:  # must be set before jax is imported, hence in the child's environment
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={num_devices}".strip()
    return env


def command(algo: str, flags, shared_cache: bool) -> list[str]:
    """The script's command line; with shared_cache, it uses the test session's compilation cache (conftest.py)
    instead of its default one under runs/."""
    cache = ["--compilation-cache-dir", os.environ["CLEANBA_TEST_COMPILATION_CACHE"]] if shared_cache else []
    return [sys.executable, SCRIPTS[algo], *cache, *map(str, flags)]


def run(cwd, *flags, algo="ppo", num_devices=None, env=None, timeout=300, shared_cache=True):
    return subprocess.run(
        command(algo, flags, shared_cache),
        cwd=cwd,
        env=env or script_env(num_devices),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start(cwd, *flags, algo="ppo", num_devices=None, env=None) -> subprocess.Popen:
    """Starts the script in a session of its own (its id is the pid), so that session_processes() can tell
    whether it left any process behind."""
    args = command(algo, flags, shared_cache=True)
    if "CLEANBA_FAULT" in (env or {}):  # a fault injected by tests/with_fault.py
        args.insert(1, os.path.join(REPO, "tests", "with_fault.py"))
    return subprocess.Popen(
        args,
        cwd=cwd,
        env=env or script_env(num_devices),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def timed_output(proc: subprocess.Popen, timeout: float) -> list[tuple[float, str]]:
    """Waits for the process to exit; returns its output lines with the time each arrived. A process that
    outlives `timeout` is killed and fails the test."""
    lines = []
    reader = threading.Thread(target=lambda: lines.extend((time.time(), line) for line in proc.stdout))
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    finally:
        reader.join(timeout=10)
    return lines


def session_processes(session_id: int) -> list[int]:
    """The live processes of a session: what a process started by start() left running, if anything."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, _, _, session = f.read().rsplit(")", 1)[1].split()[:4]  # after the command name
        except OSError:  # it exited meanwhile
            continue
        if int(session) == session_id and state != "Z":
            pids.append(int(entry))
    return pids


def lingering_processes(session_ids: list[int], grace: float = 10.0) -> list[int]:
    """The live processes of these sessions once they have had `grace` seconds to end: one SIGKILLed a moment ago may
    still be tearing down its memory (seconds for a large process on a loaded machine); one left running stays."""
    deadline = time.time() + grace
    while True:
        left = [pid for session_id in session_ids for pid in session_processes(session_id)]
        if not left or time.time() > deadline:
            return left
        time.sleep(0.1)


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def run_dirs(cwd) -> list[str]:
    return sorted(glob.glob(os.path.join(str(cwd), "runs", "*")))


def only_run(cwd) -> str:
    dirs = run_dirs(cwd)
    assert len(dirs) == 1, dirs
    return dirs[0]


def values(scalars, tag) -> list[float]:
    return [value for _, value in scalars[tag]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(cwd, *flags, num_processes=2, algo="ppo", timeout=300) -> list[str]:
    """Runs the script as `num_processes` --distributed processes on localhost; returns their outputs
    once all have exited 0."""
    os.makedirs(cwd, exist_ok=True)
    flags = [
        *flags,
        "--distributed",
        "--coordinator-address",
        f"127.0.0.1:{free_port()}",
        "--num-processes",
        num_processes,
    ]
    procs = [start(cwd, *flags, "--process-id", rank, algo=algo) for rank in range(num_processes)]
    outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    for rank, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"process {rank} exited {proc.returncode}\n{output[-5000:]}"
    return outputs


def train(cwd, *flags, num_processes=1, **kwargs) -> str:
    """Trains in its own directory and returns the run directory."""
    os.makedirs(cwd, exist_ok=True)
    if num_processes > 1:
        run_processes(cwd, *flags, num_processes=num_processes, **kwargs)
    else:
        check(run(cwd, *flags, **kwargs))
    return only_run(cwd)


@functools.cache
def load_module(path: str):
    """Imports a script as a module (its main() only runs as __main__), once, for in-process checks. It is
    registered in sys.modules, where tyro finds the source of Args's field docstrings."""
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[: -len(".py")], path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_script(algo: str):
    return load_module(SCRIPTS[algo])


def wait_for_updates(cwd, count, proc, timeout=120):
    """Blocks until the run under cwd has `count` lines in updates.jsonl (a resumed run starts with the lines
    it keeps); fails if the process exits first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            stdout, stderr = proc.communicate()
            output = (stdout or "")[-1500:] + (stderr or "")[-1500:]  # a crash's cause is on stderr
            raise AssertionError(f"exit status {proc.returncode} before {count} updates: {output}")
        logs = glob.glob(os.path.join(str(cwd), "runs", "*", "updates.jsonl"))
        if logs and sum(1 for _ in open(logs[0])) >= count:
            return
        time.sleep(0.2)
    raise TimeoutError(f"fewer than {count} updates after {timeout}s")


class Run(NamedTuple):
    """A finished run, read right after it ended (a later test may start it over)."""

    path: str
    output: str
    config: dict  # config.json
    records: list[dict]  # updates.jsonl
    scalars: dict  # TensorBoard's scalars: {tag: [(step, value), ...]}


def finished_run(cwd, output: str = "") -> Run:
    path = only_run(cwd)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "updates.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return Run(path, output, config, records, read_scalars(path))


def load_checkpoint(run_dir, name: str = "checkpoint.msgpack") -> dict:
    """A checkpoint's contents (its first line is the SHA-256 of the rest, which read_checkpoint checks)."""
    with open(os.path.join(run_dir, name), "rb") as f:
        return flax.serialization.msgpack_restore(f.read().partition(b"\n")[2])


def stop_actors(actors, timeout: float = 30):
    """Stops a script's Actors (as its finish() does) and waits for their threads."""
    actors.stop.set()
    deadline = time.time() + timeout
    for thread, *_ in actors.threads:
        thread.join(timeout=max(0.0, deadline - time.time()))


def host_collate(rollouts, devices: int) -> dict:
    """The learner's batch the way the scripts once made it: every thread's batch fetched to the host, concatenated
    there in global env order, a block per learner device (the update sends it back)."""
    batch = jax.tree.map(lambda *threads: np.concatenate(threads, axis=1), *jax.device_get([r.batch for r in rollouts]))

    def split(x):  # (T, envs, ...) -> (devices, T, envs / devices, ...)
        return np.moveaxis(x.reshape(x.shape[0], devices, x.shape[1] // devices, *x.shape[2:]), 1, 0)

    batch = jax.tree.map(split, batch)
    batch["env_ids"] = np.concatenate([r.env_ids for r in rollouts]).reshape(devices, -1)
    return batch


class Parts(NamedTuple):
    """A script's pieces for in-process tests, as its main() makes them, parameters on the learner devices."""

    args: object
    cfg: object
    spec: object
    networks: object
    state: object


def script_parts(script, *flags) -> Parts:
    args = tyro.cli(script.Args, args=[str(flag) for flag in flags])
    script.check_args(args)
    cfg, spec = script.derive_config(args), script.env_spec(args)
    networks = script.make_networks(args, spec)
    state, _ = script.init_train_state(args, cfg, networks, spec.observation_space)
    state, _ = script.resume(cfg, state, checkpoint=None, run_name="")  # a fresh state, on the learner devices
    return Parts(args, cfg, spec, networks, state)


def made_once(tmp_path_factory, name: str, make):
    """What make(cwd) returns (a finished run, read right after it ended: a test may write to the run later, as
    evaluate.py does), made once per test session: the first pytest-xdist worker that needs it makes it in the
    workers' common directory, holding a lock, and the others wait for it. (Each worker making the runs its tests read
    cost ~10% of the suite's time; grouping the tests of a run onto one worker with --dist loadgroup left the others
    idle, and pytest 9.2 no longer honours the groups, pytest-xdist#1386.) A test that starts a run over does so in a
    copy."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    cwd, made = root / name, root / f"{name}.pickle"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not made.exists():
            shutil.rmtree(cwd, ignore_errors=True)  # what a worker that failed to make it left
            cwd.mkdir()
            made.write_bytes(pickle.dumps(make(cwd)))
    return pickle.loads(made.read_bytes())


def trained(*flags, **run_options):
    """What made_once makes most runs with: the run the script trains in cwd (run()'s options), finished."""
    return lambda cwd: finished_run(cwd, check(run(cwd, *flags, **run_options)).stdout)
