"""A tiny, random ``WanImageToVideoPipeline`` (a few hundred kB), saved like a real checkout.

    python -m lit_flowgrpo.tiny.wan_i2v .tiny_models/wan_i2v
    python -m lit_flowgrpo.tiny.wan_i2v .tiny_models/wan22_ti2v ti2v
    python -m lit_flowgrpo.tiny.wan_i2v .tiny_models/wan22_i2v_a14b a14b

The text encoder, tokenizer, VAE and scheduler are those of the tiny Wan text-to-video pipeline
(:mod:`lit_flowgrpo.tiny.wan`, built with the same seed), so the two families differ only where the
checkpoints do:

- ``"2.1"``: Wan 2.1 I2V (``Wan-AI/Wan2.1-I2V-14B-480P-Diffusers``'s form): a ``CLIPVisionModel`` image
  encoder (2 layers of 32, 28 px images in 14 px patches: 5 tokens where ViT-H/14 gives 257) with a
  ``CLIPImageProcessor`` made locally (shortest edge and centre crop 28, the OpenAI CLIP mean and std,
  bicubic, as the 14B's at 224), and a transformer with CLIP cross-attention (``image_dim``,
  ``added_kv_proj_dim``) taking 4 + 4 + 4 = 12 channels in (latent, mask, first-frame latent; 36 in the
  14B) and 4 out.
- ``"a14b"``: Wan 2.2 I2V-A14B's form: two experts of the image-to-video input (12 channels in) without
  CLIP cross-attention (no image encoder), switched at ``boundary_ratio`` (0.875, as the T2V A14B).
- ``"ti2v"``: Wan 2.2 TI2V-5B's form: ``expand_timesteps``, Wan 2.2's VAE in small (16× in space, 8
  latent channels where the 5B has 48), no image encoder, a transformer of 8 channels in and out.

Sizes: 5 frames of 32×32 px → (4, 2, 4, 4) latents → 8 tokens; TI2V: 5 frames of 64×64 px → (8, 2, 4, 4)
at the transformer (8 tokens), of which the policy's trajectory holds the generated (8, 1, 4, 4).
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any, Literal

import torch
from diffusers import WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

from lit_flowgrpo.tiny.specs import SPECS
from lit_flowgrpo.tiny.wan import (
    A14B_BOUNDARY_RATIO,
    TI2V_LATENT_CHANNELS,
    VAE,
    build_tiny_wan,
    transformer_config,
)

Variant = Literal["2.1", "ti2v", "a14b"]
I2V = SPECS["wan21_i2v_14b_480p"]
#: ViT-H/14 shrunk: 2 layers of 32 (4 heads), 28 px images → 2 × 2 patches + the class token.
VISION = dict(
    I2V["image_encoder"],
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=28,
    projection_dim=32,
)
#: The 14B's image processor at the tiny encoder's 28 px.
IMAGE_PROCESSOR = dict(
    I2V["image_processor"], size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
)


def i2v_transformer_config(latent_channels: int, image_dim: int | None) -> dict[str, Any]:
    """The tiny Wan transformer with the image-to-video input: (latent + mask + first frame) channels in,
    the latent's out; with CLIP cross-attention of ``image_dim`` states (Wan 2.1 I2V), or none (``None``:
    Wan 2.2 I2V-A14B's experts)."""
    base = transformer_config(latent_channels)
    inner = base["num_attention_heads"] * base["attention_head_dim"]
    # 4 mask channels: one per frame the VAE folds into a latent frame (the 14B's 36 = 16 + 4 + 16)
    mask = I2V["transformer"]["in_channels"] - 2 * I2V["transformer"]["out_channels"]
    return dict(
        base,
        in_channels=2 * latent_channels + mask,
        image_dim=image_dim,
        added_kv_proj_dim=None if image_dim is None else inner,  # the 14B's 5120: its inner width
    )


def build_tiny_wan_i2v(path: str | os.PathLike[str], variant: Variant = "2.1", seed: int = 0) -> str:
    """Write a tiny Wan image-to-video pipeline of ``variant`` to ``path``; return ``path``.

    Idempotent: an existing, complete folder is left as it is.
    """
    path = os.fspath(path)
    if variant not in ("2.1", "ti2v", "a14b"):
        raise ValueError(f"variant ({variant!r}) must be '2.1', 'ti2v' or 'a14b'")
    if os.path.isfile(os.path.join(path, "model_index.json")):
        return path
    with tempfile.TemporaryDirectory() as tmp:
        # The text-to-video tiny pipeline's text encoder, tokenizer, VAE and scheduler (same seed).
        t2v = WanPipeline.from_pretrained(build_tiny_wan(tmp, variant, seed=seed), torch_dtype=torch.float32)
    image_encoder = processor = transformer_2 = None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        if variant == "ti2v":
            transformer = WanTransformer3DModel(**transformer_config(TI2V_LATENT_CHANNELS))
        elif variant == "a14b":
            transformer = WanTransformer3DModel(**i2v_transformer_config(VAE["z_dim"], None))
            transformer_2 = WanTransformer3DModel(**i2v_transformer_config(VAE["z_dim"], None))
        else:
            image_encoder = CLIPVisionModel(CLIPVisionConfig(**VISION))
            processor = CLIPImageProcessor(**IMAGE_PROCESSOR)
            transformer = WanTransformer3DModel(**i2v_transformer_config(VAE["z_dim"], VISION["hidden_size"]))
    pipe = WanImageToVideoPipeline(
        tokenizer=t2v.tokenizer,
        text_encoder=t2v.text_encoder,
        vae=t2v.vae,
        scheduler=t2v.scheduler,
        image_processor=processor,
        image_encoder=image_encoder,
        transformer=transformer,
        transformer_2=transformer_2,
        boundary_ratio=A14B_BOUNDARY_RATIO if variant == "a14b" else None,
        expand_timesteps=variant == "ti2v",
    )
    pipe.save_pretrained(path)
    return path


if __name__ == "__main__":
    print(
        build_tiny_wan_i2v(
            sys.argv[1] if len(sys.argv) > 1 else ".tiny_models/wan_i2v",
            sys.argv[2] if len(sys.argv) > 2 else "2.1",
        )
    )
