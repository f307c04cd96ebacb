"""A tiny, random FluxPipeline (under a megabyte), saved like a real checkout.

    python -m lit_flowgrpo.tiny.flux .tiny_models/flux

Every component has the real FLUX.1 class (CLIP + T5 text encoders, ``FluxTransformer2DModel`` with
a guidance embedding, an ``AutoencoderKL`` without quant convs and with FLUX's scaling/shift, the
dynamic-shift ``FlowMatchEulerDiscreteScheduler``), so
:class:`~lit_flowgrpo.policies.flux.FluxPolicy` loads it through the same ``from_pretrained`` path
as ``black-forest-labs/FLUX.1-dev``. Tokenizers are the character-level ones of
:mod:`lit_flowgrpo.tiny.tokenizers`.

Sizes: 32×32 images → 16×16×4 latents (VAE factor 2) → 64 packed tokens of 16 channels.
"""

from __future__ import annotations

import os
import sys

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from lit_flowgrpo.tiny.specs import SPECS, TINY_IMAGE_VAE
from lit_flowgrpo.tiny.tokenizers import clip_tokenizer, t5_tokenizer

FLUX = SPECS["flux"]
#: FLUX.1-dev's transformer shrunk: one joint and one single block of 2 heads of 16, 16 channels in.
TRANSFORMER = dict(
    FLUX["transformer"],
    in_channels=16,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    axes_dims_rope=(4, 6, 6),
)
#: FLUX.1's VAE (its normalisation constants, no quant convs) shrunk: two levels (2× in space), 4
#: latent channels.
VAE = dict(FLUX["vae"], **TINY_IMAGE_VAE)


def build_tiny_flux(path: str | os.PathLike[str], seed: int = 0) -> str:
    """Write a tiny FLUX.1 pipeline (32×32 images, 64 packed tokens × 16) to ``path``; return ``path``.

    Idempotent: an existing, complete folder is left as it is.
    """
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, "model_index.json")):
        return path
    tokenizer = clip_tokenizer()
    tokenizer_2 = t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(tokenizer),
                hidden_size=32,
                intermediate_size=37,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=77,
                projection_dim=32,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
        text_encoder_2 = T5EncoderModel(
            T5Config(
                vocab_size=len(tokenizer_2),
                d_model=32,
                d_ff=37,
                d_kv=8,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                pad_token_id=tokenizer_2.pad_token_id,
                eos_token_id=tokenizer_2.eos_token_id,
                decoder_start_token_id=tokenizer_2.pad_token_id,
            )
        )
        transformer = FluxTransformer2DModel(**TRANSFORMER)
        vae = AutoencoderKL(**VAE)
        # Random decoders saturate the [0, 1] clamp; shrink the output layer so images stay inside.
        with torch.no_grad():
            vae.decoder.conv_out.weight.mul_(0.1)
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX["scheduler"])  # dynamic shift, as FLUX.1-dev
    pipe = FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    pipe.save_pretrained(path)
    return path


if __name__ == "__main__":
    print(build_tiny_flux(sys.argv[1] if len(sys.argv) > 1 else ".tiny_models/flux"))
