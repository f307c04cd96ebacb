"""The editing world: source scenes of the shapes world, an instruction, and the target it asks for.

A source is a 32×32 scene of the shapes world (:mod:`lit_flowgrpo.toy.world`) holding two or three
objects of distinct shapes ("the square" names one object), each in a palette colour. An instruction
changes exactly one of them; the rest of the scene must stay as it was:

- ``recolor``: "make the red circle blue": the circle, same place and size, in the new colour;
- ``remove``: "remove the square": the square gone, nothing else moved;
- ``move``: "move the triangle to the left" (right, up, down): the triangle :data:`MOVE_DISTANCE`
  pixels that way, the same size and colour, still inside the canvas and apart from the others.

The target scene is computed from the source and the instruction (:func:`apply_edit`), exactly: it
is the same list of objects with one changed or dropped. A record carries both scenes, so the
verifier (:mod:`lit_flowgrpo.toy.edit_verifier`) checks the output against the target with no
learned part::

    {"prompt": "move the triangle to the left", "tag": "move",
     "condition_images": ["edit_val/0007.png"],
     "edit": {"kind": "move", "index": 1, "direction": "left"},
     "source": [{"shape": "circle", "color": "red", "center": [8.5, 20.25], "size": 10.0}, ...],
     "target": [...]}

``index`` is the edited object's place in ``source`` (and in ``target`` for recolour and move; a
removal drops it). Centres and sizes are rounded to 1/4 pixel before anything is rendered, so the
shipped PNG is exactly ``render(source)``.

Held out: the shipped validation sources (``assets/edit_val``) are scenes drawn from their own seed;
pretraining and the RL training list draw theirs from others, so every held-out source is a scene the
model has never seen (continuous positions and sizes: a repeat has probability 0).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Literal

import numpy as np

from lit_flowgrpo.toy import world

EDIT_KINDS = ("recolor", "remove", "move")
"""Instruction families (the records' ``tag``)."""

KIND_WEIGHTS: dict[str, float] = {"recolor": 0.4, "remove": 0.3, "move": 0.3}
"""How often each kind is drawn where it is possible (a move needs room on that side)."""

DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
"""Move directions, as (dx, dy) unit steps (y grows downward, as in the renderer)."""

MOVE_DISTANCE = 8.0
"""How far a move carries its object, in pixels: far beyond the verifier's centre tolerance (2.5 px)."""

MIN_OBJECTS, MAX_OBJECTS = 2, 3
"""Objects per source scene: at least two, so a removal leaves a scene to preserve."""

_DIRECTION_WORDS = {"left": "to the left", "right": "to the right", "up": "up", "down": "down"}

EDIT_VOCAB: tuple[str, ...] = tuple(
    sorted({"make", "the", "remove", "move", "to"} | set(DIRECTIONS) | set(world.COLORS) | set(world.SHAPES))
)
"""Every word an instruction of this world can contain."""

_WORD = re.compile(r"[^\s,.;:!?]+")
_ASSETS = os.path.join(os.path.dirname(__file__), "assets")


def unknown_edit_words(prompt: str) -> list[str]:
    """The words of ``prompt`` outside :data:`EDIT_VOCAB`, each once, in order of appearance."""
    return [w for w in dict.fromkeys(_WORD.findall(prompt.lower())) if w not in EDIT_VOCAB]


def edit_words(prompt: str) -> list[str]:
    """Lower-cased words of an instruction (raises ``ValueError`` listing every unknown word)."""
    unknown = unknown_edit_words(prompt)
    if unknown:
        raise ValueError(
            f"instruction {prompt!r} has words outside the editing world's vocabulary: {unknown}; "
            f"known words: {list(EDIT_VOCAB)}"
        )
    return _WORD.findall(prompt.lower())


# ------------------------------------------------------------------ scenes


def _quarter(x: float) -> float:
    return round(float(x), 3)


def _rounded(obj: dict[str, Any]) -> dict[str, Any]:
    return {
        "shape": obj["shape"],
        "color": obj["color"],
        "center": [_quarter(obj["center"][0]), _quarter(obj["center"][1])],
        "size": _quarter(obj["size"]),
    }


def _apart(a: tuple[float, ...], b: tuple[float, ...], gap: float) -> bool:
    # Boxes separated by at least ``gap`` along x or along y (the renderer's placement rule).
    return a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1]


