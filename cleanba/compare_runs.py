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
the policy loss (early in IMPALA's training the policy loss is almost all of it).

It compares layouts of one configuration: two runs of other algorithm flags (the fields each script's Args marks
Algorithm[...], with the global number of environments; --exp-name aside, which only names a run) make other
batches whatever the layout, so the comparison would blame the layout for the flags. Such a pair is refused in one
line naming the flags that differ (exit status 2); --different-configs compares them anyway (to see how far two
settings agree, e.g. --concurrency against the synchronous architecture), saying which flags differ. Another layout
(devices, actor threads, processes, --local-num-envs for the same global count) is what it is for.

Exit status: 0 if the fingerprints agree and every series is within its tolerance, 1 otherwise, 2 for bad input or
runs of different configurations. A tool, never imported by the training scripts.
"""

import argparse
import ast
import functools
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
NO_DEFAULT = object()  # a field whose default is not a literal (exp_name's: the script's name)
NOT_SET = "(unset)"  # a flag one run's script has and the other's has not

NEAR_ZERO = {"loss", "policy_loss", "approx_kl", "grad_norm"}
RTOL, NEAR_ZERO_RTOL = 1e-5, 1e-3


def within_tolerance(name: str, difference: float, rtol=RTOL, near_zero_rtol=NEAR_ZERO_RTOL) -> bool:
    return difference <= (near_zero_rtol if name in NEAR_ZERO else rtol)


def literal_default(value: ast.expr | None):
    """A field's default as the script's source writes it: a literal, or dataclasses.field(default_factory=list or a
    lambda returning a literal); NO_DEFAULT otherwise."""
    try:
        if isinstance(value, ast.Call):
            keywords = {keyword.arg: keyword.value for keyword in value.keywords}
            factory = keywords.get("default_factory")
            if isinstance(factory, ast.Name) and factory.id in ("list", "dict"):
                return [] if factory.id == "list" else {}
            if isinstance(factory, ast.Lambda):
                return ast.literal_eval(factory.body)
            return ast.literal_eval(keywords["default"]) if "default" in keywords else NO_DEFAULT
        return NO_DEFAULT if value is None else ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, KeyError):
        return NO_DEFAULT


@functools.cache
def script_fields(script: str) -> tuple[dict, frozenset] | None:
    """({Algorithm field: default}, {Runtime fields}) of cleanba/<script>'s Args, in their order, read from its source
    (no import: no JAX); None where the script is not here (a copy kept elsewhere)."""
    try:
        with open(os.path.join(HERE, os.path.basename(script))) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    algorithm, runtime = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Args":
            for field in node.body:
                if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name):
                    kind = field.annotation.value if isinstance(field.annotation, ast.Subscript) else None
                    if isinstance(kind, ast.Name) and kind.id == "Algorithm":
                        algorithm[field.target.id] = literal_default(field.value)
                    elif isinstance(kind, ast.Name) and kind.id == "Runtime":
                        runtime.add(field.target.id)
    return (algorithm, frozenset(runtime)) if algorithm else None


def script_of(config: dict) -> str:
    """The script that wrote config.json (the earliest runs' name no script: PPO's have update_epochs)."""
    return config.get("script") or ("cleanba_ppo.py" if "update_epochs" in config["args"] else "cleanba_impala.py")


def algorithm_config(config: dict) -> dict:
    """What a run computes, from its config.json: the script, the args its script's Args marks Algorithm[...] (a
    field added since the run, missing from its config.json, at its default, as the run name's hash takes it) and
    num_envs, the global number of environments (not their split): what the scripts' algorithm_config hashes into
    the run name, so it works for runs named by --run-name too. A script that is not in cleanba/ (a copy): every
    arg but the Runtime fields of the scripts here. Raises KeyError or TypeError on a config.json without them."""
    args, layout = config["args"], config.get("layout") or {}
    script = script_of(config)
    fields = script_fields(script)
    if fields is None:
        known = [script_fields(os.path.basename(path)) for path in glob.glob(os.path.join(HERE, "cleanba_*.py"))]
        runtime = frozenset().union(*(found[1] for found in known if found))
        algorithm = {name: value for name, value in args.items() if name not in runtime}
    else:
        algorithm = {name: args.get(name, default) for name, default in fields[0].items()}
        algorithm = {name: value for name, value in algorithm.items() if value is not NO_DEFAULT}
    num_envs = layout.get("num_envs")
    per_process = ("local_num_envs", "num_actor_threads", "actor_device_ids")
    if num_envs is None and all(name in args for name in per_process):  # written before the layout had num_envs
        num_envs = args["local_num_envs"] * args["num_actor_threads"] * len(args["actor_device_ids"])
        num_envs *= layout.get("processes", 1)
    return {"script": script, **algorithm, **({} if num_envs is None else {"num_envs": num_envs})}


def flag_value(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def config_differences(config_a: dict, config_b: dict, ignore=("exp_name",)) -> list[tuple[str, str, str]]:
    """[(flag, value in a, value in b)] of the algorithm flags that differ, in the scripts' order."""
    a, b = algorithm_config(config_a), algorithm_config(config_b)
    names = [*a, *(name for name in b if name not in a)]
    return [
        (name, flag_value(a.get(name, NOT_SET)), flag_value(b.get(name, NOT_SET)))
        for name in names
        if name not in ignore and a.get(name, NOT_SET) != b.get(name, NOT_SET)
    ]


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
    parser.add_argument(
        "--different-configs",
        action="store_true",
        help="compare runs whose algorithm flags differ (refused otherwise: exit status 2), naming the flags",
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
    try:
        differences = config_differences(config_a, config_b)
    except (KeyError, TypeError, AttributeError) as error:
        print(f"error: a config.json without the run's arguments: {error!r}", file=sys.stderr)
        sys.exit(2)
    differing = ", ".join(f"{name} {a} vs {b}" for name, a, b in differences)
    if differences and not args.different_configs:
        print(
            f"error: {args.run_a} and {args.run_b} are runs of different configurations ({differing}), not layouts "
            "of one: their batches differ whatever the layout; --different-configs compares them anyway",
            file=sys.stderr,
        )
        sys.exit(2)
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
    if differences:
        print(f"different configurations: {differing} (--different-configs): not a comparison of layouts")
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
