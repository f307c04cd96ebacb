"""JPEG (in)compressibility: the file size of the image saved as JPEG at quality 95.

DDPO (Black et al., 2023, §5 "Compressibility and incompressibility"; ddpo-pytorch
``rewards.py``): ``incompressibility = size_bytes / 1000`` (KB), ``compressibility = −that``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lit_flowgrpo.rewards.images import encode, to_pil
from lit_flowgrpo.rewards.registry import register_reward

QUALITY = 95


def jpeg_size_kb(images: Tensor, quality: int = QUALITY) -> Tensor:
    """(B,) fp32 size in kilobytes (1000 bytes, as DDPO) of each image saved as JPEG at ``quality``."""
    sizes = [len(encode(image, "jpeg", quality=quality)) / 1000 for image in to_pil(images)]
    return torch.tensor(sizes, dtype=torch.float32)


@register_reward("jpeg_incompressibility")
class JpegIncompressibility:
    """Reward = JPEG size in KB at quality 95: detailed, high-frequency images score higher."""

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        return jpeg_size_kb(images)


@register_reward("jpeg_compressibility")
class JpegCompressibility:
    """Reward = −(JPEG size in KB at quality 95): smooth, simple images score higher."""

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        return -jpeg_size_kb(images)
