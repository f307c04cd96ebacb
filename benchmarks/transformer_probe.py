"""The SD3.5-Medium-sized transformer alone on one GPU: where the compiled step's time goes.

Builds the transformer from the public config (random weights, bf16) with the benchmark's LoRA
(r32 on the attention projections, fp32 master weights computing in bf16) and
``PerformanceSettings`` applied, and times a no-grad forward (the rollout's work) and a
forward+backward into the adapters (the update's), per sample, for:

- ``lora``: compiled blocks, cuDNN attention, 16 samples per forward (8 images with CFG);
- ``no_lora``: the same without adapters (what the adapters cost);
- ``lora_batch32``: 32 samples per forward;
- ``lora_fp8``: + float8 base products.

It then writes a ``torch.profiler`` breakdown of one ``lora`` forward+backward by kernel family.

    python benchmarks/transformer_probe.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.throughput import SPECS
from lit_flowgrpo.performance import PerformanceSettings
from lit_flowgrpo.policies.sd3 import SD3Policy

PEAK = 989.4e12  # dense bf16, H100 SXM / H200


def build(lora: bool, performance: PerformanceSettings) -> torch.nn.Module:
    from diffusers import SD3Transformer2DModel
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig

    torch.manual_seed(0)
    with torch.device("cuda"):
        transformer = SD3Transformer2DModel(**SPECS["sd35m"]["transformer"]).to(torch.bfloat16)
    transformer.requires_grad_(False)
    if lora:
        targets = list(SD3Policy.default_lora_targets)
        transformer.add_adapter(
            LoraConfig(r=32, lora_alpha=64, init_lora_weights="gaussian", target_modules=targets)
        )
        cast_training_params(transformer, dtype=torch.float32)
    performance.apply(transformer)
    return transformer


def inputs(batch: int) -> dict:
    g = torch.Generator("cuda").manual_seed(1)
    bf16 = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    return dict(
        hidden_states=torch.randn(batch, 16, 64, 64, **bf16),
        encoder_hidden_states=torch.randn(batch, 333, 4096, **bf16),
        pooled_projections=torch.randn(batch, 2048, **bf16),
        timestep=torch.full((batch,), 500.0, device="cuda"),
        return_dict=False,
    )


def ms(fn, n: int = 5) -> float:
    for _ in range(2):  # the first call compiles
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def probe(name: str, batch: int, lora: bool, performance: PerformanceSettings, flops: float) -> dict:
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    transformer, x = build(lora, performance), inputs(batch)

    def forward() -> None:
        with torch.no_grad():
            transformer(**x)

    def forward_backward() -> None:
        transformer(**x)[0].float().square().mean().backward()

    transformer.eval()
    f = ms(forward) / batch
    result = dict(name=name, batch=batch, forward_ms_per_sample=f, mfu_forward=flops / (f / 1e3) / PEAK)
    if lora:
        transformer.train()
        fb = ms(forward_backward) / batch
        # the frozen base gets no weight gradient: the backward is one more forward's worth of products
        result.update(forward_backward_ms_per_sample=fb, mfu_forward_backward=2 * flops / (fb / 1e3) / PEAK)
    result["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    result["profile"] = breakdown(forward_backward) if name == "lora" else None
    print(json.dumps({k: v for k, v in result.items() if k != "profile"}), flush=True)
    return result


def breakdown(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        key = event.key.lower()
        family = (
            "attention"
            if any(w in key for w in ("fmha", "flash", "sdpa", "cudnn"))
            else "gemm"
            if any(w in key for w in ("gemm", "nvjet", "cutlass", "xmma", "sm90"))
            else "triton (fused elementwise, norms)"
            if "triton" in key
            else "other"
        )
        totals[family] = totals.get(family, 0.0) + event.device_time_total
    whole = sum(totals.values())
    return {k: round(v / whole, 3) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from torch.utils.flop_counter import FlopCounterMode

    plain = build(False, PerformanceSettings(compute_dtype="bfloat16"))  # FLOPs of one sample's forward
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        plain(**inputs(1))
    del plain
    flops = float(counter.get_total_flops())
    compiled = PerformanceSettings(compile_blocks=True, attention_backend="cudnn")
    runs = [
        probe("lora", 16, True, compiled, flops),
        probe("no_lora", 16, False, compiled, flops),
        probe("lora_batch32", 32, True, compiled, flops),
        probe(
            "lora_fp8",
            16,
            True,
            PerformanceSettings(compile_blocks=True, attention_backend="cudnn", fp8_base_matmuls=True),
            flops,
        ),
    ]
    name = torch.cuda.get_device_name().replace(" ", "_")
    out = Path(args.out) / f"{name}_transformer_probe.json"
    out.write_text(
        json.dumps(
            dict(device=name, torch=torch.__version__, flops_per_sample_forward=flops, runs=runs), indent=2
        )
        + "\n"
    )
    print(json.dumps(runs[0]["profile"]), flush=True)


if __name__ == "__main__":
    main()
