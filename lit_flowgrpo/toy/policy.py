"""The toy policy: the tiny pixel-space text-to-image model of the shapes world.

It implements the same :class:`~lit_flowgrpo.policies.base.FlowPolicy` interface as the SD3 policy,
so the RL loop runs the very code path real models use. Latents ARE the pixels, (3, H, W) in
[-1, 1]; there is no VAE. The checkpoint (U-Net + text encoder in one safetensors file) is made by
``lit-flowgrpo fit --config configs/toy_pretrain.yaml``; the default is the one shipped inside the
package, so the quickstart needs no download.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from diffusers import UNet2DConditionModel
from torch import Tensor, nn

from lit_flowgrpo.policies.base import (
    HEIGHT_FLAG,
    WIDTH_FLAG,
    DType,
    Embeds,
    FlowPolicy,
    PromptCache,
    cat_embeds,
    resolve_dtype,
)
from lit_flowgrpo.toy.model import (
    REGENERATE_HINT,
    ToyTextEncoder,
    default_checkpoint,
    load_checkpoint,
    predict_velocity,
)

_FLAG = "--model.init_args.policy.init_args"


class ToyPolicy(FlowPolicy):
    """The toy U-Net and its text encoder behind the policy interface.

    Args:
        pretrained: a toy checkpoint (``.safetensors``) written by the toy pretraining; ``None``
            uses the one shipped in the package.
        dtype: dtype of both networks. Velocities are returned in fp32 whatever it is.
        shift: SD3's timestep shift of the sampling sigmas, σ' = s·σ / (1 + (s − 1)·σ); 1 keeps the
            plain linear schedule.
    """

    # peft target_modules (suffix match): the attention projections and the ResNet convolutions
    # of every U-Net block, so a LoRA can change both what the image attends to and how it draws.
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "conv1", "conv2")
    uses_cfg_batch = True
    image_size_multiple = 4
    image_size_reason = (
        "the shipped U-Net halves the resolution at 2 of its 3 levels; it was trained at 32x32"
    )

    def __init__(self, pretrained: str | None = None, dtype: DType = "float32", shift: float = 1.0) -> None:
        super().__init__()
        self.pretrained = pretrained
        self.dtype_name = dtype
        self.shift = shift
        self.unet: UNet2DConditionModel | None = None
        self.text_encoder: ToyTextEncoder | None = None
        # The world has a few thousand short prompts: all of them stay cached.
        self._cache = PromptCache(size=1 << 20)

    @property
    def checkpoint_path(self) -> str:
        return default_checkpoint() if self.pretrained is None else os.path.expanduser(self.pretrained)

    def problems(self) -> list[str]:
        out = []
        if self.dtype_name not in ("float32", "bfloat16", "float16"):
            out.append(f"{_FLAG}.dtype ({self.dtype_name!r}) must be one of 'float32', 'bfloat16', 'float16'")
        if not self.shift > 0:
            out.append(f"{_FLAG}.shift ({self.shift}) must be positive (1 = no shift)")
        if self.pretrained is not None and not os.path.isfile(self.checkpoint_path):
            out.append(
                f"{_FLAG}.pretrained ({self.pretrained}) is not a file: give a toy checkpoint "
                f"(.safetensors) or leave it unset for the shipped one"
            )
        elif self.pretrained is None and not os.path.isfile(self.checkpoint_path):
            out.append(f"the shipped toy checkpoint {self.checkpoint_path} is missing: {REGENERATE_HINT}")
        return out

    def load(self) -> None:
        """Read the checkpoint; the text encoder is frozen, the U-Net stays trainable."""
        if self.unet is not None:
            return
        found = self.problems()
        if found:
            raise ValueError("; ".join(found))
        unet, text_encoder, _ = load_checkpoint(self.checkpoint_path, dtype=resolve_dtype(self.dtype_name))
        text_encoder.requires_grad_(False).eval()
        unet.requires_grad_(True)
        self.unet, self.text_encoder = unet, text_encoder
        self._cache.clear()

    @property
    def transformer(self) -> nn.Module:
        return self._loaded()[0]

    def _loaded(self) -> tuple[UNet2DConditionModel, ToyTextEncoder]:
        if self.unet is None or self.text_encoder is None:
            raise RuntimeError("ToyPolicy.load() must run before the policy is used")
        return self.unet, self.text_encoder

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> Embeds:
        """``text_hidden`` (B, L, D), ``text_mask`` (B, L) bool, ``text_pooled`` (B, D).

        Each unique prompt is encoded once and cached (the text encoder is frozen).

        Raises:
            ValueError: a prompt has words outside the toy world's vocabulary (all are listed).
        """
        _, text_encoder = self._loaded()
        device = text_encoder.token_embedding.weight.device

        def encode_one(prompt: str) -> dict[str, Tensor]:
            ids, mask = text_encoder.tokenize([prompt])
            hidden, pooled = text_encoder(ids.to(device), mask.to(device))
            return {"text_hidden": hidden, "text_mask": mask.to(device), "text_pooled": pooled}

        return cat_embeds(self._cache.rows(prompts, encode_one))

    def velocity(self, latents: Tensor, sigma: Tensor, embeds: Embeds, guidance_scale: float) -> Tensor:
        unet, _ = self._loaded()
        batch = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).reshape(-1).expand(batch)
        if guidance_scale <= 1.0:
            return predict_velocity(unet, latents, sigma, embeds).float()
        # The unconditional half is the empty prompt, which pretraining's prompt dropout trained.
        uncond = {k: v.expand(batch, *v.shape[1:]) for k, v in self.encode_prompts([""]).items()}
        both = predict_velocity(
            unet, torch.cat([latents, latents]), torch.cat([sigma, sigma]), cat_embeds([embeds, uncond])
        ).float()
        v_cond, v_uncond = both.chunk(2)
        # Classifier-free guidance (Ho & Salimans 2022, eq. 6), as diffusers' SD3 pipeline combines it.
        return v_uncond + guidance_scale * (v_cond - v_uncond)

    def decode(self, latents: Tensor) -> Tensor:
        return ((latents.float() + 1.0) / 2.0).clamp(0.0, 1.0)

    def sigmas(self, num_steps: int, height: int, width: int) -> Tensor:
        if num_steps < 1:
            raise ValueError(f"num_steps ({num_steps}) must be at least 1")
        sigmas = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float32)
        # SD3's resolution shift (Esser et al. 2024, eq. 23; diffusers FlowMatchEulerDiscreteScheduler).
        return self.shift * sigmas / (1.0 + (self.shift - 1.0) * sigmas)

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        levels = 3 if self.unet is None else len(self.unet.config.block_out_channels)
        factor = 2 ** (levels - 1)  # each U-Net level but the last halves the resolution
        if height % factor or width % factor:
            raise ValueError(
                f"{HEIGHT_FLAG}/{WIDTH_FLAG} ({height}x{width}): the toy model needs both divisible by "
                f"{factor}: use 32x32, the size it was trained at"
            )
        return (3, height, width)
