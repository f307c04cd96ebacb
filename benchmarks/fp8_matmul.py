"""Float8 against bf16 for the products of an SD3.5-Medium block, on one GPU (Hopper or Ada).

Times ``x @ W.T`` in bf16 (cuBLAS) and with both operands in e4m3 and a scale per row
(``torch._scaled_mm``, as ``lit_flowgrpo.fp8`` computes it), and the compiled row quantization on its
own, for the block's shapes at 16 images per forward: 16,384 image-token rows (K, N = 1536 or 6144)
and 5,328 text-token rows (333 × 16). Two runs on an H200 (torch 2.11), ms:

    rows × K × N          bf16           float8         quantize (standalone, compiled)
    16384 × 1536 × 1536   0.105 / 0.103  0.071 / 0.071  0.071 / 0.067
    16384 × 1536 × 6144   0.402 / 0.397  0.266 / 0.263  0.062 / 0.059
    16384 × 6144 × 1536   0.389 / 0.382  0.229 / 0.227  0.233 / 0.231
     5328 × 1536 × 1536   0.039 / 0.038  0.039 / 0.026  0.087 / 0.047

At 16k rows float8 is 1.45× to 1.7× faster; at 5k rows the two runs disagree (1.0× and 1.46×).
Inside a compiled block the quantization fuses with the op that produces its input, so the
standalone figure is an upper bound on its cost. ``lit_flowgrpo.fp8`` converts every frozen block
linear alike: a threshold on the rows (tokens × images) would make the rollout and the update, which
batch differently, compute one layer in different precisions.

    python benchmarks/fp8_matmul.py
"""

from __future__ import annotations

import torch

from lit_flowgrpo.fp8 import _quantize_rows, fp8_supported

SHAPES = [(16384, 1536, 1536), (16384, 1536, 6144), (16384, 6144, 1536), (5328, 1536, 1536)]


def _ms(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def _row(rows: int, k: int, n: int, quantize, device: torch.device) -> str:
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    xq, x_scale = _quantize_rows(x)
    wq, w_scale = _quantize_rows(w)
    bf16 = _ms(lambda: x @ w.t())
    fp8 = _ms(
        lambda: torch._scaled_mm(
            xq, wq.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), out_dtype=torch.bfloat16
        )
    )
    quant = _ms(lambda: quantize(x))
    flop = 2 * rows * k * n
    return f"{rows} × {k} × {n}: {bf16:.3f} ({flop / bf16 / 1e9:.0f}) | {fp8:.3f} ({flop / fp8 / 1e9:.0f}) | {quant:.3f}"


def main() -> None:
    device = torch.device("cuda")
    if not torch.cuda.is_available() or not fp8_supported(device):
        raise SystemExit("needs a GPU with float8 tensor cores (compute capability 8.9+)")
    quantize = torch.compile(_quantize_rows)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    print("rows × K × N: bf16 ms (TFLOP/s) | float8 ms (TFLOP/s) | quantize ms")
    for rows, k, n in SHAPES:
        print(_row(rows, k, n, quantize, device))


if __name__ == "__main__":
    main()
