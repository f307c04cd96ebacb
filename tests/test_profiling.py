"""benchmarks/profiling.py: the profile summary's arithmetic on hand-made GPU traces (two streams, NCCL
kernels partly under compute; a step's parts on the host's and the GPU's timelines), the kernel
categories of real kernel names, and the whole path on a real CPU trace of torch.profiler."""

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
            torch.profiler.record_function(profiling.STEP_RANGE),
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
    parts = s["parts"]  # the host's ranges: operators on the CPU's timeline
    assert parts["step"]["ranges"] == parts["update"]["ranges"] == 1 and parts["rollout"] is None
    assert parts["step"]["by_category_ms"]["gemm"] > 0 and parts["update"]["by_category_ms"]["nccl"] > 0
    assert 0 < parts["update"]["gpu_busy_fraction"] <= 1


# Kernel names as the profiler records them on H100/H200 (cuBLAS, cuDNN, PyTorch's own, inductor's
# Triton kernels) and CPU operators, with the category each must fall in.
NAMED_KERNELS = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas": "gemm",
    "nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT": "gemm",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn_align8>(...)": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, false>(...)": "gemm",
    "triton_tem_fused_addmm_0": "gemm",  # an inductor matmul template (max-autotune)
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7_64x128x64_4x1x1_kernel0_0": "attention",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t>>(...)": "attention",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t>::Params)": "attention",
    "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_warpgroupsize1x1x1": "conv",
    "void cutlass__5x_cudnn::Kernel<cutlass__5x_cudnn::conv::kernel::ImplicitGemmConvolution<...>>(...)": "conv",
    "triton_poi_fused__to_copy_add_mul_0": "triton",
    "triton_red_fused_native_layer_norm_1": "triton",
    "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_2": "triton",
    "triton_poi_fused_addmm_gelu_3": "triton",  # addmm's pointwise epilogue, not a product
    "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float>>(...)": "elementwise",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float>>>(...)": "elementwise",
    "void at::native::(anonymous namespace)::upsample_bilinear2d_out_frame<float, float>(...)": "elementwise",
    "void cudnn::ops::nchwToNhwcKernel<__nv_bfloat16, __nv_bfloat16, float, false, true>(...)": "elementwise",
    "Memcpy DtoD (Device -> Device)": "memcpy",
    "Memset (Device)": "memcpy",
    AR: "nccl",
    "aten::mm": "gemm",
    "aten::addmm": "gemm",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::convolution": "conv",
    "aten::add_": "elementwise",
}  # fmt: skip


@pytest.mark.parametrize("name", list(NAMED_KERNELS))
def test_kernel_categories(name: str) -> None:
    assert profiling.kernel_category(name) == NAMED_KERNELS[name]


def test_parts_of_a_step() -> None:
    """A step range of [0, 400) on the host; on the GPU a rollout [0, 100) (its decode [60, 100)) and
    an update [150, 200), a copy [210, 220) outside both, idle GPU elsewhere."""
    events = [
        kernel(GEMM, 7, 0, 60),
        kernel("triton_poi_fused_add_0", 7, 70, 10),
        kernel("triton_poi_fused_add_0", 7, 90, 10),
        kernel("flash_fwd_kernel", 7, 150, 40),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 210, "dur": 10,
         "args": {"stream": 7}},
        {"ph": "X", "cat": "user_annotation", "name": profiling.STEP_RANGE, "ts": 0, "dur": 400},
        # the host's ranges run ahead of the GPU's: the parts are measured on the GPU's
        {"ph": "X", "cat": "user_annotation", "name": profiling.ROLLOUT_RANGE, "ts": 0, "dur": 30},
        {"ph": "X", "cat": "gpu_user_annotation", "name": profiling.ROLLOUT_RANGE, "ts": 0, "dur": 100},
        {"ph": "X", "cat": "gpu_user_annotation", "name": profiling.DECODE_RANGE, "ts": 60, "dur": 40},
        {"ph": "X", "cat": "gpu_user_annotation", "name": profiling.UPDATE_RANGE, "ts": 150, "dur": 50},
    ]  # fmt: skip
    parts = profiling.summarise_trace({"traceEvents": events})["parts"]
    step = parts["step"]
    assert step["window_ms"] == pytest.approx(0.4) and step["gpu_busy_ms"] == pytest.approx(0.13)
    assert step["gpu_busy_fraction"] == pytest.approx(0.13 / 0.4)
    assert step["by_category_ms"] == pytest.approx(
        {
            "gemm": 0.06,
            "attention": 0.04,
            "conv": 0,
            "triton": 0.02,
            "elementwise": 0,
            "memcpy": 0.01,
            "nccl": 0,
        }
    )
    assert step["by_category_fraction"]["gemm"] == pytest.approx(0.06 / 0.13)
    assert step["top_kernels"][0] == {
        "name": GEMM, "category": "gemm", "count": 1, "total_ms": pytest.approx(0.06), "mean_us": 60.0
    }  # fmt: skip
    triton = next(r for r in step["top_kernels"] if r["category"] == "triton")
    assert (triton["count"], triton["mean_us"]) == (2, 10.0)
    rollout, decode, update = parts["rollout"], parts["decode"], parts["update"]
    assert rollout["window_ms"] == pytest.approx(0.1) and rollout["gpu_busy_fraction"] == pytest.approx(0.8)
    assert decode["by_category_ms"]["triton"] == pytest.approx(0.02) and decode["by_category_ms"]["gemm"] == 0
    assert decode["gpu_busy_fraction"] == pytest.approx(0.5)
    assert update["by_category_ms"]["attention"] == pytest.approx(0.04) and update["ranges"] == 1
    text = profiling.format_summary(profiling.summarise_trace({"traceEvents": events}), "rank 0")
    assert "== part decode (1 range(s), GPU's timeline)" in text and "idle 67.5%" in text


