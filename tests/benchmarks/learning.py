"""Learning benchmark: each script trains on one environment for a fixed wall-clock budget, as a user runs it; then
its steps/s over the run and its episodic-return curve are reported, with a CSV and a PNG.

    .venv/bin/python tests/benchmarks/learning.py --env-id Breakout-v5 --minutes 3.5 --out results/learning  # a GPU
    .venv/bin/python tests/benchmarks/learning.py --minutes 0.5 -- --local-num-envs 8 --num-steps 32  # a smoke run
    .venv/bin/python tests/benchmarks/learning.py --env-id StarpilotEasy-v0 --algos ppo --evaluate 20 -- \
        --num-levels 200 \
        --total-timesteps 1048576 --save-model                                    # Procgen: train and test returns

Each script runs with its defaults (the paper's Atari settings) and the flags given after `--`, in a subprocess,
and gets SIGTERM when its budget is spent: it finishes the update in progress, checkpoints and exits, as under
SLURM's preemption. Its TensorBoard events are then read back. Reported per script: compile time (start to the
first update), steady steps/s (after the first two updates) and how it varied over the run (the slowest and the
fastest tenth of the run against the median), the queue waits (the side that waits is not the bottleneck), and the
mean episodic return of the last tenth of the logged points. With --evaluate N, a run that finished its
--total-timesteps within the budget and saved its model (--save-model) then plays N episodes on its training levels
and, for a Procgen run on some levels only (--num-levels), N on levels it never saw (cleanba/evaluate.py): the train
and test returns of Procgen's protocol. A measurement, not a test: it asserts nothing.
"""

import argparse
import csv
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "cleanba"))
from events import read_scalars  # noqa: E402

LOG_FREQUENCY = {"ppo": 1, "impala": 10, "pqn": 5}  # a point every few seconds at the papers' batch sizes on a GPU
WARMUP_UPDATES = 2  # compilation, and with the Cleanba architecture a second batch collected early


