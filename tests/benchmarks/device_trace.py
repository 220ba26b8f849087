"""Where the learner's update spends the device's time: JAX's profiler around a few updates, the device's events summed
by the part of the network (or of the loss) that each computes, read from the optimised program's metadata; with
--actors, where the actors' rollouts do (the script's own actor threads, no learner).

    bash benchmark.sh gpu-profile --out results --raw-out results/raw   # on a GPU machine
    .venv/bin/python tests/benchmarks/device_trace.py --algo ppo --out /tmp/trace --calls 1 -- \\
        --local-num-envs 8 --num-steps 8 --num-actor-threads 1   # on a CPU

A script's defaults (PPO's by default, Breakout-v5), with XLA's deterministic GPU ops as the script sets them
(--no-deterministic-gpu: off). The update runs on a batch of the script's own actors, once untimed (it compiles), then
--calls times under the profiler. On a GPU the events are the CUDA kernels and copies on the device's streams (CUPTI);
on a CPU, XLA's operations on the host's threads (a loop's event, which holds its body's, is left out), which run side
by side: there a part's share is of the events' summed time, not of the wall time. Each event is named by its XLA
operation (a fusion, a cuDNN convolution; the innermost one a kernel's annotations name, else the kernel's own name);
the optimised HLO gives that operation's source: the flax module path (ResNet/Conv_3), the primitive
(conv_general_dilated) and the pass: forward (under jvp), backward (under transpose), or outside the gradient (the
advantages, the optimiser). Some operations have no source (XLA's CPU convolutions, YNN fusions): they are counted by
their kind. A third table sums the events by kernel (cuDNN runs a convolution as several: layout conversions, memsets,
the convolution). Written to --out: update_trace_<algo>_<det|nondet>.json (the summary, and a few raw events of each
line of the trace, to show its format) and .md (the tables); to --raw-out, if given, the optimised program (.hlo.txt.gz,
to read an operation in full) and the trace itself (.perfetto.json.gz, for ui.perfetto.dev). Exit status 1 when the
trace holds no event of the device (on a GPU: CUPTI missing).

--actors: the script's actor threads (its Actors, fed the first parameters, as throughput.py's actor_alone) collect a
rollout untimed (it compiles), then --calls rollouts each under the profiler: the tables are per rollout (every
thread's), their operations without a source (several small programs: the inference, the observations' processing),
and the first line adds the wall time and the device's busy time per actor step; set against the wall time, the busy
time says how much of an actor step is the device's work and how much the host's (EnvPool, Python, transfers' waits).
Written as actor_trace_<algo>_<det|nondet>.json and .md.
"""

import argparse
import collections
import glob
import gzip
import itertools
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time

import jax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import actor_step  # noqa: E402

