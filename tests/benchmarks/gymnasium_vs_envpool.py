"""The Gymnasium path against EnvPool's: the same PPO command on CartPole-v1 (the README's quickstart settings), once
through EnvPool and once through Gymnasium's own CartPole in worker processes (--env-backend gymnasium), a few seeds
each, one run at a time. Reported per backend: the steady steps/s (charts/SPS at the end), the wall-clock seconds from
the start of the process to the first logged mean return of 450 or more, and the last logged return; then the ratios.

    .venv/bin/python tests/benchmarks/gymnasium_vs_envpool.py --seeds 3 --out docs/results/gymnasium

A measurement, not a test: it asserts nothing. It writes <out>/gymnasium_vs_envpool.md (a table) and .json.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "cleanba"))
from events import read_events  # noqa: E402

QUICKSTART = "--env-id CartPole-v1 --local-num-envs 8 --num-actor-threads 1 --learning-rate 1e-3 --clip-coef 0.2"
QUICKSTART = [*QUICKSTART.split(), "--total-timesteps", "300000"]
SOLVED = 450


def one_run(backend: str, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as cwd:
        command = [sys.executable, os.path.join(REPO, "cleanba", "cleanba_ppo.py"), *QUICKSTART, "--seed", str(seed)]
        command += ["--env-backend", backend, "--run-name", "run", "--compilation-cache-dir", "None"]
        started = time.time()
        subprocess.run(command, cwd=cwd, check=True, capture_output=True)
        wall = time.time() - started
        scalars = read_events(os.path.join(cwd, "runs", "run")).scalars
    returns = scalars["charts/episodic_return"]
    solved = [when for _, value, when in returns if value >= SOLVED]
    return dict(
        backend=backend,
        seed=seed,
        sps=scalars["charts/SPS"][-1][1],
        seconds=wall,
        seconds_to_450=solved[0] - started if solved else None,
        final_return=returns[-1][1],
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default="results/gymnasium")
    args = parser.parse_args()
    runs = [one_run(backend, seed) for seed in range(1, args.seeds + 1) for backend in ("envpool", "gymnasium")]
    rows = ["| backend | steps/s | seconds to a return of 450 | whole run, s | last return |", "|---|---|---|---|---|"]
    medians = {}
    for backend in ("envpool", "gymnasium"):
        mine = [run for run in runs if run["backend"] == backend]
        solved = [run["seconds_to_450"] for run in mine if run["seconds_to_450"] is not None]
        medians[backend] = dict(
            sps=np.median([run["sps"] for run in mine]),
            to_450=np.median(solved) if solved else float("nan"),
            seconds=np.median([run["seconds"] for run in mine]),
        )
        to_450 = f"{medians[backend]['to_450']:.1f} ({len(solved)} of {len(mine)} seeds reached it)"
        finals = ", ".join(f"{run['final_return']:.0f}" for run in mine)
        m = medians[backend]
        rows.append(f"| {backend} | {m['sps']:,.0f} | {to_450} | {m['seconds']:.1f} | {finals} |")
    ratio = medians["gymnasium"]["sps"] / medians["envpool"]["sps"]
    rows.append(
        f"\nMedians over {args.seeds} seeds. Gymnasium / EnvPool: steps/s {ratio:.2f}, time to 450 "
        f"{medians['gymnasium']['to_450'] / medians['envpool']['to_450']:.2f}x."
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gymnasium_vs_envpool.json"), "w") as f:
        json.dump(runs, f, indent=2)
    with open(os.path.join(args.out, "gymnasium_vs_envpool.md"), "w") as f:
        f.write("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
