"""FP8 matrix products for the frozen base weights of a LoRA run (``performance.fp8_base_matmuls``).

Each frozen ``nn.Linear`` of the transformer's repeated blocks computes ``x @ W.T`` in float8
(e4m3) with one scale per row of each operand (``torch._scaled_mm``, Hopper and Ada GPUs), in the
forward and in the backward's input gradient; the LoRA adapters, norms and attention stay in bf16.

Why written here: torch's own float8 training recipes (torchao) re-quantize every weight at every
call and compute its gradient, because they train the weights. A LoRA base is frozen, so each weight
is quantized once, when this is applied, in the two layouts the forward (``W``, a scale per output
row) and the backward (``W.T``, a scale per input column) read, and no weight gradient is computed.
No activation is kept for the backward either: with the weight frozen, ``dX = dY @ W`` needs none.

Exactness: the rollout, the update and the KL reference all run these products, and each row of
``x`` (one token) is quantized with its own scale, independent of the batch it comes in, so the
importance ratio at the first update stays at 1 up to bf16 rounding. The model itself differs from
its bf16 self by the quantization (about 2⁻⁴ relative per element): a policy change of its own,
which is why the setting is off by default.

The quantized copies live beside the bf16 weights, which stay in place for checkpoints and exports.
They are derived once: a load into the weights (``load_state_dict``) or a device or dtype move
quantizes them again, but any other in-place write to a converted weight (peft's ``merge``,
diffusers' ``fuse_lora``) needs :meth:`Float8FrozenLinear.requantize` after it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["Float8FrozenLinear", "convert_frozen_linears", "fp8_problems", "fp8_supported"]

_FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(_FP8).max  # 448


def fp8_supported(device: torch.device) -> bool:
    """Whether ``device`` has float8 tensor cores (compute capability 8.9 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_problems(
    flag: str = "--model.init_args.performance",
    *,
    full_fine_tune: bool = False,
    rollout_merged_lora: bool = False,
    device: torch.device | None = None,
    sharded: bool = False,
) -> list[str]:
    """Every rule of ``fp8_base_matmuls`` (on), in one place: what the settings alone exclude (a full
    fine-tune, merged sampling), and, given the run's ``device`` and whether its strategy shards the
    weights (``sharded``), what the run cannot give. ``PerformanceSettings.problems`` asks the first
    part with the settings; the module's setup asks the second with the strategy."""
    p = []
    if full_fine_tune:
        p.append(
            f"{flag}.fp8_base_matmuls with a full fine-tune (--model.init_args.weights.lora=null): it converts the "
            "frozen linear layers, and a full fine-tune trains them all; set --model.init_args.weights.lora, or drop "
            "the setting"
        )
    if rollout_merged_lora:
        p.append(
            f"{flag}.fp8_base_matmuls and {flag}.rollout_merged_lora: the merged weights would bypass the "
            "float8 copies of the base; choose one"
        )
    if sharded:
        p.append(
            f"{flag}.fp8_base_matmuls keeps whole float8 copies of the frozen weights on every rank, which "
            "defeats --trainer.strategy=fsdp2: use ddp, or drop it"
        )
    elif device is not None and device.type == "cuda":
        if torch.torch_version.TorchVersion(torch.__version__) < (2, 5):
            p.append(
                f"{flag}.fp8_base_matmuls needs torch 2.5 or newer (a scale per row in torch._scaled_mm); "
                f"this is {torch.__version__}: upgrade torch or set it to false"
            )
        elif not fp8_supported(device):
            p.append(
                f"{flag}.fp8_base_matmuls needs float8 tensor cores (compute capability 8.9+: Ada, Hopper or "
                f"newer); {torch.cuda.get_device_name(device)} has none: set it to false"
            )
    return p


def _quantize_rows(t: Tensor) -> tuple[Tensor, Tensor]:
    """``t`` (…, K) as e4m3 and the per-row float32 scale that multiplies it back."""
    amax = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / _FP8_MAX
    q = (t.float() / scale).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8)
    return q, scale


