"""The toy world: procedural 32×32 scenes of coloured shapes, their prompts and GenEval-style records.

A prompt names one to three objects (a shape, often a colour) and maybe where one sits relative to
another. Every prompt comes with a record in the format of GenEval's metadata
(``geneval/prompts/evaluation_metadata.jsonl``; the same fields Flow-GRPO's GenEval reward reads)::

    {"tag": "position",
     "include": [{"class": "square", "count": 1, "color": "yellow"},
                 {"class": "circle", "count": 1, "color": "red", "position": ["left of", 0]}],
     "exclude": [{"class": "square", "count": 2}, {"class": "circle", "count": 2},
                 {"class": "triangle", "count": 1}],
     "prompt": "a red circle to the left of a yellow square"}

``position`` sits on the second object and points at the first, as in GenEval ("a cow right of a
laptop" has the laptop first). Unlike GenEval, every record carries ``exclude`` entries: the world's
images show exactly what the prompt asks for, so "a circle" with an extra square is wrong. Under
GenEval's own reading (include: at least ``count``; exclude: fewer than ``count``) these entries
express exactly that.

The families mirror GenEval's tags: ``single_object`` ("a circle"), ``colors`` ("a red circle"),
``counting`` ("two green triangles"), ``two_object`` ("a circle and a square"), ``color_attr``
("a red circle and a blue square") and ``position``.

Two colour–shape bindings (:data:`UNSEEN_BINDINGS`) never appear in a prompt of the training side:
:func:`sample_record` leaves them out unless asked, the training list never holds them, and part
of the validation list is made of them, so generalisation to unseen compositions shows. (The
shapes themselves are still drawn in those colours for colour-free prompts: what is new is the
wording, not the picture.)
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from itertools import permutations, product
from typing import Any, Literal

import numpy as np

IMAGE_SIZE = 32
"""Side of the world's square images, in pixels."""

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 100, 250),
    "yellow": (240, 220, 40),
}
"""Palette, far apart in hue so a pixel's nearest colour is unambiguous even when a bit off."""

SHAPES = ("circle", "square", "triangle")
"""Shape classes (GenEval's ``class``). Triangles point up."""

RELATIONS = ("left of", "right of", "above", "below")
"""GenEval's position relations: ``include[1]`` is RELATION ``include[0]``."""

FAMILIES = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
"""Prompt families, named as GenEval's tags."""

FAMILY_WEIGHTS: dict[str, float] = {
    "single_object": 0.145,
    "colors": 0.17,
    "counting": 0.145,
    "two_object": 0.18,
    "color_attr": 0.18,
    "position": 0.18,
}
"""How often each family is drawn (records of the shipped lists and :func:`sample_record`).

GenEval's own mix, rounded: its 553 prompts hold 80 single-object, 94 colour, 80 counting, 99
two-object, 100 position and 100 colour-binding ones. Until 2026-12-02 the easy families weighed more
(single objects 0.20, colours 0.25, counting, two objects and colour binding 0.15 each, position 0.10),
so that a weak base landed mid-range; with a stronger base that filled half the held-out score with
families it already drew (docs/shapes_world.md, "A base with errors RL can fix").
"""

COUNT_WEIGHTS: dict[int, float] = {2: 0.8, 3: 0.2}
"""Counting prompts ask for two objects mostly; three is rare (a 32×32 canvas crowds quickly)."""

UNSEEN_BINDINGS: tuple[tuple[str, str], ...] = (("blue", "circle"), ("yellow", "triangle"))
"""(colour, shape) pairs no training-side prompt contains."""

NUMBER_WORDS = {1: "a", 2: "two", 3: "three"}
PLURALS = {shape: shape + "s" for shape in SHAPES}
RELATION_WORDS = {
    "left of": "to the left of",
    "right of": "to the right of",
    "above": "above",
    "below": "below",
}

