"""Where the learner's update spends the device's time: JAX's profiler around a few updates, the device's events summed
by the part of the network (or of the loss) that each computes, read from the optimised program's metadata.

    source .gpu/env.sh && PYTHON=python3 bash benchmark.sh gpu-profile --out "$OUT"   # the three, on the GPU machine
    python tests/benchmarks/device_trace.py --algo ppo --out /tmp/trace --calls 1 -- --local-num-envs 8 --num-steps 8

A script's defaults (PPO's by default, Breakout-v5), with XLA's deterministic GPU ops as the script sets them
(--no-deterministic-gpu: off). The update runs on a batch of the script's own actors, is compiled and run once untimed,
then --calls times under the profiler. On a GPU the events are the CUDA kernels and copies on the device's streams
(CUPTI; kernels that XLA launches as a CUDA graph may carry no operation's name, only their own, which is then mapped
to the fusion it was named after; XLA_FLAGS=--xla_gpu_enable_command_buffer= turns the graphs off); on a CPU, XLA's
operations on its threads. Each event is named by its XLA operation (a fusion, a cuDNN
convolution); the optimised HLO gives that operation's source: the flax module path (ResNet/Conv_3), the primitive
(conv_general_dilated) and the pass (forward, or backward when under a transpose). Written to --out:
update_trace_<algo>_<det|nondet>.json (the summary, and a few raw events to show the trace's format), .md (the tables)
and .hlo.txt.gz (the optimised program, to read an operation in full).
"""

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

import jax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import actor_step  # noqa: E402

# The optimised HLO text: a computation's first line, and an instruction with what it calls and its source, e.g.
#   %fused_computation.12 (param_0: f32[64,42,42,16]) -> f32[64,42,42,16] {
#   %fusion.12 = f32[64,42,42,16]{...} fusion(...), kind=kLoop, calls=%fused_computation.12, metadata={op_name="..."}
COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+) .*\{$")
INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+) = ")
CALLS = re.compile(r"calls=%?([\w.\-]+)")
OP_NAME = re.compile(r"metadata=\{[^}]*?op_name=\"([^\"]*)\"")
KEPT_ROWS = 80  # of each table, in the JSON
MODULE_NAME = re.compile(r"^[A-Z]\w*$")  # flax's module names: ResNet, Conv_3, Dense_0, LayerNorm_1, LSTMCore_0


def sources_of(hlo_text: str) -> dict:
    """Each instruction's name in the optimised HLO -> the op_name of its metadata (its JAX source); for a fusion
    without one, that of the first instruction inside it that has one."""
    sources, calls, first_inside = {}, {}, {}
    computation = None
    for line in hlo_text.splitlines():
        match = COMPUTATION.match(line)
        if match:
            computation = match.group(1)
            continue
        match = INSTRUCTION.match(line)
        if not match:
            continue
        op_name = OP_NAME.search(line)
        if op_name:
            sources[match.group(1)] = op_name.group(1)
            first_inside.setdefault(computation, op_name.group(1))
        called = CALLS.search(line)
        if called:
            calls[match.group(1)] = called.group(1)
    for instruction, computation in calls.items():
        if instruction not in sources and computation in first_inside:
            sources[instruction] = first_inside[computation]
    return sources


# The names of JAX's transformations and XLA's control flow in an op_name: not where in the program an operation is.
WRAPPERS = {
    "jit",
    "pmap",
    "_fun",
    "main",
    "closed_call",
    "eval_jaxpr",
    "while",
    "body",
    "cond",
    "vmap",
    "jvp",
    "transpose",
}


def part_of(op_name: str) -> tuple[str, str]:
    """(pass, part) of a JAX op_name: backward when it is under a transpose (the gradient), the flax module path and
    the primitive; outside any module, the last three names of the path (the loss, the optimiser, the advantages)."""
    names = [n.replace(".<locals>.", ".") for n in re.split(r"[/()]", op_name) if n]
    pass_name = "backward" if "transpose(" in op_name else "forward"  # the transformation, not the primitive
    modules = [n for n in names if MODULE_NAME.match(n)]
    if modules:
        return pass_name, "/".join(modules) + " " + names[-1]
    return pass_name, "/".join([n for n in names if n not in WRAPPERS][-3:])


