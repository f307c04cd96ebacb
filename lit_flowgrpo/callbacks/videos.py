"""Video encodings for the sample logger: animated GIFs (Pillow, no video library), grids of videos
and the captioned picture, and the TensorBoard summary of a GIF.

A GIF holds at most 256 colours per frame (Pillow picks an adaptive palette for each) and its frame
delays are whole centiseconds, so the shown rate is 100 / round(100 / fps) frames per second
(16 fps shows at 16.7). Pillow merges consecutive identical frames into one longer frame: a static
video is one frame shown for the whole duration.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_flowgrpo.callbacks.grids import captioned_grid, image_grid

__all__ = ["captioned_video", "downscale", "gif_bytes", "tensorboard_gif_summary", "video_grid"]


def gif_bytes(frames: Sequence[Any], fps: float) -> bytes:
    """Encode PIL images (one per frame, all one size) as a looping animated GIF."""
    if not frames:
        raise ValueError("a GIF needs at least one frame")
    if not fps > 0:
        raise ValueError(f"fps ({fps}) must be positive")
    buffer = io.BytesIO()
    delay_ms = 10 * max(1, round(100 / fps))  # GIF stores delays in centiseconds
    rgb = [frame.convert("RGB") for frame in frames]
    rgb[0].save(buffer, format="GIF", save_all=True, append_images=rgb[1:], duration=delay_ms, loop=0)
    return buffer.getvalue()


def frames_of(pixels: Tensor) -> list[Any]:
    """(F, 3, H, W) uint8 -> F PIL RGB images."""
    from PIL import Image

    return [Image.fromarray(frame.permute(1, 2, 0).numpy()) for frame in pixels]


def downscale(pixels: Tensor, max_side: int | None) -> Tensor:
    """(B, F, 3, H, W) uint8 with the longer side brought down to at most ``max_side`` (area average,
    aspect kept); unchanged when already small enough or ``max_side`` is ``None``."""
    b, f, c, h, w = pixels.shape
    if max_side is None or max(h, w) <= max_side:
        return pixels
    scale = max_side / max(h, w)
    size = (max(1, round(h * scale)), max(1, round(w * scale)))
    small = F.interpolate(pixels.reshape(b * f, c, h, w).float(), size=size, mode="area")
    return small.round().clamp(0, 255).to(torch.uint8).reshape(b, f, c, *size)


def video_grid(pixels: Tensor, pad: int = 2) -> Tensor:
    """(B, F, 3, H, W) uint8 -> (F, 3, H', W'): each frame a grid of the B videos' frames, as
    :func:`lit_flowgrpo.callbacks.grids.image_grid` lays out images (TensorBoard's ``add_video``
    also tiles a batch into one video)."""
    return torch.stack([image_grid(pixels[:, t], pad=pad) for t in range(pixels.shape[1])])


def captioned_video(pixels: Tensor, captions: Sequence[str], cell: int = 128) -> list[Any]:
    """(B, F, 3, H, W) uint8 -> F PIL frames: each the captioned grid of the B videos at that frame
    (:func:`lit_flowgrpo.callbacks.grids.captioned_grid`: prompt and rewards drawn under each)."""
    return [captioned_grid(pixels[:, t], captions, cell=cell) for t in range(pixels.shape[1])]


def tensorboard_gif_summary(tag: str, gif: bytes, height: int, width: int) -> Any:
    """A TensorBoard ``Summary`` holding one animated GIF as an image, the form ``add_video`` writes
    (``torch.utils.tensorboard.summary.video``), which the image dashboard plays. ``add_video`` itself
    encodes with moviepy, not a dependency here."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=gif)
    return Summary(value=[Summary.Value(tag=tag, image=image)])