VOCAB: tuple[str, ...] = tuple(
    sorted(
        {"a", "and", "two", "three"}
        | set(COLORS)
        | set(SHAPES)
        | set(PLURALS.values())
        | {word for phrase in RELATION_WORDS.values() for word in phrase.split()}
    )
)
"""Every word a prompt of this world can contain."""

# Scene geometry, in pixels of the 32×32 canvas. The renderer's margins are stricter than the
# verifier's (lit_flowgrpo.toy.verifier): objects keep GAP pixels apart so blur cannot merge them,
# and a "left of" pair is apart along x by a full gap with at most half that offset across.
MIN_SIZE, MAX_SIZE = 9.0, 12.0
BORDER = 1.0
GAP = 3.0
MAX_CROSS_RATIO = 0.5

_WORD = re.compile(r"[^\s,.;:!?]+")
_ASSETS = os.path.join(os.path.dirname(__file__), "assets")


# ------------------------------------------------------------------ words


def tokenize(prompt: str) -> list[str]:
    """Lower-cased words of ``prompt`` (punctuation separates words).

    Raises:
        ValueError: listing every word outside :data:`VOCAB`; nothing is dropped silently.
    """
    unknown = unknown_words(prompt)
    if unknown:
        raise ValueError(
            f"prompt {prompt!r} has words outside the toy world's vocabulary: {unknown}; "
            f"known words: {list(VOCAB)}"
        )
    return _WORD.findall(prompt.lower())


def unknown_words(prompt: str) -> list[str]:
    """The words of ``prompt`` outside :data:`VOCAB`, each once, in order of appearance."""
    return [w for w in dict.fromkeys(_WORD.findall(prompt.lower())) if w not in VOCAB]


# ------------------------------------------------------------------ records


def _object_phrase(shape: str, count: int, color: str | None) -> str:
    noun = shape if count == 1 else PLURALS[shape]
    return " ".join(w for w in (NUMBER_WORDS[count], color, noun) if w)


def make_record(
    tag: str,
    objects: list[tuple[str, int, str | None]],
    relation: str | None = None,
) -> dict[str, Any]:
    """Build the record of a prompt from its objects.

    Args:
        tag: the family (one of :data:`FAMILIES`).
        objects: ``(shape, count, colour or None)`` per object group, in prompt order. With a
            relation, the first group is the subject and the second the reference ("a red circle
            to the left of a yellow square": circle first); the record lists them GenEval's way
            round (reference first, ``position`` on the second entry).
        relation: one of :data:`RELATIONS`, for the ``position`` family.

    Returns:
        ``{"tag", "include", "exclude", "prompt"}``.
    """
    if tag not in FAMILIES:
        raise ValueError(f"tag {tag!r} is not a toy-world family: use one of {list(FAMILIES)}")
    problems = [f"shape {s!r}" for s, _, _ in objects if s not in SHAPES]
    problems += [f"colour {c!r}" for _, _, c in objects if c is not None and c not in COLORS]
    problems += [f"count {n!r}" for _, n, _ in objects if n not in NUMBER_WORDS]
    if relation is not None and (relation not in RELATIONS or len(objects) != 2):
        problems.append(f"relation {relation!r} (needs one of {list(RELATIONS)} and exactly two objects)")
    if len({s for s, _, _ in objects}) != len(objects):
        problems.append("the same shape twice (object groups must have distinct shapes)")
    if problems:
        raise ValueError(f"cannot build a toy-world record with {', '.join(problems)}")

    phrases = [_object_phrase(s, n, c) for s, n, c in objects]
    if relation is None:
        prompt = " and ".join(phrases)
        ordered = objects
    else:
        prompt = f"{phrases[0]} {RELATION_WORDS[relation]} {phrases[1]}"
        ordered = [objects[1], objects[0]]

    include: list[dict[str, Any]] = []
    for i, (shape, count, color) in enumerate(ordered):
        entry: dict[str, Any] = {"class": shape, "count": count}
        if color is not None:
            entry["color"] = color
        if relation is not None and i == 1:
            entry["position"] = [relation, 0]
        include.append(entry)
    # One more than asked of each named shape, any of the others: the image holds nothing else.
    counts = {shape: count for shape, count, _ in objects}
    exclude = [{"class": s, "count": counts[s] + 1} for s, _, _ in ordered]
    exclude += [{"class": s, "count": 1} for s in SHAPES if s not in counts]
    return {"tag": tag, "include": include, "exclude": exclude, "prompt": prompt}


