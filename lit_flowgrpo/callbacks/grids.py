"""Grids of samples: images tiled into one picture, plain (for TensorBoard and W&B) or captioned with
each sample's prompt and rewards (for PNG files and GIF frames). The image and the video logger both
draw with these.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["captioned_grid", "image_grid"]


def image_grid(images: Tensor, pad: int = 2) -> Tensor:
    """(B, C, H, W) uint8 -> (C, H', W') grid of ceil(sqrt(B)) columns, ``pad`` black pixels apart.

    >>> image_grid(torch.full((3, 1, 2, 2), 255, dtype=torch.uint8), pad=1)[0]
    tensor([[255, 255,   0, 255, 255],
            [255, 255,   0, 255, 255],
            [  0,   0,   0,   0,   0],
            [255, 255,   0,   0,   0],
            [255, 255,   0,   0,   0]], dtype=torch.uint8)
    """
    b, c, h, w = images.shape
    cols = math.ceil(math.sqrt(b))
    rows = math.ceil(b / cols)
    grid = torch.zeros((c, rows * h + (rows - 1) * pad, cols * w + (cols - 1) * pad), dtype=images.dtype)
    for i in range(b):
        r, col = divmod(i, cols)
        grid[:, r * (h + pad) : r * (h + pad) + h, col * (w + pad) : col * (w + pad) + w] = images[i]
    return grid


def captioned_grid(pixels: Tensor, captions: Sequence[str], cell: int = 128) -> Any:
    """(B, 3, H, W) uint8 -> a PIL image: ceil(sqrt(B)) columns of samples, each with its caption (prompt,
    then one line per reward) drawn under it.

    Small samples are enlarged by the integer factor that brings their longer side nearest ``cell`` px
    without exceeding it (nearest neighbour: a 32 px sample becomes 128 px of 4×4 blocks, its pixels
    exact), so the picture reads without zooming; samples of ``cell`` px or more keep their size.
    """
    from PIL import Image, ImageDraw, ImageFont

    b, _, h, w = pixels.shape
    scale = max(1, cell // max(h, w))
    tile_w, tile_h = w * scale, h * scale
    try:
        font = ImageFont.load_default(size=13)  # a FreeType font (Pillow >= 10.1)
    except TypeError:
        font = ImageFont.load_default()
    line_h = 16
    char_w = max(1.0, font.getlength("abcdefghijklmnopqrstuvwxyz") / 26)
    lines = [_caption_lines(c, max(8, int(tile_w / char_w))) for c in captions]
    text_h = line_h * max((len(x) for x in lines), default=0)
    pad = 8
    cols = math.ceil(math.sqrt(b))
    rows = math.ceil(b / cols)
    cell_w, cell_h = tile_w + pad, tile_h + text_h + 2 * pad
    canvas = Image.new("RGB", (pad + cols * cell_w, rows * cell_h), (30, 30, 30))
    draw = ImageDraw.Draw(canvas)
    hwc = pixels.permute(0, 2, 3, 1).numpy()  # (B, H, W, 3) uint8
    for i in range(b):
        r, c = divmod(i, cols)
        x0, y0 = pad + c * cell_w, pad + r * cell_h
        canvas.paste(Image.fromarray(hwc[i]).resize((tile_w, tile_h), Image.NEAREST), (x0, y0))
        for k, line in enumerate(lines[i]):
            draw.text((x0, y0 + tile_h + 2 + k * line_h), line, fill=(235, 235, 235), font=font)
    return canvas


def _caption_lines(caption: str, width: int, max_prompt_lines: int = 4) -> list[str]:
    """The prompt wrapped to ``width`` characters (at most 4 lines), then one line per reward.

    >>> _caption_lines("a red circle left of a blue square | reward=0.5 | ocr=nan (failed)", 16)
    ['a red circle', 'left of a blue', 'square', 'reward=0.5', 'ocr=nan (failed)']
    """
    prompt, *rewards = caption.split(" | ")
    wrapped = textwrap.wrap(prompt, width) or [""]
    if len(wrapped) > max_prompt_lines:
        wrapped = [*wrapped[: max_prompt_lines - 1], wrapped[max_prompt_lines - 1][: width - 3] + "..."]
    return [*wrapped, *rewards]
