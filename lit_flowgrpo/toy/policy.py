"""The toy policy: the tiny pixel-space text-to-image model of the shapes world.

It implements the same :class:`~lit_flowgrpo.policies.base.FlowPolicy` interface as the SD3 policy,
so the RL loop runs the very code path real models use. Latents ARE the pixels, (3, H, W) in
[-1, 1]; there is no VAE. The checkpoint (U-Net + text encoder in one safetensors file) is made by
``lit-flowgrpo fit --config configs/toy_pretrain.yaml``; the default is the one shipped inside the
package, so the quickstart needs no download.

:class:`PixelToyPolicy` holds what this policy and the toy video policy
(:class:`~lit_flowgrpo.toy.video_policy.ToyVideoPolicy`) share.
"""

from __future__ import annotations

import os
from abc import abstractmethod
from collections.abc import Sequence
from typing import ClassVar, Literal

import torch
from diffusers import UNet2DConditionModel
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from lit_flowgrpo.performance import native_bf16
from lit_flowgrpo.policies.base import (
    HEIGHT_FLAG,
    WIDTH_FLAG,
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

ToyDType = Literal["auto", "float32", "bfloat16", "float16"]
"""A toy policy's dtype: a fixed one, or ``"auto"`` (:func:`toy_dtype`)."""


def toy_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype a toy policy's ``dtype`` names on ``device``.

    ``"auto"`` is bfloat16 where ``device`` computes it in hardware
    (:func:`~lit_flowgrpo.performance.native_bf16`) and float32 elsewhere: the toy world runs on
    any CPU, and on one without bf16 instructions a bf16 fit is many times slower than a float32 one.
    """
    if name == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    return resolve_dtype(name)


class PixelToyPolicy(FlowPolicy):
    """A toy model family in pixel space: a denoiser and a frozen text encoder read from one toy
    checkpoint, classifier-free guidance against the empty prompt, SD3's shifted linear sigmas.

    A subclass names the attribute of its denoiser, reads its checkpoint and runs its denoiser;
    prompts, latent shapes and frame counts are its own.

    Args:
        pretrained: a checkpoint of the subclass's kind; ``None`` uses the one shipped in the package.
        dtype: dtype of both networks, or ``"auto"`` (:func:`toy_dtype`), resolved when the policy
            loads, for the device it loads on: inside a fit the fit's device (Lightning builds the
            model under it), called directly torch's default device. Velocities are returned in
            fp32 whatever it is.
        shift: SD3's timestep shift of the sampling sigmas.
        cache_size: prompts whose embeddings stay cached.
    """

    #: The attribute that holds the loaded denoiser; it prefixes the denoiser's keys in state dicts.
    denoiser_name: ClassVar[str]
    #: What the checkpoint is called in messages ("toy checkpoint").
    checkpoint_name: ClassVar[str]
    #: How to regenerate or restore the shipped checkpoint.
    regenerate_hint: ClassVar[str]
    uses_cfg_batch = True
    image_size_multiple = 4

    def __init__(self, pretrained: str | None, dtype: ToyDType, shift: float, cache_size: int) -> None:
        super().__init__()
        self.pretrained = pretrained
        self.dtype_name = dtype
        self.shift = shift
        setattr(self, self.denoiser_name, None)
        self.text_encoder: ToyTextEncoder | None = None
        self._cache = PromptCache(size=cache_size)

    @abstractmethod
    def _shipped_checkpoint(self) -> str:
        """Path of the checkpoint shipped in the package."""

    @abstractmethod
    def _read_checkpoint(self, path: str, dtype: torch.dtype) -> tuple[nn.Module, ToyTextEncoder]:
        """The denoiser and the text encoder stored at ``path``, in ``dtype``."""

    @abstractmethod
    def _predict(self, denoiser: nn.Module, latents: Tensor, sigma: Tensor, embeds: Embeds) -> Tensor:
        """The denoiser's velocity (B, ...) at noise levels ``sigma`` (B,), in the denoiser's dtype."""

    @property
    def checkpoint_path(self) -> str:
        return self._shipped_checkpoint() if self.pretrained is None else os.path.expanduser(self.pretrained)

    def problems(self) -> list[str]:
        out = []
        if self.dtype_name not in ("auto", "float32", "bfloat16", "float16"):
            out.append(
                f"{_FLAG}.dtype ({self.dtype_name!r}) must be one of 'auto', 'float32', 'bfloat16', 'float16'"
            )
        if not self.shift > 0:
            out.append(f"{_FLAG}.shift ({self.shift}) must be positive (1 = no shift)")
        if self.pretrained is not None and not os.path.isfile(self.checkpoint_path):
            out.append(
                f"{_FLAG}.pretrained ({self.pretrained}) is not a file: give a {self.checkpoint_name} "
                f"(.safetensors) or leave it unset for the shipped one"
            )
        elif self.pretrained is None and not os.path.isfile(self.checkpoint_path):
            out.append(
                f"the shipped {self.checkpoint_name} {self.checkpoint_path} is missing: {self.regenerate_hint}"
            )
        return out

    def load(self) -> None:
        """Read the checkpoint; the text encoder is frozen, the denoiser stays trainable."""
        if getattr(self, self.denoiser_name) is not None:
            return
        found = self.problems()
        if found:
            raise ValueError("; ".join(found))
        device = torch.get_default_device()
        if device.type == "meta":  # a sharded strategy's empty init: the ranks compute on their GPU
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = toy_dtype(self.dtype_name, device)
        if self.dtype_name == "auto":
            why = (
                "computes bf16 in hardware" if dtype == torch.bfloat16 else "has no bf16 matrix instructions"
            )
            rank_zero_info(f"{_FLAG}.dtype auto: {str(dtype).removeprefix('torch.')} ({device.type} {why})")
        denoiser, text_encoder = self._read_checkpoint(self.checkpoint_path, dtype)
        text_encoder.requires_grad_(False).eval()
        denoiser.requires_grad_(True)
        setattr(self, self.denoiser_name, denoiser)
        self.text_encoder = text_encoder
        self._cache.clear()

    @property
    def transformer(self) -> nn.Module:
        return self._loaded()[0]

    def _loaded(self) -> tuple[nn.Module, ToyTextEncoder]:
        denoiser = getattr(self, self.denoiser_name)
        if denoiser is None or self.text_encoder is None:
            raise RuntimeError(f"{type(self).__name__}.load() must run before the policy is used")
        return denoiser, self.text_encoder

    def velocity(self, latents: Tensor, sigma: Tensor, embeds: Embeds, guidance_scale: float) -> Tensor:
        denoiser, _ = self._loaded()
        batch = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).reshape(-1).expand(batch)
        if guidance_scale <= 1.0:
            return self._predict(denoiser, latents, sigma, embeds).float()
        # The unconditional half is the empty prompt, which pretraining's prompt dropout trained.
        uncond = {k: v.expand(batch, *v.shape[1:]) for k, v in self.encode_prompts([""]).items()}
        both = self._predict(
            denoiser, torch.cat([latents, latents]), torch.cat([sigma, sigma]), cat_embeds([embeds, uncond])
        ).float()
        v_cond, v_uncond = both.chunk(2)
        # Classifier-free guidance (Ho & Salimans 2022, eq. 6), as diffusers' pipelines combine it.
        return v_uncond + guidance_scale * (v_cond - v_uncond)

    def decode(self, latents: Tensor) -> Tensor:
        """Images (B, 3, H, W) or clips (B, F, 3, H, W) in [0, 1]: the latents are the pixels in [-1, 1]."""
        return ((latents.float() + 1.0) / 2.0).clamp(0.0, 1.0)

    def encode_images(self, images: Tensor) -> Tensor:
        """The inverse of :meth:`decode`: the latents are the pixels, 2·image − 1, images or clips alike."""
        return images.float() * 2.0 - 1.0

    def sigmas(self, num_steps: int, height: int, width: int) -> Tensor:
        if num_steps < 1:
            raise ValueError(f"num_steps ({num_steps}) must be at least 1")
        sigmas = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float32)
        # SD3's resolution shift (Esser et al. 2024, eq. 23; diffusers FlowMatchEulerDiscreteScheduler).
        return self.shift * sigmas / (1.0 + (self.shift - 1.0) * sigmas)


class ToyPolicy(PixelToyPolicy):
    """The toy U-Net and its text encoder behind the policy interface.

    Args:
        pretrained: a toy checkpoint (``.safetensors``) written by the toy pretraining; ``None``
            uses the one shipped in the package.
        dtype: dtype of both networks, or ``"auto"``: bfloat16 where the fit's device computes it in
            hardware, float32 elsewhere (:func:`~lit_flowgrpo.toy.policy.toy_dtype`). Velocities are
            returned in fp32 whatever it is.
        shift: SD3's timestep shift of the sampling sigmas, σ' = s·σ / (1 + (s − 1)·σ); 1 keeps the
            plain linear schedule.
    """

    # peft target_modules (suffix match): the attention projections and the ResNet convolutions
    # of every U-Net block, so a LoRA can change both what the image attends to and how it draws.
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "conv1", "conv2")
    image_size_reason = (
        "the shipped U-Net halves the resolution at 2 of its 3 levels; it was trained at 32x32"
    )
    denoiser_name = "unet"
    checkpoint_name = "toy checkpoint"
    regenerate_hint = REGENERATE_HINT
    unet: UNet2DConditionModel | None

    def __init__(
        self, pretrained: str | None = None, dtype: ToyDType = "float32", shift: float = 1.0
    ) -> None:
        # The world has a few thousand short prompts: all of them stay cached.
        super().__init__(pretrained, dtype, shift, cache_size=1 << 20)

    def _shipped_checkpoint(self) -> str:
        return default_checkpoint()

    def _read_checkpoint(self, path: str, dtype: torch.dtype) -> tuple[nn.Module, ToyTextEncoder]:
        unet, text_encoder, _ = load_checkpoint(path, dtype=dtype)
        return unet, text_encoder

    def _predict(self, denoiser: nn.Module, latents: Tensor, sigma: Tensor, embeds: Embeds) -> Tensor:
        return predict_velocity(denoiser, latents, sigma, embeds)

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

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        levels = 3 if self.unet is None else len(self.unet.config.block_out_channels)
        factor = 2 ** (levels - 1)  # each U-Net level but the last halves the resolution
        if height % factor or width % factor:
            raise ValueError(
                f"{HEIGHT_FLAG}/{WIDTH_FLAG} ({height}x{width}): the toy model needs both divisible by "
                f"{factor}: use 32x32, the size it was trained at"
            )
        return (3, height, width)