def bindings(record: dict[str, Any]) -> list[tuple[str, str]]:
    """The (colour, shape) pairs a record's prompt names."""
    return [(e["color"], e["class"]) for e in record["include"] if "color" in e]


def is_unseen(record: dict[str, Any]) -> bool:
    """Whether the record names a colour–shape binding kept out of everything training-side."""
    return any(b in UNSEEN_BINDINGS for b in bindings(record))


@functools.cache
def _universe(family: str) -> tuple[str, ...]:
    """Every distinct record of a family, as JSON text, in a fixed order."""
    records = []
    if family == "single_object":
        records = [make_record(family, [(s, 1, None)]) for s in SHAPES]
    elif family == "colors":
        records = [make_record(family, [(s, 1, c)]) for c, s in product(COLORS, SHAPES)]
    elif family == "counting":
        records = [make_record(family, [(s, n, c)]) for n, c, s in product(COUNT_WEIGHTS, COLORS, SHAPES)]
    elif family == "two_object":
        records = [make_record(family, [(a, 1, None), (b, 1, None)]) for a, b in permutations(SHAPES, 2)]
    elif family == "color_attr":
        records = [
            make_record(family, [(a, 1, ca), (b, 1, cb)])
            for (a, b), (ca, cb) in product(permutations(SHAPES, 2), permutations(COLORS, 2))
        ]
    elif family == "position":
        records = [
            make_record(family, [(a, 1, ca), (b, 1, cb)], rel)
            for (a, b), (ca, cb), rel in product(permutations(SHAPES, 2), product(COLORS, COLORS), RELATIONS)
        ]
    else:
        raise ValueError(f"family {family!r} is not a toy-world family: use one of {list(FAMILIES)}")
    return tuple(json.dumps(r) for r in records)


def family_records(family: str, unseen: bool | None = False) -> list[dict[str, Any]]:
    """Distinct records of ``family`` in a fixed order.

    Args:
        family: one of :data:`FAMILIES`.
        unseen: ``False`` only records without an unseen binding, ``True`` only records with one,
            ``None`` all of them.
    """
    records = [json.loads(r) for r in _universe(family)]
    if unseen is None:
        return records
    return [r for r in records if is_unseen(r) == unseen]


def record_weight(record: dict[str, Any]) -> float:
    """Relative probability of a record within its family (counting favours two over three)."""
    if record["tag"] == "counting":
        return COUNT_WEIGHTS[record["include"][0]["count"]]
    return 1.0


def sample_record(
    rng: np.random.Generator, family: str | None = None, *, unseen: bool = False
) -> dict[str, Any]:
    """Draw one record.

    Args:
        rng: the source of randomness.
        family: one of :data:`FAMILIES`; ``None`` draws it with :data:`FAMILY_WEIGHTS`.
        unseen: ``False`` (default, what pretraining uses) never names an unseen binding; ``True``
            always does (families without colours have none: asking for them raises).
    """
    if family is None:
        names = list(FAMILY_WEIGHTS)
        p = np.array([FAMILY_WEIGHTS[f] for f in names])
        family = names[int(rng.choice(len(names), p=p / p.sum()))]
    pool, p = _pool(family, unseen)
    if not pool:
        raise ValueError(
            f"family {family!r} names no colours, so it has no unseen compositions: use unseen=False"
        )
    return json.loads(pool[int(rng.choice(len(pool), p=p))])


