"""The packed-latent base that FLUX.1 and Qwen-Image share.

Both families keep the VAE's (C, h, w) latent as a sequence of 2×2 patches, (h/2·w/2, 4C) tokens
per image, and both sample with the dynamic-shift schedule whose shift grows with the token count
(``mu``). What they share lives here: reading the pipeline folder (and its family) before any
weight, loading with the requested dtype, prompt conditioning cached per prompt, and the
geometry of packed latents. :mod:`lit_flowgrpo.policies.flux` and
:mod:`lit_flowgrpo.policies.qwenimage` add the family's encode / velocity / decode, written with
the loaded pipeline's own helpers.
"""

from __future__ import annotations

import json
import os
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from diffusers import DiffusionPipeline
from torch import Tensor, nn

from lit_flowgrpo.attention import AttentionShape
from lit_flowgrpo.policies.base import (
    HEIGHT_FLAG,
    WIDTH_FLAG,
    DType,
    Embeds,
    FlowPolicy,
    PromptCache,
    cat_embeds,
    check_family,
    check_pretrained,
    load_pipeline,
    resolve_dtype,
)
from lit_flowgrpo.sde import flux_sigmas

PRETRAINED_FLAG = "--model.init_args.policy.init_args.pretrained"


def read_model_index(pretrained: str, flag: str = PRETRAINED_FLAG) -> dict[str, Any]:
    """The ``model_index.json`` of a pipeline folder or hub id, read before any weight.

    Raises:
        ValueError: naming ``flag`` when the file cannot be found or read.
    """
    try:
        if os.path.isdir(pretrained):
            with open(os.path.join(pretrained, "model_index.json"), encoding="utf-8") as f:
                return json.load(f)
        return dict(DiffusionPipeline.load_config(pretrained))
    except (OSError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        raise ValueError(
            f"{flag} ({pretrained}): cannot read its model_index.json ({err}); give a diffusers pipeline "
            "folder or a reachable hub id"
        ) from err


def family_problem(
    index: dict[str, Any], pretrained: str, expected: str, policy: str, flag: str = PRETRAINED_FLAG
) -> str:
    """A message when ``model_index.json`` names another pipeline class than ``expected`` (else "")."""
    found = index.get("_class_name")
    if found == expected:
        return ""
    return (
        f"{flag} ({pretrained}) holds a {found or 'pipeline of unknown class'}, but {policy} needs a "
        f"{expected}: point it at weights of that family or choose the policy that matches them"
    )


class PackedLatentPolicy(FlowPolicy):
    """What FLUX.1 and Qwen-Image share: a diffusers pipeline folder, 2×2-packed latents, the
    dynamic-shift schedule, and prompt conditioning cached per prompt.

    Latents are the pipeline's packed layout, (seq, C) per sample with seq = (H/2f)·(W/2f) for the
    VAE factor f (8 for both families: 1024² → 4096 tokens). A packed latent does not say its
    height and width, so the policy remembers the (height, width) of each token count it was asked
    about in :meth:`latent_shape` or :meth:`sigmas` (square images need no such call).

    Subclasses name their pipeline class and components and write the family's encode / velocity /
    decode with the loaded pipeline's own helpers.
    """

    #: Pipeline components registered as submodules of the policy (all frozen).
    component_names: tuple[str, ...] = ()
    default_lora_rank: int = 64
    default_lora_alpha: int = 128
    image_size_multiple: int = 16
    image_size_reason: str = "the VAE downsamples by 8 and latents are packed in 2×2 patches"

    def __init__(
        self, pretrained: str, dtype: DType, max_sequence_length: int, prompt_cache_size: int, max_tokens: int
    ) -> None:
        super().__init__()
        self.pretrained = pretrained
        self.dtype_name = dtype
        self.max_sequence_length = max_sequence_length
        self.prompt_cache_size = prompt_cache_size
        self._max_tokens = max_tokens
        #: The loaded pipeline (None before :meth:`load`); its components are this policy's submodules.
        self.pipe: Any = None
        self._cache = PromptCache(prompt_cache_size)
        self._grids: dict[int, tuple[int, int]] = {}

    def problems(self) -> list[str]:
        out = check_pretrained(self.pretrained, PRETRAINED_FLAG) or check_family(
            self.pretrained, (self.pipeline_name,), PRETRAINED_FLAG, type(self).__name__
        )
        if self.dtype_name not in ("float32", "bfloat16", "float16"):
            out.append(
                f"--model.init_args.policy.init_args.dtype ({self.dtype_name}) must be float32, bfloat16 or float16"
            )
        if not 1 <= self.max_sequence_length <= self._max_tokens:
            out.append(
                f"--model.init_args.policy.init_args.max_sequence_length ({self.max_sequence_length}) must be in "
                f"[1, {self._max_tokens}]: the text encoder of {type(self).__name__} takes at most "
                f"{self._max_tokens} prompt tokens"
            )
        if self.prompt_cache_size < 0:
            out.append(
                f"--model.init_args.policy.init_args.prompt_cache_size ({self.prompt_cache_size}) must be >= 0"
            )
        return out

    def _raise_problems(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))

    def _family_problem(self, index: dict[str, Any]) -> str:
        return family_problem(index, self.pretrained, self.pipeline_name, type(self).__name__)

    # -- loading ------------------------------------------------------------------------------------

    def load(self) -> None:
        if self.pipe is not None:
            return
        self._raise_problems()
        # A hub id's family is known only from its model_index.json: read it before any weight.
        problem = self._family_problem(read_model_index(self.pretrained))
        if problem:
            raise ValueError(problem)
        pipe = self._read_pipeline()
        pipe.set_progress_bar_config(disable=True)
        # Registered as submodules so that ``.to(device)`` moves them; the pipeline holds the same
        # objects and keeps serving its encode / pack helpers. Everything starts frozen: the
        # training module decides what to train (a LoRA adapter, or the transformer itself).
        for name in (*self.component_names, "transformer"):
            module = getattr(pipe, name)
            module.requires_grad_(False)
            module.eval()
            setattr(self, "_transformer" if name == "transformer" else name, module)
        self.pipe = pipe
        self._check_loaded()

    def _read_pipeline(self) -> Any:
        """The pipeline's ``from_pretrained`` in the requested dtype (a family that hands it a component
        read its own way overrides this)."""
        return load_pipeline(self, resolve_dtype(self.dtype_name), PRETRAINED_FLAG)

    def _check_loaded(self) -> None:
        """Family-specific checks of the loaded configs (raise ``ValueError``)."""

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def transformer(self) -> nn.Module:
        """The denoising transformer; add LoRA in place (``transformer.add_adapter(LoraConfig(...))``)."""
        if self.pipe is None:
            raise RuntimeError(f"{type(self).__name__}.load() has not been called yet")
        return self._transformer

    # -- prompts ------------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> Embeds:
        """Conditioning rows for ``prompts``; each distinct prompt goes through the encoders once."""
        return self._collate(self._cache.rows(prompts, self._encode_one))

    @abstractmethod
    def _encode_one(self, prompt: str) -> Embeds:
        """One prompt's conditioning (batch dimension 1), as the pipeline encodes it."""

    def _collate(self, rows: list[Embeds]) -> Embeds:
        return cat_embeds(rows)

    # -- geometry -----------------------------------------------------------------------------------

    @property
    def vae_scale_factor(self) -> int:
        return int(self.pipe.vae_scale_factor)

    def _packed_grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of 2×2 latent patches for an image, remembered for its token count."""
        f = 2 * self.vae_scale_factor
        for flag, value in ((HEIGHT_FLAG, height), (WIDTH_FLAG, width)):
            if isinstance(value, bool) or not isinstance(value, int) or value < f or value % f:
                raise ValueError(
                    f"{flag} ({value}) must be a positive multiple of {f} for {type(self).__name__}: "
                    f"the VAE downsamples by {f // 2} and latents are packed in 2×2 patches"
                )
        grid = (height // f, width // f)
        seq = grid[0] * grid[1]
        known = self._grids.get(seq)
        if known is not None and known != grid:
            raise ValueError(
                f"images of {height}x{width} and {known[0] * f}x{known[1] * f} give the same token count "
                f"({seq}); {type(self).__name__} can serve only one of them per run"
            )
        self._grids[seq] = grid
        return grid

    def _grid_of(self, seq: int) -> tuple[int, int]:
        grid = self._grids.get(seq)
        if grid is not None:
            return grid
        side = round(seq**0.5)
        if side * side == seq:
            return side, side
        raise ValueError(
            f"packed latents with {seq} tokens are not square: call latent_shape(height, width) first so "
            f"{type(self).__name__} knows their height and width"
        )

    def _check_packed(self, latents: Tensor) -> tuple[int, int, int]:
        """(batch, rows, cols) of packed latents."""
        if latents.dim() != 3:
            raise ValueError(f"latents must be packed (B, seq, C), got shape {tuple(latents.shape)}")
        rows, cols = self._grid_of(latents.shape[1])
        return latents.shape[0], rows, cols

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        rows, cols = self._packed_grid(height, width)
        return (rows * cols, int(self.transformer.config.in_channels))

    def attention_shape(self, height: int, width: int) -> AttentionShape:
        # Prompts are padded to max_sequence_length tokens, then the image's packed patches.
        rows, cols = self._packed_grid(height, width)
        config = self.transformer.config
        return AttentionShape(
            config.num_attention_heads,
            config.attention_head_dim,
            self.max_sequence_length + rows * cols,
            masked=self.masked_prompts,
        )

    def sigmas(self, num_steps: int, height: int, width: int) -> Tensor:
        rows, cols = self._packed_grid(height, width)
        return scheduler_sigmas(self.pipe.scheduler.config, num_steps, rows * cols)


def padded_prompts(rows: Sequence[Embeds], length: int) -> Embeds:
    """Prompts of unpadded ``prompt_embeds`` (1, L, D) each, zero-padded to (B, ``length``, D) with their
    ``prompt_embeds_mask`` (B, ``length``), 1 on real tokens (Qwen-Image's and Z-Image's conditioning)."""
    first = rows[0]["prompt_embeds"]
    embeds = first.new_zeros(len(rows), length, first.shape[-1])
    mask = torch.zeros(len(rows), length, dtype=torch.long, device=first.device)
    for i, row in enumerate(rows):
        n = row["prompt_embeds"].shape[1]
        embeds[i, :n] = row["prompt_embeds"][0]
        mask[i, :n] = 1
    return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}


def scheduler_sigmas(config: Any, num_steps: int, image_seq_len: int) -> Tensor:
    """The pipeline's dynamic-shift sigmas for a loaded ``FlowMatchEulerDiscreteScheduler`` config.

    FluxPipeline and QwenImagePipeline both call ``set_timesteps(sigmas=linspace(1, 1/n, n), mu=
    calculate_shift(image_seq_len, ...))`` with the scheduler's own base/max shift and sequence
    lengths; :func:`lit_flowgrpo.sde.flux_sigmas` reproduces exactly that for exponential shifting.
    """
    if not config.get("use_dynamic_shifting", False) or config.get("time_shift_type", "exponential") != (
        "exponential"
    ):
        raise ValueError(
            f"{PRETRAINED_FLAG}: the scheduler config must use dynamic exponential shifting (use_dynamic_shifting="
            f"{config.get('use_dynamic_shifting')}, time_shift_type={config.get('time_shift_type')})"
        )
    return flux_sigmas(
        num_steps,
        image_seq_len,
        base_seq_len=config.get("base_image_seq_len", 256),
        max_seq_len=config.get("max_image_seq_len", 4096),
        base_shift=config.get("base_shift", 0.5),
        max_shift=config.get("max_shift", 1.15),
        shift_terminal=config.get("shift_terminal"),
    )
