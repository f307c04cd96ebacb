"""PickScore: a CLIP-H fine-tuned on Pick-a-Pic human preferences (Kirstain et al., 2023).

score = exp(logit_scale) · cos(E_text, E_image) / 26, as flow_grpo/pickscore_scorer.py (the /26
maps typical values to about [0, 1]); the unscaled ``logit`` is reported as a component too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lit_flowgrpo.policies.base import DType
from lit_flowgrpo.rewards.hf import as_features, check_dtype, place
from lit_flowgrpo.rewards.images import to_pil
from lit_flowgrpo.rewards.registry import register_reward

_FLAG = "--model.init_args.reward.init_args.config.pickscore"

PICKSCORE_NORMALIZER = 26.0
"""flow_grpo divides the PickScore logit by 26 ("norm to 0-1", pickscore_scorer.py)."""


@register_reward("pickscore")
class PickScoreReward:
    """PickScore of each (prompt, image) pair.

    Components: ``score`` (logit / 26, the primary) and ``logit`` (exp(logit_scale)·cos).

    Args:
        model: PickScore weights: a hub id or a local ``save_pretrained`` folder (``AutoModel``).
        processor: the CLIP-H processor: a hub id or a local folder (``AutoProcessor``).
        device: where the scorer runs; ``None`` follows the images.
        dtype: the scorer's weights dtype.
    """

    primary = "score"

    def __init__(
        self,
        model: str = "yuvalkirstain/PickScore_v1",
        processor: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        device: str | None = None,
        dtype: DType = "float32",
    ) -> None:
        check_dtype(dtype, _FLAG)
        self.model_name = model
        self.processor_name = processor
        self.device = device
        self.dtype = dtype
        self.model: torch.nn.Module | None = None
        self.processor = None

    @classmethod
    def from_modules(
        cls, model: torch.nn.Module, processor: Any, device: str | None = None, dtype: DType = "float32"
    ) -> PickScoreReward:
        """PickScore on a CLIP model and processor already built (Python use: weights loaded some other
        way, or a model of PickScore's shape with random weights to measure its cost)."""
        reward = cls(
            model=type(model).__name__, processor=type(processor).__name__, device=device, dtype=dtype
        )
        reward.model = model.eval().requires_grad_(False)
        reward.processor = processor
        return reward

    def load(self) -> None:
        """Read the weights (``from_pretrained``); called on first use."""
        if self.model is not None:
            return
        from transformers import AutoModel, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(self.processor_name)
        self.model = AutoModel.from_pretrained(self.model_name).eval().requires_grad_(False)

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, Tensor]:
        if len(prompts) != images.shape[0]:
            raise ValueError(f"pickscore: {images.shape[0]} images but {len(prompts)} prompts")
        self.load()
        device = torch.device(self.device) if self.device else images.device
        model = place(self.model, device, self.dtype)
        dtype = next(model.parameters()).dtype
        image_inputs = self.processor(images=to_pil(images), return_tensors="pt")
        text_inputs = self.processor(
            text=list(prompts), padding=True, truncation=True, max_length=77, return_tensors="pt"
        )
        image_embs = as_features(
            model.get_image_features(pixel_values=image_inputs["pixel_values"].to(device, dtype))
        )
        text_embs = as_features(
            model.get_text_features(
                input_ids=text_inputs["input_ids"].to(device),
                attention_mask=text_inputs["attention_mask"].to(device),
            )
        )
        image_embs = image_embs.float() / image_embs.float().norm(dim=-1, keepdim=True)  # (B, D) fp32
        text_embs = text_embs.float() / text_embs.float().norm(dim=-1, keepdim=True)  # (B, D) fp32
        logit = model.logit_scale.exp().float() * (text_embs * image_embs).sum(-1)  # (B,) paired diag
        return {"score": (logit / PICKSCORE_NORMALIZER).cpu(), "logit": logit.cpu()}