@functools.cache
def _pool(family: str, unseen: bool) -> tuple[tuple[str, ...], np.ndarray]:
    """A family's records (JSON text) on one side of the unseen split, and their probabilities."""
    records = family_records(family, unseen=unseen)
    w = np.array([record_weight(r) for r in records])
    return tuple(json.dumps(r) for r in records), w / max(w.sum(), 1e-12)


# ------------------------------------------------------------------ scenes


def object_box(obj: dict[str, Any]) -> tuple[float, float, float, float]:
    """(x0, y0, x1, y1) of an object's bounding box, in pixels (x right, y down)."""
    (x, y), half = obj["center"], obj["size"] / 2
    return x - half, y - half, x + half, y + half


def _apart(a: tuple[float, ...], b: tuple[float, ...], gap: float) -> bool:
    # Boxes separated by at least ``gap`` along x or along y.
    return a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1]


def _relation_holds(subject: dict[str, Any], reference: dict[str, Any], relation: str) -> bool:
    """The renderer's strict reading of a relation: boxes a full gap apart along the axis, and the
    centres' offset across the axis at most half the offset along it."""
    s, r = object_box(subject), object_box(reference)
    dx = subject["center"][0] - reference["center"][0]
    dy = subject["center"][1] - reference["center"][1]
    if relation == "left of":
        return s[2] + GAP <= r[0] and abs(dy) <= MAX_CROSS_RATIO * abs(dx)
    if relation == "right of":
        return r[2] + GAP <= s[0] and abs(dy) <= MAX_CROSS_RATIO * abs(dx)
    if relation == "above":
        return s[3] + GAP <= r[1] and abs(dx) <= MAX_CROSS_RATIO * abs(dy)
    return r[3] + GAP <= s[1] and abs(dx) <= MAX_CROSS_RATIO * abs(dy)


def sample_scene(
    record: dict[str, Any], rng: np.random.Generator, max_tries: int = 1000
) -> list[dict[str, Any]]:
    """Concrete objects that satisfy ``record``.

    Objects come in the record's ``include`` order, ``count`` per entry, as
    ``{"shape", "color", "center": [x, y], "size"}`` (pixels of the 32×32 canvas; ``size`` is the
    side of the bounding box). Entries without a colour get a random palette colour per object.
    Placement is by rejection: inside the canvas with a border, every pair ``GAP`` apart, and a
    relation held with the renderer's strict margins.
    """
    include = record.get("include")
    if not include:
        raise ValueError(f"record {record.get('prompt', record)!r} has no 'include' entries to draw")
    colors = list(COLORS)
    specs: list[tuple[int, str, str]] = []
    for index, entry in enumerate(include):
        for _ in range(int(entry["count"])):
            color = entry.get("color") or colors[int(rng.integers(len(colors)))]
            specs.append((index, entry["class"], color))
    # Crowded scenes draw smaller objects so rejection sampling stays quick.
    max_size = MAX_SIZE if len(specs) <= 2 else MAX_SIZE - 1
    for _ in range(max_tries):
        scene: list[dict[str, Any]] = []
        for _index, shape, color in specs:
            size = float(rng.uniform(MIN_SIZE, max_size))
            lo, hi = BORDER + size / 2, IMAGE_SIZE - BORDER - size / 2
            center = [float(rng.uniform(lo, hi)), float(rng.uniform(lo, hi))]
            scene.append({"shape": shape, "color": color, "center": center, "size": size})
        boxes = [object_box(o) for o in scene]
        if not all(_apart(boxes[i], boxes[j], GAP) for i in range(len(boxes)) for j in range(i)):
            continue
        ok = True
        for index, entry in enumerate(include):
            if "position" not in entry:
                continue
            relation, target = entry["position"]
            subjects = [o for (k, _, _), o in zip(specs, scene, strict=True) if k == index]
            references = [o for (k, _, _), o in zip(specs, scene, strict=True) if k == target]
            ok &= all(_relation_holds(s, r, relation) for s in subjects for r in references)
        if ok:
            return scene
    raise RuntimeError(f"could not place the objects of {record.get('prompt')!r} in {max_tries} tries")


