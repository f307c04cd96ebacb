"""The toy video policy: the tiny pixel-space text-to-video model of the shapes world's clips.

The video counterpart of :class:`~lit_flowgrpo.toy.policy.ToyPolicy`, behind the same
:class:`~lit_flowgrpo.policies.base.FlowPolicy` interface as :class:`~lit_flowgrpo.policies.wan.WanPolicy`
(``modality = "video"``), so the RL loop runs the code path a real video model uses. Latents ARE the
pixels, (F, 3, H, W) in [-1, 1] per clip; there is no VAE. The checkpoint is made by
``lit-flowgrpo fit --config configs/toy_video_pretrain.yaml``; the default is the one shipped in the
package (:mod:`lit_flowgrpo.toy.video_model`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lit_flowgrpo.policies.base import (
    FRAMES_FLAG,
    HEIGHT_FLAG,
    WIDTH_FLAG,
    Embeds,
    cat_embeds,
)
from lit_flowgrpo.toy.model import ToyTextEncoder
from lit_flowgrpo.toy.policy import PixelToyPolicy, ToyDType
from lit_flowgrpo.toy.video_model import (
    VIDEO_REGENERATE_HINT,
    ToyVideoNet,
    default_video_checkpoint,
    load_video_checkpoint,
    predict_video_velocity,
    read_video_checkpoint_metadata,
    trained_size,
)


class ToyVideoPolicy(PixelToyPolicy):
    """The toy video network and its text encoder behind the policy interface.

    Args:
        pretrained: a toy video checkpoint (``.safetensors``) written by the toy video pretraining;
            ``None`` uses the one shipped in the package.
        dtype: dtype of both networks, or ``"auto"``: bfloat16 where the fit's device computes it in
            hardware, float32 elsewhere (:func:`~lit_flowgrpo.toy.policy.toy_dtype`). Velocities are
            returned in fp32 whatever it is.
        shift: SD3's timestep shift of the sampling sigmas, σ' = s·σ / (1 + (s − 1)·σ); 1 keeps the
            plain linear schedule.
    """

    modality = "video"
    # peft target_modules (suffix match): every spatial and temporal convolution and the temporal
    # attention's output, so a LoRA can change how each frame is drawn and how frames agree.
    default_lora_targets = ("conv1", "conv2", "conv", "out_proj")
    image_size_reason = "the shipped network halves the frame at 2 of its 3 levels"
    denoiser_name = "net"
    checkpoint_name = "toy video checkpoint"
    regenerate_hint = VIDEO_REGENERATE_HINT
    net: ToyVideoNet | None

    def __init__(
        self, pretrained: str | None = None, dtype: ToyDType = "float32", shift: float = 1.0
    ) -> None:
        super().__init__(pretrained, dtype, shift, cache_size=1 << 16)  # 48 prompts in the whole video world

    def _shipped_checkpoint(self) -> str:
        return default_video_checkpoint()

    def _read_checkpoint(self, path: str, dtype: torch.dtype) -> tuple[nn.Module, ToyTextEncoder]:
        net, text_encoder, _ = load_video_checkpoint(path, dtype=dtype)
        return net, text_encoder

    def _predict(self, denoiser: nn.Module, latents: Tensor, sigma: Tensor, embeds: Embeds) -> Tensor:
        return predict_video_velocity(denoiser, latents, sigma, embeds)

    def trained_frames(self) -> int | None:
        """The frame count the checkpoint was trained at (read from its metadata, no weights);
        ``None`` when the checkpoint cannot be read (:meth:`problems` says why)."""
        if self.net is not None:
            return int(self.net.config.frames)
        try:
            return trained_size(read_video_checkpoint_metadata(self.checkpoint_path))[0]
        except (ValueError, KeyError):
            return None

    def frame_problems(self, frames: int, flag: str = FRAMES_FLAG) -> list[str]:
        if isinstance(frames, bool) or not isinstance(frames, int) or frames < 2:
            return [
                f"{flag} ({frames!r}) must be a whole number of at least 2 for {type(self).__name__}: "
                "a clip needs a first and a last frame to move between"
            ]
        trained = self.trained_frames()
        if trained is not None and frames != trained:
            return [
                f"{flag} ({frames}) must be {trained} for {type(self).__name__}: its checkpoint "
                f"({self.checkpoint_path}) was trained on {trained}-frame clips, and the toy world's motion "
                f"spreads over the clip's length; set {flag}={trained}, or pretrain at {frames} frames "
                f"(--data.init_args.frames in configs/toy_video_pretrain.yaml)"
            ]
        return []

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> Embeds:
        """``text_pooled`` (B, D): the begin token's final state, each unique prompt encoded once.

        Raises:
            ValueError: a prompt has words outside the video world's vocabulary (all are listed).
        """
        _, text_encoder = self._loaded()
        device = text_encoder.token_embedding.weight.device

        def encode_one(prompt: str) -> dict[str, Tensor]:
            ids, mask = text_encoder.tokenize([prompt])
            _, pooled = text_encoder(ids.to(device), mask.to(device))
            return {"text_pooled": pooled}

        return cat_embeds(self._cache.rows(prompts, encode_one))

    def latent_shape(self, height: int, width: int, frames: int = 2) -> tuple[int, ...]:
        levels = 3 if self.net is None else len(self.net.config.block_out_channels)
        factor = 2 ** (levels - 1)  # each level but the last halves the frame
        problems = self.frame_problems(frames)
        if height % factor or width % factor:
            size = (
                "" if self.net is None else f", the size it was trained at is {self.net.config.sample_size}"
            )
            problems.append(
                f"{HEIGHT_FLAG}/{WIDTH_FLAG} ({height}x{width}): the toy video model needs both divisible by "
                f"{factor}{size}"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return (frames, 3, height, width)
