"""Image and video conversions shared by the reward families.

Rewards receive ``(B, 3, H, W)`` float images in [0, 1], and video rewards ``(B, F, 3, H, W)`` videos. Scorers want uint8 pixels (PIL images,
numpy arrays) or encoded bytes (PNG/JPEG for HTTP). Quantisation is ``round(x·255)`` as in the
flow_grpo reward functions (``(images * 255).round().clamp(0, 255)``, flow_grpo/rewards.py).
"""

from __future__ import annotations

import base64
import io
from typing import Literal

import numpy as np
import torch
from PIL import Image
from torch import Tensor

ImageFormat = Literal["png", "jpeg"]


def check_images(images: Tensor) -> None:
    """Raise a ``ValueError`` unless ``images`` is a (B, 3, H, W) tensor."""
    if not isinstance(images, Tensor) or images.ndim != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
        raise ValueError(f"rewards take images as a (B, 3, H, W) tensor in [0, 1]; got {shape}")


def check_videos(videos: Tensor, label: str = "video rewards") -> None:
    """Raise a ``ValueError`` naming ``label`` unless ``videos`` is a (B, F, 3, H, W) tensor with F >= 1."""
    if not isinstance(videos, Tensor) or videos.ndim != 5 or videos.shape[2] != 3 or videos.shape[1] < 1:
        shape = tuple(videos.shape) if isinstance(videos, Tensor) else type(videos).__name__
        hint = (
            " (that is a batch of images: score images with an image reward)"
            if (isinstance(videos, Tensor) and videos.ndim == 4)
            else ""
        )
        raise ValueError(f"{label} take videos as a (B, F, 3, H, W) tensor in [0, 1]; got {shape}{hint}")


def frame_indices(frames: int, max_frames: int | None) -> list[int]:
    """``max_frames`` indices of ``frames``, evenly spaced, first and last included; all when ``None``.

    >>> frame_indices(81, 5)
    [0, 20, 40, 60, 80]
    >>> frame_indices(3, 8)
    [0, 1, 2]
    """
    if max_frames is None or frames <= max_frames:
        return list(range(frames))
    if max_frames == 1:
        return [0]
    # (F-1)·k/(n-1) for k = 0..n-1 (numpy.linspace's spacing), rounded half up to whole frames
    return [int((frames - 1) * k / (max_frames - 1) + 0.5) for k in range(max_frames)]


def to_uint8(images: Tensor) -> Tensor:
    """(B, 3, H, W) in [0, 1] -> (B, 3, H, W) uint8 on the same device."""
    check_images(images)
    return (images.detach().float() * 255).round().clamp(0, 255).to(torch.uint8)


def to_numpy_hwc(images: Tensor) -> np.ndarray:
    """(B, 3, H, W) in [0, 1] -> (B, H, W, 3) uint8 numpy array on the CPU."""
    return to_uint8(images).permute(0, 2, 3, 1).cpu().numpy()


def to_pil(images: Tensor) -> list[Image.Image]:
    """(B, 3, H, W) in [0, 1] -> B RGB PIL images."""
    return [Image.fromarray(array) for array in to_numpy_hwc(images)]


def to_pil_resized(images: Tensor, side: int | None) -> list[Image.Image]:
    """:func:`to_pil`, each image resized to ``side`` × ``side`` (PIL's default filter) unless ``side`` is
    ``None``."""
    pil = to_pil(images)
    return pil if side is None else [image.resize((side, side)) for image in pil]


def encode(image: Image.Image, fmt: ImageFormat, quality: int | None = None) -> bytes:
    """Encode one image as PNG or JPEG bytes.

    Args:
        image: an RGB image.
        fmt: ``"png"`` (lossless) or ``"jpeg"``.
        quality: JPEG quality; ``None`` keeps PIL's default (75), which is what the published
            GenEval client sends.
    """
    buffer = io.BytesIO()
    if fmt == "jpeg":
        kwargs = {} if quality is None else {"quality": quality}
        image.save(buffer, format="JPEG", **kwargs)
    elif fmt == "png":
        image.save(buffer, format="PNG")
    else:
        raise ValueError(f"image format must be 'png' or 'jpeg', got {fmt!r}")
    return buffer.getvalue()


def to_base64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def data_url(image: Image.Image, fmt: ImageFormat) -> str:
    """An RFC 2397 ``data:`` URL, the form OpenAI-compatible servers accept in ``image_url``."""
    return f"data:image/{fmt};base64,{to_base64(encode(image, fmt))}"
