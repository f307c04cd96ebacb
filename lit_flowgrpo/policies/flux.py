"""FLUX.1 (dev / schnell) behind the :class:`~lit_flowgrpo.policies.base.FlowPolicy` interface.

What makes FLUX different from SD3:

- latents are **packed** (:class:`~lit_flowgrpo.policies.packed.PackedLatentPolicy`, shared with
  Qwen-Image): the VAE's (C, h, w) latent is cut into 2×2 patches, giving (h/2·w/2, 4C) tokens, each
  with a position id (0, row, col) for the rotary embedding; text tokens get id 0;
- FLUX.1-dev is **guidance-distilled**: the guidance scale is an input of the network (an
  embedding), so guidance costs no second (unconditional) batch;
- the sigma schedule is shifted by an amount that grows with the image token count (``mu``).

Everything the pipeline already does is reused from the loaded ``FluxPipeline``: ``encode_prompt``,
``_pack_latents`` / ``_unpack_latents`` / ``_prepare_latent_image_ids``, the VAE's scaling and shift
factors and its image post-processing. The schedule is :func:`lit_flowgrpo.sde.flux_sigmas` fed
from the loaded scheduler's config.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lit_flowgrpo.policies.base import MMDIT_ATTENTION_PROJECTIONS, DType, Embeds, T5Truncation, vae_pixels
from lit_flowgrpo.policies.packed import PackedLatentPolicy


class FluxPolicy(PackedLatentPolicy):
    """FLUX.1 text-to-image (``black-forest-labs/FLUX.1-dev``; schnell loads too).

    Packed latents of (H/16)·(W/16) tokens × 64 channels; T5 sequence embeddings plus a pooled CLIP
    embedding as conditioning; one transformer forward per step whatever the guidance.

    Args:
        pretrained: Hub id or local folder of a ``FluxPipeline`` (what ``save_pretrained`` writes).
        dtype: Weights' dtype; the step math stays fp32.
        guidance_scale: The distilled guidance the transformer is conditioned on (FLUX.1-dev: 3.5),
            in rollout and update alike; ignored by checkpoints without a guidance embedding
            (schnell). The CFG scale the training loop passes to :meth:`velocity` does not apply.
        max_sequence_length: T5 tokens per prompt (padded to this length, as the pipeline does).
        prompt_cache_size: Prompts whose conditioning stays cached (least recently used dropped).
    """

    #: Attention projections of the double-stream blocks (flow_grpo ``scripts/train_flux.py``);
    #: the names also match q/k/v of the single-stream blocks.
    default_lora_targets: tuple[str, ...] = MMDIT_ATTENTION_PROJECTIONS
    #: Guidance is an input embedding, not a second batch.
    uses_cfg_batch: bool = False
    pipeline_name = "FluxPipeline"
    component_names = ("text_encoder", "text_encoder_2", "vae")

    def __init__(
        self,
        pretrained: str,
        dtype: DType = "bfloat16",
        guidance_scale: float = 3.5,
        max_sequence_length: int = 512,
        prompt_cache_size: int = 256,
    ) -> None:
        super().__init__(pretrained, dtype, max_sequence_length, prompt_cache_size, max_tokens=512)
        self._truncation = T5Truncation(max_sequence_length)
        self.guidance_scale = guidance_scale

    def problems(self) -> list[str]:
        out = super().problems()
        if not self.guidance_scale > 0:
            out.append(
                f"--model.init_args.policy.init_args.guidance_scale ({self.guidance_scale}) must be positive "
                "(FLUX.1-dev was distilled around 3.5)"
            )
        return out

    def _encode_one(self, prompt: str) -> Embeds:
        """``prompt_embeds`` (1, L, D) from T5 and ``pooled_prompt_embeds`` (1, D') from CLIP."""
        with self._truncation.encoding(self.pipe, self.pipe.tokenizer_2, prompt):
            prompt_embeds, pooled, _ = self.pipe.encode_prompt(
                prompt=[prompt],
                prompt_2=None,
                device=self.text_encoder_2.device,
                max_sequence_length=self.max_sequence_length,
            )
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    def velocity(self, latents: Tensor, sigma: Tensor, embeds: Embeds, guidance_scale: float) -> Tensor:
        """v = ε − x0 in the packed layout: one forward, conditioned on ``self.guidance_scale``.

        ``guidance_scale`` (the loop's CFG scale) is ignored: FLUX.1 has no unconditional branch, and
        its distilled guidance is a property of the policy, so rollout and update (with or without
        the loop's CFG) score the same model. ``FluxPipeline`` feeds ``timestep = t / 1000 = σ``
        (the transformer multiplies it and the guidance by 1000 inside) and steps with
        ``x + (σ_next − σ)·out``, so the network output is already the velocity of this package.
        """
        batch, rows, cols = self._check_packed(latents)
        dtype = self.input_dtype(self.transformer)
        img_ids = self.pipe._prepare_latent_image_ids(batch, rows, cols, latents.device, dtype)  # (seq, 3)
        return self._forward(latents.to(dtype), img_ids, sigma, embeds)

    def _forward(self, hidden_states: Tensor, img_ids: Tensor, sigma: Tensor, embeds: Embeds) -> Tensor:
        """The transformer's output (B, seq, C) fp32 for image tokens ``hidden_states`` (B, seq, C), already in
        the input dtype, at position ids ``img_ids`` (seq, 3): the prompt's rows, text ids all 0 and the
        distilled guidance, as ``FluxPipeline`` and ``FluxKontextPipeline`` call it (Kontext passes the
        noisy tokens joined to the source's)."""
        transformer = self.transformer
        batch, dtype, device = hidden_states.shape[0], hidden_states.dtype, hidden_states.device
        prompt_embeds = embeds["prompt_embeds"].to(device, dtype)  # (B, L, D)
        guidance = None
        if transformer.config.guidance_embeds:
            guidance = torch.full((batch,), float(self.guidance_scale), device=device, dtype=torch.float32)
        out = transformer(
            hidden_states=hidden_states,
            timestep=sigma.to(device=device, dtype=dtype).expand(batch),
            guidance=guidance,
            pooled_projections=embeds["pooled_prompt_embeds"].to(device, dtype),
            encoder_hidden_states=prompt_embeds,
            txt_ids=torch.zeros(prompt_embeds.shape[1], 3, device=device, dtype=dtype),  # text ids are all 0
            img_ids=img_ids,
            return_dict=False,
        )[0]
        return out.float()

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Unpack, undo the VAE normalization (``/ scaling_factor + shift_factor``), decode to [0, 1]."""
        pipe = self.pipe
        _, rows, cols = self._check_packed(latents)
        f = 2 * self.vae_scale_factor
        x = pipe._unpack_latents(latents, rows * f, cols * f, self.vae_scale_factor)  # (B, C, h, w)
        x = x / self.vae.config.scaling_factor + self.vae.config.shift_factor
        image = self.vae.decode(x.to(self.vae.dtype), return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pt").float()

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> Tensor:
        """The inverse of :meth:`decode`: the VAE's mean latent, ``(z − shift_factor)·scaling_factor``,
        packed in 2×2 patches by the pipeline's ``_pack_latents`` (B, H/16·W/16, 4C), as
        ``FluxKontextPipeline._encode_vae_image`` / ``prepare_latents`` encode a conditioning image and
        diffusers' ``train_dreambooth_lora_flux.py`` its training images (which draw a sample)."""
        vae = self.vae
        height, width = images.shape[-2:]
        self._packed_grid(height, width)  # checks the size and remembers the grid of a non-square one
        z = vae.encode(vae_pixels(vae, images)).latent_dist.mode().float()
        z = (z - vae.config.shift_factor) * vae.config.scaling_factor  # (B, C, h, w)
        return self.pipe._pack_latents(z, *z.shape)
