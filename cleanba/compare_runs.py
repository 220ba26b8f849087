"""Compares two runs update by update: batch fingerprints and losses.

    python cleanba/compare_runs.py runs/RUN_A runs/RUN_B [--updates N]

Reads `updates.jsonl` (one line per update, written by the training scripts) and `config.json` of each
run. Prints both layouts, the first update whose batch fingerprints differ, and for each series of the
records' "losses" (whatever the script logs there) its maximum relative difference over the first N
common updates (all by default) with the update where it occurs. The difference at an update is |a - b|
divided by the series' scale, max |a| over the compared updates (a pointwise ratio would measure noise
wherever a series crosses zero).

The policy loss, the approximate KL and the gradient norm are built from terms of size ~1 that nearly
cancel, so float reassociation moves them by far more, relative to their size, than the value loss and
the entropy: they get their own tolerance (--near-zero-rtol), and so does the total loss, which contains
the policy loss (early in IMPALA's training the policy loss is almost all of it). Exit status: 0 if the
fingerprints agree and every series is within its tolerance, 1 otherwise, 2 for bad input. A tool, never
imported by the training scripts.
"""

import argparse
import json
import os
import sys

NEAR_ZERO = {"loss", "policy_loss", "approx_kl", "grad_norm"}
RTOL, NEAR_ZERO_RTOL = 1e-5, 1e-3


def within_tolerance(name: str, difference: float, rtol=RTOL, near_zero_rtol=NEAR_ZERO_RTOL) -> bool:
    return difference <= (near_zero_rtol if name in NEAR_ZERO else rtol)


def load_run(run_dir: str) -> tuple[dict, list[dict]]:
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(run_dir, "updates.jsonl")) as f:
        updates = [json.loads(line) for line in f if line.strip()]
    return config, updates


def compare(updates_a: list[dict], updates_b: list[dict], num_updates: int | None = None) -> dict:
    """{"updates": n compared, "first_fingerprint_mismatch": update or None,
    "max_relative_difference": {series: (value, update)}} over the first common updates."""
    n = min(len(updates_a), len(updates_b))
    if num_updates is not None:
        n = min(n, num_updates)
    pairs = list(zip(updates_a[:n], updates_b[:n], strict=True))
    mismatch = next((a["update"] for a, b in pairs if a["fingerprint"] != b["fingerprint"]), None)
    max_difference = {}
    for name in [name for name in pairs[0][0]["losses"] if name in pairs[0][1]["losses"]] if pairs else []:
        scale = max(abs(a["losses"][name]) for a, _ in pairs) or 1.0
        differences = [(abs(a["losses"][name] - b["losses"][name]) / scale, a["update"]) for a, b in pairs]
        max_difference[name] = max(differences)
    return dict(updates=n, first_fingerprint_mismatch=mismatch, max_relative_difference=max_difference)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_a")
    parser.add_argument("run_b")
    parser.add_argument("--updates", type=int, default=None, help="compare only the first N updates")
    parser.add_argument("--rtol", type=float, default=RTOL, help="tolerance of the other series (value_loss, entropy)")
    parser.add_argument(
        "--near-zero-rtol",
        type=float,
        default=NEAR_ZERO_RTOL,
        help="tolerance of loss, policy_loss, approx_kl and grad_norm",
    )
    return parser.parse_args(argv)


def main():
    args = parse_args()
    if args.updates is not None and args.updates <= 0:
        print(f"error: --updates must be positive, got {args.updates}", file=sys.stderr)
        sys.exit(2)
    runs = []
    for run_dir in (args.run_a, args.run_b):
        try:
            runs.append(load_run(run_dir))
        except (OSError, json.JSONDecodeError) as error:
            print(f"error: {run_dir} is not a readable run directory: {error}", file=sys.stderr)
            sys.exit(2)
    (config_a, updates_a), (config_b, updates_b) = runs
    if not updates_a or not updates_b:  # a run stopped before its first update: nothing to compare
        empty = args.run_a if not updates_a else args.run_b
        print(f"error: {empty} has no update in its updates.jsonl: nothing to compare", file=sys.stderr)
        sys.exit(2)
    result = compare(updates_a, updates_b, args.updates)
    for label, run_dir, config in (("A", args.run_a, config_a), ("B", args.run_b, config_b)):
        layout = config["layout"]
        print(
            f"{label}: {run_dir}\n   layout {layout['notation']}, {layout['actor_threads_per_device']} actor "
            f"threads per actor device, {layout['processes']} processes, on {layout['platform']}"
        )
    if len(updates_a) != len(updates_b):
        print(f"runs have {len(updates_a)} and {len(updates_b)} updates; comparing the first {result['updates']}")
    mismatch = result["first_fingerprint_mismatch"]
    print(
        f"batch fingerprints: {'identical' if mismatch is None else f'first differ at update {mismatch}'} "
        f"over {result['updates']} updates"
    )
    print(f"{'series':14s} {'max rel. diff':>13s} {'(update)':>9s} {'tolerance':>10s}")
    within = True
    for name, (difference, update) in result["max_relative_difference"].items():
        tolerance = args.near_zero_rtol if name in NEAR_ZERO else args.rtol
        within &= within_tolerance(name, difference, args.rtol, args.near_zero_rtol)
        print(f"{name:14s} {difference:13.3e} {f'({update})':>9s} {tolerance:10g}")
    same = mismatch is None and within
    print("SAME: identical batches, losses within tolerance" if same else "DIFFERENT")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
