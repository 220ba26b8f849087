"""Whether the rollout a CPU runs, one compiled program with EnvPool's XLA step inside, collects on a GPU what the GPU's
loop of jitted calls collects, and how much faster it is there: the question behind the scripts' GPU rollout being a
Python loop.

    .venv/bin/python tests/benchmarks/compiled_rollout.py --out results   # on a GPU machine (~2 min)
    .venv/bin/python tests/benchmarks/compiled_rollout.py --out /tmp/compiled --shapes 4x8        # on a CPU

On a CPU each actor thread's rollout is a jitted lax.scan of the script's act, EnvPool's XLA step (envs.xla()) and
observe. On an H100 on 2026-11-23 that program gave wrong data at 64 envs x 128 steps (garbage bytes in the episode
ends, NaN returns, observations unlike a CPU's) and the right data at 8 x 32, while EnvPool's operation alone in a
scan was right (docs/notes/compiled-rollout.md). EnvPool's GPU step has waited for its copies before returning since
EnvPool #393 (April 2026, every release from 1.2.0): so it was very likely not a copy from a freed host buffer.

For each shape ENVSxSTEPS in --shapes, a script's defaults otherwise (IMPALA's, Breakout-v5, XLA's deterministic GPU
ops as the script sets them): one EnvPool of ENVS envs (the script's share of the cores for a thread) collects
--rollouts rollouts with the compiled program on the default device, and another, made alike, with the script's GPU
loop (compile_rollout's two paths, chosen by the platform it is given). Every field of the batches is compared (the
behaviour log-probabilities to 1e-6: the policy is compiled into another program), with the first rollout, field and
step that differ; the compiled batches are checked for what went wrong before (episode ends that are not 0 or 1,
rewards or returns that are not finite); and each path's time per step, the median of the rollouts after the first.
The two paths may part in a sampled action where a logit rounds apart in its last bit, after which the
trajectories differ without either being wrong: the sanity checks, and the steps before the first difference, say
which it is. Written to --out: compiled_rollout.json and .md.
"""

import argparse
import json
import os
import sys
import time

import envpool
import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import actor_step  # noqa: E402


def collect(algo, args, networks, params, device, platform: str, count: int) -> tuple[list, list]:
    """`count` rollouts of one pool of args.local_num_envs envs by compile_rollout's path for `platform`, on device:
    (the batches on the host, the seconds each took)."""
    ids = np.arange(args.local_num_envs)
    envs = algo.make_env(args, len(ids), 0, **algo.env_threads(args, 0, sorted(os.sched_getaffinity(0))))
    handle, rollout = algo.make_rollout(args, networks, [envs], platform)
    states = jax.device_put([algo.first_state(envs, handle, ids, 0, networks)], device)
    batches, seconds = [], []
    for _ in range(count):
        start = time.perf_counter()
        states, batch = rollout(params, states)
        batches.append(jax.device_get(batch))
        seconds.append(time.perf_counter() - start)
    envs.close()
    return batches, seconds


def first_difference(compiled: list, looped: list):
    """(rollout, field, step) of the first difference between two lists of batches, or None."""
    for index, (a, b) in enumerate(zip(compiled, looped, strict=True)):
        for (path, x), y in zip(jax.tree.leaves_with_path(a), jax.tree.leaves(b), strict=True):
            field = jax.tree_util.keystr(path)
            if "logprobs" in field:
                same = np.isclose(x, y, rtol=1e-6, atol=1e-6)
            else:
                same = x == y
            if not np.all(same):
                step = int(np.argwhere(~same.reshape(same.shape[0], -1).all(axis=1))[0, 0])
                return dict(rollout=index, field=field, step=step)
    return None


def sanity_problems(batches: list) -> list[str]:
    """What went wrong on the GPU before: episode ends that are not 0 or 1, returns or rewards that are not finite."""
    problems = []
    for index, batch in enumerate(batches):
        for name in ["dones", "terminations"]:
            if np.asarray(batch[name]).view(np.uint8).max() > 1:
                problems.append(f"rollout {index}: {name} holds bytes other than 0 and 1")
        for name in ["rewards", "episode_returns"]:
            if not np.isfinite(batch[name]).all():
                problems.append(f"rollout {index}: {name} not finite")
    return problems


def markdown(report: dict) -> str:
    lines = [
        f"{report['device']}, {report['cores']} CPU cores, JAX {report['jax']}, EnvPool {report['envpool']}, "
        f"{report['date']}; {report['algo']} on {report['env_id']}, deterministic GPU ops: "
        f"{report['deterministic_gpu']}; {report['rollouts']} rollouts each way",
        "",
        "| envs x steps | the same batches | first difference | compiled batches' problems | "
        "ms per step: compiled | loop |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        first = r["first_difference"]
        where = f"rollout {first['rollout']}, {first['field']}, step {first['step']}" if first else "-"
        problems = "; ".join(r["problems"]) or "none"
        times = f"{r['compiled_ms_per_step']:.2f} | {r['loop_ms_per_step']:.2f}"
        lines.append(f"| {r['envs']} x {r['steps']} | {first is None} | {where} | {problems} | {times} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="a directory for compiled_rollout.json and .md")
    parser.add_argument("--shapes", nargs="+", default=["8x32", "64x20", "64x128"], help="ENVSxSTEPS")
    parser.add_argument("--rollouts", type=int, default=4, help="each way, the first of which compiles")
    actor_step.add_script_options(parser, "impala")
    opts = parser.parse_args()
    report = None
    for shape in opts.shapes:
        num_envs, num_steps = shape.split("x")
        shaped = argparse.Namespace(**{**vars(opts), "flags": [*opts.flags, "--local-num-envs", num_envs]})
        shaped.flags += ["--num-steps", num_steps]
        algo, args, cfg, networks, state = actor_step.script_and_state(shaped)
        device = cfg.actor_devices[0]
        params = jax.device_put(jax.tree.map(lambda x: x.addressable_data(0), state.params), device)
        if report is None:
            report = dict(**actor_step.what_ran(device, opts, args), rollouts=opts.rollouts, runs=[])
            report["envpool"] = envpool.__version__
        compiled, compiled_s = collect(algo, args, networks, params, device, "cpu", opts.rollouts)
        looped, looped_s = collect(algo, args, networks, params, device, "gpu", opts.rollouts)
        report["runs"].append(
            dict(
                envs=int(num_envs),
                steps=int(num_steps),
                first_difference=first_difference(compiled, looped),
                problems=sanity_problems(compiled),
                compiled_ms_per_step=1000 * float(np.median(compiled_s[1:])) / int(num_steps),
                loop_ms_per_step=1000 * float(np.median(looped_s[1:])) / int(num_steps),
            )
        )
        os.makedirs(opts.out, exist_ok=True)
        with open(os.path.join(opts.out, "compiled_rollout.json"), "w") as f:
            json.dump(report, f, indent=2)
        with open(os.path.join(opts.out, "compiled_rollout.md"), "w") as f:
            f.write(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