# The optimised HLO text: a computation's first line, and an instruction with what it calls and its source, e.g.
#   %fused_computation.12 (param_0: f32[64,42,42,16]) -> f32[64,42,42,16] {
#   %fusion.12 = f32[64,42,42,16]{...} fusion(...), kind=kLoop, calls=%fused_computation.12, metadata={op_name="..."}
COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+) .*\{$")
INSTRUCTION = re.compile(r"^\s+(ROOT\s+)?%?([\w.\-]+) = ")
CALLS = re.compile(r"calls=%?([\w.\-]+)")
OP_NAME = re.compile(r"metadata=\{[^}]*?op_name=\"([^\"]*)\"")
CONTROL_FLOW = re.compile(r"\s(?:while|call|conditional)\(")  # on a CPU their events hold their bodies' events
MODULE_NAME = re.compile(r"^[A-Z]\w*$")  # flax's module names: ResNet, Conv_3, Dense_0, LayerNorm_1, LSTMCore_0
# The names of JAX's transformations and XLA's control flow in an op_name: not where in the program an operation is.
WRAPPERS = {"jit", "pmap", "_fun", "main", "closed_call", "eval_jaxpr", "while", "body", "cond", "vmap", "jvp"}
KEPT_ROWS = 80  # of each table, in the JSON


def normal(name: str) -> str:  # kernels are named after their operation with "_" for "." and "-": fusion_3, fusion.3
    return re.sub(r"\W", "_", name)


def parse_hlo(hlo_text: str) -> tuple[dict, set]:
    """(each instruction's name, normalised -> the op_name of its metadata (its JAX source), the control-flow
    instructions). A fusion without metadata takes that of its computation's root, else of the first instruction in it
    that has one."""
    sources, calls, inside, control_flow = {}, {}, {}, set()
    computation = None
    for line in hlo_text.splitlines():
        match = COMPUTATION.match(line)
        if match:
            computation = match.group(1)
            continue
        match = INSTRUCTION.match(line)
        if not match:
            continue
        is_root, name = match.groups()
        op_name = OP_NAME.search(line)
        if op_name:
            sources[normal(name)] = op_name.group(1)
            if is_root or computation not in inside:
                inside[computation] = op_name.group(1)
        called = CALLS.search(line)
        if called:
            calls[normal(name)] = called.group(1)
        if CONTROL_FLOW.search(line):
            control_flow.add(normal(name))
    for instruction, computation in calls.items():
        if instruction not in sources and computation in inside:
            sources[instruction] = inside[computation]
    return sources, control_flow


def part_of(op_name: str) -> tuple[str, str]:
    """(pass, part) of a JAX op_name: the flax module path and the primitive; outside any module, the last names of the
    path (the loss, the optimiser, the advantages). The pass: backward under transpose(...) (the transformation, not
    the primitive: the ResNet's input transpose is forward), forward under jvp(...), else outside the gradient."""
    names = [n.replace(".<locals>.", ".") for n in re.split(r"[/()]", op_name) if n]
    pass_name = "outside the gradient"
    if "transpose(" in op_name:
        pass_name = "backward"
    elif "jvp(" in op_name:
        pass_name = "forward"
    modules = [n for n in names if MODULE_NAME.match(n)]
    # A jitted helper's name says what a primitive is part of: relu's max is not the max-pool's (jit(main): the whole)
    helpers = [name for before, name in itertools.pairwise(names) if before == "jit" and name != "main"]
    primitive = "/".join(helpers[-1:] + names[-1:])
    if modules:
        return pass_name, "/".join(modules) + " " + primitive
    where = [n for n in names if n not in WRAPPERS][-3:] or names[-1:]
    return pass_name, "/".join(where)


def device_events(trace: dict, platform: str) -> tuple[list, str, dict]:
    """The events of the device's work, where they were found, and every line of the trace's device (or host) seen:
    its events, their ms and two of them raw, to check the choice against. On a GPU: the complete events on the lines
    of its streams (kernels, copies), not the lines derived from them (XLA Ops, XLA Modules) that repeat them; on a
    CPU: XLA's operations (events named by their hlo_op), which its runtime records on the host's threads."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
    }

    def row(e):  # a line of the trace viewer: process / thread
        return f"{processes.get(e['pid'], e['pid'])} / {threads.get((e['pid'], e['tid']), e['tid'])}"

    devices = {pid for pid, name in processes.items() if "/device:GPU" in name}
    complete = [e for e in events if e.get("ph") == "X" and (platform == "cpu" or e["pid"] in devices)]
    rows = collections.defaultdict(lambda: dict(events=0, ms=0.0, samples=[]))
    for e in complete:
        seen = rows[row(e)]
        seen["events"] += 1
        seen["ms"] += e.get("dur", 0) / 1000
        if len(seen["samples"]) < 2:
            seen["samples"].append(e)
    if platform == "cpu":
        ops = [e for e in complete if e.get("args", {}).get("hlo_op") == e.get("name")]
        return ops, "CPU: XLA's operations on the host's threads", dict(rows)
    streams = {name for name in rows if "stream" in name.split(" / ")[-1].lower()}
    if not streams:  # another naming of the lines: all but the derived ones
        streams = {name for name in rows if not re.search(r"XLA|Steps|Launch|Framework|Source", name)}
    return [e for e in complete if row(e) in streams], "GPU: " + (", ".join(sorted(streams)) or "none"), dict(rows)


def op_of(event: dict) -> str:
    """The XLA operation an event ran: its hlo_op argument; else the innermost hlo_op of its annotations (a kernel in
    a while loop is annotated with the loop, then with its own operation); else its name."""
    args = event.get("args", {})
    if "hlo_op" in args:
        return args["hlo_op"]
    named = [op for value in args.values() if isinstance(value, str) for op in re.findall(r"hlo_op=([\w.\-]+)", value)]
    return named[-1] if named else event["name"]


def kernel_name(name: str) -> str:
    """A CUDA kernel's name without its parameter list (its template arguments stay: they say what it converts)."""
    name = name.removeprefix("void ")
    depth = 0
    for i in range(len(name) - 1, 0, -1):  # the parameter list is the last balanced (...) at the end
        depth += {")": 1, "(": -1}.get(name[i], 0)
        if depth == 0:
            return name[:i].strip() if name.endswith(")") else name
    return name


def busy_ms(events: list) -> float:
    """The time in which at least one of the events ran: their intervals' union (streams and threads overlap)."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy / 1000


def summarize(events: list, sources: dict, control_flow: set, calls: int, wall_s: float) -> dict:
    """Per update, ms: the events' time by part of the program and by XLA operation, each with its share of their sum;
    the sum itself and the time the device was busy (the union); how many events and how many had no source."""
    events = [e for e in events if normal(op_of(e)) not in control_flow]
    by_part = collections.defaultdict(lambda: dict(ms=0.0, events=0))
    by_op = collections.defaultdict(lambda: dict(ms=0.0, events=0, kernel=None, part=None))
    # cuDNN runs a convolution as several kernels (layout conversions, memsets, the convolution): which ones cost
    by_kernel = collections.defaultdict(lambda: dict(ms=0.0, events=0))
    without_source = 0
    for e in events:
        op = op_of(e)
        source = sources.get(normal(op))
        without_source += source is None
        pass_name, part = part_of(source) if source else ("?", f"{op.split('.')[0]} (no source in the HLO)")
        ms = e.get("dur", 0) / 1000 / calls
        by_part[(pass_name, part)]["ms"] += ms
        by_part[(pass_name, part)]["events"] += 1
        by_op[op]["ms"] += ms
        by_op[op]["events"] += 1
        by_op[op]["kernel"] = by_op[op]["kernel"] or e["name"]
        by_op[op]["part"] = f"{pass_name}: {part}"
        by_kernel[kernel_name(e["name"])]["ms"] += ms
        by_kernel[kernel_name(e["name"])]["events"] += 1
    summed = sum(r["ms"] for r in by_part.values())
    share = 1 / summed if summed else 0.0
    parts = [
        {"pass": p, "part": part, "ms": r["ms"], "share": r["ms"] * share, "events_per_update": r["events"] / calls}
        for (p, part), r in by_part.items()
    ]
    ops = [dict(op=op, share=r["ms"] * share, **r) for op, r in by_op.items()]
    kernels = [dict(kernel=name, share=r["ms"] * share, **r) for name, r in by_kernel.items()]
    passes = collections.Counter()
    for r in parts:
        passes[r["pass"]] += r["ms"]
    return dict(
        wall_ms_per_update=1000 * wall_s / calls,
        summed_ms_per_update=summed,
        busy_ms_per_update=busy_ms(events) / calls,
        events_per_update=len(events) / calls,
        events_without_source=without_source,
        ms_by_pass=dict(passes),
        parts=sorted(parts, key=lambda r: -r["ms"])[:KEPT_ROWS],
        ops=sorted(ops, key=lambda r: -r["ms"])[:KEPT_ROWS],
        kernels=sorted(kernels, key=lambda r: -r["ms"])[:KEPT_ROWS],
    )


def markdown(report: dict, rows: int = 25) -> str:
    s = report["summary"]
    ops = "deterministic" if report["deterministic_gpu"] else "non-deterministic"
    passes = ", ".join(f"{name} {ms:.1f}" for name, ms in sorted(s["ms_by_pass"].items(), key=lambda kv: -kv[1]))
    wall, busy = s["wall_ms_per_update"], s["busy_ms_per_update"]
    events, without_source = s["events_per_update"], s["events_without_source"] / report["calls"]
    unit = "rollout" if report.get("traced") == "actors" else "update"
    what = f"update on {report['env_id']}, {report['batch_steps']:,} steps"
    per_step = ""
    if unit == "rollout":
        shape = f"{report['threads']} threads x {report['envs_per_thread']} envs x {report['num_steps']} steps"
        what = f"actors on {report['env_id']}, {shape} per rollout"
        step_wall, step_busy = wall / report["num_steps"], busy / report["num_steps"]
        per_step = f"; per actor step (every thread's): {step_wall:.2f} ms wall, the device busy {step_busy:.2f} ms"
    lines = [
        f"{report['device']}, {report['cores']} CPU cores, JAX {report['jax']}, {report['date']}; {report['algo']}'s "
        f"{what}, {ops} GPU ops; {report['calls']} {unit}s; XLA_FLAGS `{report['xla_flags']}`",
        "",
        f"Per {unit}: **{wall:.1f} ms** wall; the device busy {busy:.1f} ms ({busy / wall:.0%}); its events "
        f"{s['summed_ms_per_update']:.1f} ms in all, {events:,.0f} of them ({without_source:,.0f} without a source), "
        f"on {report['events_found_on']}; by pass, ms: {passes}{per_step}",
        "",
        f"| pass | part of the program | ms per {unit} | share | events per {unit} |",
        "|---|---|---|---|---|",
    ]
    for r in s["parts"][:rows]:
        lines.append(f"| {r['pass']} | {r['part']} | {r['ms']:.2f} | {r['share']:.1%} | {r['events_per_update']:.0f} |")
    lines += ["", f"| XLA operation | first kernel | part | ms per {unit} | share |", "|---|---|---|---|---|"]
    for r in s["ops"][:rows]:
        kernel = r["kernel"] if len(r["kernel"]) <= 60 else r["kernel"][:57] + "..."
        lines.append(f"| {r['op']} | `{kernel}` | {r['part']} | {r['ms']:.2f} | {r['share']:.1%} |")
    lines += ["", f"| kernel | ms per {unit} | share | events per {unit} |", "|---|---|---|---|"]
    for r in s["kernels"][:rows]:
        name = r["kernel"] if len(r["kernel"]) <= 100 else r["kernel"][:97] + "..."
        lines.append(f"| `{name}` | {r['ms']:.2f} | {r['share']:.1%} | {r['events'] / report['calls']:.0f} |")
    return "\n".join(lines) + "\n"


class Rollouts:
    """The script's actor threads as a callable (--actors): each call, a rollout of every thread with the first
    parameters, collected; nobody trains. close() stops the threads and raises the first thread's failure."""

    def __init__(self, algo, args, cfg, networks, params):
        self.actors = algo.Actors(args, cfg, networks, 0, threading.Event())
        self.params = params
        self.version = 0

    def __call__(self):
        self.version += 1
        self.actors.publish(self.params, self.version)
        self.actors.collect()

    def close(self):
        self.actors.stop.set()
        for thread, *_ in self.actors.threads:
            thread.join(timeout=30)
        if self.actors.failures:
            raise RuntimeError(self.actors.failures[0])


def positive(text: str) -> int:
    if int(text) < 1:
        raise argparse.ArgumentTypeError("at least 1")
    return int(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs/results/gpu", help="for update_trace_<algo>_<det|nondet>.json and .md")
    parser.add_argument("--raw-out", help="for the optimised program (.hlo.txt.gz) and the trace (.perfetto.json.gz)")
    parser.add_argument("--calls", type=positive, default=3, help="updates (or rollouts, with --actors) traced")
    parser.add_argument("--actors", action="store_true", help="trace the actors' rollouts, not the update")
    actor_step.add_script_options(parser, "ppo")
    opts = parser.parse_args()
    algo, args, cfg, networks, state = actor_step.script_and_state(opts)
    ops = "det" if actor_step.deterministic_gpu() else "nondet"
    if opts.actors:
        name, device, hlo_text = f"actor_trace_{opts.algo}_{ops}", cfg.actor_devices[0], ""
        work = Rollouts(algo, args, cfg, networks, state.params)
    else:
        name, device = f"update_trace_{opts.algo}_{ops}", cfg.learner_devices[0]
        work = actor_step.Learner(algo, args, networks, state)
        # Compiled once, for its text and to run: without determinism XLA autotunes each convolution as it compiles
        compiled = work.update_fn.lower(work.state, work.batch, 1).compile()
        hlo_text = compiled.as_text()
        work.update_fn = compiled
    for directory in filter(None, [opts.out, opts.raw_out]):
        os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory() as log_dir:
        try:
            work()  # the first call, untimed (the actors' programs compile in it)
            with jax.profiler.trace(log_dir, create_perfetto_trace=True):
                start = time.perf_counter()
                for _ in range(opts.calls):
                    work()
                wall_s = time.perf_counter() - start
        finally:
            if opts.actors:
                work.close()
        [path] = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
        if opts.raw_out:
            shutil.copyfile(path, os.path.join(opts.raw_out, f"{name}.perfetto.json.gz"))
        with gzip.open(path) as f:
            events, found_on, rows_seen = device_events(json.load(f), device.platform)
    if opts.raw_out and hlo_text:
        with gzip.open(os.path.join(opts.raw_out, f"{name}.hlo.txt.gz"), "wt") as f:
            f.write(hlo_text)
    report = dict(
        **actor_step.what_ran(device, opts, args),
        traced="actors" if opts.actors else "update",
        threads=args.num_actor_threads * len(cfg.actor_devices),
        envs_per_thread=args.local_num_envs,
        num_steps=args.num_steps,
        batch_steps=cfg.batch_size,
        calls=opts.calls,
        events_found_on=found_on,
        summary=summarize(events, *parse_hlo(hlo_text), opts.calls, wall_s),
        rows_seen=rows_seen,
    )
    with open(os.path.join(opts.out, f"{name}.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(opts.out, f"{name}.md"), "w") as f:
        f.write(markdown(report))
    print(markdown(report))
    if not events:
        print(f"device_trace.py: no event of the device in the trace ({found_on}); its lines: {list(rows_seen)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
