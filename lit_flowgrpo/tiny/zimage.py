"""A tiny, random ZImagePipeline (a few hundred kB), saved like a real checkout.

    python -m lit_flowgrpo.tiny.zimage .tiny_models/zimage              (Z-Image-Turbo's schedule)
    python -m lit_flowgrpo.tiny.zimage .tiny_models/zimage_base base    (Z-Image's)

Every component has the real Z-Image class: ``ZImageTransformer2DModel`` (single-stream, with its noise
and caption refiners), FLUX.1's ``AutoencoderKL``, the ``FlowMatchEulerDiscreteScheduler`` with Z-Image's
static shift, a ``Qwen3Model`` text encoder (the pipeline takes its second-to-last hidden state; its
config is the tiny klein's, :func:`lit_flowgrpo.tiny.flux2.qwen3_config`) and the byte-level Qwen3
tokenizer of :func:`lit_flowgrpo.tiny.tokenizers.qwen3_tokenizer`. So
:class:`~lit_flowgrpo.policies.zimage.ZImagePolicy` loads it through the same ``from_pretrained`` path
as ``Tongyi-MAI/Z-Image-Turbo``.

Sizes: 32×32 images → 16×16×4 latents (VAE factor 2) → 2×2 patches: 64 image tokens.
"""

from __future__ import annotations

import os
import sys

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from transformers import Qwen3Model

from lit_flowgrpo.tiny.flux2 import TEXT_HIDDEN, qwen3_config
from lit_flowgrpo.tiny.specs import SPECS, TINY_IMAGE_VAE
from lit_flowgrpo.tiny.tokenizers import qwen3_tokenizer

#: Z-Image-Turbo's transformer shrunk: one main and one refiner block each of 2 heads of 16, 4 channels in.
TRANSFORMER = dict(
    SPECS["zimage_turbo"]["transformer"],
    in_channels=4,
    dim=32,
    n_layers=1,
    n_refiner_layers=1,
    n_heads=2,
    n_kv_heads=2,
    cap_feat_dim=TEXT_HIDDEN,
    axes_dims=[4, 6, 6],
)
#: FLUX.1's VAE (Z-Image's) shrunk: two levels (2× in space), 4 latent channels.
VAE = dict(SPECS["zimage_turbo"]["vae"], **TINY_IMAGE_VAE)


def build_tiny_zimage(path: str | os.PathLike[str], variant: str = "turbo", seed: int = 0) -> str:
    """Write a tiny Z-Image pipeline to ``path`` and return ``path``: ``"turbo"`` (Z-Image-Turbo's shift
    3) or ``"base"`` (Z-Image's shift 6). Idempotent: an existing, complete folder is left as it is."""
    specs = {"turbo": "zimage_turbo", "base": "zimage"}
    if variant not in specs:
        raise ValueError(f"variant ({variant!r}) must be one of {sorted(specs)}")
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, "model_index.json")):
        return path
    tokenizer = qwen3_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen3Model(qwen3_config(tokenizer, layers=3)).eval()
        transformer = ZImageTransformer2DModel(**TRANSFORMER)
        # The refiners' and blocks' output gates start at zero in diffusers' init (an identity network
        # whose velocity ignores the prompt): random weights make the prompt and the latents matter.
        with torch.no_grad():
            for param in transformer.parameters():
                if not param.any():
                    param.normal_(0.0, 0.2)
        vae = AutoencoderKL(**VAE)
        with torch.no_grad():
            # Random decoders saturate the [0, 1] clamp; shrink the output layer so images stay inside.
            vae.decoder.conv_out.weight.mul_(0.1)
    scheduler = FlowMatchEulerDiscreteScheduler(**SPECS[specs[variant]]["scheduler"])
    pipe = ZImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
    pipe.save_pretrained(path)
    return path


if __name__ == "__main__":
    print(
        build_tiny_zimage(
            sys.argv[1] if len(sys.argv) > 1 else ".tiny_models/zimage",
            sys.argv[2] if len(sys.argv) > 2 else "turbo",
        )
    )
