"""The toy editing policy: the shapes world's pixel-space U-Net, given the source image to edit.

An image-conditioned family behind the :class:`~lit_flowgrpo.policies.base.FlowPolicy` interface as
the editing families are (``condition_images = (1, 1)``: one source per record), so the RL loop runs
the path FLUX.1 Kontext and Qwen-Image-Edit take: :meth:`encode_conditioned` puts the source into the
conditioning dict beside the instruction's states, and :meth:`velocity` reads it from there, so the
rollout, the update's visits and DiffusionNFT carry it untouched. Latents ARE the pixels, (3, H, W) in
[-1, 1]; the source is concatenated to them (:mod:`lit_flowgrpo.toy.edit_model`).

The model was trained at 32×32 and takes sources of exactly its own size: it has no image processor
to resize with (a diffusers editing pipeline resizes the source to the output; here a resized scene
would move its objects off the pixel grid the verifier's tolerances are set on), so
:meth:`condition_size_problems` refuses any other size before the weights load.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lit_flowgrpo.conditioning import Condition
from lit_flowgrpo.policies.base import HEIGHT_FLAG, WIDTH_FLAG, Embeds, cat_embeds
from lit_flowgrpo.toy.edit_model import (
    EDIT_REGENERATE_HINT,
    default_edit_checkpoint,
    load_edit_checkpoint,
    predict_edit_velocity,
    read_edit_checkpoint_metadata,
    trained_size,
)
from lit_flowgrpo.toy.model import ToyTextEncoder
from lit_flowgrpo.toy.policy import PixelToyPolicy, ToyDType

_TEXT_KEYS = ("text_hidden", "text_mask", "text_pooled")


class ToyEditPolicy(PixelToyPolicy):
    """The toy editing U-Net and its text encoder behind the policy interface.

    Args:
        pretrained: a toy editing checkpoint (``.safetensors``) written by the toy editing pretraining;
            ``None`` uses the one shipped in the package.
        dtype: dtype of both networks, or ``"auto"``: bfloat16 where the fit's device computes it in
            hardware, float32 elsewhere (:func:`~lit_flowgrpo.toy.policy.toy_dtype`). Velocities are
            returned in fp32 whatever it is.
        shift: SD3's timestep shift of the sampling sigmas, σ' = s·σ / (1 + (s − 1)·σ); 1 keeps the
            plain linear schedule.
    """

    condition_images = (1, 1)
    condition_name = "source image"
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "conv1", "conv2")
    image_size_reason = (
        "the shipped U-Net halves the resolution at 2 of its 3 levels; it was trained at 32x32"
    )
    denoiser_name = "unet"
    checkpoint_name = "toy editing checkpoint"
    regenerate_hint = EDIT_REGENERATE_HINT

    def __init__(
        self, pretrained: str | None = None, dtype: ToyDType = "float32", shift: float = 1.0
    ) -> None:
        # A few thousand (instruction, source) pairs in the whole shipped world: all stay cached.
        super().__init__(pretrained, dtype, shift, cache_size=1 << 16)

    def _shipped_checkpoint(self) -> str:
        return default_edit_checkpoint()

    def _read_checkpoint(self, path: str, dtype: torch.dtype) -> tuple[nn.Module, ToyTextEncoder]:
        unet, text_encoder, _ = load_edit_checkpoint(path, dtype=dtype)
        return unet, text_encoder

    def _predict(self, denoiser: nn.Module, latents: Tensor, sigma: Tensor, embeds: Embeds) -> Tensor:
        return predict_edit_velocity(denoiser, latents, sigma, embeds)

    def trained_size(self) -> int | None:
        """The image side the checkpoint was trained at (its metadata, no weights read); ``None`` when the
        checkpoint cannot be read (:meth:`problems` says why)."""
        if self.unet is not None:
            return int(self.unet.config.sample_size)
        try:
            return trained_size(read_edit_checkpoint_metadata(self.checkpoint_path))
        except (ValueError, KeyError):
            return None

    def condition_size_problems(self, width: int, height: int, out_height: int, out_width: int) -> list[str]:
        side = self.trained_size() or 32
        if (width, height) == (out_width, out_height) == (side, side):
            return []
        return [
            f"a {self.condition_name} of {width}x{height} pixels for {out_width}x{out_height} outputs: "
            f"{type(self).__name__} edits {side}x{side} images and takes a source of exactly that size (it has "
            f"no image processor to resize with); set {HEIGHT_FLAG}={side} and {WIDTH_FLAG}={side} and give "
            f"{side}x{side} sources (python -m lit_flowgrpo.toy.edit_prompts writes them)"
        ]

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> Embeds:
        """The instructions' ``text_hidden`` (B, L, D), ``text_mask`` (B, L) bool, ``text_pooled`` (B, D),
        each unique instruction encoded once. Without a source these cannot drive the U-Net:
        :meth:`encode_conditioned` adds it."""
        _, text_encoder = self._loaded()
        device = text_encoder.token_embedding.weight.device

        def encode_one(prompt: str) -> dict[str, Tensor]:
            ids, mask = text_encoder.tokenize([prompt])
            hidden, pooled = text_encoder(ids.to(device), mask.to(device))
            return {"text_hidden": hidden, "text_mask": mask.to(device), "text_pooled": pooled}

        return cat_embeds(self._cache.rows(prompts, encode_one))

    @torch.no_grad()
    def encode_conditioned(
        self,
        prompts: Sequence[str],
        conditions: Sequence[Condition],
        height: int,
        width: int,
        frames: int = 1,
    ) -> Embeds:
        """The instructions' text states plus ``source`` (B, 3, H, W) in [-1, 1], one row per sample.

        Raises:
            ValueError: a sample has no source or more than one, or a source is not ``height`` x ``width``.
        """
        if len(conditions) != len(prompts):
            raise ValueError(f"{len(prompts)} instructions but {len(conditions)} conditions: one per sample")
        text = self.encode_prompts(prompts)
        device = text["text_pooled"].device
        rows = []
        for condition in conditions:
            if len(condition.images) != 1:
                raise ValueError(
                    f"{type(self).__name__} takes one {self.condition_name} per record, got "
                    f"{len(condition.images)} ({condition.key})"
                )
            image = condition.images[0]
            if tuple(image.shape) != (3, height, width):
                raise ValueError(
                    "; ".join(self.condition_size_problems(image.shape[-1], image.shape[-2], height, width))
                )
            # The latents are the pixels: the source enters as the output does, 2·image − 1.
            rows.append(self.encode_images(image[None].to(device)))
        return text | {"source": torch.cat(rows)}

    def velocity(self, latents: Tensor, sigma: Tensor, embeds: Embeds, guidance_scale: float) -> Tensor:
        denoiser, _ = self._loaded()
        batch = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).reshape(-1).expand(batch)
        if guidance_scale <= 1.0:
            return self._predict(denoiser, latents, sigma, embeds).float()
        # Guidance on the instruction alone: the unconditional half keeps each sample's source and
        # drops the instruction to the empty one, which pretraining's instruction dropout trained
        # (InstructPix2Pix's text guidance, Brooks et al. 2023 eq. 3, with its image scale at 1).
        empty = self.encode_prompts([""])
        uncond = {k: empty[k].expand(batch, *empty[k].shape[1:]) for k in _TEXT_KEYS}
        uncond["source"] = embeds["source"]
        both = self._predict(
            denoiser,
            torch.cat([latents, latents]),
            torch.cat([sigma, sigma]),
            cat_embeds([{k: embeds[k] for k in uncond}, uncond]),
        ).float()
        v_cond, v_uncond = both.chunk(2)
        return v_uncond + guidance_scale * (v_cond - v_uncond)

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        levels = 3 if self.unet is None else len(self.unet.config.block_out_channels)
        factor = 2 ** (levels - 1)
        if height % factor or width % factor:
            raise ValueError(
                f"{HEIGHT_FLAG}/{WIDTH_FLAG} ({height}x{width}): the toy editing model needs both divisible by "
                f"{factor}: use 32x32, the size it was trained at"
            )
        return (3, height, width)

    def flops_forward(self, height: int, width: int, frames: int = 1):  # type: ignore[no-untyped-def]
        """One single-sample forward for FLOP counting, with a black source of the output's size."""
        device = next(self.transformer.parameters()).device
        black = Condition([torch.zeros(3, height, width)], "flops")

        def forward() -> Tensor:
            embeds = self.encode_conditioned([""], [black], height, width)
            latents = torch.zeros((1, 3, height, width), device=device)
            return self.velocity(latents, torch.full((1,), 0.5, device=device), embeds, 1.0)

        return forward
