"""What the Qwen2-VL reward models (HPSv3, VideoAlign) share: the backbone loaded from a released state dict,
and the forward that turns a prompt and an image or a video into the hidden state at reward tokens.

Both models are a ``Qwen2VLForConditionalGeneration`` with a small head ``rm_head`` on the last hidden
states, read at special tokens added to the tokenizer (``<|Reward|>`` for HPSv3; ``<|VQ_reward|>``,
``<|MQ_reward|>``, ``<|TA_reward|>`` for VideoAlign). Their forwards (MizzenAI/HPSv3
``hpsv3/model/qwen2vl_trainer.py`` and KwaiVGI/VideoAlign ``trainer.py``, ``Qwen2VLRewardModelBT.forward``)
embed the tokens, scatter the vision tower's merged patch features into the image or video pad tokens,
and call the language model with ``position_ids=None``: the language model then numbers the tokens
0..L−1 on all three rotary axes, not with Qwen2-VL's multimodal rope indices. The models were trained
so, and :func:`hidden_states` does the same.

The checkpoint is a state dict of that class; its keys are either transformers >= 4.52's
(``model.visual.``, ``model.language_model.``) or the earlier ones (``visual.``, ``model.``), both
mapped here onto ``Qwen2VLModel``'s; ``lm_head`` is not needed for a score and is left out. The
backbone loads with ``Qwen2VLModel.from_pretrained(None, config=..., state_dict=...)``, its
configuration that of the base model (``Qwen/Qwen2-VL-7B-Instruct`` / ``-2B-Instruct``) with the
vocabulary grown by the added tokens, as the published ``resize_token_embeddings`` did.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lit_flowgrpo.errors import SettingsError

__all__ = [
    "IMAGE_PAD",
    "backbone_key",
    "chat_text",
    "encode_images",
    "hidden_states",
    "load_backbone",
    "load_tokenizer",
    "split_state",
]

IMAGE_PAD = "<|image_pad|>"
"""Qwen2-VL's image placeholder: the chat template writes it once, the encoding repeats it per merged patch."""


def backbone_key(key: str) -> str | None:
    """``Qwen2VLModel``'s name of a reward checkpoint's key, ``None`` for a key outside the backbone.

    transformers >= 4.52 saves ``model.visual.*`` and ``model.language_model.*``; earlier releases
    ``visual.*`` and ``model.*`` (the language model).
    """
    key = key.removeprefix("module.")
    if key.startswith(("model.visual.", "model.language_model.")):
        return key.removeprefix("model.")
    if key.startswith("visual."):
        return key
    if key.startswith("model."):
        return "language_model." + key.removeprefix("model.")
    return None


