"""LAION aesthetic predictor: an MLP on L2-normalised CLIP ViT-L/14 image embeddings.

The "improved aesthetic predictor" (C. Schuhmann, ``sac+logos+ava1-l14-linearMSE.pth``), used by
DDPO and Flow-GRPO (flow_grpo/aesthetic_scorer.py): embed with ``get_image_features``, divide by
the L2 norm, apply the MLP 768→1024→128→64→16→1 (no activations; dropout is inactive in eval).
Scores are on the AVA 1–10 scale.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from lit_flowgrpo.policies.base import DType
from lit_flowgrpo.rewards.hf import HUB_FILE, as_features, check_dtype, place
from lit_flowgrpo.rewards.images import to_pil
from lit_flowgrpo.rewards.registry import register_reward

_FLAG = "--model.init_args.reward.init_args.config.aesthetic"

DEFAULT_MLP_WEIGHTS = "https://github.com/christophschuhmann/improved-aesthetic-predictor/raw/main/sac+logos+ava1-l14-linearMSE.pth"


class AestheticMLP(nn.Module):
    """The predictor's head. Layer indices match the published state dict (``layers.{0,2,4,6,7}``)."""

    def __init__(self, input_size: int = 768) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeds: Tensor) -> Tensor:
        return self.layers(embeds)


def _weights_problem(source: str) -> str | None:
    if source.startswith(("https://", "http://")) or os.path.isfile(source) or HUB_FILE.match(source):
        return None
    return (
        f"{_FLAG}.mlp_weights ({source!r}) is neither an existing file, an http(s) URL, nor a hub file "
        "'org/repo/filename'"
    )


def load_mlp_state(source: str) -> dict[str, Tensor]:
    """The MLP's state dict from a local file, a URL (cached by torch.hub) or a hub file ``org/repo/file``."""
    if os.path.isfile(source):
        return torch.load(source, map_location="cpu", weights_only=True)
    if source.startswith(("https://", "http://")):
        return torch.hub.load_state_dict_from_url(source, map_location="cpu", weights_only=True)
    from huggingface_hub import hf_hub_download

    org, repo, filename = source.split("/", 2)
    return torch.load(hf_hub_download(f"{org}/{repo}", filename), map_location="cpu", weights_only=True)


@register_reward("aesthetic")
class AestheticReward:
    """LAION aesthetic score (1–10 scale) of each image.

    Args:
        clip: the CLIP ViT-L/14 checkpoint (model and processor), hub id or local folder.
        mlp_weights: the predictor's state dict: a local ``.pth`` file, an http(s) URL, or a hub
            file ``org/repo/filename``.
        device: where the scorer runs; ``None`` follows the images.
        dtype: the CLIP model's dtype (the MLP runs in fp32).
    """

    def __init__(
        self,
        clip: str = "openai/clip-vit-large-patch14",
        mlp_weights: str = DEFAULT_MLP_WEIGHTS,
        device: str | None = None,
        dtype: DType = "float32",
    ) -> None:
        check_dtype(dtype, _FLAG)
        problem = _weights_problem(mlp_weights)
        if problem:
            raise ValueError(problem)
        self.clip_name = clip
        self.mlp_weights = mlp_weights
        self.device = device
        self.dtype = dtype
        self.clip: nn.Module | None = None
        self.mlp: AestheticMLP | None = None
        self.processor = None

    def load(self) -> None:
        """Read the CLIP model (``from_pretrained``) and the MLP weights; called on first use."""
        if self.clip is not None:
            return
        from transformers import CLIPModel, CLIPProcessor

        self.processor = CLIPProcessor.from_pretrained(self.clip_name)
        clip = CLIPModel.from_pretrained(self.clip_name).eval().requires_grad_(False)
        mlp = AestheticMLP(clip.config.projection_dim)
        mlp.load_state_dict(load_mlp_state(self.mlp_weights))
        self.mlp = mlp.eval().requires_grad_(False)
        self.clip = clip

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        self.load()
        device = torch.device(self.device) if self.device else images.device
        clip = place(self.clip, device, self.dtype)
        mlp = place(self.mlp, device, "float32")
        pixels = self.processor(images=to_pil(images), return_tensors="pt")["pixel_values"]
        embeds = as_features(
            clip.get_image_features(pixel_values=pixels.to(device, next(clip.parameters()).dtype))
        )
        embeds = embeds.float() / embeds.float().norm(dim=-1, keepdim=True)  # (B, D) fp32, unit norm
        return mlp(embeds).squeeze(1).cpu()  # (B,)
