"""Z-Image and Z-Image-Turbo behind the :class:`~lit_flowgrpo.policies.base.FlowPolicy` interface.

Z-Image (``Tongyi-MAI/Z-Image``, 6B) is a single-stream DiT: image patches and prompt tokens go through
the same blocks after their own refiner blocks. What differs from the other families:

- the transformer takes **lists**, one (C, 1, h, w) latent and one (L, D) prompt per sample: each
  prompt keeps only its real tokens (Qwen3-4B's second-to-last hidden state of the chat-templated
  prompt), so prompts have different lengths;
- the network is fed ``1 − σ`` as its time and predicts x0 − ε: ``ZImagePipeline`` steps with the
  negated output, so v = ε − x0 = −out;
- guidance is CFG written as ``pos + g·(pos − neg)`` with the empty negative prompt (``g`` the
  pipeline's ``guidance_scale``; 0 turns it off, as Z-Image-Turbo samples);
- the schedule is a static shift (Turbo 3.0, base 6.0), through the pipeline's own sigmas
  (``linspace(1, 1/n, n)``) and the scheduler's ``set_timesteps``.

Latents are the VAE's (C, H/8, W/8) (the transformer cuts its own 2×2 patches). Prompts are padded with
zeros to ``max_sequence_length`` rows with a mask (as :class:`~lit_flowgrpo.policies.qwenimage.QwenImagePolicy`
does), so conditioning from any two calls concatenates; :meth:`ZImagePolicy.velocity` hands the
transformer each prompt's real rows only. Reuses :class:`~lit_flowgrpo.policies.packed.PackedLatentPolicy`'s
pipeline loading, prompt cache and size checks (a multiple of 16 px), not its packing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lit_flowgrpo.attention import AttentionShape
from lit_flowgrpo.policies.base import DType, Embeds, embeds_to, vae_pixels
from lit_flowgrpo.policies.packed import PackedLatentPolicy, padded_prompts


class ZImagePolicy(PackedLatentPolicy):
    """Z-Image text-to-image (``Tongyi-MAI/Z-Image-Turbo``, ``Tongyi-MAI/Z-Image``) through diffusers'
    ``ZImagePipeline``.

    Embeds: ``prompt_embeds`` (B, max_sequence_length, D) and ``prompt_embeds_mask`` (B,
    max_sequence_length) int64, 1 on real tokens.

    Guidance follows the loop's convention: ``--model.init_args.sampler.guidance_scale`` s > 1 runs CFG as
    one batched forward over [prompt; negative prompt] and combines ``pos + (s − 1)·(pos − neg)``, which is
    the pipeline's ``guidance_scale`` g = s − 1. So Z-Image-Turbo (g = 0) trains with s = 1, and the
    pipeline's g = 4 is s = 5. The pipeline's optional CFG renormalisation and truncation
    (``cfg_normalization``, ``cfg_truncation``) are off, as by default.

    Args:
        pretrained: Hub id or local folder of a ``ZImagePipeline`` (what ``save_pretrained`` writes).
        dtype: Weights' dtype; the step math stays fp32.
        negative_prompt: The unconditional prompt of CFG (the pipeline's default: empty).
        max_sequence_length: Prompt tokens, the chat template included (the pipeline's default 512).
        prompt_cache_size: Prompts whose conditioning stays cached (least recently used dropped).
    """

    masked_prompts = True
    #: Flow-Factory's Z-Image targets (``src/flow_factory/models/z_image/z_image.py``): attention and
    #: SwiGLU projections of every block, refiners included.
    default_lora_targets: tuple[str, ...] = (
        "attention.to_q",
        "attention.to_k",
        "attention.to_v",
        "attention.to_out.0",
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
    )
    uses_cfg_batch: bool = True
    pipeline_name = "ZImagePipeline"
    component_names = ("text_encoder", "vae")
    image_size_reason: str = "the VAE downsamples by 8 and the transformer cuts 2×2 patches"

    def __init__(
        self,
        pretrained: str,
        dtype: DType = "bfloat16",
        negative_prompt: str = "",
        max_sequence_length: int = 512,
        prompt_cache_size: int = 256,
    ) -> None:
        super().__init__(pretrained, dtype, max_sequence_length, prompt_cache_size, max_tokens=512)
        self.negative_prompt = negative_prompt

    # -- prompts ------------------------------------------------------------------------------------

    def _encode_one(self, prompt: str) -> Embeds:
        """The prompt's real-token rows (1, L, D), as ``ZImagePipeline.encode_prompt``."""
        (embeds,), _ = self.pipe.encode_prompt(
            prompt=[prompt],
            device=self.text_encoder.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return {"prompt_embeds": embeds[None]}

    def _collate(self, rows: list[Embeds]) -> Embeds:
        return padded_prompts(rows, self.max_sequence_length)

    # -- the network ----------------------------------------------------------------------------------

    def velocity(self, latents: Tensor, sigma: Tensor, embeds: Embeds, guidance_scale: float) -> Tensor:
        """v = ε − x0 = −(network output) for (B, C, h, w) latents; with CFG one forward over [pos; neg]."""
        batch = latents.shape[0]
        transformer = self.transformer
        dtype = self.input_dtype(transformer)
        device = latents.device
        cfg = guidance_scale > 1.0
        prompts = _rows(embeds["prompt_embeds"], embeds["prompt_embeds_mask"])
        x, sigma = latents, sigma.to(device=device, dtype=torch.float32).expand(batch)
        if cfg:
            neg = embeds_to(self.encode_prompts([self.negative_prompt]), embeds["prompt_embeds"].device)
            prompts = prompts + _rows(neg["prompt_embeds"], neg["prompt_embeds_mask"]) * batch
            x, sigma = torch.cat([x, x]), torch.cat([sigma, sigma])
        # The pipeline's time: t = σ·1000 from the scheduler, fed as (1000 − t) / 1000 in float32 whatever
        # the model's dtype (ZImagePipeline.__call__; the transformer's timestep embedding computes its
        # frequencies in float32 and casts them to its weights' dtype, so frozen bf16 copies and float32
        # masters under autocast round them alike). In bf16, 1 − σ would move by up to 2⁻⁹, a whole unit
        # of the transformer's t·1000.
        timestep = (1000 - sigma * 1000) / 1000  # (B,) fp32
        out = transformer(
            list(x.to(dtype).unsqueeze(2).unbind(0)),  # B × (C, 1, h, w)
            timestep,
            [p.to(device, dtype) for p in prompts],
            return_dict=False,
        )[0]
        out = torch.stack([o.float() for o in out]).squeeze(2)
        if cfg:
            pos, neg_out = out.chunk(2)
            out = pos + (guidance_scale - 1.0) * (pos - neg_out)  # ZImagePipeline.__call__, g = s − 1
        return -out

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Undo the VAE normalisation (``/ scaling_factor + shift_factor``), decode to [0, 1]."""
        vae = self.vae
        x = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(x, return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type="pt").float()

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> Tensor:
        """The inverse of :meth:`decode`: the VAE's mean latent, ``(z − shift_factor)·scaling_factor``,
        unpacked (B, C, H/8, W/8), as ``ZImageImg2ImgPipeline.prepare_latents`` normalises (its ControlNet
        inpainting pipeline takes the mean, ``sample_mode="argmax"``, as here)."""
        vae = self.vae
        self._packed_grid(*images.shape[-2:])  # the size check latent_shape makes
        z = vae.encode(vae_pixels(vae, images)).latent_dist.mode().float()
        return (z - vae.config.shift_factor) * vae.config.scaling_factor

    # -- geometry and the schedule --------------------------------------------------------------------

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        rows, cols = self._packed_grid(height, width)  # checks the multiple of 2 × the VAE factor
        return (int(self.transformer.config.in_channels), 2 * rows, 2 * cols)

    def attention_shape(self, height: int, width: int) -> AttentionShape:
        rows, cols = self._packed_grid(height, width)
        config = self.transformer.config
        return AttentionShape(
            config.n_heads, config.dim // config.n_heads, self.max_sequence_length + rows * cols, masked=True
        )

    def sigmas(self, num_steps: int, height: int, width: int) -> Tensor:
        """The pipeline's schedule: its default sigmas shifted by the loaded scheduler's ``set_timesteps``
        (``mu`` from the token count, used only by a dynamic-shift config), then the terminal 0."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, get_default_z_image_sigmas

        rows, cols = self._packed_grid(height, width)
        config = self.pipe.scheduler.config
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
        mu = calculate_shift(
            rows * cols,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(num_steps), mu=mu, device="cpu")
        return scheduler.sigmas.to(torch.float32)


def _rows(embeds: Tensor, mask: Tensor) -> list[Tensor]:
    """Each prompt's real rows: (L_i, D) from the padded (B, max, D) and its mask."""
    return [e[: int(m.sum())] for e, m in zip(embeds, mask, strict=True)]
