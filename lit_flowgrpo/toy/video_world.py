"""Video prompts of the shapes world: one shape of one colour moving in one direction.

The grammar is shape × colour × direction, 3 × 4 × 4 = 48 prompts: "a red circle moving left to
right", "a blue square moving up", "a green triangle moving right to left", "a yellow circle moving
down". Each comes with a GenEval-style record, the image world's ``colors`` record of the object
(:func:`lit_flowgrpo.toy.world.make_record`: exactly one such object, nothing else, in every frame)
with the tag ``motion`` and the direction on the entry::

    {"tag": "motion",
     "include": [{"class": "circle", "count": 1, "color": "red", "motion": "right"}],
     "exclude": [{"class": "circle", "count": 2}, {"class": "square", "count": 1},
                 {"class": "triangle", "count": 1}],
     "prompt": "a red circle moving left to right"}

Directions are named by where the object goes: ``right`` ("left to right"), ``left``, ``up`` (towards
the top of the frame: y decreases, as image rows count down) and ``down``. Scenes are drawn with the
image world's renderer, one scene per frame (:func:`sample_trajectory`, :func:`render_video`).
"""

from __future__ import annotations

import re
from itertools import product
from typing import Any

import numpy as np

from lit_flowgrpo.toy.world import BORDER, COLORS, IMAGE_SIZE, MAX_SIZE, MIN_SIZE, SHAPES, make_record, render

VIDEO_TAG = "motion"
"""The ``tag`` of every video record."""

DIRECTIONS = ("right", "left", "up", "down")
"""Where the object moves, as the record's ``motion`` names it."""

DIRECTION_WORDS: dict[str, str] = {
    "right": "moving left to right",
    "left": "moving right to left",
    "up": "moving up",
    "down": "moving down",
}

AXES: dict[str, tuple[int, int]] = {"right": (0, 1), "left": (0, -1), "up": (1, -1), "down": (1, 1)}
"""Direction -> (axis of the centre that changes: 0 for x, 1 for y, and the sign it changes with)."""

VIDEO_VOCAB: tuple[str, ...] = tuple(
    sorted({"a"} | set(COLORS) | set(SHAPES) | {w for p in DIRECTION_WORDS.values() for w in p.split()})
)
"""Every word a video prompt can contain."""

NUM_FRAMES = 8
"""Frames of a drawn video, unless asked otherwise."""

TRAVEL = (0.35, 0.5)
"""Range of the distance a drawn object travels, as a fraction of the frame side: above the
verifier's ``min_travel`` (0.25) by a margin, and within what a 12-pixel object can cross of a
32-pixel frame with its border (0.5625)."""

_WORD = re.compile(r"[^\s,.;:!?]+")


def unknown_video_words(prompt: str) -> list[str]:
    """The words of ``prompt`` outside :data:`VIDEO_VOCAB`, each once, in order of appearance."""
    return [w for w in dict.fromkeys(_WORD.findall(prompt.lower())) if w not in VIDEO_VOCAB]


def make_video_record(shape: str, color: str, direction: str) -> dict[str, Any]:
    """The record of "a ``color`` ``shape`` moving ``direction``".

    Raises:
        ValueError: naming every argument outside the world.
    """
    problems = [f"shape {shape!r} (shapes: {list(SHAPES)})"] if shape not in SHAPES else []
    problems += [f"colour {color!r} (colours: {list(COLORS)})"] if color not in COLORS else []
    problems += (
        [f"direction {direction!r} (directions: {list(DIRECTIONS)})"] if direction not in DIRECTIONS else []
    )
    if problems:
        raise ValueError(f"cannot build a toy-world video record with {', '.join(problems)}")
    record = make_record("colors", [(shape, 1, color)])
    record["tag"] = VIDEO_TAG
    record["include"][0]["motion"] = direction
    record["prompt"] = f"{record['prompt']} {DIRECTION_WORDS[direction]}"
    return record


def video_records() -> list[dict[str, Any]]:
    """Every video record, in a fixed order (direction, colour, shape)."""
    return [make_video_record(s, c, d) for d, c, s in product(DIRECTIONS, COLORS, SHAPES)]


def sample_video_record(rng: np.random.Generator) -> dict[str, Any]:
    """One video record, uniformly over the 48."""
    return make_video_record(
        SHAPES[int(rng.integers(len(SHAPES)))],
        list(COLORS)[int(rng.integers(len(COLORS)))],
        DIRECTIONS[int(rng.integers(len(DIRECTIONS)))],
    )


def sample_trajectory(
    record: dict[str, Any],
    rng: np.random.Generator,
    frames: int = NUM_FRAMES,
    travel: tuple[float, float] = TRAVEL,
) -> list[list[dict[str, Any]]]:
    """One scene per frame: the record's object moving at constant speed in its direction.

    The object travels ``travel`` (a fraction of the frame side, drawn uniformly from the range)
    along its axis between the first and the last frame, at a fixed place across it, inside the
    canvas with the image world's border. Scenes are in the image world's form (pixels of the
    :data:`~lit_flowgrpo.toy.world.IMAGE_SIZE` canvas).
    """
    if frames < 2:
        raise ValueError(f"frames ({frames}) must be at least 2: motion needs a first and a last frame")
    if not 0 < travel[0] <= travel[1]:
        raise ValueError(f"travel {travel} must be a range (low, high) of positive fractions")
    entry = record["include"][0]
    axis, sign = AXES[entry["motion"]]
    size = float(rng.uniform(MIN_SIZE, MAX_SIZE))
    lo, hi = BORDER + size / 2, IMAGE_SIZE - BORDER - size / 2
    distance = float(rng.uniform(*travel)) * IMAGE_SIZE
    if distance > hi - lo:
        raise ValueError(
            f"an object of {size:.1f} px cannot travel {distance:.1f} px inside the {IMAGE_SIZE} px canvas: "
            f"lower travel (at most {(hi - lo) / IMAGE_SIZE:.3f})"
        )
    start = float(rng.uniform(lo, hi - distance)) if sign > 0 else float(rng.uniform(lo + distance, hi))
    across = float(rng.uniform(lo, hi))
    scenes = []
    for t in range(frames):
        along = start + sign * distance * t / (frames - 1)
        center = [along, across] if axis == 0 else [across, along]
        scenes.append([{"shape": entry["class"], "color": entry["color"], "center": center, "size": size}])
    return scenes


def render_video(scenes: list[list[dict[str, Any]]], size: int = IMAGE_SIZE) -> np.ndarray:
    """Draw one scene per frame: (F, size, size, 3) uint8 (:func:`lit_flowgrpo.toy.world.render`)."""
    return np.stack([render(scene, size) for scene in scenes])


def video_split() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out) video records: 32 and 16 of the 48.

    For each colour and direction one shape is held out (the ``(colour + direction) mod 3``-th), so
    every held-out prompt is an unseen composition of a shape, a colour and a direction that the
    train list shows in every pair: each shape with each colour and with each direction, each colour
    with each direction. Written to ``assets/video_train.jsonl`` and ``assets/video_val.jsonl``.
    """
    train, val = [], []
    for d, direction in enumerate(DIRECTIONS):
        for c, color in enumerate(COLORS):
            for s, shape in enumerate(SHAPES):
                held_out = s == (c + d) % len(SHAPES)
                (val if held_out else train).append(make_video_record(shape, color, direction))
    return train, val