def train_for(algo: str, env_id: str, minutes: float, flags: list[str], cwd: str) -> dict:
    """Runs the script for `minutes`, then stops it with SIGTERM; returns its scalars and its start time."""
    command = [
        sys.executable,
        os.path.join(REPO, "cleanba", f"cleanba_{algo}.py"),
        "--env-id",
        env_id,
        "--log-frequency",
        str(LOG_FREQUENCY[algo]),
        "--run-name",
        algo,
        "--no-resume",
        *flags,
    ]
    print(f"[{algo}] {' '.join(command)}", flush=True)
    started = time.time()
    with open(os.path.join(cwd, f"{algo}.log"), "w") as log:
        proc = subprocess.Popen(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=minutes * 60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()
    with open(os.path.join(cwd, f"{algo}.log")) as f:
        output = f.read()
    if proc.returncode not in (0, 128 + signal.SIGTERM):
        raise RuntimeError(f"{algo} exited {proc.returncode}:\n{output[-3000:]}")
    return dict(scalars=read_scalars(os.path.join(cwd, "runs", algo), wall_time=True), started=started)


def machine() -> str:
    """The device, CPU cores, JAX version and date (the device's name from a JAX process of its own, which exits
    before the scripts start and leaves them the device's memory)."""
    probe = "import jax; print(f'{jax.devices()[0].device_kind}, JAX {jax.__version__}')"
    device = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip()
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return f"{device or 'device unknown'}, {len(os.sched_getaffinity(0))} CPU cores, {date}"


def evaluate(run_dir: str, episodes: int, levels: str) -> str | None:
    """The return (mean ± standard deviation) of `episodes` episodes of the run's saved model on its training levels
    or on unseen ones."""
    command = [sys.executable, os.path.join(REPO, "cleanba", "evaluate.py"), run_dir, "--episodes", str(episodes)]
    played = subprocess.run([*command, "--levels", levels], capture_output=True, text=True)
    mean = re.search(r"^mean return over \d+ episodes.*: (\S+ ± \S+)$", played.stdout, re.M)
    if played.returncode:
        print(f"evaluate.py --levels {levels} exited {played.returncode}:\n{played.stderr[-3000:]}", flush=True)
    elif not mean:
        print(f"evaluate.py --levels {levels}: no episode finished:\n{played.stdout[-3000:]}", flush=True)
    return mean.group(1) if mean and not played.returncode else None


def evaluations(run_dir: str, episodes: int) -> dict:
    """Train and test (unseen levels) returns of a run that saved its model; none for one that did not finish."""
    if not glob.glob(os.path.join(run_dir, "*.cleanba_model")):
        print(f"{run_dir}: no saved model (the budget ended the run, or no --save-model): not evaluated", flush=True)
        return {}
    with open(os.path.join(run_dir, "config.json")) as f:
        some_levels = json.load(f)["args"].get("num_levels", 0) > 0
    played = dict(eval_train=evaluate(run_dir, episodes, "train"))
    if some_levels:
        played["eval_unseen"] = evaluate(run_dir, episodes, "unseen")
    return played


def summarize(algo: str, scalars: dict, started: float) -> dict:
    updates = scalars["stats/update"]  # (global step, update, wall time)
    steps, walls = np.array([p[0] for p in updates], float), np.array([p[2] for p in updates])
    steady = [i for i, (_, update, _) in enumerate(updates) if update >= WARMUP_UPDATES]
    if len(steady) < 3:
        raise RuntimeError(
            f"{algo}: {len(updates)} updates logged in the budget, too few to measure; give more minutes"
        )
    first, last = steady[0], steady[-1]
    sps = (steps[last] - steps[first]) / (walls[last] - walls[first])
    # The rate in each tenth of the steady part of the run (by logged points), against its median.
    windows = np.array_split(np.arange(first, last + 1), 10)
    rates = [(steps[w[-1]] - steps[w[0]]) / (walls[w[-1]] - walls[w[0]]) for w in windows if len(w) > 1] or [sps]
    returns = scalars.get("charts/episodic_return", [])
    tail = returns[-max(1, len(returns) // 10) :]
    # Waits logged once the steady part has begun (with the Cleanba architecture, a wait is logged an update late).

    def steady_waits(tag):
        return [p[1] for p in scalars.get(f"stats/{tag}", []) if p[0] > steps[first + 1]]

    waits = {tag: np.mean(steady_waits(tag) or [0.0]) for tag in ("rollout_queue_get_time", "params_queue_get_time")}
    seconds_per_update = (walls[last] - walls[first]) / (updates[last][1] - updates[first][1])
    return dict(
        algo=algo,
        steps=int(steps[-1]),
        updates=int(updates[-1][1]),
        sps=sps,
        compile_seconds=walls[0] - started,
        sps_slowest=min(rates) / np.median(rates) - 1,
        sps_fastest=max(rates) / np.median(rates) - 1,
        learner_wait=waits["rollout_queue_get_time"] / seconds_per_update,
        actor_wait=waits["params_queue_get_time"] / seconds_per_update,
        final_return=float(np.mean([p[1] for p in tail])) if tail else float("nan"),
        episodes_logged=len(returns),
    )


def write_curves(results: dict, out: str, env_id: str):
    with open(os.path.join(out, "learning.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["algo", "global_step", "seconds", "episodic_return", "sps"])
        for algo, result in results.items():
            sps = {step: value for step, value, _ in result["scalars"].get("charts/SPS", [])}
            for step, value, wall in result["scalars"].get("charts/episodic_return", []):
                writer.writerow([algo, step, round(wall - result["started"], 2), value, sps.get(step, "")])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for algo, result in results.items():
        points = result["scalars"].get("charts/episodic_return", [])
        by_step.plot([p[0] for p in points], [p[1] for p in points], label=algo)
        updates = result["scalars"]["stats/update"]  # the rate between consecutive log points shows any drift
        rates = [(b[0] - a[0]) / (b[2] - a[2]) for a, b in zip(updates[:-1], updates[1:], strict=True)]
        by_time.plot([p[2] - result["started"] for p in updates[1:]], rates, label=algo)
    by_step.set(xlabel="environment steps", ylabel="episodic return", title=env_id)
    by_time.set(xlabel="wall-clock seconds", ylabel="steps per second", title="throughput between log points")
    for axis in (by_step, by_time):
        axis.grid(alpha=0.3)
        axis.legend()
        axis.ticklabel_format(axis="x", style="sci", scilimits=(-3, 4))
    fig.tight_layout()
    fig.savefig(os.path.join(out, "learning.png"), dpi=100)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env-id", default="Breakout-v5")
    parser.add_argument("--minutes", type=float, default=3.5, help="wall-clock budget of each script")
    parser.add_argument("--algos", nargs="+", choices=list(LOG_FREQUENCY), default=list(LOG_FREQUENCY))
    parser.add_argument("--out", default="learning", help="directory for learning.csv, learning.png, summary.txt")
    parser.add_argument("--evaluate", type=int, default=0, help="episodes to play with a finished run's saved model")
    argv = sys.argv[1:]
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    os.makedirs(args.out, exist_ok=True)
    measured_on = machine()
    results = {}
    with tempfile.TemporaryDirectory() as cwd:
        for algo in args.algos:
            results[algo] = train_for(algo, args.env_id, args.minutes, flags, cwd)
            results[algo]["summary"] = summarize(algo, results[algo]["scalars"], results[algo]["started"])
            if args.evaluate:
                results[algo]["summary"].update(evaluations(os.path.join(cwd, "runs", algo), args.evaluate))
    write_curves(results, args.out, args.env_id)
    header = "| script | steps | updates | steps/s | slowest / fastest tenth | compile s | learner wait | actor wait | "
    header += "final return (last 10%) |"
    if args.evaluate:
        header += f" saved model, {args.evaluate} episodes: training levels | unseen levels |"
    rows = [header, "|---" * (header.count("|") - 1) + "|"]
    for result in results.values():
        s = result["summary"]
        row = (
            f"| {s['algo']} | {s['steps']:,} | {s['updates']} | {s['sps']:,.0f} | {s['sps_slowest']:+.0%} / "
            f"{s['sps_fastest']:+.0%} | {s['compile_seconds']:.0f} | {s['learner_wait']:.0%} | "
            f"{s['actor_wait']:.0%} | {s['final_return']:.1f} ({s['episodes_logged']} points) |"
        )
        if args.evaluate:
            played = [s.get(key) for key in ("eval_train", "eval_unseen")]
            row += "".join(f" {value or '-'} |" for value in played)
        rows.append(row)
    summary = f"{args.env_id}, {args.minutes} min per script, flags: {' '.join(flags) or 'the defaults'}\n"
    summary += f"{measured_on}\n\n"
    summary += "\n".join(rows)
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write(summary + "\n")
    print(summary)
    print(f"curves in {args.out}/learning.csv and {args.out}/learning.png")


if __name__ == "__main__":
    main()
