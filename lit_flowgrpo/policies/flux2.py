"""FLUX.2 (klein 4B / 9B and dev 32B) behind the :class:`~lit_flowgrpo.policies.base.FlowPolicy` interface.

What FLUX.2 changes from FLUX.1 (:mod:`lit_flowgrpo.policies.flux`):

- the VAE has 32 latent channels, cut into 2×2 patches (128 channels per token) and normalised by the
  VAE's batch-norm running statistics (``latents * sqrt(var + eps) + mean`` before decoding);
- the text conditioning is the hidden states of three layers of one decoder-only language model,
  stacked along the channels (klein: Qwen3-4B / 8B, layers 9, 18, 27; dev: Mistral-Small-3.1,
  layers 10, 20, 30), every prompt padded to ``max_sequence_length`` tokens; there is no pooled vector;
- positions are 4-D (time, row, column, token) for image and text tokens alike;
- the schedule's shift ``mu`` is the pipelines' ``compute_empirical_mu`` of the token count *and the
  step count*, not FLUX.1's line in the token count;
- guidance: klein is true classifier-free guidance with the empty prompt (the base checkpoints; the
  step-distilled ones run without it), dev a distilled guidance embedding like FLUX.1-dev.

Everything the pipelines already do is reused from the loaded pipeline: ``encode_prompt``, the position
ids (``_prepare_text_ids`` / ``_prepare_latent_ids``), ``_unpack_latents_with_ids``,
``_unpatchify_latents``, the image post-processing, ``compute_empirical_mu`` and the scheduler's own
``set_timesteps`` for the sigmas.

Text-to-image only: the family's reference images (editing: the pipelines' ``image`` argument, encoded
and appended to the image tokens) wait for the conditioning a rollout record carries.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from lit_flowgrpo.policies.base import MMDIT_ATTENTION_PROJECTIONS, DType, Embeds, embeds_to, vae_pixels
from lit_flowgrpo.policies.packed import PRETRAINED_FLAG, PackedLatentPolicy


class Flux2KleinPolicy(PackedLatentPolicy):
    """FLUX.2 klein text-to-image (``black-forest-labs/FLUX.2-klein-base-4B`` / ``-9B``; the distilled
    ``FLUX.2-klein-4B`` / ``-9B`` load too), through diffusers' ``Flux2KleinPipeline``.

    Packed latents of (H/16)·(W/16) tokens × 128 channels; ``prompt_embeds`` (B, max_sequence_length,
    3·hidden) as conditioning. Guidance is the loop's: with ``--model.init_args.sampler.guidance_scale``
    s > 1, one batched forward over [prompt; ""] and ``uncond + s·(cond − uncond)`` (the pipeline's
    CFG; its examples use 4.0). A step-distilled checkpoint (``is_distilled`` in its
    ``model_index.json``) samples without CFG, so s must be 1 there.

    Args:
        pretrained: Hub id or local folder of a ``Flux2KleinPipeline`` (what ``save_pretrained`` writes).
        dtype: Weights' dtype; the step math stays fp32.
        max_sequence_length: Prompt tokens (the chat template included), padded to this length as the
            pipeline pads them (its default 512).
        prompt_cache_size: Prompts whose conditioning stays cached (least recently used dropped).
    """

    #: Flow-Factory's FLUX.2 klein targets (``src/flow_factory/models/flux/flux2_klein.py``): the
    #: attention and MLP projections of both streams of the double blocks, and the single blocks' fused
    #: QKV + MLP input projection.
    default_lora_targets: tuple[str, ...] = (
        *MMDIT_ATTENTION_PROJECTIONS,
        "ff.linear_in",
        "ff.linear_out",
        "ff_context.linear_in",
        "ff_context.linear_out",
        "attn.to_qkv_mlp_proj",
    )
    uses_cfg_batch: bool = True
    pipeline_name = "Flux2KleinPipeline"
    component_names = ("text_encoder", "vae")
    #: The unconditional prompt of the pipeline's CFG (it encodes "").
    negative_prompt: str = ""

    def __init__(
        self,
        pretrained: str,
        dtype: DType = "bfloat16",
        max_sequence_length: int = 512,
        prompt_cache_size: int = 256,
    ) -> None:
        super().__init__(pretrained, dtype, max_sequence_length, prompt_cache_size, max_tokens=512)

    def _check_loaded(self) -> None:
        if self._transformer.config.guidance_embeds:
            raise ValueError(
                f"{PRETRAINED_FLAG} ({self.pretrained}): this transformer has a guidance embedding (FLUX.2-dev); "
                "use lit_flowgrpo.policies.flux2.Flux2DevPolicy for it"
            )

    @property
    def is_distilled(self) -> bool:
        """Whether the checkpoint is step-distilled (sampled without CFG), as its ``model_index.json`` says."""
        return bool(self.pipe.config.get("is_distilled", False))

    # -- prompts ------------------------------------------------------------------------------------

    def _encode_one(self, prompt: str) -> Embeds:
        """``prompt_embeds`` (1, max_sequence_length, 3·hidden), as the pipeline's ``encode_prompt``."""
        prompt_embeds, _ = self.pipe.encode_prompt(
            prompt=[prompt], device=self.text_encoder.device, max_sequence_length=self.max_sequence_length
        )
        return {"prompt_embeds": prompt_embeds}

    # -- the network ----------------------------------------------------------------------------------

    def velocity(self, latents: Tensor, sigma: Tensor, embeds: Embeds, guidance_scale: float) -> Tensor:
        """v = ε − x0 in the packed layout; with CFG, one forward over [cond; uncond].

        ``Flux2KleinPipeline`` feeds ``timestep = t / 1000 = σ`` and steps with ``x + (σ_next − σ)·out``,
        so the (guided) network output is the velocity of this package.
        """
        batch = latents.shape[0]
        cfg = guidance_scale > 1.0
        if cfg and self.is_distilled:
            raise ValueError(
                f"--model.init_args.sampler.guidance_scale ({guidance_scale}) must be 1 for {self.pretrained}: "
                "a step-distilled FLUX.2 klein samples without classifier-free guidance (its pipeline ignores it)"
            )
        prompt_embeds = embeds["prompt_embeds"]
        x = latents
        if cfg:
            neg = embeds_to(self.encode_prompts([self.negative_prompt]), prompt_embeds.device)[
                "prompt_embeds"
            ]
            prompt_embeds = torch.cat([prompt_embeds, neg.expand(batch, -1, -1)])
            x, sigma = torch.cat([x, x]), torch.cat([sigma, sigma])
        out = self._forward(x, sigma, prompt_embeds, guidance=None)
        if not cfg:
            return out
        cond, uncond = out.chunk(2)
        return uncond + guidance_scale * (cond - uncond)  # Flux2KleinPipeline.__call__

    def _forward(
        self, latents: Tensor, sigma: Tensor, prompt_embeds: Tensor, guidance: Tensor | None
    ) -> Tensor:
        """One transformer forward on packed latents, with the pipeline's 4-D position ids; fp32 out."""
        batch, rows, cols = self._check_packed(latents)
        transformer = self.transformer
        dtype = self.input_dtype(transformer)
        device = latents.device
        prompt_embeds = prompt_embeds.to(device, dtype)
        pipe = self.pipe
        # The ids read only the shapes: (0, row, col, 0) per image token, (0, 0, 0, l) per text token.
        img_ids = pipe._prepare_latent_ids(latents.new_empty(batch, 0, rows, cols)).to(device)
        txt_ids = pipe._prepare_text_ids(prompt_embeds).to(device)
        out = transformer(
            hidden_states=latents.to(dtype),
            timestep=sigma.to(device=device, dtype=dtype).expand(batch),
            guidance=guidance,
            encoder_hidden_states=prompt_embeds,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        return out.float()

    # -- decoding and the schedule ----------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Unpack, undo the batch-norm normalisation, un-patchify, decode to [0, 1] (the pipeline's tail)."""
        pipe, vae = self.pipe, self.vae
        batch, rows, cols = self._check_packed(latents)
        ids = pipe._prepare_latent_ids(latents.new_empty(batch, 0, rows, cols)).to(latents.device)
        x = pipe._unpack_latents_with_ids(latents, ids)  # (B, 4C, h/2, w/2)
        mean, std = latent_statistics(vae, x)
        x = pipe._unpatchify_latents(x * std + mean)  # (B, C, h, w)
        image = vae.decode(x.to(vae.dtype), return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pt").float()

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> Tensor:
        """The inverse of :meth:`decode`: the VAE's mean latent patchified 2×2, normalised by the VAE's
        batch-norm running statistics, ``(z − mean) / sqrt(var + eps)``, and flattened to tokens
        (B, H/16·W/16, 4C), as ``Flux2KleinPipeline._encode_vae_image`` and ``_pack_latents`` encode a
        reference image."""
        pipe, vae = self.pipe, self.vae
        height, width = images.shape[-2:]
        self._packed_grid(height, width)  # checks the size and remembers the grid of a non-square one
        z = pipe._patchify_latents(vae.encode(vae_pixels(vae, images)).latent_dist.mode().float())
        mean, std = latent_statistics(vae, z)
        return pipe._pack_latents((z - mean) / std)

    def sigmas(self, num_steps: int, height: int, width: int) -> Tensor:
        """The pipeline's schedule: ``linspace(1, 1/n, n)`` shifted by ``compute_empirical_mu(tokens, n)``
        through the loaded scheduler's own ``set_timesteps``, then the terminal 0."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        rows, cols = self._packed_grid(height, width)
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.pipe.scheduler.config)
        scheduler.set_timesteps(
            sigmas=np.linspace(1.0, 1 / num_steps, num_steps),
            mu=compute_empirical_mu(image_seq_len=rows * cols, num_steps=num_steps),
            device="cpu",
        )
        return scheduler.sigmas.to(torch.float32)


def latent_statistics(vae: Any, like: Tensor) -> tuple[Tensor, Tensor]:
    """The (1, 4C, 1, 1) mean and ``sqrt(var + eps)`` of the VAE's batch-norm running statistics, on
    ``like``'s device and in its dtype: FLUX.2's latent normalisation (``Flux2KleinPipeline``)."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(
        like.device, like.dtype
    )
    return mean, std


class Flux2DevPolicy(Flux2KleinPolicy):
    """FLUX.2-dev text-to-image (``black-forest-labs/FLUX.2-dev``, 32B), through diffusers' ``Flux2Pipeline``.

    Like klein but guidance-distilled: the guidance scale is an input embedding of the transformer (one
    forward per step whatever the scale), set on the policy; the loop's CFG scale does not apply, as
    with :class:`~lit_flowgrpo.policies.flux.FluxPolicy`. Prompts are encoded by the pipeline's Mistral
    encoder with its system message.

    Args:
        pretrained: Hub id or local folder of a ``Flux2Pipeline``.
        dtype: Weights' dtype; the step math stays fp32.
        guidance_scale: The distilled guidance the transformer is conditioned on (the pipeline's default
            4.0), in rollout and update alike.
        max_sequence_length: Prompt tokens (system message included), padded to this length (512).
        prompt_cache_size: Prompts whose conditioning stays cached (least recently used dropped).
    """

    uses_cfg_batch: bool = False
    pipeline_name = "Flux2Pipeline"

    def __init__(
        self,
        pretrained: str,
        dtype: DType = "bfloat16",
        guidance_scale: float = 4.0,
        max_sequence_length: int = 512,
        prompt_cache_size: int = 256,
    ) -> None:
        super().__init__(pretrained, dtype, max_sequence_length, prompt_cache_size)
        self.guidance_scale = guidance_scale

    def problems(self) -> list[str]:
        out = super().problems()
        if not self.guidance_scale > 0:
            out.append(
                f"--model.init_args.policy.init_args.guidance_scale ({self.guidance_scale}) must be positive "
                "(FLUX.2-dev samples with 4.0)"
            )
        return out

    def _check_loaded(self) -> None:
        if not self._transformer.config.guidance_embeds:
            raise ValueError(
                f"{PRETRAINED_FLAG} ({self.pretrained}): this transformer has no guidance embedding; "
                "Flux2DevPolicy serves FLUX.2-dev"
            )

    def velocity(self, latents: Tensor, sigma: Tensor, embeds: Embeds, guidance_scale: float) -> Tensor:
        """v = ε − x0: one forward conditioned on ``self.guidance_scale`` (``Flux2Pipeline.__call__``);
        the loop's ``guidance_scale`` is ignored, so rollout and update score the same model."""
        guidance = torch.full((latents.shape[0],), float(self.guidance_scale), device=latents.device)
        return self._forward(latents, sigma, embeds["prompt_embeds"], guidance=guidance)