def test_a_trace_without_ranges_is_one_part() -> None:
    parts = profiling.summarise_trace(synthetic_trace())["parts"]
    assert parts["rollout"] is None and parts["decode"] is None and parts["update"]["ranges"] == 1
    assert parts["step"]["ranges"] == 0 and parts["step"]["window_ms"] == pytest.approx(0.310)
    assert parts["step"]["by_category_ms"]["nccl"] == pytest.approx(0.08)


def test_thin_products_by_recorded_shape() -> None:
    """Kernels linked to their operators' shapes: a LoRA pair (4096x32 down, 32-deep up) is thin, the
    base product is not, a kernel with no operator (a CUDA graph's replay) is left out."""

    def op(name: str, ext: int, dims: list, ts: float) -> dict:
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": 1,
                "args": {"External id": ext, "Input Dims": dims}}  # fmt: skip

    def linked(name: str, ext: int, ts: float, dur: float) -> dict:
        return dict(kernel(name, 7, ts, dur), args={"stream": 7, "External id": ext})

    events = [
        op("aten::addmm", 1, [[1536], [4096, 1536], [1536, 1536], [], []], 0),
        op("aten::mm", 2, [[4096, 1536], [1536, 32]], 10),
        op("aten::mm", 3, [[4096, 32], [32, 1536]], 20),
        op("aten::linear", 4, [[4096, 1536], [32, 1536]], 30),  # not a product operator itself
        linked(GEMM, 1, 0, 50),
        linked("nvjet_small", 2, 50, 6),
        linked("nvjet_small", 3, 56, 4),
        kernel(GEMM, 7, 60, 30),  # replayed: no operator, no shape
        {"ph": "X", "cat": "gpu_user_annotation", "name": profiling.UPDATE_RANGE, "ts": 52, "dur": 40},
    ]
    shapes = profiling.matmul_shapes({"traceEvents": events})
    assert shapes == {1: (4096, 1536, 1536), 2: (4096, 32, 1536), 3: (4096, 1536, 32)}
    parts = profiling.summarise_trace({"traceEvents": events})["parts"]
    thin = parts["step"]["thin_products"]
    assert (thin["kernels"], thin["total_ms"], thin["matmul_ms"]) == (
        2,
        pytest.approx(0.01),
        pytest.approx(0.06),
    )
    assert thin["shapes"][0] == {"m": 4096, "n": 32, "k": 1536, "count": 1, "total_ms": pytest.approx(0.006)}
    update = parts["update"]["thin_products"]  # kernels starting in [52, 92): the up projection only
    assert update["kernels"] == 1 and update["share_of_matmuls"] == 1.0
    text = profiling.format_summary(profiling.summarise_trace({"traceEvents": events}), "rank 0")
    assert "thin matrix products (N or K <= 64: LoRA's adapters): 2 kernels" in text
    assert "thin_products" not in profiling.summarise_trace(synthetic_trace())["parts"]["step"]


def test_thin_products_of_a_real_cpu_trace(tmp_path: Path) -> None:
    """torch.profiler with shapes, on a LoRA-shaped pair beside a base layer (the CPU operators)."""
    base, down, up = (
        torch.nn.Linear(256, 256),
        torch.nn.Linear(256, 8, bias=False),
        torch.nn.Linear(8, 256, bias=False),
    )
    x = torch.randn(512, 256)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        base(x) + up(down(x))
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    thin = profiling.write_summary(tmp_path / "trace.json", tmp_path / "summary", "cpu")["parts"]["step"][
        "thin_products"
    ]
    assert thin["kernels"] == 2 and 0 < thin["share_of_matmuls"] < 1
    assert {(r["m"], r["n"], r["k"]) for r in thin["shapes"]} == {(512, 8, 256), (512, 256, 8)}
