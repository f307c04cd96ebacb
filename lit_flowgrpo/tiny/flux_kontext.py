"""A tiny, random FluxKontextPipeline (under a megabyte), saved like a real checkout.

    python -m lit_flowgrpo.tiny.flux_kontext .tiny_models/flux_kontext

FLUX.1 Kontext [dev] is FLUX.1-dev's network (``FluxTransformer2DModel`` with a guidance embedding, the
same VAE, text encoders and dynamic-shift scheduler) fine-tuned to read a source image's latent tokens
beside the noisy ones; only the pipeline class differs. So this is the tiny FLUX.1 pipeline of
:mod:`lit_flowgrpo.tiny.flux`, rebuilt as a ``FluxKontextPipeline`` through diffusers' own
``from_pipe`` (which hands the same components to another pipeline class), and
:class:`~lit_flowgrpo.policies.flux_kontext.FluxKontextPolicy` loads it through the same
``from_pretrained`` path as ``black-forest-labs/FLUX.1-Kontext-dev``.

Sizes: 32×32 images → 16×16×4 latents (VAE factor 2) → 64 packed tokens of 16 channels, and as many
source tokens beside them.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
from diffusers import FluxKontextPipeline, FluxPipeline

from lit_flowgrpo.policies.base import pretrained_dtype_kwargs
from lit_flowgrpo.tiny.flux import build_tiny_flux


def build_tiny_flux_kontext(path: str | os.PathLike[str], seed: int = 0) -> str:
    """Write a tiny FLUX.1 Kontext pipeline (32×32 images, 64 packed tokens × 16) to ``path``; return
    ``path``. Its weights are those of ``build_tiny_flux(seed)``.

    Idempotent: an existing, complete folder is left as it is.
    """
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, "model_index.json")):
        return path
    with tempfile.TemporaryDirectory() as tmp:
        flux = FluxPipeline.from_pretrained(
            build_tiny_flux(tmp, seed), **pretrained_dtype_kwargs(torch.float32)
        )
        FluxKontextPipeline.from_pipe(flux).save_pretrained(path)
    return path


if __name__ == "__main__":
    print(build_tiny_flux_kontext(sys.argv[1] if len(sys.argv) > 1 else ".tiny_models/flux_kontext"))
