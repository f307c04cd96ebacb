"""The toy video policy: the tiny pixel-space text-to-video model of the shapes world's clips.

The video counterpart of :class:`~lit_flowgrpo.toy.policy.ToyPolicy`, behind the same
:class:`~lit_flowgrpo.policies.base.FlowPolicy` interface as :class:`~lit_flowgrpo.policies.wan.WanPolicy`
(``modality = "video"``), so the RL loop runs the code path a real video model uses. Latents ARE the
pixels, (F, 3, H, W) in [-1, 1] per clip; there is no VAE. The checkpoint is made by
``lit-flowgrpo fit --config configs/toy_video_pretrain.yaml``; the default is the one shipped in the
package (:mod:`lit_flowgrpo.toy.video_model`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lit_flowgrpo.policies.base import (
    FRAMES_FLAG,
    HEIGHT_FLAG,
    WIDTH_FLAG,
    DType,
    Embeds,
    FlowPolicy,
    PromptCache,
    cat_embeds,
    resolve_dtype,
)
from lit_flowgrpo.toy.video_model import (
    VIDEO_REGENERATE_HINT,
    ToyVideoNet,
    ToyVideoTextEncoder,
    default_video_checkpoint,
    load_video_checkpoint,
    predict_video_velocity,
    read_video_checkpoint_metadata,
    trained_size,
)

_FLAG = "--model.init_args.policy.init_args"


class ToyVideoPolicy(FlowPolicy):
    """The toy video network and its text encoder behind the policy interface.

    Args:
        pretrained: a toy video checkpoint (``.safetensors``) written by the toy video pretraining;
            ``None`` uses the one shipped in the package.
        dtype: dtype of both networks. Velocities are returned in fp32 whatever it is.
        shift: SD3's timestep shift of the sampling sigmas, σ' = s·σ / (1 + (s − 1)·σ); 1 keeps the
            plain linear schedule.
    """

    modality = "video"
    # peft target_modules (suffix match): every spatial and temporal convolution and the temporal
    # attention's output, so a LoRA can change how each frame is drawn and how frames agree.
    default_lora_targets = ("conv1", "conv2", "conv", "out_proj")
    uses_cfg_batch = True
    image_size_multiple = 4
    image_size_reason = "the shipped network halves the frame at 2 of its 3 levels"

    def __init__(self, pretrained: str | None = None, dtype: DType = "float32", shift: float = 1.0) -> None:
        super().__init__()
        self.pretrained = pretrained
        self.dtype_name = dtype
        self.shift = shift
        self.net: ToyVideoNet | None = None
        self.text_encoder: ToyVideoTextEncoder | None = None
        self._cache = PromptCache(size=1 << 16)  # 48 prompts in the whole video world

    @property
    def checkpoint_path(self) -> str:
        return default_video_checkpoint() if self.pretrained is None else os.path.expanduser(self.pretrained)

    def problems(self) -> list[str]:
        out = []
        if self.dtype_name not in ("float32", "bfloat16", "float16"):
            out.append(f"{_FLAG}.dtype ({self.dtype_name!r}) must be one of 'float32', 'bfloat16', 'float16'")
        if not self.shift > 0:
            out.append(f"{_FLAG}.shift ({self.shift}) must be positive (1 = no shift)")
        if self.pretrained is not None and not os.path.isfile(self.checkpoint_path):
            out.append(
                f"{_FLAG}.pretrained ({self.pretrained}) is not a file: give a toy video checkpoint "
                f"(.safetensors) or leave it unset for the shipped one"
            )
        elif self.pretrained is None and not os.path.isfile(self.checkpoint_path):
            out.append(
                f"the shipped toy video checkpoint {self.checkpoint_path} is missing: {VIDEO_REGENERATE_HINT}"
            )
        return out

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

    def load(self) -> None:
        """Read the checkpoint; the text encoder is frozen, the network stays trainable."""
        if self.net is not None:
            return
        found = self.problems()
        if found:
            raise ValueError("; ".join(found))
        net, text_encoder, _ = load_video_checkpoint(
            self.checkpoint_path, dtype=resolve_dtype(self.dtype_name)
        )
        text_encoder.requires_grad_(False).eval()
        net.requires_grad_(True)
        self.net, self.text_encoder = net, text_encoder
        self._cache.clear()

    @property
    def transformer(self) -> nn.Module:
        return self._loaded()[0]

    def _loaded(self) -> tuple[ToyVideoNet, ToyVideoTextEncoder]:
        if self.net is None or self.text_encoder is None:
            raise RuntimeError("ToyVideoPolicy.load() must run before the policy is used")
        return self.net, self.text_encoder

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

    def velocity(self, latents: Tensor, sigma: Tensor, embeds: Embeds, guidance_scale: float) -> Tensor:
        net, _ = self._loaded()
        batch = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).reshape(-1).expand(batch)
        if guidance_scale <= 1.0:
            return predict_video_velocity(net, latents, sigma, embeds).float()
        # The unconditional half is the empty prompt, which pretraining's prompt dropout trained.
        uncond = {k: v.expand(batch, *v.shape[1:]) for k, v in self.encode_prompts([""]).items()}
        both = predict_video_velocity(
            net, torch.cat([latents, latents]), torch.cat([sigma, sigma]), cat_embeds([embeds, uncond])
        ).float()
        v_cond, v_uncond = both.chunk(2)
        # Classifier-free guidance (Ho & Salimans 2022, eq. 6), as diffusers' pipelines combine it.
        return v_uncond + guidance_scale * (v_cond - v_uncond)

    def decode(self, latents: Tensor) -> Tensor:
        """Clips (B, F, 3, H, W) in [0, 1]: the latents are the pixels in [-1, 1]."""
        return ((latents.float() + 1.0) / 2.0).clamp(0.0, 1.0)

    def sigmas(self, num_steps: int, height: int, width: int) -> Tensor:
        if num_steps < 1:
            raise ValueError(f"num_steps ({num_steps}) must be at least 1")
        sigmas = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float32)
        # SD3's resolution shift (Esser et al. 2024, eq. 23; diffusers FlowMatchEulerDiscreteScheduler).
        return self.shift * sigmas / (1.0 + (self.shift - 1.0) * sigmas)

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
