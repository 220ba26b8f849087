"""GPU check: one command that measures, in a few minutes on one GPU machine, what the docs need to know about it.

    bash benchmark.sh gpu-check --out results      # on a GPU machine (~8 min)
    bash benchmark.sh gpu-check --out /tmp/gpucheck --seconds 5 --env-id CartPole-v1 --repro-env-id CartPole-v1 \\
        --repro-envs 16 --repro-steps 16 --repro-updates 5 -- --local-num-envs 8 --num-steps 32  # a dry run on a CPU

In order, each step's figures written to --out (gpu_check.json and gpu_check.md) as soon as it ends, so that a
check cut short still leaves what it measured:

1. the machine: GPU name (JAX's device kind), the CPU cores this process may use, JAX's and EnvPool's versions, the
   date and the git commit;
2. EnvPool alone: the scripts' default shape (2 actor threads x 64 envs, or the flags after `--`), each actor
   thread's pool with the scripts' own EnvPool thread share (throughput.py's env ceiling), random actions;
3. training throughput: each script (PPO, IMPALA, PQN) at its defaults, actor and learner on device 0, as a user
   runs it (a subprocess; the throughput runs share one directory, hence its compilation cache). Its console lines
   are read as they come (--log-frequency 1): the first --warmup updates are left out (compilation; with Cleanba
   the second batch is collected early), then the run is timed for --seconds and stopped with SIGTERM (to the
   process, not its group: that would also stop XLA's compiler processes). Steady steps/s: the steps between the
   first and the last timed console line over the time between their arrivals; the learner's and the actors'
   waits: their means over the timed updates (the side that waits is not the bottleneck). Then, as the budget
   allows, the speed flag (--no-deterministic-gpu: the cost of deterministic GPU ops; the run also records the
   algorithms XLA timed, in this check's temporary directory), the default again with those algorithms (-recorded:
   deterministic ops, the recorded algorithms instead of the first that works; it needs its -nondet run earlier in
   the same check), IMPALA's --env-pools 2 and 4 (the default is 1) and each script with one actor thread of 128
   envs in two pools (-1x128: the same batch as 2 threads x 64), with their steps/s over the default run's;
   the ceilings (<script>-parts, after the default runs): each script's actors alone (no learner) and learner alone
   (its update looped on a batch of its actors, on the device), measured by throughput.py --parts in a process of
   its own, and the ceiling its default architecture allows: the slower of EnvPool alone and the learner alone with
   Cleanba's architecture (IMPALA's default), the two taking turns when synchronous (PPO's and PQN's,
   1 / (1 / EnvPool alone + 1 / learner alone)); the default run's steps/s over it (the goal: 0.9);
4. reproducibility, after the throughput runs (so that it does not disturb their timings), five PPO runs at once
   sharing the GPU (no memory preallocation; 4 EnvPool threads each): the same command twice, a layout-free
   run (--layout-free-group-size 4) on 1 and on 2 actor threads, and the first command with every kernel in CUDA
   graphs (GRAPHS); each pair is bitwise identical (updates.jsonl), or the first update that differs and what
   differs (the batch fingerprint, the losses, the episodes).

A global time budget (--budget) ranks the work: EnvPool alone and the three default runs first, then the
reproducibility runs (their time, --repro-seconds, is reserved, though they run last), then the ceilings and the
variants while they fit, in the order of --runs (by default the ceilings, then PPO's without determinism, then with
its recorded algorithms). A run that would not fit is reported as skipped, never dropped, and a later, shorter one
may still fit. Each run's time is estimated from its script's default run (start to exit; the ceilings' from the
first one measured), or as --seconds + 60 s before one. On an H100 the default budget fits the defaults, the
reproducibility runs and a few more; the others: a second call with --runs (e.g. impala impala-nondet
impala-recorded) and --no-repro. `bash benchmark.sh gpu-next` chooses the runs that choose among the candidates.

Exit status 0 when everything that ran worked, "not bitwise" included (a measurement, not a test: it asserts
nothing); 1 if a run crashed or timed out (its last output lines are in the JSON) or the check was interrupted.
"""

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

# Whether the user set it: the throughput runs get the user's environment (a script preallocates the GPU's memory by
# default), the reproducibility runs share the GPU without preallocating. Importing throughput.py sets it for us.
USER_PREALLOCATE = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # this process only steps EnvPool

import envpool  # noqa: E402
import jax  # noqa: E402
import tyro  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "cleanba"))
import throughput  # noqa: E402
from compare_runs import compare  # noqa: E402

