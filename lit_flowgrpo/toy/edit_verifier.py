"""The editing world's verifier: is the edit done, and is the rest of the scene unchanged?

Detection is the shapes world's (:class:`~lit_flowgrpo.toy.verifier.ShapeVerifier`: colour
segmentation, connected components, the shape classifier, stray pixels). The record's target scene
(:func:`lit_flowgrpo.toy.edit_world.apply_edit`) says what the output must hold, object by object. A
detection *matches* a target object when it has the object's shape and colour, its bounding-box
centre is within ``center_tolerance`` pixels of the object's (each axis) and its box sides within
``size_tolerance`` pixels of the object's size. The tolerances sit far inside what an edit changes
(a move carries an object 8 px; a recolour changes the colour a match needs) and outside what
rendering does to an exact scene (anti-aliasing moves a detected box by under a pixel).

Components, each 0/1 but ``partial``:

- ``edit``: the instruction is done. Recolour and move: exactly one object of the edited shape in
  the image, and it matches the target's (new colour, or new place). Remove: no object of that shape.
- ``preserve``: the rest is unchanged: every other target object is matched by its own detection,
  no other detection is left over (objects of the edited shape are ``edit``'s concern), and the stray
  foreground stays under one ``stray_unit`` (noise is not an unchanged background).
- ``strict``: both, that is the image holds exactly the target scene.
- ``partial``: the conditions met (``edit`` and one per preserved object) over the conditions plus
  the extra objects (leftover detections and stray units), as the text world's ``partial``.

So an image that redraws the scene from scratch with the edited object right passes ``edit`` and
fails ``preserve``: the reward-hacking view trains on ``edit`` alone to see whether RL does that.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lit_flowgrpo.toy.edit_world import check_edit_record
from lit_flowgrpo.toy.verifier import Detection, Detections, ShapeVerifier
from lit_flowgrpo.toy.world import IMAGE_SIZE


@dataclass(frozen=True)
class EditVerifier:
    """Checks an edited image against its record's target scene.

    Args:
        shapes: the detector (the shapes world's thresholds).
        center_tolerance: largest offset of a detected box centre from the object's, per axis, in
            pixels of a 32×32 image (scaled with the image side).
        size_tolerance: largest difference of a detected box side from the object's size, in pixels
            of a 32×32 image (scaled with the image side).
    """

    shapes: ShapeVerifier = field(default_factory=ShapeVerifier)
    center_tolerance: float = 2.5
    size_tolerance: float = 3.0

    def matches(self, found: Detection, obj: Mapping[str, Any], scale: float) -> bool:
        """Whether a detection is the target object ``obj`` (shape, colour, place and size)."""
        if found.shape != obj["shape"] or found.color != obj["color"]:
            return False
        cx, cy = found.center
        w, h = found.size
        near = abs(cx - obj["center"][0] * scale) <= self.center_tolerance * scale
        near &= abs(cy - obj["center"][1] * scale) <= self.center_tolerance * scale
        sized = max(abs(w - obj["size"] * scale), abs(h - obj["size"] * scale)) <= self.size_tolerance * scale
        return bool(near and sized)

    def check(self, found: Detections, record: Mapping[str, Any], side: int = IMAGE_SIZE) -> dict[str, Any]:
        """Score what the detector found in one ``side``×``side`` image against an editing record.

        Returns:
            ``{"edit", "preserve", "strict": bool, "partial": float, "kept": [bool per preserved
            object], "extra_objects": int, "stray_pixels": int}``.
        """
        scale = side / IMAGE_SIZE
        edit = record["edit"]
        index, kind = int(edit["index"]), edit["kind"]
        shape = record["source"][index]["shape"]
        target = list(record["target"])
        edited = None if kind == "remove" else target[index]
        others = [o for i, o in enumerate(target) if kind == "remove" or i != index]
        of_shape = [d for d in found.objects if d.shape == shape]
        rest = [d for d in found.objects if d.shape != shape]
        if edited is None:
            edit_done = not of_shape
        else:
            edit_done = len(of_shape) == 1 and self.matches(of_shape[0], edited, scale)
        # Greedy one-to-one: the preserved objects have distinct shapes (the world's scenes do), so
        # at most one detection of each shape can match and the order does not matter.
        left = list(rest)
        kept = []
        for obj in others:
            hit = next((d for d in left if self.matches(d, obj, scale)), None)
            kept.append(hit is not None)
            if hit is not None:
                left.remove(hit)
        unit = self.shapes.stray_unit * found.pixels / IMAGE_SIZE**2
        strays = int(found.stray // unit)
        extra = len(left) + strays
        preserve = all(kept) and extra == 0
        met = int(edit_done) + sum(kept)
        conditions = 1 + len(others)
        extra_total = extra + max(0, len(of_shape) - (0 if edited is None else 1))
        return {
            "edit": bool(edit_done),
            "preserve": bool(preserve),
            "strict": bool(edit_done and preserve),
            "partial": met / (conditions + extra_total),
            "kept": kept,
            "extra_objects": extra_total,
            "stray_pixels": found.stray,
        }

    def verify(self, image: np.ndarray, record: dict[str, Any]) -> dict[str, Any]:
        """Detect and check one (H, W, 3) uint8 image; the result also lists the detected objects."""
        check_edit_record(record)
        found = self.shapes.detect(image)
        result = self.check(found, record, side=image.shape[0])
        result["objects"] = [o.as_dict() for o in found.objects]
        return result

    def score_batch(self, images: np.ndarray, records: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
        """``{"edit", "preserve", "strict", "partial"}``, each (B,) float64, for (B, H, W, 3) uint8 images."""
        if len(images) != len(records):
            raise ValueError(f"{len(images)} images but {len(records)} editing records: give one per image")
        if images.ndim != 4 or images.shape[1] != images.shape[2]:
            raise ValueError(f"images must be (B, S, S, 3) uint8 squares, got {images.shape}")
        found = self.shapes.detect_batch(images)
        keys = ("edit", "preserve", "strict", "partial")
        out = {k: np.zeros(len(records)) for k in keys}
        for i, (detections, record) in enumerate(zip(found, records, strict=True)):
            result = self.check(detections, record, side=images.shape[1])
            for k in keys:
                out[k][i] = float(result[k])
        return out
