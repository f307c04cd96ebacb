"""ImageReward (Xu et al., 2023, "ImageReward: Learning and Evaluating Human Preferences for Text-to-Image
Generation"): BLIP's ViT-L/16 image encoder, its BERT text encoder with cross-attention to the image,
and an MLP on the text encoder's first token.

The score, as THUDM/ImageReward ``ImageReward/ImageReward.py`` (``ImageReward.score``): the prompt
tokenised by BERT's uncased tokenizer padded to 35 tokens; the image encoder's output sequence (after
its final layer norm) as the cross-attention memory; the text encoder's first hidden state in float32
through the MLP 768→1024→128→64→16→1 (no activations, the aesthetic predictor's shape), then
``(raw − 0.16717362830052426) / 1.0333394966054072``, the published mean and std of the raw score.

The backbone is transformers' BLIP: ``BlipVisionModel`` is the same ViT (fused ``qkv`` of the same
layout, final layer norm on every token), ``BlipTextModel`` the same BERT with cross-attention (BLIP's
``med.py``, whose parameter names it keeps). The released ``ImageReward.pt`` is one state dict of the
BLIP and the MLP; :func:`convert_state` renames the image encoder's keys, and each part loads with
``from_pretrained(None, config=..., state_dict=...)``. ImageReward's own package is not used: it pins
old timm and fairscale, and torchvision, which is not safely installable beside any torch build.

Preprocessing is ImageReward's: the image quantised to 8 bits, resized by PIL so its shorter side is
224 (bicubic), the central crop, normalised with the OpenAI CLIP mean and std.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn

from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.policies.base import DType
from lit_flowgrpo.rewards.aesthetic import AestheticMLP
from lit_flowgrpo.rewards.hf import check_dtype, from_state_dict, local_file, place, source_problem
from lit_flowgrpo.rewards.images import check_images, to_pil
from lit_flowgrpo.rewards.registry import register_reward

__all__ = ["BLIP_VIT_LARGE", "IMAGE_REWARD_MEAN", "IMAGE_REWARD_STD", "ImageRewardReward", "convert_state"]

_FLAG = "--model.init_args.reward.init_args.config.image_reward"

IMAGE_REWARD_MEAN = 0.16717362830052426
"""The raw score's mean, subtracted (ImageReward.py, ``self.mean``)."""
IMAGE_REWARD_STD = 1.0333394966054072
"""The raw score's standard deviation, divided by (ImageReward.py, ``self.std``)."""

BLIP_VIT_LARGE: dict[str, Any] = {
    "image_size": 224,
    "patch_size": 16,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "layer_norm_eps": 1e-6,
    "hidden_act": "gelu",
}
"""BLIP's ``create_vit('large', 224)``: ViT-L/16, MLP ratio 4, LayerNorm eps 1e-6, exact GELU (vit.py)."""