def split_state(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(``Qwen2VLModel``'s state dict, the head's ``rm_head.*`` without its prefix) of a reward checkpoint.

    Raises:
        ValueError: a key that is neither the backbone's, the language head's nor the reward head's, or
            no reward head at all.
    """
    backbone: dict[str, Tensor] = {}
    head: dict[str, Tensor] = {}
    unknown = []
    for key, value in state.items():
        name = backbone_key(key)
        if name is not None:
            backbone[name] = value
        elif key.removeprefix("module.").startswith("rm_head."):
            head[key.removeprefix("module.").removeprefix("rm_head.")] = value
        elif key.removeprefix("module.") != "lm_head.weight":  # next-token logits: not part of a score
            unknown.append(key)
    if unknown or not head:
        raise ValueError(
            "the checkpoint is not a Qwen2-VL reward model's state dict: "
            + (
                f"{len(unknown)} keys have no place (e.g. {unknown[:3]})"
                if unknown
                else "it has no rm_head.* weights"
            )
        )
    return backbone, head


def load_backbone(base: str, state: dict[str, Tensor], vocab_size: int, flag: str) -> nn.Module:
    """``Qwen2VLModel`` with ``base``'s configuration (vocabulary of ``vocab_size``) and ``state``'s weights.

    Raises:
        SettingsError: naming ``flag``, when ``state`` leaves a weight unset or holds one of no place.
    """
    from transformers import AutoConfig, Qwen2VLModel

    config = AutoConfig.from_pretrained(base)
    text_config = getattr(config, "text_config", config)
    text_config.vocab_size = vocab_size
    if hasattr(config, "vocab_size"):
        config.vocab_size = vocab_size
    model, info = Qwen2VLModel.from_pretrained(
        None, config=config, state_dict=state, output_loading_info=True
    )
    if info["missing_keys"] or info["unexpected_keys"]:
        raise SettingsError(
            f"{flag} does not match {base!r}'s configuration: missing {list(info['missing_keys'])[:3]}, "
            f"unexpected {list(info['unexpected_keys'])[:3]}"
        )
    return model


QWEN2VL_SYSTEM = "You are a helpful assistant."
"""The system turn Qwen2-VL's chat template writes when the conversation has none."""


def chat_text(tokenizer: Any, vision: str, text: str) -> str:
    """One user turn of an ``"image"`` or a ``"video"`` then ``text``, and the assistant's prompt, as
    Qwen2-VL's chat template renders it (the published rewards' ``apply_chat_template(...,
    add_generation_prompt=True)``). The tokenizer's own template when it carries one; when it carries
    none (the template may live only in the processor's ``chat_template.json``), that rendering
    written out: the default system turn, the vision placeholder between its start and end tokens.
    """
    if getattr(tokenizer, "chat_template", None):
        message = {"role": "user", "content": [{"type": vision}, {"type": "text", "text": text}]}
        return tokenizer.apply_chat_template([message], tokenize=False, add_generation_prompt=True)
    pad = "<|image_pad|>" if vision == "image" else "<|video_pad|>"
    return (
        f"<|im_start|>system\n{QWEN2VL_SYSTEM}<|im_end|>\n<|im_start|>user\n"
        f"<|vision_start|>{pad}<|vision_end|>{text}<|im_end|>\n<|im_start|>assistant\n"
    )


def load_tokenizer(base: str, reward_tokens: list[str]) -> Any:
    """``base``'s tokenizer, padding on the right, with the reward tokens added (as the published models)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base, padding_side="right")
    tokenizer.padding_side = "right"
    tokenizer.add_special_tokens({"additional_special_tokens": reward_tokens})
    return tokenizer


def encode_images(
    tokenizer: Any, image_processor: Any, texts: list[str], images: list[Any]
) -> dict[str, Tensor]:
    """Token ids and pixels of B (chat text, PIL image) pairs, as ``Qwen2VLProcessor.__call__`` makes them.

    The processor is not used because transformers >= 5 builds its video half on torchvision, which is
    not a dependency; its image half is the image processor itself, and what the processor adds is
    written here: each text's one :data:`IMAGE_PAD` repeated once per merged patch of its image
    (``grid_t · grid_h · grid_w / merge_size²``), then the texts tokenised, padded on the right.
    """
    pixels = image_processor(images=images, return_tensors="pt")
    merge = image_processor.merge_size
    counts = (pixels["image_grid_thw"].prod(-1) // merge**2).tolist()
    expanded = [t.replace(IMAGE_PAD, IMAGE_PAD * int(n), 1) for t, n in zip(texts, counts, strict=True)]
    tokens = tokenizer(expanded, padding=True, return_tensors="pt")
    return {
        "input_ids": tokens["input_ids"],
        "attention_mask": tokens["attention_mask"],
        "pixel_values": pixels["pixel_values"],
        "image_grid_thw": pixels["image_grid_thw"],
    }


def _merged(output: Any) -> Tensor:
    """The vision tower's merged patch features: a tensor (transformers < 5) or ``pooler_output``."""
    return output if isinstance(output, Tensor) else output.pooler_output


def hidden_states(
    backbone: nn.Module, batch: dict[str, Tensor], token_ids: list[int]
) -> tuple[Tensor, Tensor]:
    """Last hidden states at each sample's reward tokens: ((B, len(token_ids), D), (B,) bool).

    ``batch`` is the processor's output on the backbone's device (``input_ids``, ``attention_mask`` and
    ``pixel_values`` + ``image_grid_thw`` or ``pixel_values_videos`` + ``video_grid_thw``). The states
    are in ``token_ids``' order; the mask says which samples hold each reward token exactly once (a
    prompt that spells a reward token's text holds it twice: that sample cannot be scored).
    """
    input_ids = batch["input_ids"]
    language = backbone.language_model
    embeds = language.embed_tokens(input_ids)  # (B, L, D)
    visual = backbone.visual
    dtype = next(visual.parameters()).dtype
    config = backbone.config
    for pixels, grid, token in (
        ("pixel_values", "image_grid_thw", config.image_token_id),
        ("pixel_values_videos", "video_grid_thw", config.video_token_id),
    ):
        if batch.get(pixels) is None:
            continue
        features = _merged(visual(batch[pixels].to(dtype), grid_thw=batch[grid]))  # (N_tokens, D)
        mask = (input_ids == token).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(mask, features.to(embeds.dtype))
    # position_ids=None: positions 0..L-1 on the three rotary axes, as the published forwards.
    hidden = language(inputs_embeds=embeds, attention_mask=batch["attention_mask"]).last_hidden_state
    found = torch.stack([(input_ids == t) for t in token_ids], dim=1)  # (B, T, L)
    ok = (found.sum(-1) == 1).all(dim=1)  # (B,)
    position = found.int().argmax(-1)  # (B, T): the first occurrence
    rows = torch.arange(hidden.shape[0], device=hidden.device)[:, None]
    return hidden[rows, position], ok  # (B, T, D), (B,)
