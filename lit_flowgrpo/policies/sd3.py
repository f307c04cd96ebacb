"""Stable Diffusion 3 / 3.5 (Medium, Large) through diffusers' StableDiffusion3Pipeline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from torch import Tensor, nn

from lit_flowgrpo.attention import AttentionShape
from lit_flowgrpo.policies.base import (
    HEIGHT_FLAG,
    MMDIT_ATTENTION_PROJECTIONS,
    WIDTH_FLAG,
    DType,
    Embeds,
    FlowPolicy,
    PromptCache,
    T5Truncation,
    cat_embeds,
    check_family,
    check_pretrained,
    pretrained_dtype_kwargs,
    resolve_dtype,
    vae_pixels,
)


class SD3Policy(FlowPolicy):
    """SD3-family policy: CLIP-L + CLIP-G + T5 prompt encoding, MMDiT transformer, 16-channel VAE.

    Args:
        pretrained: a hub id (``stabilityai/stable-diffusion-3.5-medium``) or a local pipeline folder.
        dtype: weights' dtype. Trainable LoRA weights stay fp32 (peft upcasts adapters); the
            sampler's step math is always fp32.
        max_sequence_length: T5 tokens per prompt (SD3's default 256; Flow-GRPO uses 128).
        negative_prompt: the unconditional prompt of classifier-free guidance.
        prompt_cache_size: encoded prompts kept on the device (least recently used are evicted).
            Each SD3.5 prompt is ~(77+T)×4096 values: mind the memory for large prompt sets.
    """

    default_lora_targets: tuple[str, ...] = MMDIT_ATTENTION_PROJECTIONS
    pipeline_name = "StableDiffusion3Pipeline"
    image_size_multiple: int = 16
    image_size_reason: str = "the VAE downsamples by 8 and the transformer cuts 2×2 patches"

    def __init__(
        self,
        pretrained: str,
        dtype: DType = "bfloat16",
        max_sequence_length: int = 128,
        negative_prompt: str = "",
        prompt_cache_size: int = 1024,
    ) -> None:
        super().__init__()
        self.pretrained = pretrained
        self.dtype_name = dtype
        self.max_sequence_length = max_sequence_length
        self.negative_prompt = negative_prompt
        self.prompt_cache_size = prompt_cache_size
        self.pipe: Any = None  # a StableDiffusion3Pipeline once loaded
        self._cache = PromptCache(prompt_cache_size)
        self._truncation = T5Truncation(max_sequence_length)

    def problems(self) -> list[str]:
        flag = "--model.init_args.policy.init_args.pretrained"
        return check_pretrained(self.pretrained, flag) or check_family(
            self.pretrained, ("StableDiffusion3Pipeline",), flag, type(self).__name__
        )

    def load(self) -> None:
        if self.pipe is not None:
            return
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))
        pipe = self.pipeline_class.from_pretrained(
            self.pretrained, **pretrained_dtype_kwargs(resolve_dtype(self.dtype_name))
        )
        pipe.set_progress_bar_config(disable=True)
        for part in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3, pipe.vae, pipe.transformer):
            if part is not None:
                part.requires_grad_(False)
                part.eval()
        # Registered as submodules so Lightning moves them to the device and strategies see them.
        self._transformer = pipe.transformer
        self.vae = pipe.vae
        self.text_encoders = nn.ModuleList(
            [m for m in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3) if m is not None]
        )
        self.pipe = pipe

    @property
    def transformer(self) -> nn.Module:
        if self.pipe is None:
            raise RuntimeError("SD3Policy.load() has not run: the weights are not loaded yet")
        return self._transformer

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> Embeds:
        rows = self._cache.rows(prompts, self._encode_one)
        return cat_embeds(rows)

    def _encode_one(self, prompt: str) -> Embeds:
        with self._truncation.encoding(self.pipe, self.pipe.tokenizer_3, prompt):
            embeds, _, pooled, _ = self.pipe.encode_prompt(
                prompt=[prompt],
                prompt_2=None,
                prompt_3=None,
                device=self.device,
                do_classifier_free_guidance=False,
                max_sequence_length=self.max_sequence_length,
            )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def _negative(self, batch: int) -> Embeds:
        neg = self.encode_prompts([self.negative_prompt])
        return {k: v.expand(batch, *v.shape[1:]) for k, v in neg.items()}

    def velocity(self, latents: Tensor, sigma: Tensor, embeds: Embeds, guidance_scale: float) -> Tensor:
        dtype = self.input_dtype(self.transformer)
        cfg = guidance_scale > 1.0
        batch = latents.shape[0]
        prompt_embeds, pooled = embeds["prompt_embeds"], embeds["pooled_prompt_embeds"]
        if cfg:  # one batched forward: [uncond; cond], as the pipeline does
            neg = self._negative(batch)
            latents = torch.cat([latents, latents])
            sigma = torch.cat([sigma, sigma])
            prompt_embeds = torch.cat([neg["prompt_embeds"], prompt_embeds])
            pooled = torch.cat([neg["pooled_prompt_embeds"], pooled])
        # The scheduler's timesteps are σ·num_train_timesteps; the transformer embeds that value.
        timestep = sigma.to(torch.float32) * self.pipe.scheduler.config.num_train_timesteps
        out = self.transformer(
            hidden_states=latents.to(dtype),
            timestep=timestep,
            encoder_hidden_states=prompt_embeds.to(dtype),
            pooled_projections=pooled.to(dtype),
            return_dict=False,
        )[0].float()
        if cfg:
            uncond, cond = out.chunk(2)
            out = uncond + guidance_scale * (cond - uncond)
        return out

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        vae = self.vae
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> Tensor:
        """(z − shift_factor)·scaling_factor of the VAE's mean latent, (B, C, H/8, W/8): the inverse of
        :meth:`decode`, as ``StableDiffusion3Img2ImgPipeline.prepare_latents`` and diffusers'
        ``train_dreambooth_sd3.py`` normalise (they draw ``latent_dist.sample()``; the mean here)."""
        vae = self.vae
        z = vae.encode(vae_pixels(vae, images)).latent_dist.mode().float()
        return (z - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor

    def sigmas(self, num_steps: int, height: int, width: int) -> Tensor:
        # The pipeline's own scheduler config (shift 3 for SD3.5) gives exactly its sigmas.
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.pipe.scheduler.config)
        scheduler.set_timesteps(num_steps, device="cpu")
        return scheduler.sigmas.to(torch.float32)

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        factor = self.pipe.vae_scale_factor
        if height % (factor * self.pipe.patch_size) or width % (factor * self.pipe.patch_size):
            raise ValueError(
                f"{HEIGHT_FLAG}/{WIDTH_FLAG} ({height}x{width}) must be multiples of "
                f"{factor * self.pipe.patch_size} for this model"
            )
        return (self.transformer.config.in_channels, height // factor, width // factor)

    def attention_shape(self, height: int, width: int) -> AttentionShape:
        _, rows, cols = self.latent_shape(height, width)
        patches = (rows // self.pipe.patch_size) * (cols // self.pipe.patch_size)
        config = self.transformer.config
        # 77 CLIP tokens and the T5 prompt, then the image patches
        return AttentionShape(
            config.num_attention_heads, config.attention_head_dim, 77 + self.max_sequence_length + patches
        )
