"""Qwen-Image behind the :class:`~lit_flowgrpo.policies.base.FlowPolicy` interface.

Qwen-Image shares FLUX's 2×2-packed latents and dynamic-shift schedule
(:class:`~lit_flowgrpo.policies.packed.PackedLatentPolicy`); what differs:

- the text encoder is Qwen2.5-VL run on a chat template; the pipeline keeps the last hidden
  state of the tokens after the template's 34-token system prefix, so prompts have **different
  lengths** and come with an attention mask;
- guidance is **true CFG** with a negative prompt (default " "), combined with a norm rescale:
  ``comb = neg + s·(cond − neg)``, then ``comb · ‖cond‖ / ‖comb‖`` per token over channels
  (diffusers ``QwenImagePipeline.__call__``; the same in verl's Qwen-Image Flow-GRPO example,
  ``examples/flowgrpo_trainer/diffusers/qwen_image.py``);
- the VAE is a video VAE (a frame axis of 1) normalized per channel by ``latents_mean/std``.

Padding: :meth:`QwenImagePolicy.encode_prompts` pads every prompt to ``max_sequence_length``
tokens (zeros, mask 0), so conditioning from any two calls can be concatenated along the batch.
:meth:`QwenImagePolicy.velocity` then cuts the text axis to the longest prompt of its batch
(negative prompt included) before the forward: padding sits at the end and text RoPE positions
count from the start, so the cut changes nothing but the cost, and conditional and unconditional
halves share one batched forward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lit_flowgrpo.policies.base import DType, Embeds, embeds_to, vae_pixels
from lit_flowgrpo.policies.packed import PRETRAINED_FLAG, PackedLatentPolicy, padded_prompts


class QwenImagePolicy(PackedLatentPolicy):
    """Qwen-Image text-to-image (``Qwen/Qwen-Image``), with true classifier-free guidance.

    Embeds: ``prompt_embeds`` (B, max_sequence_length, D) and ``prompt_embeds_mask``
    (B, max_sequence_length) int64, 1 on real tokens.

    Args:
        pretrained: Hub id or local folder of a ``QwenImagePipeline`` (what ``save_pretrained`` writes).
        dtype: Weights' dtype; the step math stays fp32.
        true_cfg_scale: The family's CFG scale (Qwen-Image samples with 4), exposed as
            ``self.guidance_scale``. :meth:`velocity` uses the scale it is given (the training
            loop's ``--model.init_args.sampler.guidance_scale``, 1 in an update without CFG): set both alike.
        negative_prompt: The unconditional prompt (the pipeline's examples use " ").
        max_sequence_length: Prompt tokens kept after the template prefix (the pipeline's limit, 1024).
        prompt_cache_size: Prompts whose conditioning stays cached (least recently used dropped);
            the cache holds each prompt's unpadded rows.
    """

    masked_prompts = True

    #: Attention and MLP projections of both streams (verl ``examples/flowgrpo_trainer``
    #: ``run_flowgrpo.sh``, Qwen-Image LoRA r64 α128).
    default_lora_targets: tuple[str, ...] = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
        "img_mlp.net.0.proj",
        "img_mlp.net.2",
        "txt_mlp.net.0.proj",
        "txt_mlp.net.2",
    )
    uses_cfg_batch: bool = True
    pipeline_name = "QwenImagePipeline"
    component_names = ("text_encoder", "vae")

    def __init__(
        self,
        pretrained: str,
        dtype: DType = "bfloat16",
        true_cfg_scale: float = 4.0,
        negative_prompt: str = " ",
        max_sequence_length: int = 1024,
        prompt_cache_size: int = 256,
    ) -> None:
        super().__init__(pretrained, dtype, max_sequence_length, prompt_cache_size, max_tokens=1024)
        self.true_cfg_scale = true_cfg_scale
        self.guidance_scale = true_cfg_scale
        self.negative_prompt = negative_prompt

    def unused_modules(self) -> tuple[str, ...]:
        """The last block's text-stream output projection and MLP: after the last block only the image tokens
        are read out (diffusers' ``QwenImageTransformer2DModel``), so nothing they compute reaches the
        velocity."""
        last = f"transformer_blocks.{len(self.transformer.transformer_blocks) - 1}"
        return (f"{last}.attn.to_add_out", f"{last}.txt_mlp.net.0.proj", f"{last}.txt_mlp.net.2")

    def problems(self) -> list[str]:
        out = super().problems()
        if not self.true_cfg_scale > 0:
            out.append(
                f"--model.init_args.policy.init_args.true_cfg_scale ({self.true_cfg_scale}) must be positive "
                "(Qwen-Image samples with 4; 1 turns guidance off)"
            )
        if not self.negative_prompt:
            out.append(
                "--model.init_args.policy.init_args.negative_prompt is empty: the template needs at least one token "
                "of it; use ' ' (Qwen-Image's default) for an unconditional prompt"
            )
        return out

    def _check_loaded(self) -> None:
        if self._transformer.config.guidance_embeds:
            raise ValueError(
                f"{PRETRAINED_FLAG} ({self.pretrained}): this transformer has a guidance embedding; QwenImagePolicy "
                "serves the true-CFG Qwen-Image checkpoints only"
            )

    # -- prompts ------------------------------------------------------------------------------------

    def _encode_one(self, prompt: str) -> Embeds:
        """The prompt's unpadded (1, L, D) hidden states, as ``QwenImagePipeline.encode_prompt``."""
        embeds, mask = self.pipe.encode_prompt(
            prompt=[prompt], device=self.text_encoder.device, max_sequence_length=self.max_sequence_length
        )
        length = embeds.shape[1] if mask is None else int(mask.sum())
        return {"prompt_embeds": embeds[:, :length]}

    def _collate(self, rows: list[Embeds]) -> Embeds:
        return padded_prompts(rows, self.max_sequence_length)

    # -- the network ----------------------------------------------------------------------------------

    def velocity(self, latents: Tensor, sigma: Tensor, embeds: Embeds, guidance_scale: float) -> Tensor:
        """v = ε − x0 in the packed layout; with CFG, one forward over [cond; uncond].

        ``QwenImagePipeline`` feeds ``timestep = t / 1000 = σ`` and steps with
        ``x + (σ_next − σ)·out``, so the (guided) network output is the velocity of this package.
        """
        batch, rows, cols = self._check_packed(latents)
        transformer = self.transformer
        dtype = self.input_dtype(transformer)
        device = latents.device
        cfg = guidance_scale > 1.0
        prompt_embeds, mask = embeds["prompt_embeds"], embeds["prompt_embeds_mask"]
        x, timestep = latents, sigma.to(device=device, dtype=torch.float32).expand(batch)
        if cfg:
            neg = embeds_to(self.encode_prompts([self.negative_prompt]), prompt_embeds.device)
            prompt_embeds = torch.cat([prompt_embeds, neg["prompt_embeds"].expand(batch, -1, -1)])
            mask = torch.cat([mask, neg["prompt_embeds_mask"].expand(batch, -1)])
            x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
        # Cut the shared padding; an all-real mask is dropped as the pipeline drops it.
        length = int(mask.sum(dim=1).max())
        prompt_embeds, mask = prompt_embeds[:, :length], mask[:, :length]
        out = transformer(
            hidden_states=x.to(dtype),
            timestep=timestep.to(dtype),
            encoder_hidden_states=prompt_embeds.to(device, dtype),
            encoder_hidden_states_mask=None if bool(mask.all()) else mask.to(device),
            img_shapes=[[(1, rows, cols)]] * x.shape[0],
            return_dict=False,
        )[0].float()
        if not cfg:
            return out
        cond, uncond = out.chunk(2)
        # True CFG, then rescale each token to the conditional prediction's norm (QwenImagePipeline).
        comb = uncond + guidance_scale * (cond - uncond)
        return comb * (cond.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Unpack to (B, C, 1, h, w), undo ``(x − mean) / std`` per channel, decode frame 0 to [0, 1]."""
        pipe, vae = self.pipe, self.vae
        _, rows, cols = self._check_packed(latents)
        f = 2 * self.vae_scale_factor
        x = pipe._unpack_latents(latents, rows * f, cols * f, self.vae_scale_factor).to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean, device=x.device, dtype=x.dtype).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=x.device, dtype=x.dtype).view(1, -1, 1, 1, 1)
        x = x / (1.0 / std) + mean  # written as the pipeline writes it, so the rounding agrees too
        image = vae.decode(x, return_dict=False)[0][:, :, 0]
        return pipe.image_processor.postprocess(image, output_type="pt").float()

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> Tensor:
        """The inverse of :meth:`decode`: the video VAE's mean latent of one frame, ``(z − mean) / std``
        per channel, packed in 2×2 patches (B, H/16·W/16, 4C), as ``QwenImageEditPipeline._encode_vae_image``
        and ``prepare_latents`` encode and pack an image (the frame axis of 1 dropped before packing)."""
        vae = self.vae
        height, width = images.shape[-2:]
        self._packed_grid(height, width)  # checks the size and remembers the grid of a non-square one
        z = vae.encode(vae_pixels(vae, images)[:, :, None]).latent_dist.mode().float()  # (B, C, 1, h, w)
        mean = torch.tensor(vae.config.latents_mean, device=z.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=z.device).view(1, -1, 1, 1, 1)
        # The edit pipeline divides by std (img2img multiplies by 1 / std: 1 ulp apart).
        z = ((z - mean) / std)[:, :, 0]  # (B, C, h, w)
        return self.pipe._pack_latents(z, *z.shape)
