"""A tiny, random HunyuanVideo15Pipeline (under a MB), saved like a real checkout.

    python -m lit_flowgrpo.tiny.hunyuanvideo15 .tiny_models/hunyuanvideo15

Every component has the real class of ``hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v``: a
``Qwen2_5_VLTextModel`` text encoder (3 layers, hidden 32; the pipeline reads the third state from the
end) with a ``Qwen2Tokenizer`` made locally, a ``T5EncoderModel`` glyph encoder (one layer, d_model 16)
with the real ``ByT5Tokenizer`` (bytes: it needs no vocabulary file), ``HunyuanVideo15Transformer3DModel``
(2 blocks of 2 heads of 16, one refiner block), ``AutoencoderKLHunyuanVideo15`` with the real factors
(16× in space, 4× in time: five levels of 8 channels), ``FlowMatchEulerDiscreteScheduler`` with the
480p shift and ``ClassifierFreeGuidance`` at the 480p scale (:data:`lit_flowgrpo.tiny.specs.SPECS`).

The tokenizer: the pipeline wraps each prompt in a chat template (a system message, then the prompt) and
crops the first ``prompt_template_encode_start_idx`` (108) tokens of the encoder's states, the
template's length in Qwen2.5-VL's tokenizer. Here the words of the system message are single tokens
but for a few spelt out in characters, chosen so that the template is 108 tokens here too: the crop
then keeps exactly the prompt's tokens, as it does for the released model. Other words are spelt out
character by character.

Sizes: 5 frames of 32×32 px → (4, 2, 2, 2) latents → 2·2·2 = 8 video tokens, beside the 729 (masked)
image tokens, 256 glyph tokens and ``max_sequence_length`` prompt tokens of the conditioning.
"""

from __future__ import annotations

import inspect
import os
import string
import sys

import torch
from diffusers import (
    AutoencoderKLHunyuanVideo15,
    ClassifierFreeGuidance,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
)
from transformers import (
    ByT5Tokenizer,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    Qwen2Tokenizer,
    T5Config,
    T5EncoderModel,
)

from lit_flowgrpo.tiny.specs import SPECS

HUNYUAN = SPECS["hunyuanvideo15_480p"]
#: ``HunyuanVideo15Pipeline.prompt_template_encode_start_idx``: the chat template's length in tokens.
TEMPLATE_TOKENS = 108
#: Latent channels of the tiny VAE (the released one has 32).
LATENT_CHANNELS = 4
#: Widths of the tiny text encoders (the transformer's ``text_embed_dim`` and ``text_embed_2_dim``).
TEXT_DIM, GLYPH_DIM = 32, 16

_CHARS = list(string.ascii_letters + string.digits + ".,'\"!?-:;()")
_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2's chat template reduced to what the pipeline sends (string contents, a generation prompt).
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

VAE = dict(
    HUNYUAN["vae"],
    latent_channels=LATENT_CHANNELS,
    block_out_channels=(8, 8, 8, 8, 8),
    layers_per_block=1,
)


def transformer_config() -> dict:
    """HunyuanVideo 1.5's transformer shrunk: 2 blocks of 2 heads of 16 (rotary axes 4 + 6 + 6), one
    refiner block, the latent channels of :data:`VAE` (in: latents, condition latents and a mask)."""
    return dict(
        HUNYUAN["transformer"],
        in_channels=2 * LATENT_CHANNELS + 1,
        out_channels=LATENT_CHANNELS,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        text_embed_dim=TEXT_DIM,
        text_embed_2_dim=GLYPH_DIM,
        image_embed_dim=16,
        rope_axes_dim=(4, 6, 6),
    )


def _system_message() -> str:
    return (
        inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default
    )


def _tokenizer(words: list[str]) -> Qwen2Tokenizer:
    from tokenizers import AddedToken, Tokenizer, pre_tokenizers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE(vocab={c: i for i, c in enumerate(_CHARS)}, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in _SPECIALS])
    tok.add_tokens([AddedToken(w, single_word=True, normalized=False) for w in words])
    return Qwen2Tokenizer(
        tokenizer_object=tok,
        chat_template=_CHAT_TEMPLATE,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        padding_side="right",  # as the conversion script loads Qwen2.5-VL's
    )


def template_prefix() -> str:
    """The text before the prompt in the pipeline's chat template: what its crop removes."""
    return f"<|im_start|>system\n{_system_message()}<|im_end|>\n<|im_start|>user\n"


def qwen_tokenizer() -> Qwen2Tokenizer:
    """A Qwen2 tokenizer in which :func:`template_prefix` is :data:`TEMPLATE_TOKENS` tokens.

    Every word of the system message starts as one token (95 in all); the shortest are then spelt out
    in characters, one word at a time, while the count stays within 108, until it is 108."""
    roles = ["system", "user", "assistant"]
    words = [w for w in dict.fromkeys(w.strip(".,:") for w in _system_message().split()) if len(w) > 1]
    words = list(dict.fromkeys(words + roles))
    prefix = template_prefix()

    def count(ws: list[str]) -> int:
        return len(_tokenizer(ws)(prefix).input_ids)

    for word in sorted((w for w in words if w not in roles), key=len):
        if count(words) == TEMPLATE_TOKENS:
            break
        trial = [w for w in words if w != word]
        if count(trial) <= TEMPLATE_TOKENS:
            words = trial
    tokenizer = _tokenizer(words)
    if count(words) != TEMPLATE_TOKENS:
        raise RuntimeError(f"the tiny template is {count(words)} tokens, not {TEMPLATE_TOKENS}")
    return tokenizer


def build_tiny_hunyuanvideo15(path: str | os.PathLike[str], seed: int = 0) -> str:
    """Write a tiny HunyuanVideo 1.5 text-to-video pipeline to ``path``; return ``path``.

    Idempotent: an existing, complete folder is left as it is.
    """
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, "model_index.json")):
        return path
    tokenizer = qwen_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen2_5_VLTextModel(
            Qwen2_5_VLTextConfig(
                vocab_size=len(tokenizer),
                hidden_size=TEXT_DIM,
                intermediate_size=64,
                num_hidden_layers=3,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=2048,
                # Qwen2.5-VL's multimodal rotary sections, sized to the head (16: 8 frequencies)
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
                bos_token_id=None,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
        tokenizer_2 = ByT5Tokenizer()
        text_encoder_2 = T5EncoderModel(
            T5Config(
                vocab_size=len(tokenizer_2),
                d_model=GLYPH_DIM,
                d_ff=32,
                d_kv=8,
                num_layers=1,
                num_heads=2,
                relative_attention_num_buckets=8,
            )
        )
        vae = AutoencoderKLHunyuanVideo15(**VAE)
        transformer = HunyuanVideo15Transformer3DModel(**transformer_config())
    pipe = HunyuanVideo15Pipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(**HUNYUAN["scheduler"]),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(**HUNYUAN["guider"]),
    )
    pipe.save_pretrained(path)
    return path


if __name__ == "__main__":
    print(build_tiny_hunyuanvideo15(sys.argv[1] if len(sys.argv) > 1 else ".tiny_models/hunyuanvideo15"))
