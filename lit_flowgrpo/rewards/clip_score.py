"""CLIPScore (Hessel et al., 2021): max(100 · cos(E_image, E_text), 0), computed by torchmetrics.

torchmetrics' functional ``clip_score`` averages over its inputs, so it is called once per
(image, prompt) pair with the loaded model handed over as a callable (its documented way to use
a model other than its four hub ids). Images go in as uint8, which the CLIP processor rescales.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lit_flowgrpo.rewards.hf import CLIPFeatures, place
from lit_flowgrpo.rewards.images import to_uint8
from lit_flowgrpo.rewards.registry import register_reward


@register_reward("clip_score")
class CLIPScoreReward:
    """torchmetrics' CLIPScore of each (image, prompt) pair, in [0, 100].

    Args:
        model: a CLIP checkpoint, hub id or local ``save_pretrained`` folder holding both the
            model and its processor.
        device: where the scorer runs; ``None`` follows the images. The scorer stays fp32:
            torchmetrics feeds it fp32 pixels.
    """

    def __init__(
        self,
        model: str = "openai/clip-vit-large-patch14",
        device: str | None = None,
    ) -> None:
        self.model_name = model
        self.device = device
        self.model: CLIPFeatures | None = None
        self.processor = None

    def load(self) -> None:
        """Read the weights (``from_pretrained``); called on first use."""
        if self.model is not None:
            return
        from transformers import CLIPModel, CLIPProcessor

        self.processor = CLIPProcessor.from_pretrained(self.model_name)
        self.model = CLIPFeatures(CLIPModel.from_pretrained(self.model_name).eval().requires_grad_(False))

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        from torchmetrics.functional.multimodal import clip_score

        if len(prompts) != images.shape[0]:
            raise ValueError(f"clip_score: {images.shape[0]} images but {len(prompts)} prompts")
        self.load()
        device = torch.device(self.device) if self.device else images.device
        model = place(self.model, device, "float32")
        pixels = to_uint8(images).to(device)  # torchmetrics runs the model on the images' device

        def loaded() -> tuple[CLIPFeatures, object]:
            return model, self.processor

        scores = [clip_score(pixels[i], prompts[i], model_name_or_path=loaded) for i in range(len(prompts))]
        return torch.stack([s.detach().float().cpu().reshape(()) for s in scores])