_VISION_BLOCK = {
    "norm1": "layer_norm1",
    "norm2": "layer_norm2",
    "attn.qkv": "self_attn.qkv",
    "attn.proj": "self_attn.projection",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
_VISION_PLAIN = {
    "cls_token": "embeddings.class_embedding",
    "pos_embed": "embeddings.position_embedding",
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
    "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
}


def convert_state(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """ImageReward's state dict as (``BlipVisionModel``'s, ``BlipTextModel``'s, the MLP's).

    The image encoder (``blip.visual_encoder.``, BLIP's timm-style ViT) is renamed; the text encoder
    (``blip.text_encoder.``) keeps its names; ``position_ids`` buffers are dropped (transformers makes
    its own); BLIP's contrastive projections (``blip.vision_proj``, ``blip.text_proj``) are not part of
    the score and are left out. Any other key raises, naming it.
    """
    vision: dict[str, Tensor] = {}
    text: dict[str, Tensor] = {}
    head: dict[str, Tensor] = {}
    unknown = []
    for key, value in state.items():
        if key.endswith("position_ids") or key.startswith(("blip.vision_proj.", "blip.text_proj.")):
            continue
        if key.startswith("mlp."):
            head[key.removeprefix("mlp.")] = value
        elif key.startswith("blip.text_encoder."):
            text[key.removeprefix("blip.text_encoder.")] = value
        elif key.startswith("blip.visual_encoder."):
            name = key.removeprefix("blip.visual_encoder.")
            if name in _VISION_PLAIN:
                vision[_VISION_PLAIN[name]] = value
                continue
            match = re.fullmatch(r"blocks\.(\d+)\.(.+)\.(weight|bias)", name)
            if match is None or match.group(2) not in _VISION_BLOCK:
                unknown.append(key)
                continue
            index, module, kind = match.groups()
            vision[f"encoder.layers.{index}.{_VISION_BLOCK[module]}.{kind}"] = value
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(
            f"{len(unknown)} keys of the ImageReward state dict have no place (e.g. {unknown[:3]}): is this "
            "ImageReward's checkpoint (ImageReward.pt)?"
        )
    return vision, text, head


def pil_resize_center_crop(images: Tensor, side: int) -> Tensor:
    """(B, 3, H, W) in [0, 1] -> (B, 3, side, side) fp32 in [0, 1]: torchvision's ``Resize(side, BICUBIC)``
    then ``CenterCrop(side)`` on PIL images, as ImageReward's ``_transform`` (PIL's bicubic, which
    differs from torch's, and the 8-bit quantisation of the PIL image)."""
    out = []
    for image in to_pil(images):
        w, h = image.size
        size = (side, int(side * h / w)) if w <= h else (int(side * w / h), side)
        image = image.resize(size, Image.BICUBIC) if size != (w, h) else image
        left, top = round((size[0] - side) / 2.0), round((size[1] - side) / 2.0)
        image = image.crop((left, top, left + side, top + side))
        out.append(torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1))
    return torch.stack(out)  # (B, 3, side, side)


@register_reward("image_reward")
class ImageRewardReward:
    """ImageReward of each (prompt, image) pair, normalised by its published mean and std.

    Args:
        checkpoint: ImageReward's state dict: a local ``.pt`` file or a hub file ``org/repo/filename``.
        med_config: the text encoder's BERT configuration (``med_config.json``), file or hub file.
        tokenizer: BERT's uncased tokenizer, hub id or local folder (``AutoTokenizer``).
        vision_config: the image encoder's ``BlipVisionConfig`` arguments; ``None`` is BLIP's ViT-L/16
            at 224 px (:data:`BLIP_VIT_LARGE`), ImageReward's.
        device: where the scorer runs; ``None`` follows the images.
        dtype: the encoders' weights dtype (released in float32); the MLP runs in float32 either way.

    Raises:
        SettingsError: naming the setting, for a file that does not exist or an unknown dtype; before any
            weight is read.
    """

    def __init__(
        self,
        checkpoint: str = "THUDM/ImageReward/ImageReward.pt",
        med_config: str = "THUDM/ImageReward/med_config.json",
        tokenizer: str = "bert-base-uncased",
        vision_config: dict[str, Any] | None = None,
        device: str | None = None,
        dtype: DType = "float32",
    ) -> None:
        check_dtype(dtype, _FLAG)
        problems = [
            p
            for p in (
                source_problem(f"{_FLAG}.checkpoint", checkpoint),
                source_problem(f"{_FLAG}.med_config", med_config),
            )
            if p
        ]
        if problems:
            raise SettingsError("; ".join(problems))
        self.checkpoint = checkpoint
        self.med_config = med_config
        self.tokenizer_name = tokenizer
        self.vision_config = dict(vision_config or BLIP_VIT_LARGE)
        self.device = device
        self.dtype = dtype
        self.vision: nn.Module | None = None
        self.text: nn.Module | None = None
        self.mlp: AestheticMLP | None = None
        self.tokenizer: Any = None

    def load(self) -> None:
        """Read the configurations, the weights and the tokenizer; called on first use."""
        if self.vision is not None:
            return
        from transformers import (
            AutoTokenizer,
            BlipTextConfig,
            BlipTextModel,
            BlipVisionConfig,
            BlipVisionModel,
        )

        vision_config = BlipVisionConfig(**self.vision_config)
        with open(local_file(self.med_config)) as f:
            bert = json.load(f)
        text_config = BlipTextConfig(
            vocab_size=bert["vocab_size"],
            hidden_size=bert["hidden_size"],
            intermediate_size=bert["intermediate_size"],
            num_hidden_layers=bert["num_hidden_layers"],
            num_attention_heads=bert["num_attention_heads"],
            max_position_embeddings=bert["max_position_embeddings"],
            layer_norm_eps=bert["layer_norm_eps"],
            hidden_act=bert["hidden_act"],
            encoder_hidden_size=vision_config.hidden_size,  # BLIP sets encoder_width to the ViT's width
            pad_token_id=bert.get("pad_token_id", 0),
            bos_token_id=None,  # generation's tokens: the score generates nothing
            sep_token_id=None,
            is_decoder=True,  # builds the cross-attention layers; the forward runs bidirectionally
        )
        state = torch.load(local_file(self.checkpoint), map_location="cpu", weights_only=True)
        vision, text, head = convert_state(state)
        mismatch = f"{_FLAG}.checkpoint: the {{}} does not match its configuration"
        self.vision = from_state_dict(
            BlipVisionModel, vision_config, vision, mismatch.format("image encoder")
        ).eval()
        self.text = from_state_dict(
            BlipTextModel, text_config, text, mismatch.format("text encoder"), add_pooling_layer=False
        ).eval()
        mlp = AestheticMLP(text_config.hidden_size)
        mlp.load_state_dict(head)
        self.mlp = mlp.eval()
        for module in (self.vision, self.text, self.mlp):
            module.requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_name)

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        """(B,) fp32: (MLP(h_0) − mean) / std."""
        check_images(images)
        if len(prompts) != images.shape[0]:
            raise ValueError(f"image_reward: {images.shape[0]} images but {len(prompts)} prompts")
        self.load()
        device = torch.device(self.device) if self.device else images.device
        vision = place(self.vision, device, self.dtype)
        text_model = place(self.text, device, self.dtype)
        mlp = place(self.mlp, device, "float32")
        dtype = next(vision.parameters()).dtype
        side = vision.config.image_size
        pixels = pil_resize_center_crop(images, side).to(device)
        # OpenAI CLIP's mean and std, as ImageReward's Normalize.
        mean = torch.tensor([0.48145466, 0.4578275, 0.40821073], device=device).view(1, 3, 1, 1)
        std = torch.tensor([0.26862954, 0.26130258, 0.27577711], device=device).view(1, 3, 1, 1)
        image_embeds = vision(pixel_values=((pixels - mean) / std).to(dtype)).last_hidden_state  # (B, N, Dv)
        text = self.tokenizer(
            list(prompts), padding="max_length", truncation=True, max_length=35, return_tensors="pt"
        )
        hidden = text_model(
            input_ids=text["input_ids"].to(device),
            attention_mask=text["attention_mask"].to(device),
            encoder_hidden_states=image_embeds,
            encoder_attention_mask=torch.ones(image_embeds.shape[:2], dtype=torch.long, device=device),
        ).last_hidden_state  # (B, 35, Dt)
        raw = mlp(hidden[:, 0].float()).squeeze(1)  # (B,) fp32, the first token's score
        return ((raw - IMAGE_REWARD_MEAN) / IMAGE_REWARD_STD).cpu()
