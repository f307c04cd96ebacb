"""The toy world's video verifier, the gold score of a video prompt ("a red circle moving up").

Every frame goes through the image verifier (:class:`lit_flowgrpo.toy.verifier.ShapeVerifier`: colour
segmentation, components, shape classes), all B·F frames of a batch in one call. Then, for a record
``{"class", "color", "motion"}`` (:mod:`lit_flowgrpo.toy.video_world`), four conditions:

- ``present``: every frame passes the image check of the record (exactly one object of the named
  shape in the named colour, and nothing else);
- ``moves``: the object's centre travels, from the first frame it is tracked in to the last, at least
  ``min_travel`` of the frame side along the named direction (width for left/right, height for
  up/down);
- ``monotonic``: no step between consecutive tracked frames goes back against the direction by more
  than ``tolerance`` pixels (at 32 px; scaled with the frame), so a back-and-forth that ends in the
  right place fails;
- ``straight``: the centre strays across the axis by at most ``max_cross_ratio`` times the distance
  it travelled (or ``min_travel`` of the side, when it travelled less), so a diagonal is not "up".

The tracked centre is the bounding-box centre of the one object of the named shape and colour in a
frame (frames with none or several are not tracked). For a rigid shape that translates, the box
centre and the centroid move by the same vector; the box centre is what the detector reports, and
the image verifier's relations use it too.

``partial`` is ``(fraction of frames present + moves + monotonic + straight) / 4``; ``strict`` is 1
when all four hold. With fewer than two tracked frames no motion condition holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lit_flowgrpo.toy.verifier import Detections, ShapeVerifier, check_record
from lit_flowgrpo.toy.video_world import AXES, DIRECTIONS, VIDEO_TAG
from lit_flowgrpo.toy.world import IMAGE_SIZE


@dataclass(frozen=True)
class VideoVerifier:
    """Detector per frame and motion checker, with its thresholds.

    Args:
        frame: the image verifier each frame goes through.
        min_travel: the least travel along the named direction, as a fraction of the frame side.
        tolerance: the largest step back against the direction, in pixels of a 32 px frame.
        max_cross_ratio: the largest drift across the axis, as a fraction of the travel.
    """

    frame: ShapeVerifier = field(default_factory=ShapeVerifier)
    min_travel: float = 0.25
    tolerance: float = 1.0
    max_cross_ratio: float = 0.5

    def __post_init__(self) -> None:
        problems = []
        if not 0 < self.min_travel <= 1:
            problems.append(f"min_travel ({self.min_travel}) must be in (0, 1]: a fraction of the frame side")
        if self.tolerance < 0:
            problems.append(f"tolerance ({self.tolerance}) must be 0 or more pixels")
        if self.max_cross_ratio < 0:
            problems.append(f"max_cross_ratio ({self.max_cross_ratio}) must be 0 or more")
        if problems:
            raise ValueError("invalid video verifier settings: " + "; ".join(problems))

    def check(
        self, found: list[Detections], record: dict[str, Any], height: int, width: int
    ) -> dict[str, Any]:
        """Score one video's per-frame detections against a video record.

        Returns:
            ``{"strict": bool, "partial": float, "conditions": [{"name", "met", "detail"}],
            "track": [[x, y] or None per frame], "frames_present": int}``.
        """
        entry = record["include"][0]
        cls, color, direction = entry["class"], entry["color"], entry["motion"]
        present = [self.frame.check(frame, record)["strict"] for frame in found]
        track: list[list[float] | None] = []
        for frame in found:
            mine = [o for o in frame.objects if o.shape == cls and o.color == color]
            track.append(list(mine[0].center) if len(mine) == 1 else None)
        axis, sign = AXES[direction]
        side = width if axis == 0 else height
        points = np.array([p for p in track if p is not None], dtype=np.float64).reshape(-1, 2)
        conditions = [
            {
                "name": f"present:{color} {cls}",
                "met": all(present),
                "detail": f"in {sum(present)} of {len(present)} frames",
            }
        ]
        if len(points) >= 2:
            along = sign * points[:, axis]  # (T,) position along the direction, px
            across = points[:, 1 - axis]
            travel = float(along[-1] - along[0])
            back = float(max(0.0, -np.diff(along).min()))  # the largest step against the direction
            drift = float(np.abs(across - across[0]).max())
            need = self.min_travel * side
            allowed_back = self.tolerance * side / IMAGE_SIZE
            allowed_drift = self.max_cross_ratio * max(abs(travel), need)
            conditions += [
                {
                    "name": f"moves:{direction}",
                    "met": travel >= need,
                    "detail": f"travelled {travel:.1f} px {direction}, want at least {need:.1f}",
                },
                {
                    "name": "monotonic",
                    "met": back <= allowed_back,
                    "detail": f"largest step back {back:.1f} px, allowed {allowed_back:.1f}",
                },
                {
                    "name": "straight",
                    "met": drift <= allowed_drift,
                    "detail": f"drifted {drift:.1f} px across, allowed {allowed_drift:.1f}",
                },
            ]
        else:
            why = f"tracked in {len(points)} frame(s): motion needs two"
            conditions += [
                {"name": n, "met": False, "detail": why}
                for n in (f"moves:{direction}", "monotonic", "straight")
            ]
        share = sum(present) / len(present)
        partial = (share + sum(c["met"] for c in conditions[1:])) / 4
        return {
            "strict": all(c["met"] for c in conditions),
            "partial": partial,
            "conditions": conditions,
            "track": track,
            "frames_present": sum(present),
        }

    def verify(self, video: np.ndarray, record: dict[str, Any]) -> dict[str, Any]:
        """Detect and check one (F, H, W, 3) uint8 video (for debugging: the result has the track)."""
        _check_videos(video, one=True)
        check_video_record(record)
        found = self.frame.detect_batch(video)
        return self.check(found, record, video.shape[1], video.shape[2])

    def score_batch(self, videos: np.ndarray, records: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        """(strict, partial), each (B,) float64, for (B, F, H, W, 3) uint8 videos and their records."""
        _check_videos(videos)
        batch, frames, height, width = videos.shape[:4]
        if len(records) != batch:
            raise ValueError(f"got {batch} videos but {len(records)} records: give one record per video")
        for record in records:
            check_video_record(record)
        found = self.frame.detect_batch(videos.reshape(batch * frames, height, width, 3))
        results = [
            self.check(found[b * frames : (b + 1) * frames], record, height, width)
            for b, record in enumerate(records)
        ]
        return (
            np.array([float(r["strict"]) for r in results]),
            np.array([r["partial"] for r in results]),
        )


def check_video_record(record: Any) -> None:
    """Raise ``ValueError`` naming what is wrong with a record the video verifier cannot read."""
    check_record(record)
    include = record["include"]
    entry = include[0]
    problems = []
    if len(include) != 1 or entry.get("count") != 1 or "color" not in entry:
        problems.append("include must be one entry of count 1 with a 'color'")
    if entry.get("motion") not in DIRECTIONS:
        problems.append(f"include[0].motion {entry.get('motion')!r} (directions: {list(DIRECTIONS)})")
    if problems:
        raise ValueError(
            f"record {record.get('prompt', '')!r} is not a toy-world video record ({VIDEO_TAG!r}): "
            + "; ".join(problems)
            + ": use lit_flowgrpo.toy.video_world.make_video_record"
        )


def _check_videos(videos: Any, one: bool = False) -> None:
    """Raise a ``ValueError`` unless ``videos`` is (B, F, H, W, 3) uint8 (``one``: (F, H, W, 3)), F >= 2."""
    ndim = 4 if one else 5
    shape = getattr(videos, "shape", None)
    ok = (
        isinstance(videos, np.ndarray)
        and videos.ndim == ndim
        and videos.shape[-1] == 3
        and videos.dtype == np.uint8
    )
    if not ok:
        want = "one (F, H, W, 3) uint8 video" if one else "(B, F, H, W, 3) uint8 videos"
        got = f"{shape} {getattr(videos, 'dtype', type(videos).__name__)}"
        image = shape is not None and len(shape) == ndim - 1
        hint = (
            ": that is an image (batch); the image verifier is lit_flowgrpo.toy.verifier.ShapeVerifier"
            if image
            else ""
        )
        raise ValueError(f"the video verifier takes {want}; got {got}{hint}")
    frames = videos.shape[ndim - 4]
    if frames < 2:
        raise ValueError(
            f"the video verifier needs at least 2 frames to see motion; got videos of {frames} frame"
        )


_DEFAULT = VideoVerifier()


def verify_video(video: np.ndarray, record: dict[str, Any]) -> dict[str, Any]:
    """Check one (F, H, W, 3) uint8 video against a video record with the default thresholds."""
    return _DEFAULT.verify(video, record)
