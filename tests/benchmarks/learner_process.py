"""The learner in a process of its own, as an experiment: do the actors' calls still wait behind the update when the
update runs in a second process (a second context on the same GPU) instead of a thread of the actors' process?

    .venv/bin/python tests/benchmarks/learner_process.py --out results          # on a GPU machine (~3 minutes)
    .venv/bin/python tests/benchmarks/learner_process.py --out /tmp/lp --seconds 3 -- --local-num-envs 8 --num-steps 32

In one process, JAX puts every program of a device on one stream, so on one GPU an actor's inference queues behind
a learner's update; two processes have two contexts, whose work the GPU interleaves. For a script (--algo, IMPALA by
default: Cleanba's architecture) at its defaults on Breakout-v5 (or the flags after --), on device 0, synchronous
actors fed the first parameters (no learner's parameters are published: it is the devices' sharing that is measured):
1. the actors alone: steps/s of the script's actor threads over --seconds at least (throughput.py's actor_alone);
2. the actors while a second process (this file with --learner-only), started and compiled first, runs the script's
   update on a batch of theirs without pause: the actors' steps/s, and the learner's updates/s in the same window
   (the actors' rollouts after their first);
3. the same with the update in a thread of the actors' process (the scripts' architecture on one device).
Both processes take GPU memory as they need it (XLA_PYTHON_CLIENT_PREALLOCATE=false, unless set). The learner alone
(its updates/s with no actors) comes first. Each figure over the same window; written to --out after each part:
learner_process.json and .md. A measurement, not a test: if 2's actors keep more of 1's rate than 3's while the
learner keeps 3's rate, a learner process of its own pays on one GPU; the scripts' architecture changes only then.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # two processes share the GPU's memory

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import actor_step  # noqa: E402
import throughput  # noqa: E402

READY = "learner ready"  # the learner process's line once its update is compiled; then a line per update


def learner_only(opts):
    """This file with --learner-only: the script's update on a batch of its actors, again and again, a line with the
    wall-clock time after each, until this process is stopped."""
    algo, args, _, networks, state = actor_step.script_and_state(opts)
    learner = actor_step.Learner(algo, args, networks, state)
    learner()  # compiles
    print(READY, flush=True)
    while True:
        learner()
        print(f"update {time.time():.6f}", flush=True)


class LearnerThread:
    """The update without pause in a thread of this process, counting the updates that end (wall-clock times)."""

    def __init__(self, learner):
        self.learner, self.ends, self.stop, self.error = learner, [], threading.Event(), None
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        try:
            while not self.stop.is_set():
                self.learner()
                self.ends.append(time.time())
        except Exception as error:
            self.error = error

    def check(self):  # the learner still ran at the window's end
        if self.error is not None:
            raise RuntimeError(f"the learner thread failed: {self.error}")

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


class LearnerProcess:
    """The update without pause in a second process (--learner-only), its update ends read from its output."""

    def __init__(self, opts, timeout: float):
        command = [sys.executable, os.path.abspath(__file__), "--learner-only", "--algo", opts.algo]
        command += ["--env-id", opts.env_id, *(["--no-deterministic-gpu"] if opts.no_deterministic_gpu else [])]
        self.proc = subprocess.Popen(
            [*command, "--", *opts.flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        self.ends, self.output, self.ready = [], [], threading.Event()
        threading.Thread(target=self.read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.5):  # until its update is compiled
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError("the learner process did not start: " + " | ".join(self.output[-5:]))

    def read(self):
        for line in self.proc.stdout:
            if line.startswith("update "):
                self.ends.append(float(line.split()[1]))
            elif line.startswith(READY):
                self.ready.set()
            else:
                self.output.append(line.rstrip())

    def check(self):  # the learner still ran at the window's end
        if self.proc.poll() is not None:
            raise RuntimeError("the learner process ended: " + " | ".join(self.output[-5:]))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def updates_per_second(ends: list[float], start: float, end: float) -> float:
    inside = [t for t in ends if start <= t <= end]
    return (len(inside) - 1) / (inside[-1] - inside[0]) if len(inside) > 1 else 0.0


def markdown(report: dict) -> str:
    lines = [
        f"{report['device']}, {report['cores']} CPU cores, JAX {report['jax']}, {report['date']}; {report['algo']} on "
        f"{report['env_id']}, flags: {' '.join(report['flags']) or 'the defaults'}; XLA_FLAGS `{report['xla_flags']}`",
        "",
        "| the update runs | actors' steps/s | / actors alone | learner's updates/s | / learner alone |",
        "|---|---|---|---|---|",
    ]
    alone = report["parts"].get("actors alone", {}).get("actors_sps")
    learner_alone = report["parts"].get("learner alone", {}).get("updates_per_s")
    for name, part in report["parts"].items():
        if "failed" in part:
            lines.append(f"| {name} | failed: {part['failed']} | | | |")
            continue
        actors, updates = part.get("actors_sps"), part.get("updates_per_s")
        cells = [
            f"{actors:,.0f}" if actors else "-",
            f"{actors / alone:.2f}" if actors and alone else "-",
            f"{updates:.2f}" if updates is not None else "-",
            f"{updates / learner_alone:.2f}" if updates is not None and learner_alone else "-",
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="a directory for learner_process.json and .md")
    parser.add_argument("--seconds", type=float, default=15.0, help="at least, of each part's actors")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds the learner process may take")
    parser.add_argument("--learner-only", action="store_true", help="(the second process)")
    actor_step.add_script_options(parser, "impala")
    opts = parser.parse_args()
    if opts.learner_only:
        return learner_only(opts)
    if not opts.out:
        parser.error("--out: a directory is needed")
    os.makedirs(opts.out, exist_ok=True)
    algo, args, cfg, networks, state = actor_step.script_and_state(opts)
    report = dict(**actor_step.what_ran(cfg.actor_devices[0], opts, args), flags=opts.flags, parts={})

    def save(name):
        with open(os.path.join(opts.out, "learner_process.json"), "w") as f:
            json.dump(report, f, indent=2)
        with open(os.path.join(opts.out, "learner_process.md"), "w") as f:
            f.write(markdown(report))
        print(f"{name}: {report['parts'][name]}", flush=True)

    learner = actor_step.Learner(algo, args, networks, state)
    learner()  # compiles
    start = time.time()
    while time.time() < start + opts.seconds / 2:
        learner()
    with LearnerThread(learner) as alone:
        time.sleep(opts.seconds / 2)
    alone.check()
    report["parts"]["learner alone"] = dict(updates_per_s=updates_per_second(alone.ends, start, time.time()))
    save("learner alone")

    env_sps = throughput.env_ceiling(algo, args, args.num_actor_threads, 2.0)  # for the rollouts' count only
    rollouts = 1 + max(2, math.ceil(opts.seconds * env_sps / cfg.batch_size))

    def actors(name, learning=None):
        try:
            sps, _ = throughput.actor_alone(algo, args, cfg, networks, state.params, rollouts)
            end = time.time()  # the actors' timed window: their rollouts after the first
            part = dict(actors_sps=sps)
            if learning is not None:
                start = end - (rollouts - 1) * cfg.batch_size / sps
                part["updates_per_s"] = updates_per_second(learning.ends, start, end)
                learning.check()
        except Exception as error:  # a part's failure (the GPU's memory, the learner process's end) is its row's
            part = dict(failed=f"{type(error).__name__}: {' '.join(str(error).split())[-200:]}")
        report["parts"][name] = part
        save(name)

    actors("actors alone")
    try:  # first of the two: the one this experiment is for
        with LearnerProcess(opts, opts.start_timeout) as learning:
            actors("in a second process", learning)
    except RuntimeError as error:
        report["parts"]["in a second process"] = dict(failed=str(error)[-300:])
        save("in a second process")
    with LearnerThread(learner) as learning:
        actors("in a thread of the actors' process", learning)
    print(markdown(report), end="")


if __name__ == "__main__":
    main()
