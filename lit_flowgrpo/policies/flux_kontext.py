"""FLUX.1 Kontext (instruction editing) behind the :class:`~lit_flowgrpo.policies.base.FlowPolicy` interface.

FLUX.1 Kontext [dev] is FLUX.1-dev's transformer trained to read a source image beside the image it
denoises: the source goes through the VAE (the mean of its latent distribution, FLUX's shift and
scaling), is packed in 2×2 patches like the noisy latents, and its tokens are joined after them in the
sequence, with position ids whose first coordinate is 1 (the noisy tokens' is 0). The transformer
returns a velocity for every token; only the first N (the noisy image's) are kept. Everything else
(prompt encoding, guidance embedding, schedule, decoding) is FLUX.1's: this policy is
:class:`~lit_flowgrpo.policies.flux.FluxPolicy` with a source image.

What is reused from the loaded ``FluxKontextPipeline``: its ``image_processor`` (``resize`` then
``preprocess``: Lanczos resampling of the 8-bit image, [-1, 1] pixels) and its ``prepare_latents``
(``_encode_vae_image`` with ``retrieve_latents(..., sample_mode="argmax")``, ``_pack_latents``), so the
source tokens are the pipeline's own, bit for bit; the join is the pipeline's denoising loop's
(``torch.cat([latents, image_latents], dim=1)``, ``noise_pred[:, :N]``).

How the source is sized for RL. ``FluxKontextPipeline.__call__`` snaps the source to the preferred
Kontext resolution nearest its aspect ratio (about a megapixel, ``PREFERRED_KONTEXT_RESOLUTIONS``),
whatever the output size. flow_grpo's ``scripts/train_flux_kontext.py`` does not: it resizes each source
to the training resolution (512×512) and its sampling loop resizes it again to the output's height and
width, so the source has exactly as many tokens as the output (1024 + 1024 at 512 px, where the
pipeline's rule would add 4096). This policy does the same: the source is resized to the output size of
the call (the rollout's, or validation's), through the pipeline's image processor. Since that resize
would silently stretch or upsample a source that does not fit, :meth:`condition_size_problems` refuses,
before any weight loads, a source smaller than the output in either side or of another aspect ratio.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lit_flowgrpo.attention import AttentionShape
from lit_flowgrpo.conditioning import Condition
from lit_flowgrpo.policies.base import (
    OUTPUT_SIZE_FLAGS,
    DType,
    Embeds,
    PromptCache,
    aspect_ratio_differs,
    cat_embeds,
    check_one_image_each,
)
from lit_flowgrpo.policies.flux import FluxPolicy


class FluxKontextPolicy(FluxPolicy):
    """FLUX.1 Kontext editing (``black-forest-labs/FLUX.1-Kontext-dev``): a prompt (the instruction) and
    one source image per record.

    Latents, schedule and decoding are FLUX.1's (packed (H/16)·(W/16) tokens × 64 channels, dynamic
    shift from the output's token count alone, as the pipeline computes it). The conditioning rows carry
    the source's packed latent (``image_latents``, (B, (H/16)·(W/16), 64)) beside the prompt's; the
    source is resized to the output size (see the module's docstring), so the transformer sees twice the
    output's tokens.

    Args:
        pretrained: Hub id or local folder of a ``FluxKontextPipeline`` (what ``save_pretrained`` writes).
        dtype: Weights' dtype; the step math stays fp32.
        guidance_scale: The distilled guidance the transformer is conditioned on, in rollout and update
            alike (2.5: flow_grpo's Kontext recipe and the model card's example; the pipeline's default
            is 3.5). The CFG scale the training loop passes to :meth:`velocity` does not apply.
        max_sequence_length: T5 tokens per prompt (padded to this length, as the pipeline does).
        prompt_cache_size: Prompts, and (source, size) pairs, whose encodings stay cached (least
            recently used dropped), each in its own cache.
    """

    pipeline_name = "FluxKontextPipeline"
    condition_images: tuple[int, int] = (1, 1)
    condition_name: str = "source image"

    def __init__(
        self,
        pretrained: str,
        dtype: DType = "bfloat16",
        guidance_scale: float = 2.5,
        max_sequence_length: int = 512,
        prompt_cache_size: int = 256,
    ) -> None:
        super().__init__(pretrained, dtype, guidance_scale, max_sequence_length, prompt_cache_size)
        self._sources = PromptCache(prompt_cache_size)

    # -- the source ---------------------------------------------------------------------------------

    def condition_size_problems(self, width: int, height: int, out_height: int, out_width: int) -> list[str]:
        """A source smaller than the output in a side (the resize to the output size would upsample it), or
        of another aspect ratio (it would stretch it), cannot be taken."""
        out = []
        fix = f"or sample at a size that fits them ({OUTPUT_SIZE_FLAGS})"
        if width < out_width or height < out_height:
            out.append(
                f"it is {width}x{height} pixels, smaller than the {out_width}x{out_height} outputs: "
                f"{type(self).__name__} resizes the source to the output size (as flow_grpo's Kontext script "
                f"does) and would upsample it; give sources of at least {out_width}x{out_height}, {fix}"
            )
        elif aspect_ratio_differs(width, height, out_width, out_height):
            out.append(
                f"its aspect ratio ({width}x{height}) is not the outputs' ({out_width}x{out_height}): "
                f"{type(self).__name__} resizes the source to the output size and would stretch it; crop the "
                f"sources to the outputs' aspect ratio, {fix}"
            )
        return out

    @torch.no_grad()
    def encode_conditioned(
        self,
        prompts: Sequence[str],
        conditions: Sequence[Condition],
        height: int,
        width: int,
        frames: int = 1,
    ) -> Embeds:
        """The prompt's rows (as :meth:`encode_prompts`) and the source's packed latent ``image_latents``
        (B, (height/16)·(width/16), 64) for outputs of ``height`` x ``width``; each prompt and each (source,
        size) is encoded once, alone, and cached."""
        if frames != 1:
            raise ValueError(self.frame_problems(frames)[0])
        self._packed_grid(height, width)  # checks the output size before any source is encoded
        check_one_image_each(self, conditions)
        text = cat_embeds(self._cache.rows(prompts, self._encode_one))
        by_key = {f"{c.key}@{height}x{width}": c for c in conditions}
        sources = self._sources.rows(
            [f"{c.key}@{height}x{width}" for c in conditions],
            lambda key: self._encode_source(by_key[key].images[0], height, width),
        )
        return {**text, "image_latents": torch.cat(sources, dim=0)}

    def _encode_source(self, image: Tensor, height: int, width: int) -> Tensor:
        """One source (3, H, W) in [0, 1] as the pipeline encodes it for outputs of ``height`` x ``width``:
        (1, seq, 4C) in the VAE's dtype."""
        pipe = self.pipe
        processor = pipe.image_processor
        # The pipeline's usual input is a PIL image, resized with Lanczos; the file's 8-bit pixels are
        # recovered exactly from the [0, 1] tensor (k / 255, rounded back to k).
        (pil,) = processor.numpy_to_pil(processor.pt_to_numpy(image[None].float().cpu()))
        pixels = processor.preprocess(processor.resize(pil, height, width), height, width)  # (1, 3, H, W)
        vae = self.vae
        device = next(vae.parameters()).device
        # Given latents, prepare_latents draws no noise (no RNG is consumed) and returns them untouched:
        # only its image path runs.
        _, image_latents, _, _ = pipe.prepare_latents(
            pixels,
            1,
            self.transformer.config.in_channels // 4,
            height,
            width,
            vae.dtype,
            device,
            None,
            torch.empty(0),
        )
        return image_latents

    # -- the network --------------------------------------------------------------------------------

    def velocity(self, latents: Tensor, sigma: Tensor, embeds: Embeds, guidance_scale: float) -> Tensor:
        """v = ε − x0 of the noisy tokens: one forward over the noisy and the source tokens, conditioned on
        ``self.guidance_scale`` (the loop's ``guidance_scale`` is ignored, as for FLUX.1)."""
        batch, rows, cols = self._check_packed(latents)
        source = embeds.get("image_latents")
        if source is None:
            raise ValueError(
                f"{type(self).__name__}.velocity needs the source's image_latents in its conditioning: encode with "
                "policy.encode(prompts, conditions, height, width) (records with condition_images), not "
                "encode_prompts"
            )
        if source.shape[0] != batch or source.shape[1] != latents.shape[1]:
            raise ValueError(
                f"image_latents of shape {tuple(source.shape)} do not match latents of shape "
                f"{tuple(latents.shape)}: the source is encoded for the output's size, one row per sample"
            )
        dtype = self.input_dtype(self.transformer)
        latent_ids = self.pipe._prepare_latent_image_ids(batch, rows, cols, latents.device, dtype)  # (seq, 3)
        image_ids = latent_ids.clone()
        image_ids[..., 0] = 1  # FluxKontextPipeline.prepare_latents: the source's first coordinate is 1
        out = self._forward(
            torch.cat([latents.to(dtype), source.to(latents.device, dtype)], dim=1),  # (B, 2·seq, C)
            torch.cat([latent_ids, image_ids], dim=0),
            sigma,
            embeds,
        )
        return out[:, : latents.shape[1]]  # the noisy tokens' velocity, fp32

    def attention_shape(self, height: int, width: int) -> AttentionShape:
        # Prompt tokens, then the noisy image's packed patches and as many of the source's.
        rows, cols = self._packed_grid(height, width)
        config = self.transformer.config
        return AttentionShape(
            config.num_attention_heads,
            config.attention_head_dim,
            self.max_sequence_length + 2 * rows * cols,
            masked=self.masked_prompts,
        )

    def flops_forward(self, height: int, width: int, frames: int = 1) -> Callable[[], Tensor]:
        """One single-sample forward with a (zero) source of the output's size: the work of a step."""
        shape = self.latent_shape(height, width)
        device = self.device

        def forward() -> Tensor:
            embeds = dict(self.encode_prompts([""]))
            embeds["image_latents"] = torch.zeros((1, *shape), device=device)
            latents = torch.zeros((1, *shape), device=device)
            return self.velocity(latents, torch.full((1,), 0.5, device=device), embeds, 1.0)

        return forward
