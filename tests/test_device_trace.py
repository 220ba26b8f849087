"""The GPU profile (benchmark.sh gpu-profile: tests/benchmarks/device_trace.py) reads a GPU's trace right. A GPU's
measurement is costly to repeat: what it brings back must be readable the first time. The trace below has the shape of
JAX's perfetto export of CUPTI's events (a process per device, a line per stream, lines derived from them, a kernel's
annotations naming the loop it runs in before its own operation), and the HLO that of an optimised update."""

import os
import sys

import pytest
from helpers import REPO

sys.path.insert(0, os.path.join(REPO, "tests", "benchmarks"))
import device_trace  # noqa: E402

PREFIX = 'metadata={op_name="pmap(update)/jit(main)/while/body/'
HLO = f"""HloModule pmap_update

%fused_computation.9 (param_0: f32[2]) -> f32[2] {{
  %param_0 = f32[2]{{0}} parameter(0)
  %negate.2 = f32[2]{{0}} negate(%param_0), {PREFIX}jvp(ResNet)/Conv_0/neg"}}
  ROOT %add.1 = f32[2]{{0}} add(%param_0, %negate.2), {PREFIX}transpose(jvp(ResNet))/Conv_2/add"}}
}}

%body.4 (state: (s32[], f32[2])) -> (s32[], f32[2]) {{
  %state = (s32[], f32[2]{{0}}) parameter(0)
  %x = f32[2]{{0}} get-tuple-element(%state), index=1
  %loop_add_fusion.3 = f32[2]{{0}} fusion(%x), kind=kLoop, calls=%fused_computation.3, {PREFIX}jvp(ResNet)/Conv_0/add"}}
  %custom-call.5 = (f32[2]{{0}}, u8[0]{{0}}) custom-call(%x), custom_call_target="__cudnn$convBackwardFilter", \
{PREFIX}transpose(jvp(ResNet))/Conv_1/conv_general_dilated"}}
  %fusion.9 = f32[2]{{0}} fusion(%x), kind=kLoop, calls=%fused_computation.9
  %transpose.7 = f32[2]{{0}} transpose(%x), dimensions={{0}}, {PREFIX}jvp(ResNet)/transpose"}}
  ROOT %tuple.1 = (s32[], f32[2]{{0}}) tuple(%x, %fusion.9)
}}

ENTRY %main.6 (x: f32[2]) -> f32[2] {{
  %x = f32[2]{{0}} parameter(0)
  %while.12 = (s32[], f32[2]{{0}}) while(%x), condition=%cond.4, body=%body.4
  ROOT %add.8 = f32[2]{{0}} add(%x, %x), metadata={{op_name="pmap(update)/jit(main)/adam/add"}}
}}
"""


def kernel(name, ts, dur, tid=7, **args):
    return {"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": args}


def metadata(kind, pid, name, tid=None):
    event = {"ph": "M", "name": kind, "pid": pid, "args": {"name": name}}
    return event if tid is None else {**event, "tid": tid}


TRACE = {
    "traceEvents": [
        metadata("process_name", 1, "/device:GPU:0"),
        metadata("process_name", 2, "/host:CPU"),
        metadata("thread_name", 1, "Stream #7(Compute)", tid=7),
        metadata("thread_name", 1, "Stream #9(MemcpyH2D)", tid=9),
        metadata("thread_name", 1, "XLA Ops", tid=8),
        # A kernel of a CUDA graph: only its name, that of its fusion with "_" for "."
        kernel("loop_add_fusion_3", 0, 100),
        kernel("void cudnn::convertTensor_kernel<float, __half>(float const*)", 100, 60, hlo_op="custom-call.5"),
        kernel("void sm90_xmma_wgrad_implicit_gemm<float>(Params)", 160, 240, hlo_op="custom-call.5"),
        # Inside the update's minibatch loop: the loop's annotation, then the kernel's own
        kernel("input_fusion", 400, 50, annotation="pmap_update:#hlo_op=while.12#::fusion.9:#hlo_op=fusion.9#"),
        kernel("transpose_7", 450, 20),
        kernel("MemcpyH2D", 0, 200, tid=9),  # beside the kernels, on a stream of its own
        kernel("fusion.3", 0, 470, tid=8),  # a derived line: the same time again
        {"ph": "X", "pid": 1, "tid": 7, "ts": 470, "name": "an event without a duration", "args": {}},
        {"ph": "X", "pid": 2, "tid": 1, "ts": 0, "dur": 999, "name": "a host event", "args": {}},
        kernel("add_8", 470, 10),
    ]
}


