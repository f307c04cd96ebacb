"""A tiny, random QwenImagePipeline (under a megabyte), saved like a real checkout.

    python -m lit_flowgrpo.tiny.qwenimage .tiny_models/qwenimage

Every component has the real Qwen-Image class: a ``Qwen2_5_VLForConditionalGeneration`` text
encoder (2 layers, hidden 32, a one-block vision tower it never uses for text), a byte-level BPE
``Qwen2Tokenizer``, ``QwenImageTransformer2DModel``, the video-style ``AutoencoderKLQwenImage``
(frames of 1, per-channel latent mean/std) and the dynamic-shift scheduler with Qwen-Image's
terminal shift. :class:`~lit_flowgrpo.policies.qwenimage.QwenImagePolicy` loads it through the same
``from_pretrained`` path as ``Qwen/Qwen-Image``.

The tokenizer knows every byte (so any text encodes) plus whole-word merges for the words of the
pipeline's prompt template, so the template's system prefix is 34 tokens, as with the real
tokenizer, and the pipeline's ``prompt_template_encode_start_idx = 34`` drops exactly that prefix.

Sizes: 32×32 images → 16×16×4 latents (VAE factor 2) → 64 packed tokens of 16 channels.
"""

from __future__ import annotations

import os
import sys

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from tokenizers import pre_tokenizers
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from lit_flowgrpo.tiny.specs import SPECS

QWEN = SPECS["qwenimage"]
#: Qwen-Image's transformer shrunk: 2 blocks of 2 heads of 16; 2×2 patches of 4 latent channels.
TRANSFORMER = dict(
    QWEN["transformer"],
    in_channels=16,
    out_channels=4,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    axes_dims_rope=(4, 6, 6),
)
#: Qwen-Image's VAE shrunk: two levels (2× in space, none in time), 4 latent channels and their statistics.
VAE = dict(
    QWEN["vae"],
    base_dim=8,
    z_dim=4,
    dim_mult=[1, 2],
    num_res_blocks=1,
    temperal_downsample=[False],
    latents_mean=[0.1, -0.2, 0.3, 0.0],
    latents_std=[1.5, 0.8, 1.2, 2.0],
)

# The words of QwenImagePipeline's prompt template, in byte-level form ("Ġ" is a leading space).
_TEMPLATE_WORDS = (
    "system",
    "user",
    "assistant",
    "Describe",
    *(
        "Ġ" + w
        for w in [
            "the",
            "image",
            "by",
            "detailing",
            "color",
            "shape",
            "size",
            "texture",
            "quantity",
            "text",
            "spatial",
            "relationships",
            "of",
            "objects",
            "and",
            "background",
        ]
    ),
)


def qwen_tokenizer() -> Qwen2Tokenizer:
    """A byte-level BPE ``Qwen2Tokenizer``: all 256 bytes, the chat markers, the template's words."""
    vocab = {"<|endoftext|>": 0}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    # Merging each word left to right, one character at a time, makes it a single token.
    merges: list[tuple[str, str]] = []
    for word in _TEMPLATE_WORDS:
        for i in range(1, len(word)):
            if word[: i + 1] not in vocab:
                vocab[word[: i + 1]] = len(vocab)
                merges.append((word[:i], word[i]))
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=32768)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


def build_tiny_qwenimage(path: str | os.PathLike[str], seed: int = 0) -> str:
    """Write a tiny Qwen-Image pipeline (32×32 images, 64 packed tokens × 16) to ``path``; return ``path``.

    Idempotent: an existing, complete folder is left as it is.
    """
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, "model_index.json")):
        return path
    tokenizer = qwen_tokenizer()
    n = len(tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen2_5_VLForConditionalGeneration(
            Qwen2_5_VLConfig(
                text_config={
                    "vocab_size": n,
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 1,
                    "max_position_embeddings": 2048,
                    # Multimodal RoPE: the sections split head_dim / 2 = 8 over (time, height, width).
                    "rope_parameters": {
                        "rope_type": "default",
                        "mrope_section": [2, 3, 3],
                        "rope_theta": 1e4,
                    },
                    "bos_token_id": None,
                    "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
                    "pad_token_id": tokenizer.pad_token_id,
                },
                vision_config={
                    "depth": 1,
                    "hidden_size": 16,
                    "intermediate_size": 32,
                    "num_heads": 2,
                    "out_hidden_size": 32,
                    "patch_size": 2,
                    "spatial_merge_size": 2,
                    "temporal_patch_size": 2,
                    "window_size": 8,
                    "fullatt_block_indexes": [0],
                },
                # Vision placeholders the tokenizer never produces.
                image_token_id=n,
                video_token_id=n + 1,
                vision_start_token_id=n + 2,
                vision_end_token_id=n + 3,
            )
        )
        transformer = QwenImageTransformer2DModel(**TRANSFORMER)
        vae = AutoencoderKLQwenImage(**VAE)
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN["scheduler"])
    pipe = QwenImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
    pipe.save_pretrained(path)
    return path


if __name__ == "__main__":
    print(build_tiny_qwenimage(sys.argv[1] if len(sys.argv) > 1 else ".tiny_models/qwenimage"))
