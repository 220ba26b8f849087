"""What --layout-free-group-size costs: each script trained with and without it, side by side in one run.

    .venv/bin/python tests/benchmarks/layout_free.py                       # CartPole and Breakout, the three scripts
    .venv/bin/python tests/benchmarks/layout_free.py --configs cartpole --algos ppo --repeats 5

The configurations are throughput.py's (its CartPole and small Breakout batches), trained as users run them, in
the synchronous architecture with actor and learner on device 0. Each run is repeated, the two variants
interleaved (a slow spell of a shared machine hits both), and the median steady-state steps/s kept. The group
size is the largest that leaves every actor thread and every minibatch of the learner two groups or more, which
the flag needs. Prints steps/s of both and their ratio; writes them as JSON. A measurement: it asserts nothing.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
from throughput import CONFIGS, run_training  # noqa: E402

# Envs per group (see the docstring): CartPole's PPO and PQN threads hold 8 envs, IMPALA's 16 in minibatches of 8;
# Breakout's single thread holds 8 envs, IMPALA's minibatches 2.
GROUP_SIZES = {"cartpole": dict(ppo=4, impala=4, pqn=4), "breakout": dict(ppo=4, impala=1, pqn=4)}


def flag_value(flags: list[str], name: str, default: int) -> int:
    return int(flags[flags.index(name) + 1]) if name in flags else default


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", choices=list(GROUP_SIZES), default=list(GROUP_SIZES))
    parser.add_argument("--algos", nargs="+", choices=["ppo", "impala", "pqn"], default=["ppo", "impala", "pqn"])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant; the median is reported")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed to each training run")
    parser.add_argument("--out", default="layout_free.json", help="where to write the figures as JSON")
    args = parser.parse_args()
    machine = dict(device=jax.devices()[0].device_kind, cpus=os.cpu_count(), jax=jax.__version__)
    machine["date"] = time.strftime("%Y-%m-%d")
    print(f"machine: {machine}", flush=True)
    results = []
    for config_name in args.configs:
        config = CONFIGS[config_name]
        for algo in args.algos:
            flags = config[algo]
            threads = flag_value(flags, "--num-actor-threads", 2)
            batch_size = flag_value(flags, "--local-num-envs", 64) * threads * flag_value(flags, "--num-steps", 128)
            group = ["--layout-free-group-size", str(GROUP_SIZES[config_name][algo])]
            variants = {"per device": flags, "layout-free": [*flags, *group]}
            sps = {name: [] for name in variants}
            for _ in range(args.repeats):
                for name, variant in variants.items():
                    updates = config["updates"][algo]
                    log_frequency = config["log_frequency"][algo]
                    run = run_training(algo, variant, updates, log_frequency, batch_size, False, 0, 1, args.timeout)
                    sps[name].append(run["sps"])
            median = {name: sorted(runs)[len(runs) // 2] for name, runs in sps.items()}
            ratio = median["layout-free"] / median["per device"]
            results.append(dict(config=config_name, algo=algo, group=group[1], runs=sps, median=median, ratio=ratio))
            print(f"[{config_name} / {algo}] {median['per device']:,.0f} -> {median['layout-free']:,.0f} steps/s")
    with open(args.out, "w") as f:
        json.dump(dict(machine=machine, results=results), f, indent=2)
    print(f"\n{machine['device']}, {machine['cpus']} CPUs, jax {machine['jax']}, {machine['date']}; {args.out}")
    print("| config | script | group | steps/s per device (runs) | steps/s layout-free (runs) | ratio |")
    print("|---|---|---|---|---|---|")
    for r in results:
        runs = {name: ", ".join(f"{x:,.0f}" for x in values) for name, values in r["runs"].items()}
        per_device = f"{r['median']['per device']:,.0f} ({runs['per device']})"
        layout_free = f"{r['median']['layout-free']:,.0f} ({runs['layout-free']})"
        print(f"| {r['config']} | {r['algo']} | {r['group']} | {per_device} | {layout_free} | {r['ratio']:.2f} |")


if __name__ == "__main__":
    main()
