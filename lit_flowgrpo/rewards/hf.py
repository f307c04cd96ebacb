"""Loading helpers shared by the CLIP-based rewards (PickScore, CLIPScore, aesthetic)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.policies.base import DType, resolve_dtype


def check_dtype(dtype: str, flag: str) -> None:
    if dtype not in ("float32", "bfloat16", "float16"):
        raise SettingsError(f"{flag}.dtype ({dtype!r}) must be 'float32', 'bfloat16' or 'float16'")


def as_features(output: Tensor | object) -> Tensor:
    """The projected embedding from ``get_image_features`` / ``get_text_features``.

    transformers < 5 returns the tensor; transformers >= 5 returns a ``BaseModelOutputWithPooling``
    whose ``pooler_output`` holds it (the projection is applied there, modeling_clip.py).
    """
    if isinstance(output, Tensor):
        return output
    pooled = getattr(output, "pooler_output", None)
    if not isinstance(pooled, Tensor):
        raise TypeError(f"expected a tensor or an output with pooler_output, got {type(output).__name__}")
    return pooled


class CLIPFeatures(nn.Module):
    """A CLIP model whose ``get_*_features`` always return tensors.

    torchmetrics 1.9's ``clip_score`` calls ``.norm`` on what ``get_image_features`` returns, which
    breaks on transformers >= 5 (torchmetrics issue #3407, fixed upstream in PR #3408). Wrapping
    the model keeps using torchmetrics' implementation on both versions.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = model.config

    def get_image_features(self, *args: object, **kwargs: object) -> Tensor:
        return as_features(self.model.get_image_features(*args, **kwargs))

    def get_text_features(self, *args: object, **kwargs: object) -> Tensor:
        return as_features(self.model.get_text_features(*args, **kwargs))


def place(model: nn.Module, device: torch.device, dtype: DType) -> nn.Module:
    """Move a frozen scorer to ``device`` (no-op when already there), in ``dtype``."""
    target = resolve_dtype(dtype)
    param = next(model.parameters())
    if param.device != device or param.dtype != target:
        model.to(device=device, dtype=target)
    return model
