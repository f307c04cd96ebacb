"""Character-level tokenizers of the real classes, built without any download."""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import Unigram
from tokenizers.processors import TemplateProcessing
from transformers import CLIPTokenizer, Qwen2Tokenizer, T5TokenizerFast

_CHARS = list(string.ascii_lowercase + string.digits + ".,'\"!?-:;()")


def clip_tokenizer(model_max_length: int = 77) -> CLIPTokenizer:
    """A CLIP BPE tokenizer whose vocabulary is single characters (with and without ``</w>``)."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in _CHARS:
        vocab[c] = len(vocab)
    for c in _CHARS:
        vocab[c + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)


def t5_tokenizer(model_max_length: int = 512) -> T5TokenizerFast:
    """A T5 (Unigram, SentencePiece-style) tokenizer over single characters."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("▁" + c, -1.0) for c in _CHARS] + [(c, -2.0) for c in _CHARS] + [("▁", -3.0)]
    tok = Tokenizer(Unigram(pieces, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return T5TokenizerFast(
        tokenizer_object=tok,
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_ids=0,
        model_max_length=model_max_length,
    )


#: Qwen3's chat template reduced to what the FLUX.2 klein and Z-Image pipelines send: user turns, the
#: generation prompt, and the empty thinking block that ``enable_thinking=False`` adds (FLUX.2 klein asks
#: for it; Z-Image does not).
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)


def qwen3_tokenizer() -> Qwen2Tokenizer:
    """A byte-level BPE ``Qwen2Tokenizer`` in Qwen3's form (the text encoder of FLUX.2 klein and Z-Image):
    the 256 byte symbols with no merges (every text encodes, a byte a token), the chat and thinking markers
    as special tokens, and :data:`QWEN3_CHAT_TEMPLATE`."""
    vocab = {"<|endoftext|>": 0}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=32768)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]}
    )
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    return tok