BATCH_LINE = re.compile(r"= (\d+) per update")
UPDATE_LINE = re.compile(r"^update (\d+)/\d+ \|.*\| waits: learner ([\d.]+)s, actors ([\d.]+)s")
START_GUESS = 60  # seconds: start-up, compilation, warm-up updates and the stop of a run on a GPU, before one is seen
STOP_WAIT = 90  # seconds a stopped run may take to finish its update and checkpoint before it is killed
TAIL_LINES = 40  # of a failed run's output, kept in the JSON

# XLA's CUDA graphs (command buffers) for every kernel, convolutions included (by default they leave convolutions out,
# and a graph needs 5 commands): the actors' calls of the ResNet launched as one graph each (the -graphs runs).
GRAPHS = "--xla_gpu_enable_command_buffer=+CONVOLUTION --xla_gpu_graph_min_graph_size=1"
# One actor thread with all the cores, its envs in two pools that step in turns: the other shape of the same batch.
ONE_THREAD = ["--num-actor-threads", "1", "--local-num-envs", "128", "--env-pools", "2"]
# The throughput runs, in priority order: (id for --runs, script, flags beyond the defaults, kind). The parts: each
# script's actors alone and learner alone, for the ceiling its default run is measured against. The variants: the
# open question first (what recorded algorithms give PPO, whose update they made 21% shorter), then the cheapest.
RUNS = [
    ("ppo", "ppo", [], "default"),
    ("impala", "impala", [], "default"),
    ("pqn", "pqn", [], "default"),
    ("impala-parts", "impala", [], "parts"),
    ("ppo-parts", "ppo", [], "parts"),
    ("pqn-parts", "pqn", [], "parts"),
    ("ppo-nondet", "ppo", ["--no-deterministic-gpu"], "variant"),
    ("ppo-recorded", "ppo", [], "variant"),
    ("impala-nondet", "impala", ["--no-deterministic-gpu"], "variant"),
    ("impala-recorded", "impala", [], "variant"),
    ("pqn-nondet", "pqn", ["--no-deterministic-gpu"], "variant"),
    ("pqn-recorded", "pqn", [], "variant"),
    ("impala-pools2", "impala", ["--env-pools", "2"], "variant"),
    ("impala-pools4", "impala", ["--env-pools", "4"], "variant"),
    ("impala-graphs", "impala", [], "variant"),
    ("ppo-graphs", "ppo", [], "variant"),
    ("pqn-graphs", "pqn", [], "variant"),
    ("impala-1x128", "impala", ONE_THREAD, "variant"),
    ("ppo-1x128", "ppo", ONE_THREAD, "variant"),
    ("pqn-1x128", "pqn", ONE_THREAD, "variant"),
]
# A script's run without deterministic ops (XLA times its algorithms) records XLA's choices in a file; its
# "-recorded" run is the default, deterministic, with those choices (docs/performance.md: recorded algorithms).
RECORDED = "-recorded"


def algorithms_file(root: str, script: str) -> str:  # where a script's -nondet run records XLA's choices
    return os.path.join(root, f"{script}_algorithms.textproto")


def run_xla_flags(run_id: str, script: str, flags: list[str], root: str) -> str | None:
    """The XLA flags a run adds to the user's: a run without deterministic ops records its algorithm choices, a
    -recorded run reads them, a -graphs run puts every kernel in CUDA graphs; None when the choices it needs were not
    recorded (its -nondet run did not run)."""
    path = algorithms_file(root, script)
    if run_id.endswith("-graphs"):
        return GRAPHS
    if "--no-deterministic-gpu" in flags:
        return f"--xla_gpu_dump_autotune_results_to={path}"
    if run_id.endswith(RECORDED):
        return f"--xla_gpu_load_autotune_results_from={path}" if os.path.exists(path) else None
    return ""


class Interrupted(Exception):
    """SIGTERM or SIGINT to this check: the runs in progress are stopped and what was measured is written."""


def on_signal(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


def machine_info(commit: str | None) -> dict:
    if commit is None and shutil.which("git"):  # a copy of the working tree may have no .git
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True)
        if head.returncode == 0:
            commit = head.stdout.strip()
            changed = subprocess.run(["git", "-C", REPO, "status", "--porcelain"], capture_output=True, text=True)
            if changed.stdout.strip():
                commit += " (with uncommitted changes)"
    device = jax.devices()[0]
    return dict(
        platform=jax.default_backend(),
        device=device.device_kind,
        devices=len(jax.devices()),
        cores=len(os.sched_getaffinity(0)),
        cpu_count=os.cpu_count(),
        jax=jax.__version__,
        envpool=envpool.__version__,
        python=sys.version.split()[0],
        date=datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        commit=commit,
        xla_flags=os.environ.get("XLA_FLAGS", ""),  # the user's; each script adds its deterministic setting
    )