def _scaled_mm(
    a: Tensor, scale_a: Tensor, b_t: Tensor, scale_b: Tensor, bias: Tensor | None, dtype: torch.dtype
) -> Tensor:
    """``(a·scale_a) @ (b_t·scale_b).T``: ``a`` (M, K) and ``b_t`` (N, K) row-major e4m3, scales (M, 1)
    and (N, 1). On a GPU without float8 tensor cores, or the CPU, the same quantized values are
    multiplied in float32 (the tests' path; no speed-up)."""
    if a.device.type == "cuda" and fp8_supported(a.device):
        fused = bias if dtype != torch.float32 else None  # _scaled_mm adds a bias to 16-bit outputs only
        out = torch._scaled_mm(
            a, b_t.t(), scale_a=scale_a, scale_b=scale_b.view(1, -1), bias=fused, out_dtype=dtype
        )
        return out if bias is None or fused is not None else out + bias
    with torch.autocast(a.device.type, enabled=False):
        out = (a.float() * scale_a) @ (b_t.float() * scale_b).t()
        if bias is not None:
            out = out + bias.float()
    return out.to(dtype)


class _Float8FrozenMatmul(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        w: Tensor,
        w_scale: Tensor,
        w_t: Tensor,
        w_t_scale: Tensor,
        bias: Tensor | None,
        dtype: torch.dtype,
    ) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(w_t, w_t_scale)
        ctx.dtype, ctx.x_dtype = dtype, x.dtype
        xq, x_scale = _quantize_rows(x)
        return _scaled_mm(xq, x_scale, w, w_scale, bias, dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        w_t, w_t_scale = ctx.saved_tensors
        gq, g_scale = _quantize_rows(grad.contiguous())
        dx = _scaled_mm(gq, g_scale, w_t, w_t_scale, None, ctx.dtype)
        return dx.to(ctx.x_dtype), None, None, None, None, None, None


class Float8FrozenLinear(nn.Linear):
    """An ``nn.Linear`` whose frozen weight multiplies in float8; ``weight`` and ``bias`` are the
    original parameters (same names, same storage).

    The e4m3 copies are plain attributes, neither parameters nor buffers: checkpoints, DDP's buffer
    broadcast (gloo cannot send float8) and FSDP never see them. ``.to()`` / ``.cuda()`` reach them
    through ``_apply``, which quantizes the moved or converted weight anew.
    """

    w_fp8: Tensor
    w_scale: Tensor
    w_t_fp8: Tensor
    w_t_scale: Tensor

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Float8FrozenLinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.requantize()
        new.register_load_state_dict_post_hook(lambda module, keys: module.requantize())
        return new

    @torch.no_grad()
    def requantize(self) -> None:
        """The e4m3 copies from the current ``weight`` (call after changing it in place)."""
        w = self.weight.detach()
        self.w_fp8, self.w_scale = _quantize_rows(w)
        w_t, self.w_t_scale = _quantize_rows(w.t())
        self.w_t_fp8 = w_t.contiguous()

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)
        self.requantize()
        return self

    def forward(self, x: Tensor) -> Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.weight.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        out = _Float8FrozenMatmul.apply(
            x.reshape(-1, x.shape[-1]).contiguous(),
            self.w_fp8,
            self.w_scale,
            self.w_t_fp8,
            self.w_t_scale,
            bias,
            dtype,
        )
        return out.view(*x.shape[:-1], self.out_features)


def convert_frozen_linears(blocks: list[nn.Module]) -> int:
    """Replace every frozen ``nn.Linear`` inside ``blocks`` (peft's ``base_layer`` under an adapter
    too) whose dimensions are multiples of 16 (the tensor cores' granularity) by a
    :class:`Float8FrozenLinear`; the modulation layers of adaptive norms (``norm*`` names: one row per
    image, nothing to gain) keep bf16. Returns how many were replaced."""
    replaced = 0
    for block in blocks:
        for parent_name, parent in list(block.named_modules()):
            if parent_name.split(".")[-1].startswith("norm"):
                continue
            for name, child in list(parent.named_children()):
                if (
                    type(child) is nn.Linear
                    and not child.weight.requires_grad
                    and (child.bias is None or not child.bias.requires_grad)  # no gradient reaches it
                    and child.in_features % 16 == 0
                    and child.out_features % 16 == 0
                ):
                    setattr(parent, name, Float8FrozenLinear.from_linear(child))
                    replaced += 1
    return replaced
