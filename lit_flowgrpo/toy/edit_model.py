"""The toy editing model: the shapes world's U-Net given the source image beside the noisy one.

The network is the text-to-image toy's (:mod:`lit_flowgrpo.toy.model`: diffusers'
``UNet2DConditionModel`` in pixel space, cross-attention to a tiny text encoder, the pooled
instruction added to the time embedding, two coordinate channels) with three more input channels:
the source image in [-1, 1], concatenated to the noisy image as InstructPix2Pix conditions its U-Net
(Brooks et al. 2023, §3.2: the encoded source is concatenated to ``z_t`` before the first
convolution). Here there is no VAE, so the source pixels are concatenated directly, and the network is
trained from scratch on editing pairs (InstructPix2Pix zero-initialises the new input channels of a
pretrained U-Net instead). The text encoder knows the instructions' words (:data:`~lit_flowgrpo.toy.edit_world.EDIT_VOCAB`).

Both networks travel in one safetensors file as the image toy's do, with their own ``format``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib import resources
from typing import Any

import torch
from diffusers import UNet2DConditionModel
from torch import Tensor, nn

from lit_flowgrpo.toy import model as image_model
from lit_flowgrpo.toy.edit_world import EDIT_VOCAB, edit_words

EDIT_CHECKPOINT_FORMAT = "lit_flowgrpo.toy_edit_base/1"
"""The ``format`` metadata value of a toy editing checkpoint."""

EDIT_PRETRAIN_COMMAND = "lit-flowgrpo fit --config configs/toy_edit_pretrain.yaml"
"""The command that (re)creates the shipped editing checkpoint."""

EDIT_REGENERATE_HINT = (
    f"regenerate it with `{EDIT_PRETRAIN_COMMAND}` (it writes "
    "lit_flowgrpo/toy/assets/toy_edit_base.safetensors; minutes on a GPU), or restore the shipped file "
    "with `git checkout -- lit_flowgrpo/toy/assets/toy_edit_base.safetensors`"
)

SOURCE_CHANNELS = 3
"""Input channels the source image adds (RGB)."""


def default_edit_checkpoint() -> str:
    """Path of the editing base checkpoint shipped inside the package."""
    return str(resources.files("lit_flowgrpo.toy") / "assets" / "toy_edit_base.safetensors")


class EditTextEncoder(image_model.ToyTextEncoder):
    """The image toy's text encoder over the editing world's vocabulary (:data:`EDIT_VOCAB`)."""

    regenerate_hint = EDIT_REGENERATE_HINT

    def words(self, prompt: str) -> list[str]:
        return edit_words(prompt)


def edit_unet_config(config: image_model.ToyModelConfig) -> dict[str, Any]:
    """The ``UNet2DConditionModel`` keyword arguments: the image toy's with the source's channels added."""
    return image_model.unet_config(config) | {"in_channels": 3 + SOURCE_CHANNELS + 2}


def build_edit_models(config: image_model.ToyModelConfig) -> tuple[UNet2DConditionModel, EditTextEncoder]:
    """A freshly initialised editing U-Net and text encoder over the editing world's vocabulary."""
    problems = config.problems()
    if problems:
        raise ValueError("; ".join(problems))
    unet = UNet2DConditionModel(**edit_unet_config(config))
    text_encoder = EditTextEncoder(
        EDIT_VOCAB, config.text_dim, config.text_layers, config.text_heads, config.max_length
    )
    return unet, text_encoder


def predict_edit_velocity(
    unet: nn.Module, latents: Tensor, sigma: Tensor, embeds: Mapping[str, Tensor]
) -> Tensor:
    """The U-Net's velocity v = ε − x0 (B, 3, H, W) for noisy images (B, 3, H, W) at σ (B,), given
    ``embeds["source"]`` (B, 3, H, W) in [-1, 1] and the instruction's text states."""
    dtype = image_model.input_dtype(unet, latents.dtype)  # the norms' dtype, as the image toy
    b, _, h, w = latents.shape
    source = embeds["source"]
    if source.shape != latents.shape:
        raise ValueError(
            f"the source image {tuple(source.shape[1:])} must be the size of the output {tuple(latents.shape[1:])}"
        )
    coords = image_model.coordinate_channels(h, w, latents.device, dtype).expand(b, -1, -1, -1)
    sample = torch.cat([latents.to(dtype), source.to(latents.device, dtype), coords], dim=1)
    return unet(
        sample,
        sigma.to(latents.device, torch.float32) * 1000.0,
        encoder_hidden_states=embeds["text_hidden"].to(dtype),
        encoder_attention_mask=embeds["text_mask"],
        class_labels=embeds["text_pooled"].to(dtype),
    ).sample


def save_edit_checkpoint(
    path: str,
    unet: UNet2DConditionModel,
    text_encoder: EditTextEncoder,
    *,
    dtype: torch.dtype = torch.float16,
    info: Mapping[str, str] | None = None,
) -> None:
    """Write both networks to one safetensors file (:func:`lit_flowgrpo.toy.model.save_checkpoint`)."""
    image_model.save_checkpoint(
        path, unet, text_encoder, dtype=dtype, info=info, checkpoint_format=EDIT_CHECKPOINT_FORMAT
    )


def read_edit_checkpoint_metadata(path: str) -> dict[str, str]:
    """The metadata of a toy editing checkpoint, validated (raises ``ValueError`` naming the fix)."""
    return image_model.read_checkpoint_metadata(
        path, checkpoint_format=EDIT_CHECKPOINT_FORMAT, hint=EDIT_REGENERATE_HINT
    )


def load_edit_checkpoint(
    path: str, *, dtype: torch.dtype = torch.float32
) -> tuple[UNet2DConditionModel, EditTextEncoder, dict[str, str]]:
    """Both networks from a file written by :func:`save_edit_checkpoint`, plus its metadata."""
    unet, text_encoder, metadata = image_model.load_checkpoint(
        os.path.expanduser(path),
        dtype=dtype,
        checkpoint_format=EDIT_CHECKPOINT_FORMAT,
        text_encoder_class=EditTextEncoder,
        hint=EDIT_REGENERATE_HINT,
    )
    return unet, text_encoder, metadata  # type: ignore[return-value]


def trained_size(metadata: Mapping[str, str]) -> int:
    """The image side an editing checkpoint was trained at, from its metadata."""
    import json

    return int(json.loads(metadata["unet_config"])["sample_size"])