# ------------------------------------------------------------------ rendering

_SUPERSAMPLE = 4


def _coverage(shape: str, xs: np.ndarray, ys: np.ndarray, cx: float, cy: float, size: float) -> np.ndarray:
    """Inside-test of sub-pixel sample points (canvas pixels) against one shape."""
    half = size / 2
    if shape == "circle":
        return (xs - cx) ** 2 + (ys - cy) ** 2 <= half**2
    if shape == "square":
        return (np.abs(xs - cx) <= half) & (np.abs(ys - cy) <= half)
    if shape == "triangle":
        # Apex (cx, cy-half), base from (cx-half, cy+half) to (cx+half, cy+half): the half-width
        # grows linearly from 0 at the apex to ``half`` at the base.
        t = (ys - (cy - half)) / size
        return (t >= 0) & (t <= 1) & (np.abs(xs - cx) <= half * t)
    raise ValueError(f"shape {shape!r} is not a toy-world shape: use one of {list(SHAPES)}")


def render(scene: list[dict[str, Any]], size: int = IMAGE_SIZE) -> np.ndarray:
    """Draw a scene: (size, size, 3) uint8, black background, anti-aliased edges.

    Scene coordinates are pixels of the :data:`IMAGE_SIZE` canvas; another ``size`` draws the same
    picture at that resolution. Each pixel is the average of 4×4 sub-pixel samples.
    """
    if size < 8:
        raise ValueError(f"size ({size}) must be at least 8 pixels")
    scale = size / IMAGE_SIZE
    image = np.zeros((size, size, 3), dtype=np.float64)
    offsets = (np.arange(_SUPERSAMPLE) + 0.5) / _SUPERSAMPLE
    for obj in scene:
        if obj["color"] not in COLORS:
            raise ValueError(f"colour {obj['color']!r} is not in the toy palette: use one of {list(COLORS)}")
        cx, cy = obj["center"][0] * scale, obj["center"][1] * scale
        extent = obj["size"] * scale
        c0, c1 = max(math.floor(cx - extent / 2), 0), min(math.ceil(cx + extent / 2), size)
        r0, r1 = max(math.floor(cy - extent / 2), 0), min(math.ceil(cy + extent / 2), size)
        if c1 <= c0 or r1 <= r0:
            continue
        xs = (np.arange(c0, c1)[:, None] + offsets[None, :]).reshape(-1)  # sub-pixel x, (W·S,)
        ys = (np.arange(r0, r1)[:, None] + offsets[None, :]).reshape(-1)
        inside = _coverage(obj["shape"], xs[None, :], ys[:, None], cx, cy, extent)
        cover = inside.reshape(r1 - r0, _SUPERSAMPLE, c1 - c0, _SUPERSAMPLE).mean(axis=(1, 3))
        color = np.asarray(COLORS[obj["color"]], dtype=np.float64)
        patch = image[r0:r1, c0:c1]
        image[r0:r1, c0:c1] = np.maximum(patch, cover[..., None] * color)
    return np.clip(np.rint(image), 0, 255).astype(np.uint8)


# ------------------------------------------------------------------ prompt lists


def prompt_file(split: Literal["train", "val"]) -> str:
    """Path of the shipped prompt list of ``split`` (``.jsonl``, one record per line)."""
    if split not in ("train", "val"):
        raise ValueError(f"split {split!r} must be 'train' or 'val'")
    return os.path.join(_ASSETS, f"{split}.jsonl")


def load_prompts(split: Literal["train", "val"]) -> list[dict[str, Any]]:
    """The shipped records of ``split`` (see ``lit_flowgrpo.toy.make_prompts`` for how they are made)."""
    with open(prompt_file(split), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