def device_events(trace: dict) -> tuple[list, str, dict]:
    """The events of the device's work, where they were found, and every line of the device seen (events, ms), to
    check the choice against. On a GPU: the complete events on the lines of its streams (kernels, copies), not the lines
    derived from them (XLA Ops, XLA Modules) that repeat them; on a CPU: XLA's operations (events named by their
    hlo_op), which the CPU's runtime records on its threads."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    gpus = {pid for pid, name in processes.items() if "/device:GPU" in name}
    complete = [e for e in events if e.get("ph") == "X"]
    if not gpus:
        ops = [e for e in complete if e.get("args", {}).get("hlo_op") == e.get("name")]
        return ops, "CPU: XLA's operations on the host's threads", {}
    lines = collections.defaultdict(lambda: [0, 0.0])
    for e in complete:
        if e["pid"] in gpus:
            line = f"{processes[e['pid']]} / {threads.get((e['pid'], e['tid']), e['tid'])}"
            lines[line][0] += 1
            lines[line][1] += e["dur"] / 1000
    streams = {line for line in lines if "stream" in line.split(" / ")[-1].lower()}
    if not streams:  # another naming of the lines: all but the derived ones
        streams = {line for line in lines if not re.search(r"XLA|Steps|Launch|Framework|Source", line)}
    on_streams = [
        e
        for e in complete
        if e["pid"] in gpus and f"{processes[e['pid']]} / {threads.get((e['pid'], e['tid']), e['tid'])}" in streams
    ]
    seen = {line: dict(events=n, ms=round(ms, 3)) for line, (n, ms) in lines.items()}
    return on_streams, "GPU: " + ", ".join(sorted(streams)), seen


def op_of(event: dict) -> str:
    """The XLA operation an event ran: its hlo_op, as an argument of its own or inside an annotation; else its name."""
    args = event.get("args", {})
    if "hlo_op" in args:
        return args["hlo_op"]
    for value in args.values():
        match = isinstance(value, str) and re.search(r"hlo_op=([\w.\-]+)", value)
        if match:
            return match.group(1)
    return event["name"]


def summarize(events: list, sources: dict, calls: int, wall_s: float) -> dict:
    """Device time per update by part of the program and by XLA operation, in ms, with each one's share."""
    by_part = collections.defaultdict(lambda: dict(ms=0.0, events=0))
    by_op = collections.defaultdict(lambda: dict(ms=0.0, events=0, kernel=None, part=None))
    busy_us = 0.0
    unmatched = 0
    for e in events:
        op = op_of(e)
        source = sources.get(op) or sources.get(re.sub(r"_(\d+)$", r".\1", op))  # a kernel named fusion_3: fusion.3
        unmatched += source is None
        pass_name, part = part_of(source) if source else ("?", f"{op.split('.')[0]} (no source in the HLO)")
        busy_us += e["dur"]
        by_part[(pass_name, part)]["ms"] += e["dur"] / 1000 / calls
        by_part[(pass_name, part)]["events"] += 1
        row = by_op[op]
        row["ms"] += e["dur"] / 1000 / calls
        row["events"] += 1
        row["kernel"] = row["kernel"] or e["name"]
        row["part"] = f"{pass_name}: {part}"
    busy_ms = max(busy_us / 1000 / calls, 1e-9)  # no events (no CUPTI on a GPU machine): every share 0
    parts = [
        dict(pass_=p, part=part, ms=r["ms"], share=r["ms"] / busy_ms, events_per_update=r["events"] / calls)
        for (p, part), r in by_part.items()
    ]
    ops = [dict(op=op, share=r["ms"] / busy_ms, **r) for op, r in by_op.items()]
    passes = collections.Counter()
    for row in parts:
        passes[row["pass_"]] += row["ms"]
    return dict(
        wall_ms_per_update=1000 * wall_s / calls,
        device_busy_ms_per_update=busy_ms,
        events_per_update=len(events) / calls,
        events_without_source=unmatched,
        ms_by_pass=dict(passes),
        parts=sorted(parts, key=lambda r: -r["ms"])[:KEPT_ROWS],
        ops=sorted(ops, key=lambda r: -r["ms"])[:KEPT_ROWS],
    )