def env_alone(env_id: str, flags: list[str], seconds: float) -> dict:
    """EnvPool alone in the PPO script's default shape (all three scripts share it and its EnvPool threads)."""
    algo = throughput.load_script("ppo")
    args = tyro.cli(algo.Args, args=["--env-id", env_id, *flags])
    cpus = sorted(os.sched_getaffinity(0))
    threads = [algo.env_threads(args, i, cpus) for i in range(args.num_actor_threads)]
    sps = throughput.env_ceiling(algo, args, args.num_actor_threads, seconds)
    return dict(
        sps=sps,
        actor_threads=args.num_actor_threads,
        envs_per_thread=args.local_num_envs,
        envpool_threads=threads,
        seconds=seconds,
    )


class Process:
    """A script in a subprocess; its output lines timestamped as they arrive (and copied to a log file)."""

    def __init__(self, command: list[str], cwd: str, env: dict, log_path: str):
        self.command, self.lines, self.started, self.ended = command, [], time.monotonic(), None
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()

    def read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            self.log.write(line)
            self.log.flush()
        self.ended = time.monotonic()  # its output closed: it exited

    def stop(self, timeout: float = STOP_WAIT) -> int:
        """SIGTERM (the script checkpoints and exits 143), then SIGKILL after `timeout`; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reader.join(timeout=10)
        self.log.close()
        return self.proc.returncode

    def tail(self) -> list[str]:
        return [line for _, line in self.lines[-TAIL_LINES:]]


def script_command(script: str) -> list[str]:
    return [sys.executable, os.path.join(REPO, "cleanba", f"cleanba_{script}.py")]


def measure_run(script: str, flags: list[str], cwd: str, log_path: str, opts, xla_flags: str = "") -> dict:
    """One throughput run, as the module docstring says; raises nothing (a failure is in the result)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
    env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
    if USER_PREALLOCATE is not None:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = USER_PREALLOCATE
    command = [
        *script_command(script),
        "--env-id",
        opts.env_id,
        "--total-timesteps",
        str(10**9),
        *opts.flags,
        *flags,
        "--log-frequency",
        "1",
        "--checkpoint-interval",
        "0",
        "--no-resume",
        "--run-name",
        "gpu_check",
    ]
    result = dict(command=shlex.join(command[1:]).replace(REPO + "/", ""))
    process = Process(command, cwd, env, log_path)
    deadline, stop_at, status = process.started + opts.run_timeout, None, None
    try:
        while True:
            time.sleep(0.05)
            updates = [(t, m) for t, line in process.lines if (m := UPDATE_LINE.match(line))]
            timed = [(t, m) for t, m in updates if int(m.group(1)) > opts.warmup]
            if timed and stop_at is None:
                stop_at = timed[0][0] + opts.seconds
            if process.proc.poll() is not None:
                status = "failed" if process.proc.returncode else "ended early"
                break
            if stop_at is not None and time.monotonic() >= stop_at and len(timed) >= 2:
                break
            if time.monotonic() > deadline:
                status = "timeout"
                break
    finally:  # also on an interrupt of this check
        measured_lines = list(process.lines)
        returncode = process.stop()
    result.update(exit_code=returncode, duration_s=time.monotonic() - process.started)
    batch = next((int(m.group(1)) for _, line in measured_lines if (m := BATCH_LINE.search(line))), None)
    updates = [(t, m) for t, line in measured_lines if (m := UPDATE_LINE.match(line))]
    if updates:
        result["first_update_s"] = updates[0][0] - process.started
    timed = [(t, int(m.group(1)), float(m.group(2)), float(m.group(3))) for t, m in updates]
    timed = [u for u in timed if u[1] > opts.warmup]
    if status is None and returncode not in (0, 128 + signal.SIGTERM):
        status = "failed"  # it crashed while stopping
    if status is None and (batch is None or len(timed) < 2):
        status = "failed"
    if status in ("failed", "timeout") or (status == "ended early" and len(timed) < 2):
        last = next((line for line in reversed(process.tail()) if line.strip()), "no output")
        why = f"no result within --run-timeout {opts.run_timeout:.0f} s" if status == "timeout" else last[:200]
        result.update(status=status if status != "ended early" else "failed", reason=why, last_output=process.tail())
        return result
    (t0, u0, _, _), (t1, u1, _, _) = timed[0], timed[-1]
    seconds_per_update = (t1 - t0) / (u1 - u0)
    result.update(
        status="ok",
        batch_size=batch,
        measured_updates=u1 - u0,
        measured_seconds=t1 - t0,
        sps=(u1 - u0) * batch / (t1 - t0),
        # The waits of the updates inside the timed span (the first timed line closes the warm-up).
        learner_wait_s=sum(u[2] for u in timed[1:]) / (len(timed) - 1),
        actor_wait_s=sum(u[3] for u in timed[1:]) / (len(timed) - 1),
    )
    result["learner_wait"] = result["learner_wait_s"] / seconds_per_update
    result["actor_wait"] = result["actor_wait_s"] / seconds_per_update
    return result


