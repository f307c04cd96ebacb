"""``shapes``: the verifiable reward of the embedded toy world, and ``shapes_color``, a proxy of it
that can be gamed; both registered when ``lit_flowgrpo.toy`` is imported (a config does that by
naming ``lit_flowgrpo.toy.ToyPolicy``).

A GenEval-style check with no learned parts: colour segmentation, connected components, a shape
classifier, exact counts and bounding-box relations (``lit_flowgrpo.toy.verifier`` has the rules
and their sources). Components: ``strict`` (0/1: exactly the asked objects, in the asked colours
and places, nothing else) and ``partial`` (the fraction of the prompt's conditions met, each extra
object counting as a failed one). ``strict`` is the primary component and the core one (the
accuracy, logged under ``val-core/``).

``shapes_color`` (:class:`ColorCoverageReward`) scores how much of the image is painted in the
colours the prompt names. It agrees with the verifier at first (an object in the wrong colour scores
nothing) and parts from it as it is pushed: bigger objects, extra copies and a canvas flooded with the
colour all raise it while they break the counts, shapes and places ``strict`` checks. Trained on it
with ``strict`` logged beside it (``configs/hacking_proxy.yaml``), the shapes world shows reward
hacking in numbers: the proxy against the gold score it stood for.

``shapes_video`` (:class:`ShapesVideoReward`) is the gold score of the world's video prompts ("a red
circle moving left to right"): the named object in every frame, moving the named way
(``lit_flowgrpo.toy.video_verifier`` has the rules). It scores videos only (``modalities``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from lit_flowgrpo.rewards.base import register_reward
from lit_flowgrpo.rewards.images import check_images, check_videos, to_numpy_hwc
from lit_flowgrpo.toy.verifier import ShapeVerifier, check_record
from lit_flowgrpo.toy.video_verifier import VideoVerifier, check_video_record
from lit_flowgrpo.toy.video_world import VIDEO_VOCAB, unknown_video_words
from lit_flowgrpo.toy.world import COLORS, VOCAB, unknown_words


@register_reward("shapes")
class ShapesReward:
    """Score toy-world images against their GenEval-style records.

    Args:
        brightness: a pixel is foreground when its brightest channel reaches this (0–1).
        chroma_tolerance: largest chromaticity distance from a palette colour still read as it.
        min_area: smallest object, in pixels of a 32×32 image (scaled with the image area).
    """

    primary = "strict"
    core_components: tuple[str | None, ...] = ("strict",)  # held-out accuracy: val-core/shapes/strict/mean@1
    required_metadata: tuple[str, ...] = ("tag", "include")

    def __init__(
        self, brightness: float = 0.35, chroma_tolerance: float = 0.45, min_area: float = 8.0
    ) -> None:
        problems = []
        if not 0 < brightness < 1:
            problems.append(
                f"--model.init_args.reward.init_args.config.shapes.brightness ({brightness}) must be in (0, 1)"
            )
        if chroma_tolerance <= 0:
            problems.append(
                f"--model.init_args.reward.init_args.config.shapes.chroma_tolerance ({chroma_tolerance}) must be positive"
            )
        if min_area < 1:
            problems.append(
                f"--model.init_args.reward.init_args.config.shapes.min_area ({min_area}) must be at least 1 pixel"
            )
        if problems:
            raise ValueError("invalid shapes reward settings:\n  " + "\n  ".join(problems))
        self.verifier = ShapeVerifier(
            brightness=brightness, chroma_tolerance=chroma_tolerance, min_area=min_area
        )

    def problems(self, records: Sequence[Mapping]) -> list[str]:
        """Every prompt record this reward cannot score (:func:`record_problems`)."""
        return record_problems(records)

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, Tensor]:
        """``{"strict": (B,), "partial": (B,)}`` fp32; NaN for an image with non-finite pixels."""
        check_images(images)
        batch = images.shape[0]
        if len(metadata) != batch:
            raise ValueError(
                f"reward 'shapes' got {batch} images but {len(metadata)} metadata records: give one "
                "record per image (a .jsonl prompt file such as lit_flowgrpo/toy/assets/train.jsonl)"
            )
        finite = torch.isfinite(images.detach()).flatten(1).all(dim=1).cpu()  # (B,) bool
        pixels = to_numpy_hwc(torch.nan_to_num(images.detach(), nan=0.0))  # (B, H, W, 3) uint8
        strict, partial = self.verifier.score_batch(pixels, list(metadata))
        nan = torch.tensor(float("nan"))
        return {
            "strict": torch.where(finite, torch.from_numpy(strict).float(), nan),
            "partial": torch.where(finite, torch.from_numpy(partial).float(), nan),
        }


def record_problems(records: Sequence[Mapping]) -> list[str]:
    """Every prompt record the toy world's rewards cannot score, each named by its index in ``records``.

    A record must carry a prompt in the toy world's vocabulary (the toy model cannot encode any
    other word) and GenEval-style metadata the verifier can read. Checked at setup, so a bad
    line fails before the first rollout instead of when a rollout first draws it.
    """
    return _records_problems(records, unknown_words, check_record, "the toy world's vocabulary", VOCAB)


def _records_problems(
    records: Sequence[Mapping],
    find_unknown: Callable[[str], list[str]],
    check: Callable[[dict], None],
    vocabulary: str,
    vocab: Sequence[str],
) -> list[str]:
    """Every record with words ``find_unknown`` lists or metadata ``check`` refuses, named by its index;
    ``vocabulary`` names ``vocab`` in the messages."""
    out = []
    for i, record in enumerate(records):
        found = []
        unknown = find_unknown(str(record.get("prompt", "")))
        if unknown:
            found.append(f"words outside {vocabulary} {unknown}")
        try:
            check(dict(record))
        except ValueError as err:
            found.append(str(err))
        if found:
            out.append(f"prompt record {i} ({record.get('prompt')!r}): " + "; ".join(found))
    if any("vocabulary" in p for p in out):
        out.append(f"{vocabulary} is {list(vocab)}")
    return out


_PALETTE = tuple(COLORS)  # the verifier's palette order: segment() returns indices into it


@register_reward("shapes_color")
class ColorCoverageReward:
    """A gameable proxy of the shapes world's verifier: the share of the image in the prompt's colours.

    score = min(c / saturation, 1), where c is the fraction of the image's pixels that the verifier's
    colour segmentation reads as one of the colours the prompt names ("a red circle and a blue
    square": red or blue), or as any palette colour when it names none ("two circles").

    Why it can be gamed: a correct scene covers a few percent of the canvas (one 10-pixel square is
    100 of 1024 pixels: 0.195 at the default saturation), and every pixel more of the colour raises
    the score, up to a canvas half covered. The verifier rejects any one object larger than 35% of
    the image, and bigger or extra objects break counts and positions, so the proxy's best images
    are ones the gold ``strict`` check fails.

    Args:
        saturation: the covered fraction that scores 1 (0–1]. Above the verifier's largest object
            (``max_area_fraction``, 0.35) by default, so that the top is reached only by breaking it.
        brightness: a pixel counts when its brightest channel reaches this (0–1), as the verifier's.
        chroma_tolerance: largest chromaticity distance from a palette colour still read as it.
    """

    core_components: tuple[str | None, ...] = ()  # a proxy, not accuracy: val-aux/shapes_color/mean@1
    required_metadata: tuple[str, ...] = ("include",)

    def __init__(
        self, saturation: float = 0.5, brightness: float = 0.35, chroma_tolerance: float = 0.45
    ) -> None:
        flag = "--model.init_args.reward.init_args.config.shapes_color"
        problems = []
        if not 0 < saturation <= 1:
            problems.append(f"{flag}.saturation ({saturation}) must be in (0, 1]")
        if not 0 < brightness < 1:
            problems.append(f"{flag}.brightness ({brightness}) must be in (0, 1)")
        if chroma_tolerance <= 0:
            problems.append(f"{flag}.chroma_tolerance ({chroma_tolerance}) must be positive")
        if problems:
            raise ValueError("invalid shapes_color reward settings:\n  " + "\n  ".join(problems))
        self.saturation = saturation
        self.verifier = ShapeVerifier(brightness=brightness, chroma_tolerance=chroma_tolerance)

    def problems(self, records: Sequence[Mapping]) -> list[str]:
        """Every prompt record this reward cannot score (:func:`record_problems`)."""
        return record_problems(records)

    def coverage(self, pixels: np.ndarray, records: Sequence[Mapping]) -> np.ndarray:
        """(B,) float64: the fraction of each (B, H, W, 3) uint8 image in its record's colours."""
        segments = self.verifier.segment(pixels)  # (B, H, W) palette index, -1 background
        out = np.empty(len(records))
        for i, record in enumerate(records):
            named = {e["color"] for e in record["include"] if "color" in e} or set(_PALETTE)
            wanted = np.isin(segments[i], [_PALETTE.index(c) for c in sorted(named)])
            out[i] = wanted.mean()
        return out

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        """(B,) fp32 in [0, 1]; NaN for an image with non-finite pixels."""
        check_images(images)
        if len(metadata) != images.shape[0]:
            raise ValueError(
                f"reward 'shapes_color' got {images.shape[0]} images but {len(metadata)} metadata records: "
                "give one record per image (a .jsonl prompt file such as lit_flowgrpo/toy/assets/train.jsonl)"
            )
        for record in metadata:
            check_record(record)
        finite = torch.isfinite(images.detach()).flatten(1).all(dim=1).cpu()  # (B,) bool
        pixels = to_numpy_hwc(torch.nan_to_num(images.detach(), nan=0.0))  # (B, H, W, 3) uint8
        score = np.minimum(self.coverage(pixels, metadata) / self.saturation, 1.0)
        return torch.where(finite, torch.from_numpy(score).float(), torch.tensor(float("nan")))


_VIDEO_FLAG = "--model.init_args.reward.init_args.config.shapes_video"


@register_reward("shapes_video")
class ShapesVideoReward:
    """Score toy-world videos against their video records (``lit_flowgrpo.toy.video_world``).

    Components: ``strict`` (0/1: the named object alone in every frame, moving the named way far
    enough, steadily and straight) and ``partial`` (the fraction of frames it is right in, plus the
    three motion conditions, over 4). ``strict`` is primary and core.

    Args:
        min_travel: the least travel along the named direction, as a fraction of the frame side.
        tolerance: the largest step back against the direction, in pixels of a 32 px frame.
        max_cross_ratio: the largest drift across the axis, as a fraction of the travel.
        brightness: a pixel is foreground when its brightest channel reaches this (0–1).
        chroma_tolerance: largest chromaticity distance from a palette colour still read as it.
        min_area: smallest object, in pixels of a 32×32 frame (scaled with the frame area).
    """

    modalities = frozenset({"video"})
    primary = "strict"
    core_components: tuple[str | None, ...] = ("strict",)
    required_metadata: tuple[str, ...] = ("tag", "include")

    def __init__(
        self,
        min_travel: float = 0.25,
        tolerance: float = 1.0,
        max_cross_ratio: float = 0.5,
        brightness: float = 0.35,
        chroma_tolerance: float = 0.45,
        min_area: float = 8.0,
    ) -> None:
        problems = []
        if not 0 < min_travel <= 1:
            problems.append(
                f"{_VIDEO_FLAG}.min_travel ({min_travel}) must be in (0, 1]: a fraction of the frame side"
            )
        if tolerance < 0:
            problems.append(f"{_VIDEO_FLAG}.tolerance ({tolerance}) must be 0 or more pixels")
        if max_cross_ratio < 0:
            problems.append(f"{_VIDEO_FLAG}.max_cross_ratio ({max_cross_ratio}) must be 0 or more")
        if not 0 < brightness < 1:
            problems.append(f"{_VIDEO_FLAG}.brightness ({brightness}) must be in (0, 1)")
        if chroma_tolerance <= 0:
            problems.append(f"{_VIDEO_FLAG}.chroma_tolerance ({chroma_tolerance}) must be positive")
        if min_area < 1:
            problems.append(f"{_VIDEO_FLAG}.min_area ({min_area}) must be at least 1 pixel")
        if problems:
            raise ValueError("invalid shapes_video reward settings:\n  " + "\n  ".join(problems))
        frame = ShapeVerifier(brightness=brightness, chroma_tolerance=chroma_tolerance, min_area=min_area)
        self.verifier = VideoVerifier(
            frame=frame, min_travel=min_travel, tolerance=tolerance, max_cross_ratio=max_cross_ratio
        )

    def problems(self, records: Sequence[Mapping]) -> list[str]:
        """Every prompt record this reward cannot score (:func:`video_record_problems`)."""
        return video_record_problems(records)

    def __call__(self, videos: Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, Tensor]:
        """``{"strict": (B,), "partial": (B,)}`` fp32; NaN for a video with non-finite pixels."""
        check_videos(videos, f"reward 'shapes_video' ({_VIDEO_FLAG}; images: the 'shapes' reward)")
        batch, frames, _, height, width = videos.shape
        if len(metadata) != batch:
            raise ValueError(
                f"reward 'shapes_video' got {batch} videos but {len(metadata)} metadata records: give one "
                "record per video (lit_flowgrpo.toy.video_world.video_records)"
            )
        finite = torch.isfinite(videos.detach()).flatten(1).all(dim=1).cpu()  # (B,) bool
        frames_hwc = to_numpy_hwc(torch.nan_to_num(videos.detach().flatten(0, 1), nan=0.0))  # (B·F, H, W, 3)
        strict, partial = self.verifier.score_batch(
            frames_hwc.reshape(batch, frames, height, width, 3), list(metadata)
        )
        nan = torch.tensor(float("nan"))
        return {
            "strict": torch.where(finite, torch.from_numpy(strict).float(), nan),
            "partial": torch.where(finite, torch.from_numpy(partial).float(), nan),
        }


def video_record_problems(records: Sequence[Mapping]) -> list[str]:
    """Every video prompt record the ``shapes_video`` reward cannot score, each named by its index."""
    return _records_problems(
        records, unknown_video_words, check_video_record, "the toy world's video vocabulary", VIDEO_VOCAB
    )
