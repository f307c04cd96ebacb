"""Tiny, random FLUX.2 pipelines (under a megabyte each), saved like a real checkout.

    python -m lit_flowgrpo.tiny.flux2 .tiny_models/flux2            (klein: Flux2KleinPipeline)
    python -m lit_flowgrpo.tiny.flux2 .tiny_models/flux2_dev dev    (dev: Flux2Pipeline)

Every component has the real FLUX.2 class: ``Flux2Transformer2DModel``, the ``AutoencoderKLFlux2`` with its
batch-norm latent statistics, the dynamic-shift ``FlowMatchEulerDiscreteScheduler`` and, for klein, a
``Qwen3ForCausalLM`` text encoder with 28 layers (the pipeline stacks the hidden states of layers 9, 18
and 27) and the byte-level Qwen3 tokenizer of :func:`lit_flowgrpo.tiny.tokenizers.qwen3_tokenizer`. So
:class:`~lit_flowgrpo.policies.flux2.Flux2KleinPolicy` loads it through the same ``from_pretrained`` path as
``black-forest-labs/FLUX.2-klein-base-4B``.

The dev pipeline's text encoder is a stand-in: FLUX.2-dev encodes with Mistral-Small-3.1 through a Pixtral
processor, which this package does not build, so the tiny dev pipeline holds the klein encoder in that
slot (``from_pretrained`` needs one there). It serves the tests of the dev transformer's guidance
embedding and of the schedule, fed prompt embeddings of the right width; dev's own prompt encoding is
the pipeline's ``encode_prompt``, not exercised on a tiny model.

Sizes: 32×32 images → 16×16×4 latents (VAE factor 2) → 2×2 patches: 64 tokens of 16 channels.
"""

from __future__ import annotations

import os
import sys

import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
)
from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3ForCausalLM

from lit_flowgrpo.tiny.specs import SPECS, TINY_IMAGE_VAE
from lit_flowgrpo.tiny.tokenizers import qwen3_tokenizer

KLEIN = SPECS["flux2_klein4b"]
#: The text encoder's width; the transformer takes three of its layers stacked (3 × 16).
TEXT_HIDDEN = 16
#: FLUX.2 klein's transformer shrunk: one joint and one single block of 2 heads of 16, 4 RoPE axes of 4.
TRANSFORMER = dict(
    KLEIN["transformer"],
    in_channels=16,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=3 * TEXT_HIDDEN,
    timestep_guidance_channels=32,
    axes_dims_rope=(4, 4, 4, 4),
)
#: FLUX.2's VAE shrunk: two levels (2× in space), 4 latent channels (16 after the 2×2 patchify).
VAE = dict(KLEIN["vae"], **TINY_IMAGE_VAE)


def qwen3_config(tokenizer: Qwen2Tokenizer, layers: int) -> Qwen3Config:
    """A Qwen3 text model of ``layers`` layers of width :data:`TEXT_HIDDEN` for ``tokenizer``."""
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_HIDDEN,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=1024,
        rope_theta=1e4,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )


def build_tiny_flux2(path: str | os.PathLike[str], variant: str = "klein", seed: int = 0) -> str:
    """Write a tiny FLUX.2 pipeline to ``path`` and return ``path``: ``"klein"`` (the undistilled
    ``Flux2KleinPipeline``, true CFG), ``"klein_distilled"`` (``is_distilled``: guidance off) or ``"dev"``
    (``Flux2Pipeline`` with a guidance embedding and the stand-in encoder above).

    Idempotent: an existing, complete folder is left as it is.
    """
    if variant not in ("klein", "klein_distilled", "dev"):
        raise ValueError(f"variant ({variant!r}) must be 'klein', 'klein_distilled' or 'dev'")
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, "model_index.json")):
        return path
    dev = variant == "dev"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = Flux2Transformer2DModel(**dict(TRANSFORMER, guidance_embeds=dev))
        vae = AutoencoderKLFlux2(**VAE)
        with torch.no_grad():
            # Random decoders saturate the [0, 1] clamp; shrink the output layer so images stay inside.
            vae.decoder.conv_out.weight.mul_(0.1)
            # Latent statistics other than (0, 1), so that a decoder that skips them is caught.
            vae.bn.running_mean.uniform_(-0.5, 0.5)
            vae.bn.running_var.uniform_(0.5, 2.0)
        tokenizer = qwen3_tokenizer()
        text_encoder = Qwen3ForCausalLM(qwen3_config(tokenizer, layers=28)).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(**KLEIN["scheduler"])
    if dev:
        pipe = Flux2Pipeline(
            scheduler=scheduler,
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            transformer=transformer,
        )
    else:
        pipe = Flux2KleinPipeline(
            scheduler=scheduler,
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            transformer=transformer,
            is_distilled=variant == "klein_distilled",
        )
    pipe.save_pretrained(path)
    return path


if __name__ == "__main__":
    print(
        build_tiny_flux2(
            sys.argv[1] if len(sys.argv) > 1 else ".tiny_models/flux2",
            sys.argv[2] if len(sys.argv) > 2 else "klein",
        )
    )
