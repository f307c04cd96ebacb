"""benchmarks/profiling.py: the profile summary's arithmetic on a hand-made GPU trace (two streams, NCCL
kernels partly under compute), and the whole path on a real CPU trace of torch.profiler."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "profiling.py"
spec = importlib.util.spec_from_file_location("profiling", PATH)
profiling = importlib.util.module_from_spec(spec)
sys.modules["profiling"] = profiling
spec.loader.exec_module(profiling)


def kernel(name: str, stream: int, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"stream": stream, "device": 0}}  # fmt: skip


GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32"
AG = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
RS = "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
AR = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def synthetic_trace() -> dict:
    """Compute on stream 7 over [0, 100) and [150, 200); an all-gather on stream 20 over [90, 130)
    (10 of its 40 µs under compute), a reduce-scatter over [160, 190) (all of it under compute) and an
    all-reduce over [300, 310) (none); the update range covers [140, 320)."""
    events = [
        kernel(GEMM, 7, 0, 60),
        kernel("flash_fwd_kernel", 7, 60, 40),
        kernel(GEMM, 7, 150, 50),
        kernel(AG, 20, 90, 40),
        kernel(RS, 21, 160, 30),
        kernel(AR, 21, 300, 10),
        {"ph": "X", "cat": "gpu_user_annotation", "name": profiling.UPDATE_RANGE, "ts": 140, "dur": 180},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 1, "ts": 0, "dur": 5},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 3},
    ]
    return {"traceEvents": events}


def test_summary_of_a_two_stream_trace() -> None:
    s = profiling.summarise_trace(synthetic_trace())
    assert s["source"] == "kernel" and s["update_ranges"] == 1
    whole = s["whole"]
    assert whole["window_ms"] == pytest.approx(0.310)
    assert whole["compute_ms"] == pytest.approx(0.150)
    assert whole["comm_ms"] == pytest.approx(0.080)
    assert whole["comm_by_kind_ms"] == pytest.approx(
        {"all_gather": 0.04, "all_reduce": 0.01, "reduce_scatter": 0.03}
    )
    assert whole["comm_overlapped_ms"] == pytest.approx(
        0.040
    )  # 10 of the all-gather, all 30 of the reduce-scatter
    assert whole["comm_exposed_ms"] == pytest.approx(0.040)
    assert whole["comm_overlapped_fraction"] == pytest.approx(0.5)
    assert whole["busy_ms"] == pytest.approx(0.150 + 0.030 + 0.010)  # [0, 130) [150, 200) [300, 310)
    assert whole["top"][0] == {"name": GEMM, "total_ms": pytest.approx(0.110), "count": 2}
    update = s["update"]  # [140, 320): the second GEMM, the reduce-scatter and the all-reduce
    assert update["window_ms"] == pytest.approx(0.180)
    assert update["comm_by_kind_ms"] == pytest.approx({"all_reduce": 0.01, "reduce_scatter": 0.03})
    assert update["comm_overlapped_fraction"] == pytest.approx(0.75)
    text = profiling.format_summary(s, "rank 0")
    assert "all_gather 0.0" in text and "overlapped with compute" in text and GEMM in text


def test_interval_clipping_and_unions() -> None:
    intervals = [profiling.Interval("a", "7", 0, 10), profiling.Interval("b", "7", 20, 10)]
    s = profiling.summarise(intervals, [(5, 25)])
    assert s["compute_ms"] == pytest.approx(0.010)  # [5, 10) and [20, 25)
    assert s["comm_overlapped_fraction"] is None and s["idle_fraction"] == pytest.approx(0.5)
    assert profiling.summarise([])["window_ms"] == 0.0


def test_summary_of_a_real_cpu_trace(tmp_path: Path) -> None:
    """torch.profiler's own trace of a tiny forward/backward with an update range and a gloo all-reduce:
    read back, the CPU operators are summarised (no GPU here) and the collective is counted."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        layer = torch.nn.Linear(64, 64)
        with (
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
            torch.profiler.record_function(profiling.UPDATE_RANGE),
        ):
            layer(torch.randn(32, 64)).square().mean().backward()
            dist.all_reduce(layer.weight.grad)
        prof.export_chrome_trace(str(tmp_path / "trace.json"))
    finally:
        dist.destroy_process_group()
    s = profiling.write_summary(tmp_path / "trace.json", tmp_path / "summary", "cpu")
    assert s["source"] == "cpu_op" and s["update_ranges"] == 1
    names = {row["name"] for row in s["whole"]["top"]}
    assert "aten::linear" in names or "aten::addmm" in names
    assert s["update"]["comm_ms"] > 0 and "all_reduce" in s["update"]["comm_by_kind_ms"]
    assert json.loads((tmp_path / "summary.json").read_text()) == s
    assert (tmp_path / "summary.txt").read_text().startswith("== cpu: CPU operators")