def markdown(report: dict, rows: int = 25) -> str:
    s = report["summary"]
    ops = "deterministic" if report["deterministic_gpu"] else "non-deterministic"
    passes = ", ".join(f"{name} {ms:.1f}" for name, ms in sorted(s["ms_by_pass"].items(), key=lambda kv: -kv[1]))
    wall, busy = s["wall_ms_per_update"], s["device_busy_ms_per_update"]
    lines = [
        f"{report['device']}, {report['cores']} CPU cores, JAX {report['jax']}, {report['date']}; {report['algo']}'s "
        f"update on {report['env_id']}, {report['batch_steps']:,} steps, {ops} GPU ops; {report['calls']} updates",
        "",
        f"Per update: **{wall:.1f} ms** wall, the device busy {busy:.1f} ms ({busy / wall:.0%}) in "
        f"{s['events_per_update']:,.0f} events ({report['events_found_on']}); by pass, ms: {passes}",
        "",
        "| pass | part of the program | ms per update | share | events per update |",
        "|---|---|---|---|---|",
    ]
    for r in s["parts"][:rows]:
        lines.append(
            f"| {r['pass_']} | {r['part']} | {r['ms']:.2f} | {r['share']:.1%} | {r['events_per_update']:.0f} |"
        )
    lines += ["", "| XLA operation | first kernel | part | ms per update | share |", "|---|---|---|---|---|"]
    for r in s["ops"][:rows]:
        kernel = r["kernel"] if len(r["kernel"]) <= 60 else r["kernel"][:57] + "..."
        lines.append(f"| {r['op']} | `{kernel}` | {r['part']} | {r['ms']:.2f} | {r['share']:.1%} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", default="docs/results/gpu", help="for update_trace_<algo>_<det|nondet>.json, .md, .hlo.txt.gz"
    )
    parser.add_argument("--calls", type=int, default=3, help="updates traced")
    actor_step.add_script_options(parser, "ppo")
    opts = parser.parse_args()
    algo, args, cfg, networks, state = actor_step.script_and_state(opts)
    learner = actor_step.Learner(algo, args, networks, state)
    learner()  # compiles
    learner()
    name = f"update_trace_{opts.algo}_{'nondet' if opts.no_deterministic_gpu else 'det'}"
    os.makedirs(opts.out, exist_ok=True)
    hlo_text = learner.update_fn.lower(learner.state, learner.batch, 1).compile().as_text()
    with gzip.open(os.path.join(opts.out, f"{name}.hlo.txt.gz"), "wt") as f:
        f.write(hlo_text)
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            start = time.perf_counter()
            for _ in range(opts.calls):
                learner()
            wall_s = time.perf_counter() - start
        [path] = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
        with gzip.open(path) as f:
            trace = json.load(f)
    events, found_on, lines_seen = device_events(trace)
    report = dict(
        **actor_step.what_ran(cfg.learner_devices[0], opts, args),
        batch_steps=cfg.batch_size,
        calls=opts.calls,
        events_found_on=found_on,
        summary=summarize(events, sources_of(hlo_text), opts.calls, wall_s),
        device_lines_seen=lines_seen,
        event_samples=events[:5],
    )
    with open(os.path.join(opts.out, f"{name}.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(opts.out, f"{name}.md"), "w") as f:
        f.write(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
