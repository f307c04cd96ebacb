"""Tolerances of tests that compare two computation orders, derived from the arithmetic.

Two computations of one value in another order (a batch against one row at a time, DDP against one
process, sharded against whole, chunked against whole, one forward against two) agree only up to
rounding, and by how much depends on the kernels: torch's CPU kernels block their sums by the SIMD
width they pick (``ATEN_CPU_CAPABILITY``: default, avx2, avx512) and by the shapes they are given, so a
bound measured on one machine fails on another. The bounds here come from the arithmetic instead:

- a sum of n terms, reordered, moves by at most about n·eps·Σ|terms| (Higham, *Accuracy and Stability
  of Numerical Algorithms*, §4.2); torch's own reductions sum pairwise (cascade), which makes that
  ⌈log₂ n⌉·eps for non-negative terms;
- a network: each layer that reduces (a matrix product, a convolution, attention, a normalisation)
  may round its output by about eps of its scale when its kernel orders its sums differently; along a
  path of d such layers the output moves by about d·eps times its scale.

The same computation in the same order (the same shapes through the same kernels, on the one intra-op
thread tests/conftest.py sets) gives the same bits on whatever machine runs both sides: tests that
compare such computations compare exactly, and these bounds are not for them.
"""

from __future__ import annotations

import math

import torch

EPS32 = torch.finfo(torch.float32).eps  # 2⁻²³: one unit in the last place of 1.0

_REDUCING = (
    torch.nn.Linear,
    torch.nn.Conv1d,
    torch.nn.Conv2d,
    torch.nn.Conv3d,
    torch.nn.ConvTranspose2d,
    torch.nn.ConvTranspose3d,
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.RMSNorm,
    torch.nn.MultiheadAttention,
)


def eps(dtype: torch.dtype = torch.float32) -> float:
    """One unit in the last place of 1.0 in ``dtype``."""
    return torch.finfo(dtype).eps


def depth(*networks: torch.nn.Module) -> int:
    """Layers of ``networks`` that reduce over a dimension: an upper bound on the reductions along any
    path through them.

    Matrix products and convolutions count as torch classes; normalisations and attentions also by
    the class-name endings the model libraries use (diffusers' ``RMSNorm`` and ``Attention``,
    transformers' ``T5LayerNorm``, ``Qwen2_5_VLAttention``, ...). An attention counts twice (the
    scores and the weighted sum), its projections once each as the ``Linear`` layers they are. Counting
    every layer rather than the longest path over-counts, which only loosens the bound.
    """
    count = 0
    for network in networks:
        for module in network.modules():
            name = type(module).__name__
            if isinstance(module, _REDUCING) or name.endswith("Norm"):
                count += 1
            if name.endswith("Attention") or isinstance(module, torch.nn.MultiheadAttention):
                count += 2
    return count


def network_atol(layers: int, magnitude: float, dtype: torch.dtype = torch.float32) -> float:
    """How far two orders of a network's computation may put an output of scale ``magnitude``:
    ``layers``·eps·magnitude (each reducing layer rounds by about eps of its scale)."""
    return layers * eps(dtype) * magnitude


def sum_rtol(terms: int, extra_ops: int = 0, dtype: torch.dtype = torch.float32) -> float:
    """Relative bound between two fp sums (or means) of the same ``terms`` non-negative values in other
    orders: each is within (⌈log₂ n⌉ + 1 + extra_ops)·eps of the exact sum when summed pairwise, as
    torch's reductions do; two of them within twice that."""
    return 2 * (math.ceil(math.log2(max(terms, 2))) + 1 + extra_ops) * eps(dtype)


def sampling_layers(network_layers: int, steps: int, guidance: float = 1.0) -> int:
    """Reducing layers on the path through a sampling loop of ``steps`` network forwards: each step's
    output feeds the next, and classifier-free guidance, (1 − g)·v_uncond + g·v_cond, scales each
    forward's rounding by |1 − g| + g."""
    return math.ceil(steps * (abs(1 - guidance) + guidance) * network_layers)


def image_mean_atol(
    network_layers: int, decoder_layers: int, *, steps: int, guidance: float, pixels: int
) -> float:
    """How far two orders may put a reward that is the mean of a sampled image's ``pixels`` values in
    [0, 1]: the sampling loop and the decoder, each reducing layer rounding by about eps of the
    image's scale (1), then the mean itself summed in another order."""
    layers = sampling_layers(network_layers, steps, guidance) + decoder_layers
    return network_atol(layers, 1.0) + sum_rtol(pixels)
