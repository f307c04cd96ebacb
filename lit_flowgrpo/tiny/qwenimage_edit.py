"""A tiny, random QwenImageEditPlusPipeline (Qwen-Image-Edit-2509 / 2511), saved like a real checkout.

    python -m lit_flowgrpo.tiny.qwenimage_edit .tiny_models/qwenimage_edit          (2509)
    python -m lit_flowgrpo.tiny.qwenimage_edit .tiny_models/qwenimage_edit_2511 2511

Every component has the real class: a ``Qwen2_5_VLForConditionalGeneration`` whose one-block vision tower
does see the source images (patches of 2 pixels, merged 2×2, so every 4×4 pixels of a source become one
``<|image_pad|>`` token), a byte-level BPE ``Qwen2Tokenizer`` with the vision markers, the Qwen2-VL image
processor of the same patch and merge sizes, and the tiny Qwen-Image transformer, VAE and scheduler of
:mod:`lit_flowgrpo.tiny.qwenimage`. 2511 differs from 2509 in the transformer's ``zero_cond_t`` only: the
source tokens are modulated with timestep 0.

The tokenizer merges the words of the edit pipeline's system prompt so that its prefix, up to and
including ``<|im_start|>user\\n``, is 64 tokens, as with the real tokenizer: the pipeline's
``prompt_template_encode_start_idx = 64`` then drops exactly that prefix.

``model_index.json`` and ``processor/`` name ``transformers.Qwen2VLProcessor`` as a real checkout does; the
processor folder holds the image processor and the tokenizer (no video processor: the pipeline never sends
video, and transformers' video processors need torchvision). :func:`lit_flowgrpo.policies.qwenimage_edit.load_processor`
reads it on any machine.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImageEditPlusPipeline,
    QwenImageTransformer2DModel,
)
from tokenizers import pre_tokenizers
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from lit_flowgrpo.policies.qwenimage_edit import ImageOnlyQwen2VLProcessor
from lit_flowgrpo.tiny.qwenimage import QWEN, TRANSFORMER, VAE
from lit_flowgrpo.tiny.specs import SPECS

#: The checkpoints this builds: 2511's transformer modulates the source tokens with timestep 0.
VARIANTS = {"2509": dict(zero_cond_t=False), "2511": dict(zero_cond_t=True)}
EDIT = SPECS["qwenimage_edit_2509"]
#: Qwen2.5-VL-7B shrunk: 2 layers of 32, 2 heads (1 KV head); the RoPE sections split head_dim / 2 = 8.
TEXT = dict(
    EDIT["text_encoder"]["text_config"],
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=2048,
    rope_parameters=dict(
        EDIT["text_encoder"]["text_config"]["rope_parameters"], mrope_section=[2, 3, 3], rope_theta=1e4
    ),
)
#: Its vision tower shrunk: one block of 16, patches of 2 pixels merged 2x2 (one token per 4x4 pixels).
VISION = dict(
    EDIT["text_encoder"]["vision_config"],
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=TEXT["hidden_size"],
    patch_size=2,
    window_size=8,
    fullatt_block_indexes=[0],
)
#: The image processor of the tiny tower's patch size; sources of 4 to 64x64 pixels keep their size.
PROCESSOR = dict(EDIT["processor"], patch_size=VISION["patch_size"], min_pixels=4 * 4, max_pixels=64 * 64)
#: How many tokens QwenImageEditPlusPipeline drops from the front of every encoded prompt.
PREFIX_TOKENS = 64
_SPECIAL = [
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


def _prefix() -> str:
    """The edit pipeline's system prompt up to the user's text, read off a pipeline without components."""
    pipe = QwenImageEditPlusPipeline(
        scheduler=None, vae=None, text_encoder=None, tokenizer=None, processor=None, transformer=None
    )
    if pipe.prompt_template_encode_start_idx != PREFIX_TOKENS:
        raise RuntimeError(
            f"this diffusers drops {pipe.prompt_template_encode_start_idx} template tokens, not 64"
        )
    template = pipe.prompt_template_encode
    return template[: template.index("{}")]


def _bpe_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Qwen2Tokenizer:
    tok = Qwen2Tokenizer(vocab=dict(vocab), merges=list(merges), model_max_length=32768)
    tok.add_special_tokens({"additional_special_tokens": _SPECIAL})
    return tok


def edit_tokenizer() -> Qwen2Tokenizer:
    """A byte-level BPE ``Qwen2Tokenizer``: all 256 bytes, the chat and vision markers, and merges that make
    each word of the edit template's prefix one token, so that the prefix is :data:`PREFIX_TOKENS` tokens."""
    vocab = {"<|endoftext|>": 0}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges: list[tuple[str, str]] = []
    prefix = _prefix()
    # The prefix's pieces between the special tokens, as the tokenizer's own pre-tokenizer cuts them.
    cut = _bpe_tokenizer(vocab, merges).backend_tokenizer.pre_tokenizer.pre_tokenize_str
    words = prefix.replace("<|im_start|>", "\0").replace("<|im_end|>", "\0").split("\0")
    pieces = list(dict.fromkeys(p for part in words for p, _ in cut(part)))
    # Merges are ranked in the order they are added, and one word's merge may cut into another ("us" of
    # "user" inside "Ġuser"): join whatever a word still splits into, pair by pair, until each is one token.
    for _ in range(32):
        tok = _bpe_tokenizer(vocab, merges)
        split = [tok.backend_tokenizer.model.tokenize(p) for p in pieces]
        pending = [[t.value for t in tokens] for tokens in split if len(tokens) > 1]
        if not pending:
            break
        for tokens in pending:
            left, right = tokens[0], tokens[1]
            if (left, right) not in merges:
                merges.append((left, right))
                vocab.setdefault(left + right, len(vocab))
    tok = _bpe_tokenizer(vocab, merges)
    n = len(tok(prefix).input_ids)
    if n != PREFIX_TOKENS:
        raise RuntimeError(f"the edit template's prefix is {n} tokens, not {PREFIX_TOKENS}")
    return tok


