"""Loading helpers shared by the rewards built on Hugging Face models: settings checks, placement, CLIP
features, and checkpoint files read from a local path or a hub file ``org/repo/filename``."""

from __future__ import annotations

import os
import re
from typing import Any

import torch
from torch import Tensor, nn

from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.policies.base import DType, resolve_dtype

#: A file in a hub repository, ``org/repo/filename`` (what ``hf_hub_download`` fetches).
HUB_FILE = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+/.+$")


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


def source_problem(flag: str, source: str) -> str | None:
    """A message when ``source`` is neither a local file nor a hub file ``org/repo/filename``."""
    if os.path.isfile(source) or HUB_FILE.match(source):
        return None
    return f"{flag} ({source!r}) is neither an existing file nor a hub file 'org/repo/filename'"


def local_file(source: str) -> str:
    """The local path of ``source``: itself when it is a file, else the hub file ``org/repo/filename``
    downloaded (or found in the hub cache)."""
    if os.path.isfile(source):
        return source
    from huggingface_hub import hf_hub_download

    org, repo, filename = source.split("/", 2)
    return hf_hub_download(f"{org}/{repo}", filename)


def load_state(source: str, wrapper: str) -> dict[str, Tensor]:
    """A checkpoint's tensors: ``.safetensors`` or a torch file, local or a hub file ``org/repo/filename``;
    a torch file holding ``{wrapper: state_dict}`` is unwrapped."""
    source = local_file(source)
    if source.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(source)
    state = torch.load(source, map_location="cpu", weights_only=True)
    return state.get(wrapper, state)


def from_state_dict(
    cls: Any, config: Any, state: dict[str, Tensor], mismatch: str, **kwargs: Any
) -> nn.Module:
    """``cls.from_pretrained`` of a converted state dict on ``config``, refusing one that leaves a weight
    unset or holds one the model has no place for (``position_ids`` buffers aside) with a
    ``SettingsError`` that begins with ``mismatch``."""
    model, info = cls.from_pretrained(
        None, config=config, state_dict=state, output_loading_info=True, **kwargs
    )
    missing = [k for k in info["missing_keys"] if not k.endswith("position_ids")]
    if missing or info["unexpected_keys"]:
        raise SettingsError(
            f"{mismatch}: missing {missing[:3]}, unexpected {list(info['unexpected_keys'])[:3]}"
        )
    return model
