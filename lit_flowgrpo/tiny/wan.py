"""A tiny, random WanPipeline (a few hundred kB), saved like a real checkout.

    python -m lit_flowgrpo.tiny.wan .tiny_models/wan
    python -m lit_flowgrpo.tiny.wan .tiny_models/wan22_a14b a14b

Every component has the real Wan class: a ``UMT5EncoderModel`` text encoder (one layer, d_model 32)
with a T5 tokenizer made locally, ``WanTransformer3DModel`` (2 blocks, 2 heads of 12, (1, 2, 2)
patches), ``AutoencoderKLWan`` with Wan's own factors (8 in space, 4 in time: four levels, two
temporal downsamples) and ``UniPCMultistepScheduler`` with flow sigmas, as the
``Wan-AI/Wan2.1-T2V-*-Diffusers`` folders hold it.

Variants (the second argument):

- ``"2.1"``: Wan 2.1 T2V (one transformer).
- ``"a14b"``: Wan 2.2 T2V A14B: two experts, ``transformer`` for σ ≥ ``boundary_ratio`` (the high-noise
  steps) and ``transformer_2`` below it, switched by the pipeline's ``boundary_ratio`` (0.875, the
  value Wan 2.2 A14B's ``model_index.json`` holds).
- ``"ti2v"``: Wan 2.2 TI2V-5B's form: the pipeline flag ``expand_timesteps`` (one timestep per latent
  token) and Wan 2.2's VAE (residual blocks, 2×2 pixel patches, 16× in space; 8 latent channels here,
  48 in the 5B), with a transformer of as many channels.

Sizes: 5 frames of 32×32 px → (4, 2, 4, 4) latents → 2·2·2 = 8 tokens; TI2V: 5 frames of 64×64 px →
(8, 2, 4, 4) latents → 8 tokens (its sizes are multiples of 32: 16× VAE, 2×2 patches).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Literal

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from transformers import UMT5Config, UMT5EncoderModel

from lit_flowgrpo.tiny.specs import SPECS
from lit_flowgrpo.tiny.tokenizers import t5_tokenizer

Variant = Literal["2.1", "a14b", "ti2v"]
WAN = SPECS["wan1p3b"]
#: Latent channels of the tiny TI2V's VAE (Wan 2.2 TI2V-5B's has 48).
TI2V_LATENT_CHANNELS = 8
#: Wan 2.2 A14B's ``boundary_ratio`` (its ``model_index.json``).
A14B_BOUNDARY_RATIO: float = SPECS["wan22a14b"]["boundary_ratio"]
#: Wan 2.1's VAE shrunk: four levels of 4 channels (still 8× in space, 4× in time), 4 latent channels.
VAE = dict(
    WAN["vae"],
    base_dim=4,
    z_dim=4,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=1,
    latents_mean=[0.1, -0.2, 0.3, 0.0],
    latents_std=[1.5, 0.8, 1.2, 2.0],
)
#: Wan 2.2's VAE in small: the Wan 2.1 VAE with residual blocks, 2×2 pixel patches in and out (12
#: channels), a wider decoder, 16× in space, 4× in time; 8 latent channels where the 5B has 48.
TI2V_VAE = dict(
    VAE,
    decoder_base_dim=8,
    z_dim=TI2V_LATENT_CHANNELS,
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
    scale_factor_temporal=4,
    latents_mean=[0.1, -0.2, 0.3, 0.0, 0.2, -0.1, 0.05, -0.3],
    latents_std=[1.5, 0.8, 1.2, 2.0, 0.9, 1.1, 1.3, 0.7],
)


def transformer_config(channels: int = 4) -> dict[str, Any]:
    """Wan 2.1's transformer shrunk: 2 blocks of 2 heads of 12, ``channels`` latent channels in and out."""
    return dict(
        WAN["transformer"],
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=channels,
        out_channels=channels,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        rope_max_seq_len=32,
    )


def build_tiny_wan(path: str | os.PathLike[str], variant: Variant = "2.1", seed: int = 0) -> str:
    """Write a tiny Wan pipeline of ``variant`` to ``path``; return ``path``.

    Idempotent: an existing, complete folder is left as it is.
    """
    path = os.fspath(path)
    if variant not in ("2.1", "a14b", "ti2v"):
        raise ValueError(f"variant ({variant!r}) must be '2.1', 'a14b' or 'ti2v'")
    if os.path.isfile(os.path.join(path, "model_index.json")):
        return path
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(
            UMT5Config(
                d_model=32,
                d_ff=32,
                d_kv=8,
                num_layers=1,
                num_heads=4,
                vocab_size=128,
                relative_attention_num_buckets=8,
            )
        )
        vae = AutoencoderKLWan(**(TI2V_VAE if variant == "ti2v" else VAE))
        transformer = WanTransformer3DModel(**transformer_config(vae.config.z_dim))
        transformer_2 = WanTransformer3DModel(**transformer_config()) if variant == "a14b" else None
    scheduler = UniPCMultistepScheduler(**WAN["scheduler"])  # flow sigmas, as Wan 2.1's folders
    pipe = WanPipeline(
        tokenizer=t5_tokenizer(),
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=transformer,
        transformer_2=transformer_2,
        boundary_ratio=A14B_BOUNDARY_RATIO if variant == "a14b" else None,
        expand_timesteps=variant == "ti2v",
    )
    pipe.save_pretrained(path)
    return path


if __name__ == "__main__":
    print(
        build_tiny_wan(
            sys.argv[1] if len(sys.argv) > 1 else ".tiny_models/wan",
            sys.argv[2] if len(sys.argv) > 2 else "2.1",
        )
    )