def scene_fits(scene: list[dict[str, Any]]) -> bool:
    """Every object inside the canvas with the renderer's border, every pair the renderer's gap apart."""
    boxes = [world.object_box(o) for o in scene]
    lo, hi = world.BORDER, world.IMAGE_SIZE - world.BORDER
    inside = all(b[0] >= lo and b[1] >= lo and b[2] <= hi and b[3] <= hi for b in boxes)
    return inside and all(_apart(boxes[i], boxes[j], world.GAP) for i in range(len(boxes)) for j in range(i))


def sample_source(rng: np.random.Generator, num_objects: int | None = None) -> list[dict[str, Any]]:
    """A source scene: ``num_objects`` (2–3, drawn when ``None``) objects of distinct shapes, random
    palette colours (repeats allowed), placed by the shapes world's renderer rules, rounded to 1/4 px."""
    n = int(rng.integers(MIN_OBJECTS, MAX_OBJECTS + 1)) if num_objects is None else num_objects
    if not MIN_OBJECTS <= n <= MAX_OBJECTS:
        raise ValueError(f"num_objects ({n}) must be in [{MIN_OBJECTS}, {MAX_OBJECTS}]")
    shapes = [world.SHAPES[i] for i in rng.permutation(len(world.SHAPES))[:n]]
    colors = list(world.COLORS)
    include = [{"class": s, "count": 1, "color": colors[int(rng.integers(len(colors)))]} for s in shapes]
    for _ in range(100):
        scene = [_rounded(o) for o in world.sample_scene({"include": include, "prompt": "source"}, rng)]
        if scene_fits(scene):  # rounding can move a box a quarter pixel over a margin
            return scene
    raise RuntimeError("could not place a source scene in 100 tries")


# ------------------------------------------------------------------ instructions


def instruction(edit: dict[str, Any], source: list[dict[str, Any]]) -> str:
    """The words of an edit on ``source``."""
    obj = source[edit["index"]]
    if edit["kind"] == "recolor":
        return f"make the {obj['color']} {obj['shape']} {edit['color']}"
    if edit["kind"] == "remove":
        return f"remove the {obj['shape']}"
    if edit["kind"] == "move":
        return f"move the {obj['shape']} {_DIRECTION_WORDS[edit['direction']]}"
    raise ValueError(f"edit kind {edit['kind']!r} is not one of {list(EDIT_KINDS)}")


def apply_edit(source: list[dict[str, Any]], edit: dict[str, Any]) -> list[dict[str, Any]]:
    """The target scene: ``source`` with the edit applied to object ``edit["index"]``, the rest unchanged.

    Raises:
        ValueError: the edit is malformed, recolours to the object's own colour, or moves the object
            off the canvas or too close to another.
    """
    kind, index = edit.get("kind"), edit.get("index")
    if kind not in EDIT_KINDS:
        raise ValueError(f"edit kind {kind!r} is not one of {list(EDIT_KINDS)}")
    if not isinstance(index, int) or not 0 <= index < len(source):
        raise ValueError(f"edit index {index!r} does not name one of the source's {len(source)} objects")
    target = [dict(o, center=list(o["center"])) for o in source]
    obj = target[index]
    if kind == "remove":
        return target[:index] + target[index + 1 :]
    if kind == "recolor":
        color = edit.get("color")
        if color not in world.COLORS or color == obj["color"]:
            raise ValueError(
                f"recolour to {color!r}: must be a palette colour other than the object's own ({obj['color']})"
            )
        obj["color"] = color
        return target
    direction = edit.get("direction")
    if direction not in DIRECTIONS:
        raise ValueError(f"move direction {direction!r} is not one of {list(DIRECTIONS)}")
    dx, dy = DIRECTIONS[direction]
    obj["center"] = [obj["center"][0] + dx * MOVE_DISTANCE, obj["center"][1] + dy * MOVE_DISTANCE]
    if not scene_fits(target):
        raise ValueError(
            f"moving the {obj['shape']} {direction} by {MOVE_DISTANCE} px leaves the canvas or meets another object"
        )
    return target


