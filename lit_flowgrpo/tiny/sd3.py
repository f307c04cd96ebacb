"""A tiny, random StableDiffusion3Pipeline (a few hundred kB), saved like a real checkout.

python -m lit_flowgrpo.tiny.sd3 .tiny_models/sd3
"""

from __future__ import annotations

import os
import sys

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from lit_flowgrpo.tiny.specs import SPECS
from lit_flowgrpo.tiny.tokenizers import clip_tokenizer, t5_tokenizer

SD3 = SPECS["sd35m"]
#: SD3.5-Medium's transformer shrunk: 2 blocks of 4 heads of 8, 1×1 patches of 4 channels, and SD3 (3.0)
#: blocks (no dual attention, no QK norm).
TRANSFORMER = dict(
    SD3["transformer"],
    sample_size=16,
    patch_size=1,
    in_channels=4,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=4,
    joint_attention_dim=64,
    caption_projection_dim=32,
    pooled_projection_dim=64,
    out_channels=4,
    pos_embed_max_size=32,
    dual_attention_layers=(),
    qk_norm=None,
)
#: SD3's VAE shrunk: two levels of 8 channels (2× in space), 4 latent channels; its scaling factor
#: 1.5035 (the public one is 1.5305) is the one the recorded tiny numbers were made with.
VAE = dict(
    SD3["vae"],
    down_block_types=["DownEncoderBlock2D"] * 2,
    up_block_types=["UpDecoderBlock2D"] * 2,
    block_out_channels=[8, 8],
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=4,
    sample_size=32,
    scaling_factor=1.5035,
)


def build_tiny_sd3(path: str, seed: int = 0) -> str:
    """Write a tiny SD3 pipeline (32×32 images, 16×16×4 latents) to ``path``; return ``path``.

    Idempotent: an existing, complete folder is left as it is.
    """
    if os.path.isfile(os.path.join(path, "model_index.json")):
        return path
    torch.manual_seed(seed)
    clip_config = CLIPTextConfig(
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=128,
        max_position_embeddings=77,
        projection_dim=32,
        hidden_act="gelu",
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    t5_config = T5Config(
        d_model=64,
        d_ff=64,
        d_kv=16,
        num_layers=1,
        num_heads=4,
        vocab_size=128,
        relative_attention_num_buckets=8,
    )
    pipe = StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(**TRANSFORMER),
        scheduler=FlowMatchEulerDiscreteScheduler(**SD3["scheduler"]),
        vae=AutoencoderKL(**VAE),
        text_encoder=CLIPTextModelWithProjection(clip_config),
        tokenizer=clip_tokenizer(),
        text_encoder_2=CLIPTextModelWithProjection(clip_config),
        tokenizer_2=clip_tokenizer(),
        text_encoder_3=T5EncoderModel(t5_config),
        tokenizer_3=t5_tokenizer(),
    )
    pipe.save_pretrained(path)
    return path


if __name__ == "__main__":
    print(build_tiny_sd3(sys.argv[1] if len(sys.argv) > 1 else ".tiny_models/sd3"))