def measure_parts(script: str, root: str, log_path: str, opts) -> dict:
    """A script's actors alone (no learner) and learner alone (its update looped on a batch of its actors, resident on
    the device) at the run's settings, with deterministic GPU ops as its default run has them: throughput.py --parts
    in a process of its own. Raises nothing (a failure is in the result)."""
    out = os.path.join(root, f"parts_{script}.json")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if "xla_gpu_deterministic_ops" not in env.get("XLA_FLAGS", ""):  # as the script sets it
        deterministic = str("--no-deterministic-gpu" not in opts.flags).lower()
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_gpu_deterministic_ops={deterministic}".strip()
    command = [sys.executable, os.path.join(HERE, "throughput.py"), "--parts", script, "--out", out]
    command += ["--seconds", str(opts.parts_seconds), "--", "--env-id", opts.env_id, *opts.flags]
    started = time.monotonic()
    with open(log_path, "w") as log:
        try:
            code = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=opts.run_timeout)
            status = "ok" if code.returncode == 0 else f"failed (exit {code.returncode})"
        except subprocess.TimeoutExpired:
            status = f"timeout: no result within --run-timeout {opts.run_timeout:.0f} s"
    result = dict(status=status, duration_s=time.monotonic() - started)
    if status != "ok":
        with open(log_path) as log:
            result["last_output"] = log.read().splitlines()[-TAIL_LINES:]
        return result
    try:
        with open(out) as f:
            parts = json.load(f)
    except (OSError, ValueError) as error:
        return dict(result, status=f"failed: no figures ({error})", last_output=[])
    result.update(
        env_sps=parts["env_sps"],
        actors_alone_sps=parts["actor_alone_sps"],
        update_s=parts["update_seconds"],
        learner_alone_sps=parts["batch_size"] / parts["update_seconds"],
    )
    return result


def ceiling(report: dict, script: str, opts) -> dict | None:
    """What a script's default architecture allows on this machine: with Cleanba's (IMPALA's default) the slower of
    EnvPool alone and the learner alone; synchronous (PPO's and PQN's), the two taking turns. None until measured."""
    parts, env = report["parts"].get(script) or {}, report.get("env_alone") or {}
    if parts.get("status") != "ok" or env.get("status") != "ok":
        return None
    algo = throughput.load_script(script)
    concurrent = tyro.cli(algo.Args, args=["--env-id", opts.env_id, *opts.flags]).concurrency  # as its runs have it
    env_sps, learner_sps = env["sps"], parts["learner_alone_sps"]
    if concurrent:
        sps = min(env_sps, learner_sps)
    else:
        sps = 1 / (1 / env_sps + 1 / learner_sps)
    return dict(architecture="Cleanba" if concurrent else "synchronous", sps=sps)


def parts_line(parts: dict) -> str:
    line = f"actors alone {parts['actors_alone_sps']:,.0f} steps/s, learner alone {parts['learner_alone_sps']:,.0f}"
    if parts.get("ceiling"):
        line += f"; ceiling ({parts['ceiling']['architecture']}) {parts['ceiling']['sps']:,.0f} steps/s"
    return line


