"""The ``shapes_edit`` reward: the editing world's verifier (:mod:`lit_flowgrpo.toy.edit_verifier`) as a
reward, registered when ``lit_flowgrpo.toy`` is imported.

Components ``edit`` (the instruction done), ``preserve`` (the rest of the scene unchanged), ``strict``
(both: the image is the target scene) and ``partial`` (the fraction of those conditions met). ``strict`` is
the primary and the core component (the held-out accuracy, ``val-core/shapes_edit/strict/mean@1``).

It reads the target scene from the record's metadata, computed exactly from the source scene and the
instruction, so it needs neither the source's pixels nor a learned model: it declares no
``uses_sources``. A record without the editing fields (a text-to-image record) is refused at setup.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from lit_flowgrpo.rewards.base import register_reward
from lit_flowgrpo.rewards.images import check_images, to_numpy_hwc
from lit_flowgrpo.toy.edit_verifier import EditVerifier
from lit_flowgrpo.toy.edit_world import EDIT_VOCAB, check_edit_record, unknown_edit_words
from lit_flowgrpo.toy.verifier import ShapeVerifier

_FLAG = "--model.init_args.reward.init_args.config.shapes_edit"


@register_reward("shapes_edit")
class ShapesEditReward:
    """Score edited toy-world images against their editing records.

    Args:
        center_tolerance: largest offset of an object's detected centre from the target's, per axis, in
            pixels of a 32×32 image.
        size_tolerance: largest difference of a detected box side from the target object's size, in pixels.
        brightness: a pixel is foreground when its brightest channel reaches this (0–1).
        chroma_tolerance: largest chromaticity distance from a palette colour still read as it.
    """

    primary = "strict"
    core_components: tuple[str | None, ...] = ("strict",)
    required_metadata: tuple[str, ...] = ("edit", "source", "target")

    def __init__(
        self,
        center_tolerance: float = 2.5,
        size_tolerance: float = 3.0,
        brightness: float = 0.35,
        chroma_tolerance: float = 0.45,
    ) -> None:
        problems = []
        if not 0 < center_tolerance < 8:
            problems.append(
                f"{_FLAG}.center_tolerance ({center_tolerance}) must be in (0, 8): a move carries an object 8 px"
            )
        if size_tolerance <= 0:
            problems.append(f"{_FLAG}.size_tolerance ({size_tolerance}) must be positive")
        if not 0 < brightness < 1:
            problems.append(f"{_FLAG}.brightness ({brightness}) must be in (0, 1)")
        if chroma_tolerance <= 0:
            problems.append(f"{_FLAG}.chroma_tolerance ({chroma_tolerance}) must be positive")
        if problems:
            raise ValueError("invalid shapes_edit reward settings:\n  " + "\n  ".join(problems))
        self.verifier = EditVerifier(
            ShapeVerifier(brightness=brightness, chroma_tolerance=chroma_tolerance),
            center_tolerance=center_tolerance,
            size_tolerance=size_tolerance,
        )

    def problems(self, records: Sequence[Mapping]) -> list[str]:
        """Every record this reward cannot score: words outside the editing vocabulary, or no valid edit."""
        out = []
        for i, record in enumerate(records):
            found = []
            unknown = unknown_edit_words(str(record.get("prompt", "")))
            if unknown:
                found.append(f"words outside the editing world's vocabulary {unknown}")
            try:
                check_edit_record(dict(record))
            except ValueError as err:
                found.append(str(err))
            if found:
                out.append(f"prompt record {i} ({record.get('prompt')!r}): " + "; ".join(found))
        if any("vocabulary" in p for p in out):
            out.append(f"the editing world's vocabulary is {list(EDIT_VOCAB)}")
        return out

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, Tensor]:
        """``{"edit", "preserve", "strict", "partial"}``, each (B,) fp32; NaN for an image with non-finite pixels."""
        check_images(images)
        if len(metadata) != images.shape[0]:
            raise ValueError(
                f"reward 'shapes_edit' got {images.shape[0]} images but {len(metadata)} metadata records: give "
                "one editing record per image (lit_flowgrpo/toy/assets/edit_train.jsonl)"
            )
        finite = torch.isfinite(images.detach()).flatten(1).all(dim=1).cpu()  # (B,) bool
        pixels = to_numpy_hwc(torch.nan_to_num(images.detach(), nan=0.0))  # (B, H, W, 3) uint8
        scores = self.verifier.score_batch(pixels, list(metadata))
        nan = torch.tensor(float("nan"))
        return {k: torch.where(finite, torch.from_numpy(v).float(), nan) for k, v in scores.items()}
