"""The learner's time per update from the actor threads' batches to its own batch on the learner devices, waited for:
gathered on the host (as the scripts did before) and device to device (as they do now).

    .venv/bin/python tests/benchmarks/learner_host_time.py --out results        # on a GPU machine (~2 minutes)
    .venv/bin/python tests/benchmarks/learner_host_time.py --out /tmp/host_time -- --local-num-envs 16 --num-steps 32

Each script (--algos) at its defaults on Breakout-v5 (or the flags after --), in this process: its own actor threads
collect one batch; then, interleaved --repeats times and each waited for to its end:
- via the host: each thread's batch fetched to the host (the actor thread did it), then the learner's part:
  concatenated there in global env order, a block per learner device, sent to the learner devices (the update did);
- on the devices: the script's collate (gathered on the first learner device, a block sent to each).
Medians of each. Then one update on each batch: their records for updates.jsonl must be the same (also a test:
tests/test_reproducibility.py). Written to --out after each script: learner_host_time.json and .md.
"""

import argparse
import json
import os
import statistics
import sys
import time

import jax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import actor_step  # noqa: E402
import throughput  # noqa: E402
from helpers import host_collate  # noqa: E402


def timed(work) -> float:  # seconds; work waits for its result
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def measure(opts) -> dict:
    algo, args, cfg, networks, state = actor_step.script_and_state(opts)
    _, rollouts = throughput.actor_alone(algo, args, cfg, networks, state.params, rollouts=1)
    devices = len(cfg.local_learner_devices)
    on_host = {}

    def fetch():  # what each actor thread did after its rollout
        on_host["batches"] = [rollout._replace(batch=jax.device_get(rollout.batch)) for rollout in rollouts]

    def gather_and_send():  # the learner's: concatenated on the host, sent to the learner devices as the update did
        batch = host_collate(on_host["batches"], devices)
        jax.block_until_ready(algo.on_learner_devices(batch, cfg))

    def on_devices():
        jax.block_until_ready(algo.collate(rollouts, cfg))

    ways = {"fetch to the host": fetch, "gather and send": gather_and_send, "on the devices": on_devices}
    for work in ways.values():  # compiles, and fills the caches
        work()
    seconds = {name: [] for name in ways}
    for _ in range(opts.repeats):
        for name, work in ways.items():
            seconds[name].append(timed(work))
    medians = {name: statistics.median(times) for name, times in seconds.items()}
    update_fn = algo.make_update(args, cfg, networks)  # one update each way: the same record
    via_host = algo.learn(update_fn, state, host_collate(on_host["batches"], devices), 1, 0)[1]
    on_the_devices = algo.learn(update_fn, state, algo.collate(rollouts, cfg), 1, 0)[1]
    return dict(
        **actor_step.what_ran(cfg.actor_devices[0], opts, args),
        batch_size=cfg.batch_size,
        batch_mb=sum(leaf.nbytes for leaf in jax.tree.leaves(on_host["batches"][0].batch)) * len(rollouts) / 2**20,
        median_s=medians,
        via_host_s=medians["fetch to the host"] + medians["gather and send"],
        on_devices_s=medians["on the devices"],
        same_record=via_host == on_the_devices,
        repeats=opts.repeats,
        flags=opts.flags,
    )


def markdown(report: dict) -> str:
    first = report["runs"][0]
    lines = [
        f"{first['device']}, {first['cores']} CPU cores, JAX {first['jax']}, {first['date']}; {first['env_id']}, "
        f"flags: {' '.join(report['flags']) or 'the defaults'}; medians of {first['repeats']} batches each",
        "",
        "| script | batch | via the host: fetch | gather and send | in all | on the devices | / via the host "
        "| same update record |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        ms = {name: f"{seconds * 1e3:,.1f} ms" for name, seconds in r["median_s"].items()}
        lines.append(
            f"| {r['algo']} | {r['batch_size']:,} steps, {r['batch_mb']:,.1f} MiB | {ms['fetch to the host']} "
            f"| {ms['gather and send']} | {r['via_host_s'] * 1e3:,.1f} ms | {ms['on the devices']} "
            f"| {r['on_devices_s'] / r['via_host_s']:.2f} | {'yes' if r['same_record'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="a directory for learner_host_time.json and .md")
    parser.add_argument("--algos", nargs="+", choices=["ppo", "impala", "pqn"], default=["impala", "ppo", "pqn"])
    parser.add_argument("--repeats", type=int, default=20, help="timed batches of each way")
    actor_step.add_script_options(parser, "impala")
    opts = parser.parse_args()
    os.makedirs(opts.out, exist_ok=True)
    report = dict(flags=opts.flags, runs=[])
    for algo_name in opts.algos:
        opts.algo = algo_name
        report["runs"].append(measure(opts))
        with open(os.path.join(opts.out, "learner_host_time.json"), "w") as f:
            json.dump(report, f, indent=2)
        with open(os.path.join(opts.out, "learner_host_time.md"), "w") as f:
            f.write(markdown(report))
        print(markdown(report).splitlines()[-1], flush=True)
    print(markdown(report), end="")


if __name__ == "__main__":
    main()
