"""Which ``scaled_dot_product_attention`` kernels a run lets PyTorch choose from.

``attention_backend: auto`` (:class:`~lit_flowgrpo.performance.PerformanceSettings`) is PyTorch's own
choice, which on Hopper GPUs is cuDNN's fused attention first, minus every kernel that is known to
fail at the run's attention shape on its GPU (:data:`KNOWN_FAULTS`). A kernel the user names is used
as named, with a warning if it is known to fail, or refused if it cannot run the shape at all (flash
attention and a padding mask: before any weight is read).

Why a table rather than a probe in the training process: the known fault returns NaN gradients or
ends in an illegal memory access, which kills the process's CUDA context, so it cannot be tried and
survived where training runs. ``benchmarks/attention_probe.py`` runs every kernel at every family's
shape in child processes, which is how the table below was measured; run it on a new GPU, driver or
PyTorch build to see whether the entries still hold there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["KNOWN_FAULTS", "AttentionShape", "KernelFault", "choose_kernels"]

KERNELS = ("cudnn", "flash", "efficient", "math")


@dataclass(frozen=True)
class AttentionShape:
    """The joint attention of one forward of a model family at the run's image size."""

    heads: int
    head_dim: int
    tokens: int
    """Text and image tokens attending together (the sequence length)."""
    masked: bool = False
    """Some forwards pass a padding mask (Qwen-Image's prompts of different lengths)."""


@dataclass(frozen=True)
class KernelFault:
    """A kernel known to compute a wrong backward, or crash, at some shapes on some GPUs."""

    kernel: str
    head_dim: int
    tokens: frozenset[int]
    capability: tuple[int, int]
    what: str

    def matches(self, kernel: str, shape: AttentionShape, capability: tuple[int, int] | None) -> bool:
        return (
            kernel == self.kernel
            and capability == self.capability
            and shape.head_dim == self.head_dim
            and shape.tokens in self.tokens
        )


KNOWN_FAULTS: tuple[KernelFault, ...] = (
    KernelFault(
        kernel="cudnn",
        head_dim=128,
        tokens=frozenset({1536}),
        capability=(9, 0),
        what=(
            "cuDNN's attention backward at head dim 128 and 1536 tokens (FLUX.1 at 512 px with 512 "
            "text tokens) returns NaN gradients, or ends in an illegal memory access, for a micro-batch "
            "of 1 or 2 on Hopper GPUs (measured on H100 and H200 with cuDNN 9.19, PyTorch 2.11; docs/scaling.md, "
            "'Attention kernels')"
        ),
    ),
)


def capability_of(device: Any) -> tuple[int, int] | None:
    """The CUDA compute capability of ``device``, or ``None`` off CUDA."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def choose_kernels(
    requested: str,
    shape: AttentionShape | None,
    capability: tuple[int, int] | None,
    flag: str = "--model.init_args.performance.attention_backend",
    faults: tuple[KernelFault, ...] = KNOWN_FAULTS,
) -> tuple[tuple[str, ...] | None, list[str], list[str]]:
    """The kernels to allow, and the warnings and errors for ``requested`` at ``shape``.

    Returns ``(kernels, warnings, errors)``: ``kernels`` is ``None`` for PyTorch's own choice among
    all of them, else the names PyTorch may choose from (in its order of preference; the math
    kernel is kept as the last resort, see :func:`sdpa_backends`).
    """
    warnings: list[str] = []
    errors: list[str] = []
    if requested not in ("auto", *KERNELS):
        return None, [], [f"{flag} ({requested}) must be auto, " + ", ".join(KERNELS)]
    known = (
        [] if shape is None else [f for f in faults if any(f.matches(k, shape, capability) for k in KERNELS)]
    )
    if requested == "auto":
        bad = {f.kernel for f in known}
        if not bad:
            return None, [], []
        return tuple(k for k in KERNELS if k not in bad), [], []
    if shape is not None and shape.masked and requested == "flash":
        errors.append(
            f"{flag}=flash cannot run this model's attention: its prompts are padded and masked, and "
            "PyTorch's flash kernel takes no mask; use auto, efficient or cudnn"
        )
    for fault in known:
        if fault.kernel == requested:
            warnings.append(
                f"{flag}={requested} at this model's attention ({shape.heads} heads × {shape.head_dim}, "
                f"{shape.tokens} tokens): {fault.what}. 'auto' avoids it"
            )
    return (requested,), warnings, errors


def sdpa_backends(kernels: tuple[str, ...]) -> list[Any]:
    """``torch.nn.attention.SDPBackend`` members for kernel names, the math kernel always among them.

    PyTorch's kernel switches (``sdpa_kernel``) are process-wide, not per thread: while a transformer
    forward runs with its kernels, a reward scoring on another thread (the rollout's overlapped
    scoring) sees the same switches. The math kernel runs any attention, so keeping it on means such
    a reward always finds a kernel (an fp32 CLIP cannot use cuDNN or flash). PyTorch prefers every
    fused kernel to it, so the transformer still gets the kernel asked for wherever that one can run.
    """
    from torch.nn.attention import SDPBackend

    members = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    return [members[k] for k in dict.fromkeys((*kernels, "math"))]
