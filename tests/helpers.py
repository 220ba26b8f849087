"""Runs the training scripts as a user does (a subprocess with real flags) and reads back their logs."""

import glob
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "cleanba"))

from events import read_scalars  # noqa: E402, F401 (for the tests)

SCRIPTS = {algo: os.path.join(REPO, "cleanba", f"cleanba_{algo}.py") for algo in ("ppo", "impala")}

ALGOS = list(SCRIPTS)

# Small, fast settings shared by the tests; each test adds what it is about. With the default 2 actor
# threads, CARTPOLE has 8 envs of 32 steps: 256 per update.
CARTPOLE = ["--env-id", "CartPole-v1", "--local-num-envs", "4", "--num-steps", "32", "--log-frequency", "1"]
# Breakout with 4 envs of 16 steps and 2 minibatches (PPO: along time, one epoch; IMPALA: along envs).
BREAKOUT = {
    "ppo": ["--env-id", "Breakout-v5", "--local-num-envs", "4", "--num-actor-threads", "1", "--num-steps", "16",
            "--num-minibatches", "2", "--update-epochs", "1", "--log-frequency", "1"],
    "impala": ["--env-id", "Breakout-v5", "--local-num-envs", "4", "--num-actor-threads", "1", "--num-steps", "16",
               "--num-minibatches", "2", "--log-frequency", "1"],
}
# CartPole-v1 is solved (mean return >= 450 of a 500 cap) within these budgets, ~30 s each here: PPO 300k
# steps; IMPALA 400k steps with 16 envs.
CARTPOLE_SOLVE = {
    "ppo": ["--env-id", "CartPole-v1", "--local-num-envs", "8", "--num-actor-threads", "1", "--num-steps", "128",
            "--learning-rate", "1e-3", "--clip-coef", "0.2", "--total-timesteps", "300000", "--log-frequency", "10"],
    "impala": ["--env-id", "CartPole-v1", "--local-num-envs", "16", "--num-actor-threads", "1", "--num-steps", "20",
               "--learning-rate", "1e-3", "--total-timesteps", "400000", "--log-frequency", "50"],
}


def script_env(num_devices: int | None = None) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if num_devices:  # must be set before jax is imported, hence in the child's environment
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={num_devices}".strip()
    return env


def run(cwd, *flags, algo="ppo", num_devices=None, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPTS[algo], *map(str, flags)], cwd=cwd,
                          env=env or script_env(num_devices), capture_output=True, text=True, timeout=timeout)


def start(cwd, *flags, algo="ppo", num_devices=None, env=None) -> subprocess.Popen:
    """Starts the script in a session of its own (its id is the pid), so that session_processes() can tell
    whether it left any process behind."""
    return subprocess.Popen([sys.executable, SCRIPTS[algo], *map(str, flags)], cwd=cwd,
                            env=env or script_env(num_devices), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


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


def solved_score(algo: str, returns: list[float]) -> float:
    """What the CartPole budget must reach: PPO's mean return over its last 3 log intervals; IMPALA's best
    log interval (each holds 20+ episodes). IMPALA here sometimes loses part of its performance after
    solving (seen in about 1 of 3 runs at these settings, with or without a resume), so its final value
    is not a stable criterion; the issue asks that it reaches 450 within the budget."""
    return float(np.mean(returns[-3:])) if algo == "ppo" else max(returns)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(cwd, *flags, num_processes=2, algo="ppo", timeout=300) -> list[str]:
    """Runs the script as `num_processes` --distributed processes on localhost; returns their outputs
    once all have exited 0."""
    os.makedirs(cwd, exist_ok=True)
    flags = [*flags, "--distributed", "--coordinator-address", f"127.0.0.1:{free_port()}",
             "--num-processes", num_processes]
    procs = [start(cwd, *flags, "--process-id", rank, algo=algo) for rank in range(num_processes)]
    outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
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


def load_module(path: str):
    """Imports a script as a module (its main() only runs as __main__), for unit checks."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(os.path.basename(path)[: -len(".py")], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_script(algo: str):
    return load_module(SCRIPTS[algo])