def edit_processor(tokenizer: Qwen2Tokenizer) -> ImageOnlyQwen2VLProcessor:
    """The Qwen2-VL image processor of the tiny vision tower's patch and merge sizes (:data:`PROCESSOR`), with
    ``tokenizer``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(**PROCESSOR)
    return ImageOnlyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer)


def _text_encoder(tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLForConditionalGeneration:
    ids = tokenizer.convert_tokens_to_ids
    return Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config=dict(
                TEXT,
                vocab_size=len(tokenizer),
                bos_token_id=None,
                eos_token_id=ids("<|im_end|>"),
                pad_token_id=tokenizer.pad_token_id,
            ),
            vision_config=VISION,
            image_token_id=ids("<|image_pad|>"),
            video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"),
            vision_end_token_id=ids("<|vision_end|>"),
        )
    )


def _set_json(file: str, key: str, value: object) -> None:
    with open(file, encoding="utf-8") as f:
        data = json.load(f)
    data[key] = value
    with open(file, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)


def build_tiny_qwenimage_edit(path: str | os.PathLike[str], variant: str = "2509", seed: int = 0) -> str:
    """Write a tiny Qwen-Image-Edit-``variant`` pipeline (32×32 outputs: 64 packed tokens × 16, and 64 more
    per 32×32 source) to ``path``; return ``path``. Idempotent: a complete folder is left as it is."""
    if variant not in VARIANTS:
        raise ValueError(f"variant ({variant!r}) must be one of {sorted(VARIANTS)}")
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, "model_index.json")):
        return path
    tokenizer = edit_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = _text_encoder(tokenizer)
        transformer = QwenImageTransformer2DModel(**TRANSFORMER, **VARIANTS[variant])
        vae = AutoencoderKLQwenImage(**VAE)
    pipe = QwenImageEditPlusPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN["scheduler"]),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=edit_processor(tokenizer),
        transformer=transformer,
    )
    pipe.save_pretrained(path)
    # The folder names the processor as a real checkout does (transformers' Qwen2VLProcessor), not as the
    # class that wrote it.
    _set_json(os.path.join(path, "model_index.json"), "processor", ["transformers", "Qwen2VLProcessor"])
    for file in ("processor_config.json", "tokenizer_config.json"):
        _set_json(os.path.join(path, "processor", file), "processor_class", "Qwen2VLProcessor")
    return path


if __name__ == "__main__":
    print(build_tiny_qwenimage_edit(*(sys.argv[1:2] or [".tiny_models/qwenimage_edit"]), *sys.argv[2:3]))