def possible_edits(source: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Every edit the source allows, by kind (moves only where the object has room)."""
    out: dict[str, list[dict[str, Any]]] = {k: [] for k in EDIT_KINDS}
    for i, obj in enumerate(source):
        out["remove"].append({"kind": "remove", "index": i})
        out["recolor"] += [
            {"kind": "recolor", "index": i, "color": c} for c in world.COLORS if c != obj["color"]
        ]
        for direction in DIRECTIONS:
            edit = {"kind": "move", "index": i, "direction": direction}
            try:
                apply_edit(source, edit)
            except ValueError:
                continue
            out["move"].append(edit)
    return out


def sample_edit(
    source: list[dict[str, Any]], rng: np.random.Generator, kind: str | None = None
) -> dict[str, Any]:
    """One edit of ``source``: its kind drawn with :data:`KIND_WEIGHTS` among the possible ones (or
    ``kind``), then uniformly among that kind's edits."""
    edits = possible_edits(source)
    if kind is None:
        kinds = [k for k in EDIT_KINDS if edits[k]]
        p = np.array([KIND_WEIGHTS[k] for k in kinds])
        kind = kinds[int(rng.choice(len(kinds), p=p / p.sum()))]
    if not edits.get(kind):
        raise ValueError(f"the source allows no {kind!r} edit")
    return edits[kind][int(rng.integers(len(edits[kind])))]


def make_edit_record(
    source: list[dict[str, Any]], edit: dict[str, Any], image: str | None = None
) -> dict[str, Any]:
    """The record of an edit: prompt, tag, the edit, both scenes and (given) the source's image path."""
    record: dict[str, Any] = {"prompt": instruction(edit, source), "tag": edit["kind"]}
    if image is not None:
        record["condition_images"] = [image]
    record |= {"edit": dict(edit), "source": source, "target": apply_edit(source, edit)}
    return record


def sample_edit_record(rng: np.random.Generator) -> dict[str, Any]:
    """A fresh source and one edit of it (pretraining's stream), without an image path."""
    source = sample_source(rng)
    return make_edit_record(source, sample_edit(source, rng))


# ------------------------------------------------------------------ records


def check_edit_record(record: dict[str, Any]) -> None:
    """Raise ``ValueError`` saying what an editing record lacks or gets wrong (its target is recomputed)."""
    missing = [k for k in ("edit", "source", "target") if k not in record]
    if missing:
        raise ValueError(
            f"editing record {record.get('prompt')!r} lacks {missing}: records come from "
            "lit_flowgrpo.toy.edit_world.make_edit_record (python -m lit_flowgrpo.toy.edit_prompts)"
        )
    try:
        for obj in list(record["source"]) + list(record["target"]):
            if obj["shape"] not in world.SHAPES or obj["color"] not in world.COLORS:
                raise ValueError(f"object {obj} is not a shapes-world object")
            float(obj["size"]), float(obj["center"][0]), float(obj["center"][1])
        expected = apply_edit(list(record["source"]), dict(record["edit"]))
    except (KeyError, TypeError, IndexError) as err:
        raise ValueError(f"editing record {record.get('prompt')!r} is malformed ({err!r})") from None
    if expected != list(record["target"]):
        raise ValueError(
            f"editing record {record.get('prompt')!r}: its target is not its source with its edit applied"
        )


def edit_prompt_file(split: Literal["train", "val"]) -> str:
    """Path of the shipped editing records of ``split`` (``.jsonl``; sources in ``assets/edit_<split>/``)."""
    if split not in ("train", "val"):
        raise ValueError(f"split {split!r} must be 'train' or 'val'")
    return os.path.join(_ASSETS, f"edit_{split}.jsonl")


def load_edit_records(split: Literal["train", "val"]) -> list[dict[str, Any]]:
    """The shipped editing records of ``split`` (``python -m lit_flowgrpo.toy.edit_prompts`` writes them)."""
    with open(edit_prompt_file(split), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
