"""What an actor step's own calls cost, without the environments' stepping: the script's `observe` and `act` on one
recorded step of E envs, called as its actor loop on a GPU calls them, from one thread and from several at once.

    .venv/bin/python tests/benchmarks/actor_calls.py --out results   # on a GPU machine (~1 minute)
    .venv/bin/python tests/benchmarks/actor_calls.py --out /tmp/calls --seconds 1 --envs 4 8   # on a CPU

An actor step on a GPU is EnvPool's recv, `observe` (the step's outputs copied to the device, the episodes'
bookkeeping), `act` (inference and sampling), the wait for the actions on the host, and EnvPool's send; the envs
idle from recv to send. Here each thread repeats the middle three on the same recorded outputs (a real step of a
pool of E envs, random actions): for each number of envs per call (--envs) and of threads (--threads), the calls per
second in all and each phase's host time per call. EnvPool's recv and send, and a rollout's stacking and bootstrap,
are not timed here (actor_step.py times the first two with the environments). N threads making N times the calls of
one run side by side; as many as one, something they share (the GIL, the GPU client, the device) serialises them,
and more actor threads or EnvPools per thread cannot hide the calls (docs/notes/gpu-investigations.md: "the actors'
own work may be serialised"). A script's defaults (IMPALA's by default, Breakout-v5), XLA's deterministic GPU ops as
the script sets them (--no-deterministic-gpu: off); XLA_FLAGS of the user's stay, so that XLA's options can be
compared (its CUDA graphs, say), each in its own --out. Written to --out after each measurement:
actor_calls_<algo>_<det|nondet>.json and .md.
"""

import argparse
import functools
import json
import os
import sys
import time

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import actor_step  # noqa: E402
import throughput  # noqa: E402

PHASES = ["observe", "act", "action_wait"]
WARMUP_CALLS = 3  # per thread, untimed: the first compiles


def recorded_step(algo, args, networks, num_envs: int):
    """One pool of num_envs envs: its first state and the outputs of one step with random actions, on the host."""
    envs = algo.make_env(args, num_envs, 0, num_threads=min(num_envs, len(os.sched_getaffinity(0))))
    state = algo.first_state(envs, np.zeros(1, np.uint8), np.arange(num_envs), 0, networks)
    actions = np.stack([envs.action_space.sample() for _ in range(num_envs)])
    envs.send(actions.astype(envs.spec.action_array_spec["action"].dtype))
    obs, reward, terminated, truncated, info = envs.recv()
    info = {"reward": info["reward"]} if "reward" in info else {}
    return envs, state, algo.to_float32((obs, reward, terminated, truncated, info))


def timed_calls(observe, act, params, state, outputs, seconds: float, action_dtype) -> dict:
    """One thread's calls for --seconds after its warm-up: the calls, the seconds they took, host seconds by phase."""
    totals = dict.fromkeys(PHASES, 0.0)
    calls = 0
    deadline = None
    while deadline is None or time.perf_counter() < deadline:
        if deadline is None and calls == WARMUP_CALLS:
            first = time.perf_counter()
            deadline = first + seconds
            totals = dict.fromkeys(PHASES, 0.0)
            calls = 0
        start = time.perf_counter()
        stepped, _ = observe(state, state.handle, outputs)  # a new state each call, from the same one: the same work
        observed = time.perf_counter()
        action, _, _ = act(params, stepped)
        acted = time.perf_counter()
        np.asarray(action, action_dtype)
        waited = time.perf_counter()
        for phase, seconds_taken in zip(PHASES, [observed - start, acted - observed, waited - acted], strict=True):
            totals[phase] += seconds_taken
        calls += 1
    return dict(calls=calls, elapsed=time.perf_counter() - first, seconds=totals)


def measure(algo, args, networks, params, device, num_envs: int, thread_counts: list[int], seconds: float) -> list:
    """For E envs per call, each count of threads calling at once: calls/s in all, host ms per call by phase."""
    envs, state, outputs = recorded_step(algo, args, networks, num_envs)
    act = jax.jit(actor_step.policy_of(algo, args, networks, [envs], device.platform))
    observe = jax.jit(functools.partial(algo.observe, args))
    action_dtype = envs.spec.action_array_spec["action"].dtype
    runs = []
    for num_threads in thread_counts:
        states = [jax.device_put(state, device) for _ in range(num_threads)]
        results = [None] * num_threads

        def work(i, states=states, results=results):
            results[i] = timed_calls(observe, act, params, states[i], outputs, seconds, action_dtype)

        throughput.in_threads(work, num_threads)
        calls = sum(r["calls"] for r in results)
        host_ms = {phase: 1000 * sum(r["seconds"][phase] for r in results) / calls for phase in PHASES}
        calls_per_s = sum(r["calls"] / r["elapsed"] for r in results)  # each thread's own window: they start apart
        runs.append(dict(envs=num_envs, threads=num_threads, calls_per_s=calls_per_s, ms_per_call=host_ms))
    envs.close()
    return runs


def markdown(report: dict) -> str:
    lines = [
        f"{report['device']}, {report['cores']} CPU cores, JAX {report['jax']}, {report['date']}; {report['algo']} on "
        f"{report['env_id']}, deterministic GPU ops: {report['deterministic_gpu']}; XLA_FLAGS `{report['xla_flags']}`",
        "",
        "| envs per call | threads | calls/s, all threads | / one thread's | env steps/s the calls could feed | "
        "ms per call: observe | act | action wait | all |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    alone = {r["envs"]: r["calls_per_s"] for r in report["runs"] if r["threads"] == 1}
    for r in report["runs"]:
        ms = r["ms_per_call"]
        speedup = f"{r['calls_per_s'] / alone[r['envs']]:.2f}" if r["envs"] in alone else "-"
        phases = " | ".join(f"{ms[phase]:.2f}" for phase in PHASES)
        feed = r["calls_per_s"] * r["envs"]
        lines.append(
            f"| {r['envs']} | {r['threads']} | {r['calls_per_s']:,.0f} | {speedup} | {feed:,.0f} | {phases} | "
            f"{sum(ms.values()):.2f} |"
        )
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="a directory for actor_calls_<algo>_<det|nondet>.json and .md")
    parser.add_argument("--seconds", type=float, default=3.0, help="of calls, per measurement")
    parser.add_argument("--envs", nargs="+", type=int, default=[32, 64, 128], help="envs per call")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2, 4], help="threads calling at once")
    actor_step.add_script_options(parser, "impala")
    opts = parser.parse_args()
    algo, args, cfg, networks, state = actor_step.script_and_state(opts)
    device = cfg.actor_devices[0]
    params = jax.device_put(jax.tree.map(lambda x: x.addressable_data(0)[0], state.params), device)
    report = dict(**actor_step.what_ran(device, opts, args), runs=[])
    os.makedirs(opts.out, exist_ok=True)
    kind = "det" if report["deterministic_gpu"] else "nondet"
    path = os.path.join(opts.out, f"actor_calls_{opts.algo}_{kind}.json")
    for num_envs in opts.envs:
        report["runs"] += measure(algo, args, networks, params, device, num_envs, opts.threads, opts.seconds)
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        with open(path.replace(".json", ".md"), "w") as f:
            f.write(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
