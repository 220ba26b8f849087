"""The actors with the device to themselves: what each script's actor threads collect when no learner shares their GPU
(the Cleanba paper's layout, and our users': --actor-device-ids 0 --learner-device-ids 1 ...), against EnvPool alone
on the same cores, for each number of EnvPools per actor thread (--env-pools: while one pool's actions are inferred,
the others step). On a machine with one GPU it is the actors' side of a run with a GPU for the learner.

    .venv/bin/python tests/benchmarks/actors_alone.py --out results        # on a GPU machine (~3 minutes)
    .venv/bin/python tests/benchmarks/actors_alone.py --out /tmp/alone --algos impala --seconds 2 -- --local-num-envs 8

Each script's defaults on Breakout-v5 (or the flags after --), with XLA's deterministic GPU ops as the script sets
them; synchronous, so that the actors take parameters at every rollout. EnvPool alone is throughput.py's env ceiling
(each actor thread's pool, the scripts' EnvPool threads, random actions), once per script; the actors alone,
throughput.py's actor_alone: the script's own Actors, fed the first parameters, timed over the rollouts after the first
(which compiles), as many as --seconds at EnvPool's pace takes. A pool count the script refuses (--local-num-envs not
a multiple) is reported with the script's message. Written to --out after each measurement: actors_alone.json and .md.
"""

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import actor_step  # noqa: E402
import throughput  # noqa: E402


def markdown(report: dict) -> str:
    lines = [
        f"{report['device']}, {report['cores']} CPU cores, JAX {report['jax']}, {report['date']}; {report['env_id']}, "
        f"flags: {' '.join(report['flags']) or 'the defaults'}; no learner; XLA_FLAGS `{report['xla_flags']}`",
        "",
        "| script | actor threads x envs | EnvPool alone | EnvPools per thread | actors alone | / EnvPool alone |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        shape = f"{r['threads']} x {r['envs_per_thread']}"
        if "refused" in r or "failed" in r:
            why = r.get("refused") or f"failed: {r['failed']}"
            lines.append(f"| {r['algo']} | {shape} | {r['env_alone_sps']:,.0f} | {r['pools']} | {why} | - |")
            continue
        ratio = r["actors_sps"] / r["env_alone_sps"]
        alone = f"{r['env_alone_sps']:,.0f} | {r['pools']} | {r['actors_sps']:,.0f} | {ratio:.2f}"
        lines.append(f"| {r['algo']} | {shape} | {alone} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="a directory for actors_alone.json and .md")
    parser.add_argument("--algos", nargs="+", choices=["ppo", "impala", "pqn"], default=["impala", "ppo", "pqn"])
    parser.add_argument("--pools", nargs="+", type=int, default=[1, 2], help="EnvPools per actor thread")
    parser.add_argument(
        "--seconds", type=float, default=8.0, help="of EnvPool alone, and of each timed set of rollouts"
    )
    parser.add_argument("--env-id", default="Breakout-v5")
    parser.add_argument("--no-deterministic-gpu", action="store_true")
    parser.add_argument("flags", nargs="*", help="after --: the scripts' flags")
    opts = parser.parse_args()
    os.makedirs(opts.out, exist_ok=True)
    report = dict(runs=[])

    def save():
        with open(os.path.join(opts.out, "actors_alone.json"), "w") as f:
            json.dump(report, f, indent=2)
        with open(os.path.join(opts.out, "actors_alone.md"), "w") as f:
            f.write(markdown(report))

    for algo_name in opts.algos:
        script_opts = argparse.Namespace(**vars(opts), algo=algo_name)
        algo, args, cfg, networks, state = actor_step.script_and_state(script_opts)
        if not report["runs"]:  # the machine, the date and the XLA flags (the scripts are in each run)
            ran = actor_step.what_ran(cfg.actor_devices[0], script_opts, args)
            report.update({key: value for key, value in ran.items() if key != "algo"}, flags=opts.flags)
        env_sps = throughput.env_ceiling(algo, args, args.num_actor_threads, opts.seconds)
        shape = dict(algo=algo_name, threads=args.num_actor_threads, envs_per_thread=args.local_num_envs)
        for pools in opts.pools:
            run = dict(shape, pools=pools, env_alone_sps=env_sps)
            args.env_pools = pools
            try:  # the pools' checks are the config's
                algo.check_args(args)
                cfg = algo.derive_config(args)
            except algo.ConfigError as refused:
                run["refused"] = str(refused)
            else:
                steps_per_rollout = args.num_actor_threads * args.local_num_envs * args.num_steps
                rollouts = 1 + max(2, math.ceil(opts.seconds * env_sps / steps_per_rollout))
                try:  # a failure (an actor thread's, the GPU's memory) is this row's, not the whole table's
                    run["actors_sps"], _ = throughput.actor_alone(algo, args, cfg, networks, state.params, rollouts)
                    run["rollouts_timed"] = rollouts - 1
                except Exception as error:
                    run["failed"] = f"{type(error).__name__}: {' '.join(str(error).split())[-200:]}"  # its end
            report["runs"].append(run)
            save()
            print(markdown(report).splitlines()[-1], flush=True)
    print(markdown(report))


if __name__ == "__main__":
    main()