def repro_commands(opts) -> dict:
    """The reproducibility checks: {check: [(run name, flags), (run name, flags)]}."""
    envs, steps, updates = opts.repro_envs, opts.repro_steps, opts.repro_updates
    common = [
        *("--env-id", opts.repro_env_id, "--num-steps", str(steps), "--seed", str(opts.repro_seed)),
        *("--total-timesteps", str(envs * steps * updates), "--env-threads", "4", *opts.repro_flags),
        *("--log-frequency", "5", "--checkpoint-interval", "0", "--no-resume"),
    ]
    one = ["--local-num-envs", str(envs), "--num-actor-threads", "1"]
    two = ["--local-num-envs", str(envs // 2), "--num-actor-threads", "2"]
    free = ["--layout-free-group-size", str(opts.repro_group_size)]
    return {
        "same command twice": [("same_1", [*common, *one]), ("same_2", [*common, *one])],
        f"layout-free (group {opts.repro_group_size}), 1 vs 2 actor threads": [
            ("free_1thread", [*common, *one, *free]),
            ("free_2threads", [*common, *two, *free]),
        ],
        "CUDA graphs of every kernel vs as XLA has them": [("same_1", [*common, *one]), ("graphs", [*common, *one])],
    }


def first_difference(a: list[dict], b: list[dict]) -> dict | None:
    """The first update whose records differ, and which of their fields (losses by name) differ."""
    for record_a, record_b in zip(a, b, strict=False):
        if record_a == record_b:
            continue
        fields = []
        for key in sorted(set(record_a) | set(record_b)):
            va, vb = record_a.get(key), record_b.get(key)
            if key == "losses" and isinstance(va, dict) and isinstance(vb, dict):
                fields += [f"losses.{n}" for n in sorted(set(va) | set(vb)) if va.get(n) != vb.get(n)]
            elif va != vb:
                fields.append(key)
        return dict(update=record_a.get("update"), fields=fields)
    if len(a) != len(b):
        return dict(update=min(len(a), len(b)) + 1, fields=[f"record count ({len(a)} vs {len(b)})"])
    return None


def reproducibility(root: str, log_dir: str, opts) -> list[dict]:
    """Runs the five runs at once (the graphs run with GRAPHS); compares each pair's updates.jsonl."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    checks, processes = repro_commands(opts), {}
    try:
        for pair in checks.values():
            for name, flags in pair:
                if name in processes:  # a run of two checks
                    continue
                run_env = env
                if name == "graphs":
                    run_env = dict(env, XLA_FLAGS=f"{env.get('XLA_FLAGS', '')} {GRAPHS}".strip())
                cwd = os.path.join(root, "repro", name)
                os.makedirs(cwd, exist_ok=True)
                command = [*script_command("ppo"), *flags, "--run-name", name]
                processes[name] = Process(command, cwd, run_env, os.path.join(log_dir, f"repro_{name}.log"))
        deadline = time.monotonic() + opts.repro_timeout
        while time.monotonic() < deadline and any(p.proc.poll() is None for p in processes.values()):
            time.sleep(0.2)
    finally:
        codes = {name: process.stop(timeout=30) for name, process in processes.items()}
    results = []
    for check, pair in checks.items():
        commands = [shlex.join(["cleanba/cleanba_ppo.py", *flags, "--run-name", name]) for name, flags in pair]
        result = dict(check=check, commands=commands)
        runs = []
        for name, _ in pair:
            process = processes[name]
            duration = (process.ended or time.monotonic()) - process.started
            run = dict(name=name, exit_code=codes[name], duration_s=duration)
            path = os.path.join(root, "repro", name, "runs", name, "updates.jsonl")
            if codes[name] != 0:
                timed_out = duration >= opts.repro_timeout
                run.update(status="timeout" if timed_out else "failed", last_output=process.tail())
            else:
                with open(path) as f:
                    run.update(status="ok", lines=f.read().splitlines())
            runs.append(run)
        result["runs"] = [{k: v for k, v in run.items() if k != "lines"} for run in runs]
        if any(run["status"] != "ok" for run in runs):
            result.update(status="failed", result="a run failed: nothing to compare")
        else:
            a, b = ([json.loads(line) for line in run["lines"]] for run in runs)
            bitwise = runs[0]["lines"] == runs[1]["lines"] and len(a) == opts.repro_updates
            difference = first_difference(a, b)
            compared = compare(a, b)
            result.update(
                status="ok",
                updates=[len(a), len(b)],
                bitwise=bitwise,
                first_difference=difference,
                first_fingerprint_mismatch=compared["first_fingerprint_mismatch"],
                max_relative_difference={k: list(v) for k, v in compared["max_relative_difference"].items()},
            )
            if bitwise:
                result["result"] = f"bitwise identical ({len(a)} updates)"
            elif difference:
                result["result"] = f"differs from update {difference['update']}: {', '.join(difference['fields'])}"
            else:
                result["result"] = f"identical records, but {len(a)} updates of {opts.repro_updates}"
        results.append(result)
    return results


def fmt(value, spec=",.0f", none="-"):
    return none if value is None else format(value, spec)


def markdown(report: dict) -> str:
    m, lines = report.get("machine") or {}, []
    if m:
        lines.append(
            f"{m['device']} ({m['platform']}), {m['cores']} CPU cores available ({m['cpu_count']} on the machine), "
            f"JAX {m['jax']}, EnvPool {m['envpool']}, Python {m['python']}, {m['date']}, commit {m['commit'] or 'n/a'}"
        )
        if m.get("xla_flags"):
            lines[-1] += f", XLA_FLAGS `{m['xla_flags']}`"
    s, state = report["settings"], ""
    if not report["finished"]:
        state = f" (unfinished: interrupted {report['interrupted']})" if "interrupted" in report else " (unfinished)"
    lines.append(
        f"\n{s['env_id']}, flags: {' '.join(s['flags']) or 'the defaults'}; {s['seconds']:.0f} s timed per run after "
        f"{s['warmup']} warm-up updates; budget {s['budget']:.0f} s, {report['elapsed_s']:.0f} s used{state}"
    )
    env = report.get("env_alone")
    env_sps = env.get("sps") if env else None
    if env:
        if env.get("status") == "failed":
            lines.append(f"\nEnvPool alone: failed: {env['error']}")
        else:
            threads = env["envpool_threads"][0]["num_threads"]
            lines.append(
                f"\nEnvPool alone: {env['actor_threads']} threads x {env['envs_per_thread']} envs, {threads} EnvPool "
                f"threads each, random actions: **{env_sps:,.0f} steps/s**"
            )
    header = ["run", "steps/s", "/ EnvPool alone", "/ ceiling", "/ default", "learner wait", "actor wait", "timed"]
    header.append("1st update")
    header.append("run s")
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in report["runs"]:
        if r["status"] != "ok":
            note = r["status"] + (f": {r['reason']}".replace("|", "\\|") if r.get("reason") else "")
            lines.append(f"| {r['name']} | {note} |" + " |" * (len(header) - 2))
            continue
        script_ceiling = (report["parts"].get(r["script"]) or {}).get("ceiling")  # of the default run's shape
        over_ceiling = r["sps"] / script_ceiling["sps"] if script_ceiling and r["id"] == r["script"] else None
        lines.append(
            f"| {r['name']} | {r['sps']:,.0f} | {fmt(r.get('over_env'), '.2f')} | {fmt(over_ceiling, '.2f')} "
            f"| {fmt(r.get('over_default'), '.2f')} "
            f"| {r['learner_wait_s']:.3f} s ({r['learner_wait']:.0%}) "
            f"| {r['actor_wait_s']:.3f} s ({r['actor_wait']:.0%}) "
            f"| {r['measured_updates']} x {r['batch_size']:,} in {r['measured_seconds']:.1f} s "
            f"| {r['first_update_s']:.0f} s | {r['duration_s']:.0f} |"
        )
    if report["parts"]:
        lines += [
            "",
            "| ceilings | actors alone | / EnvPool alone | learner alone | update | architecture | ceiling "
            "| default run / ceiling | / actors alone | / learner alone |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
    for script, parts in report["parts"].items():
        if parts["status"] != "ok":
            note = parts["status"] + (f": {parts['reason']}" if parts.get("reason") else "")
            lines.append(f"| {script} | {note} |" + " |" * 8)
            continue
        default = next((r for r in report["runs"] if r["id"] == script and r["status"] == "ok"), None)
        limit = parts.get("ceiling")
        ratio = default["sps"] / limit["sps"] if default and limit else None
        over_actors = default["sps"] / parts["actors_alone_sps"] if default else None
        over_learner = default["sps"] / parts["learner_alone_sps"] if default else None
        actors = parts["actors_alone_sps"]
        architecture, limit_sps = (limit["architecture"], limit["sps"]) if limit else ("-", None)
        lines.append(
            f"| {script} | {actors:,.0f} | {fmt(actors / env_sps if env_sps else None, '.2f')} "
            f"| {parts['learner_alone_sps']:,.0f} | {parts['update_s']:.3f} s "
            f"| {architecture} | {fmt(limit_sps)} | {fmt(ratio, '.2f')} | {fmt(over_actors, '.2f')} "
            f"| {fmt(over_learner, '.2f')} |"
        )
    if report["reproducibility"]:
        lines += ["", "| reproducibility (PPO) | result | max relative difference | run s |", "|---|---|---|---|"]
        for r in report["reproducibility"]:
            worst = r.get("max_relative_difference") or {}
            worst = ", ".join(f"{k} {v[0]:.1e} (update {v[1]})" for k, v in worst.items() if v[0]) or "-"
            seconds = ", ".join(f"{run['duration_s']:.0f}" for run in r.get("runs", [])) or "-"
            lines.append(f"| {r['check']} | {r.get('result', r['status'])} | {worst} | {seconds} |")
    return "\n".join(lines) + "\n"


def write(report: dict, out: str):
    report["elapsed_s"] = time.monotonic() - report["_t0"]
    saved = {k: v for k, v in report.items() if not k.startswith("_")}
    with open(os.path.join(out, "gpu_check.json.tmp"), "w") as f:
        json.dump(saved, f, indent=2)
    os.replace(os.path.join(out, "gpu_check.json.tmp"), os.path.join(out, "gpu_check.json"))
    with open(os.path.join(out, "gpu_check.md"), "w") as f:
        f.write(markdown(report))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "results", "gpu"), help="gpu_check.json, .md")
    parser.add_argument("--env-id", default="Breakout-v5", help="of EnvPool alone and the throughput runs")
    parser.add_argument("--seconds", type=float, default=30, help="timed seconds of each throughput run")
    parser.add_argument("--warmup", type=int, default=2, help="updates left out at the start of each run")
    parser.add_argument("--env-seconds", type=float, default=10, help="seconds of EnvPool alone")
    parser.add_argument("--budget", type=float, default=420, help="seconds for the whole check (see above)")
    parser.add_argument("--run-timeout", type=float, default=240, help="seconds a throughput run may take")
    parser.add_argument("--parts-seconds", type=float, default=5, help="timed seconds of each part")
    parser.add_argument(
        "--runs", nargs="+", choices=[r[0] for r in RUNS], default=[r[0] for r in RUNS], help="in priority order"
    )
    parser.add_argument("--no-repro", dest="repro", action="store_false", help="skip the reproducibility runs")
    parser.add_argument("--repro-env-id", default="Breakout-v5")
    parser.add_argument("--repro-envs", type=int, default=32, help="environments (split over 2 actor threads)")
    parser.add_argument("--repro-steps", type=int, default=32, help="--num-steps of the reproducibility runs")
    parser.add_argument("--repro-updates", type=int, default=20)
    parser.add_argument("--repro-seed", type=int, default=41)
    parser.add_argument("--repro-group-size", type=int, default=4, help="--layout-free-group-size")
    parser.add_argument("--repro-flags", default="", help="more flags of the reproducibility runs (one string)")
    parser.add_argument("--repro-seconds", type=float, default=90, help="the reproducibility runs' reserved time")
    parser.add_argument("--repro-timeout", type=float, default=300, help="seconds they may take")
    parser.add_argument("--commit", help="the commit to report (default: git's, where there is a .git)")
    parser.add_argument("--logs", help="keep the runs' output here (default: a temporary directory, deleted)")
    argv = sys.argv[1:]
    opts = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    opts.flags = argv[argv.index("--") + 1 :] if "--" in argv else []  # to EnvPool alone and every throughput run
    opts.repro_flags = shlex.split(opts.repro_flags)
    for position, run_id in enumerate(opts.runs):  # the choices it reuses are recorded by a run of this check
        recorder = run_id.removesuffix(RECORDED) + "-nondet"
        if run_id.endswith(RECORDED) and recorder not in opts.runs[:position]:
            parser.error(f"--runs: {run_id} reuses the algorithms {recorder} records: name {recorder} before it")
    os.makedirs(opts.out, exist_ok=True)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    report = dict(
        _t0=time.monotonic(),
        finished=False,
        settings=dict(
            env_id=opts.env_id,
            flags=opts.flags,
            seconds=opts.seconds,
            warmup=opts.warmup,
            budget=opts.budget,
            repro=dict(
                env_id=opts.repro_env_id,
                envs=opts.repro_envs,
                steps=opts.repro_steps,
                updates=opts.repro_updates,
                seed=opts.repro_seed,
                group_size=opts.repro_group_size,
                flags=opts.repro_flags,
            ),
        ),
        machine=None,
        env_alone=None,
        runs=[],
        parts={},
        reproducibility=[],
    )
    failed = False
    root = tempfile.mkdtemp(prefix="gpu_check_")
    log_dir = opts.logs or os.path.join(root, "logs")
    os.makedirs(log_dir, exist_ok=True)
    os.makedirs(os.path.join(root, "throughput"))

    def elapsed():
        return time.monotonic() - report["_t0"]

    try:
        report["machine"] = machine_info(opts.commit)
        print(f"machine: {report['machine']}", flush=True)
        write(report, opts.out)
        try:
            report["env_alone"] = dict(status="ok", **env_alone(opts.env_id, opts.flags, opts.env_seconds))
        except (Exception, SystemExit) as error:
            failed = True
            report["env_alone"] = dict(status="failed", error=f"{type(error).__name__}: {error}")
        print(f"EnvPool alone: {report['env_alone']}", flush=True)
        write(report, opts.out)

        durations = {}  # script: seconds of its default run, start to exit
        reserve = opts.repro_seconds if opts.repro else 0
        selected = [next(run for run in RUNS if run[0] == run_id) for run_id in opts.runs]  # in the order given
        for run_id, script, flags, kind in selected:
            name = " ".join([script, *flags]) + (" (recorded algorithms)" if run_id.endswith(RECORDED) else "")
            if run_id.endswith("-graphs"):
                name += " (CUDA graphs)"
            if kind == "parts":
                name = f"{script}: actors alone, learner alone"
                estimate = durations.get("parts", 4 * opts.parts_seconds + START_GUESS)
            else:
                estimate = durations.get(script, opts.seconds + START_GUESS)
            # The defaults go first and need only fit the budget; the others leave the reproducibility runs' time.
            ends = elapsed() + estimate + (reserve if kind != "default" else 0)
            result = dict(name=name, id=run_id, script=script, flags=flags, estimate_s=estimate)
            report["runs"].append(result)
            xla_flags = run_xla_flags(run_id, script, flags, root)
            if xla_flags is None:
                result.update(status="skipped", reason=f"no algorithms recorded (by {script}-nondet, on a GPU)")
                print(f"[{name}] skipped: {result['reason']}", flush=True)
                write(report, opts.out)
                continue
            if ends > opts.budget:
                what = "the time reserved for the reproducibility runs" if kind != "default" and reserve else ""
                result.update(
                    status="skipped",
                    reason=f"needs ~{estimate:.0f} s; would end at {ends:.0f} s of the {opts.budget:.0f} s budget"
                    + (f" (with {what})" if what else ""),
                )
                if kind == "parts":
                    report["runs"].remove(result)
                    report["parts"][script] = result
                print(f"[{name}] skipped: {result['reason']}", flush=True)
                write(report, opts.out)
                continue
            print(f"[{name}] at {elapsed():.0f} s", flush=True)
            log_path = os.path.join(log_dir, f"{run_id}.log")
            if kind == "parts":
                report["runs"].remove(result)
                report["parts"][script] = result
                result["status"] = "interrupted"  # until it ends
                result.update(measure_parts(script, root, log_path, opts))
                if result["status"] == "ok":
                    durations["parts"] = result["duration_s"]
                    result["ceiling"] = ceiling(report, script, opts)
                    print(f"[{name}] {parts_line(result)}", flush=True)
                else:
                    failed = True
                    print(f"[{name}] {result['status']}; its last lines:\n  " + "\n  ".join(result["last_output"]))
                write(report, opts.out)
                continue
            result["status"] = "interrupted"  # until it ends
            result["xla_flags"] = xla_flags.replace(root + "/", "")
            result.update(measure_run(script, flags, os.path.join(root, "throughput"), log_path, opts, xla_flags))
            if result["status"] == "ok":
                if kind == "default":
                    durations[script] = result["duration_s"]
                env_sps = (report["env_alone"] or {}).get("sps")
                result["over_env"] = result["sps"] / env_sps if env_sps else None
                default = next((r for r in report["runs"] if r["name"] == script and r["status"] == "ok"), None)
                result["over_default"] = result["sps"] / default["sps"] if default and kind == "variant" else None
                print(
                    f"[{name}] {result['sps']:,.0f} steps/s over {result['measured_updates']} updates "
                    f"({result['measured_seconds']:.1f} s) | learner waited {result['learner_wait']:.0%}, actors "
                    f"{result['actor_wait']:.0%} | {result['duration_s']:.0f} s in all",
                    flush=True,
                )
            else:
                failed = True
                print(f"[{name}] {result['status']}; its last lines:\n  " + "\n  ".join(result["last_output"]))
            write(report, opts.out)

        if opts.repro:
            if (ends := elapsed() + opts.repro_seconds) > opts.budget:
                report["reproducibility"] = [
                    dict(
                        check=check,
                        status="skipped",
                        result=f"skipped: needs ~{opts.repro_seconds:.0f} s; would end at {ends:.0f} s of the budget",
                    )
                    for check in repro_commands(opts)
                ]
            else:
                print(f"[reproducibility] 5 PPO runs at once, at {elapsed():.0f} s", flush=True)
                start = time.monotonic()
                report["reproducibility"] = reproducibility(root, log_dir, opts)
                report["repro_duration_s"] = time.monotonic() - start
                failed |= any(r["status"] == "failed" for r in report["reproducibility"])
            for r in report["reproducibility"]:
                print(f"[reproducibility] {r['check']}: {r.get('result', r['status'])}", flush=True)
            write(report, opts.out)
        report["finished"] = True
    except Interrupted as signal_name:
        failed = True
        report["interrupted"] = f"by {signal_name} at {elapsed():.0f} s"
        print(f"interrupted by {signal_name}: writing what was measured", flush=True)
    finally:
        write(report, opts.out)
        shutil.rmtree(root, ignore_errors=True)
    print()
    print(markdown(report), end="")
    print(f"figures in {os.path.join(opts.out, 'gpu_check.json')} and gpu_check.md", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