def test_a_gpu_trace_is_read_by_layer_and_pass():
    events, found_on, rows = device_trace.device_events(TRACE, "gpu")
    assert "Stream #7(Compute)" in found_on and "XLA Ops" not in found_on
    assert {"XLA Ops", "Stream #9(MemcpyH2D)"} <= {name.split(" / ")[1] for name in rows}
    summary = device_trace.summarize(events, *device_trace.parse_hlo(HLO), calls=2, wall_s=0.002)
    parts = {(r["pass"], r["part"]): r["ms"] for r in summary["parts"]}
    assert parts == pytest.approx(
        {
            ("forward", "ResNet/Conv_0 add"): 0.05,  # a kernel named after its fusion
            ("backward", "ResNet/Conv_1 conv_general_dilated"): 0.15,  # named by its hlo_op
            ("backward", "ResNet/Conv_2 add"): 0.025,  # in the loop: its own operation, the fusion's root's source
            ("forward", "ResNet transpose"): 0.01,  # the primitive transpose is not the backward pass
            ("?", "MemcpyH2D (no source in the HLO)"): 0.1,
            ("?", "an event without a duration (no source in the HLO)"): 0.0,
            ("outside the gradient", "update/adam/add"): 0.005,  # the optimiser, in the function update
        }
    )
    assert summary["summed_ms_per_update"] == pytest.approx(0.34)
    assert summary["busy_ms_per_update"] == pytest.approx(0.24)  # the copy ran beside the kernels: counted once
    assert summary["events_without_source"] == 2
    kernels = {r["kernel"]: r["ms"] for r in summary["kernels"]}  # a cuDNN convolution's kernels, without templates
    assert kernels["cudnn::convertTensor_kernel<float, __half>"] == pytest.approx(0.03)
    assert kernels["sm90_xmma_wgrad_implicit_gemm<float>"] == pytest.approx(0.12)
    ran = dict(device="NVIDIA H200", cores=16, jax="0.11.2", date="2026-11-27", algo="ppo", env_id="Breakout-v5")
    report = dict(ran, deterministic_gpu=True, xla_flags="--xla_gpu_deterministic_ops=true", batch_steps=16384)
    text = device_trace.markdown(dict(report, calls=2, events_found_on=found_on, summary=summary))
    assert "XLA_FLAGS `--xla_gpu_deterministic_ops=true`" in text.splitlines()[0]
    assert "| `cudnn::convertTensor_kernel<float, __half>` | 0.03 |" in text  # the third table: by kernel


def test_the_actors_trace_is_read_per_rollout_and_per_actor_step():  # device_trace.py --actors
    events, found_on, _ = device_trace.device_events(TRACE, "gpu")
    summary = device_trace.summarize(events, {}, set(), calls=2, wall_s=0.002)  # their programs' sources unread
    ran = dict(device="NVIDIA H200", cores=16, jax="0.11.2", date="2026-11-27", algo="impala", env_id="Breakout-v5")
    shape = dict(traced="actors", threads=2, envs_per_thread=64, num_steps=4, batch_steps=512)
    report = dict(ran, **shape, deterministic_gpu=True, xla_flags="", calls=2, events_found_on=found_on)
    lines = device_trace.markdown(dict(report, summary=summary)).splitlines()
    assert "impala's actors on Breakout-v5, 2 threads x 64 envs x 4 steps per rollout" in lines[0]
    assert lines[2].startswith("Per rollout: **1.0 ms** wall; the device busy 0.2 ms (24%)")
    assert lines[2].endswith("per actor step (every thread's): 0.25 ms wall, the device busy 0.06 ms")
    assert "| pass | part of the program | ms per rollout | share | events per rollout |" in lines


def test_a_jitted_helper_names_its_primitive():  # jax.nn.relu's max is not the max-pool's maximum
    assert device_trace.part_of("pmap(update)/jit(main)/jvp(ResNet)/jit(relu)/max") == ("forward", "ResNet relu/max")
    conv = "pmap(update)/jit(main)/transpose(jvp(ResNet))/Conv_1/conv_general_dilated"
    assert device_trace.part_of(conv) == ("backward", "ResNet/Conv_1 conv_general_dilated")


def test_a_trace_without_the_device_has_no_events():
    host_only = {"traceEvents": [e for e in TRACE["traceEvents"] if e["pid"] == 2]}
    events, found_on, _ = device_trace.device_events(host_only, "gpu")
    assert events == [] and found_on == "GPU: none"


def test_on_a_cpu_a_loop_is_not_counted_with_its_body():
    def op(name, dur):
        return {"ph": "X", "pid": 2, "tid": 1, "ts": 0, "dur": dur, "name": name, "args": {"hlo_op": name}}

    events, _, _ = device_trace.device_events({"traceEvents": [op("while.12", 500), op("fusion.9", 40)]}, "cpu")
    summary = device_trace.summarize(events, *device_trace.parse_hlo(HLO), calls=1, wall_s=0.001)
    assert [(r["part"], r["ms"]) for r in summary["parts"]] == [("ResNet/Conv_2 add", 0.04)]
