"""Video rewards with no model of their own: any image reward applied frame by frame, and a
temporal-consistency score.

A video reward takes ``(B, F, 3, H, W)`` videos in [0, 1] and returns one value per video, and says
so with ``modalities = frozenset({"video"})`` (:mod:`lit_flowgrpo.rewards.base`).

- ``per_frame`` (:class:`PerFrame`): scores the B·F frames with an image reward as one image batch
  and reduces each video's F values (mean or min). In YAML::

      weights: {per_frame: 1.0}
      config: {per_frame: {reward: aesthetic, reduce: mean, config: {...aesthetic's settings}}}

- ``temporal_consistency`` (:class:`TemporalConsistencyReward`): one minus the mean absolute change
  between consecutive frames.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_flowgrpo.rewards.base import (
    checked_output,
    needs_sources,
    reward_modalities,
    thread_safe,
    uses_sources,
)
from lit_flowgrpo.rewards.images import check_videos, frame_indices
from lit_flowgrpo.rewards.registry import (
    Reward,
    available_rewards,
    build_reward,
    qualname,
    register_reward,
    unknown_rewards_hint,
)

__all__ = ["PerFrame", "TemporalConsistencyReward"]

Reduce = Literal["mean", "min"]
REDUCTIONS: tuple[str, ...] = ("mean", "min")

_PER_FRAME = "--model.init_args.reward.init_args.config.per_frame"
_TEMPORAL = "--model.init_args.reward.init_args.config.temporal_consistency"


@register_reward("per_frame")
class PerFrame:
    """Score a video with an image reward: every frame as an image, then one value per video.

    The B·F frames go to the wrapped reward as one image batch (video-major: video 0's frames, then
    video 1's), each with its video's prompt and metadata; each video's F values are then reduced.
    A dict-valued reward is reduced component by component. A frame the wrapped reward could not
    score (NaN) makes its video's component NaN, whatever the reduction: the video is dropped, never
    scored on the frames that happened to work.

    The wrapper keeps what the wrapped reward declares (``primary``, ``core_components``,
    ``required_metadata``, ``thread_safe``, ``check()``, ``problems()``), and its name in
    :attr:`name` (errors read ``PerFrame(<name>)``).

    Args:
        reward: the image reward: a registered name (built with ``config``) or a built reward.
        reduce: ``"mean"`` (the video's average frame) or ``"min"`` (its worst frame: one bad frame
            sinks the video).
        config: keyword arguments of the named reward's constructor (only with a name).
        max_frames: score at most this many frames, evenly spaced with the first and the last
            (:func:`lit_flowgrpo.rewards.images.frame_indices`); ``None`` scores every frame.
        frames_per_call: hand the wrapped reward at most this many frames per call (a neural scorer's
            memory); ``None`` hands it all B·F at once. Rewards are per-sample, so the values are the
            same either way.

    Raises:
        ValueError: naming the setting, for an unknown ``reduce``, a count below 1, ``config`` with a
            built reward, or a wrapped reward that cannot score images.
    """

    modalities = frozenset({"video"})

    def __init__(
        self,
        reward: str | Reward,
        reduce: Reduce = "mean",
        config: dict[str, Any] | None = None,
        max_frames: int | None = None,
        frames_per_call: int | None = None,
    ) -> None:
        problems = []
        if reduce not in REDUCTIONS:
            problems.append(f"{_PER_FRAME}.reduce ({reduce!r}) must be one of {list(REDUCTIONS)}")
        if max_frames is not None and max_frames < 1:
            problems.append(
                f"{_PER_FRAME}.max_frames ({max_frames}) must be at least 1, or null for every frame"
            )
        if frames_per_call is not None and frames_per_call < 1:
            problems.append(
                f"{_PER_FRAME}.frames_per_call ({frames_per_call}) must be at least 1, or null for one call"
            )
        if config and not isinstance(reward, str):
            problems.append(
                f"{_PER_FRAME}.config is given for a reward that is already built ({qualname(reward)}): "
                "give the reward by its registered name to have it built with config"
            )
        if problems:
            raise ValueError("; ".join(problems))
        if isinstance(reward, str) and reward not in available_rewards():
            raise ValueError(
                f"{_PER_FRAME}.reward ({reward!r}) is not a registered reward: {unknown_rewards_hint([reward])}"
            )
        inner = build_reward(reward, **(config or {})) if isinstance(reward, str) else reward
        if "image" not in reward_modalities(inner):
            raise ValueError(
                f"{_PER_FRAME}.reward ({reward if isinstance(reward, str) else qualname(inner)}) scores "
                f"{sorted(reward_modalities(inner))}, not images: PerFrame wraps an image reward; use a "
                "video reward as it is"
            )
        self.reward = inner
        self.reduce = reduce
        self.max_frames = max_frames
        self.frames_per_call = frames_per_call
        self.name: str = (
            reward if isinstance(reward, str) else getattr(inner, "name", None) or qualname(inner)
        )
        self.__qualname__ = f"PerFrame({self.name})"  # what MultiReward's messages name
        self.thread_safe = thread_safe(inner)
        self.primary = getattr(inner, "primary", None)
        self.core_components = getattr(inner, "core_components", ())
        self.required_metadata = tuple(getattr(inner, "required_metadata", ()))
        # A reward that sees the source (a first frame's preservation) gets each video's sources with
        # every one of its frames.
        self.uses_sources = uses_sources(inner)
        self.needs_sources = needs_sources(inner)

    def check(self) -> None:
        """The wrapped reward's start-up check, if it has one."""
        hook = getattr(self.reward, "check", None)
        if callable(hook):
            hook()

    def problems(self, records: Sequence[Mapping[str, Any]]) -> list[str]:
        """The wrapped reward's ``problems(records)``, if it has the hook."""
        hook = getattr(self.reward, "problems", None)
        return list(hook(records)) if callable(hook) else []

    def __call__(
        self,
        videos: Tensor,
        prompts: list[str],
        metadata: list[dict],
        sources: Sequence[Sequence[Tensor]] | None = None,
    ) -> Tensor | dict[str, Tensor]:
        """(B,) fp32 per component of the wrapped reward (a Tensor for a Tensor-valued one). ``sources``
        (each video's conditioning images) go with every frame of their video to a wrapped reward that
        declares ``uses_sources``."""
        check_videos(videos, self.__qualname__)
        batch, frames = videos.shape[:2]
        metadata = list(metadata)
        if len(prompts) != batch or len(metadata) not in (0, batch):
            raise ValueError(
                f"{self.__qualname__} got {batch} videos, {len(prompts)} prompts and {len(metadata)} metadata "
                "records: give one prompt (and one record, if any) per video"
            )
        index = frame_indices(frames, self.max_frames)
        n = len(index)
        images = videos[:, index].reshape(batch * n, *videos.shape[2:])  # (B·n, 3, H, W), video-major
        frame_prompts = [p for p in prompts for _ in range(n)]
        frame_metadata = [m for m in metadata for _ in range(n)]
        given = None
        if self.uses_sources:
            given = [list(s) for s in (sources or [[] for _ in range(batch)]) for _ in range(n)]
        step = self.frames_per_call or batch * n
        parts: list[dict[str | None, Tensor]] = []
        for start in range(0, batch * n, step):
            stop = min(start + step, batch * n)
            args = (images[start:stop], frame_prompts[start:stop], frame_metadata[start:stop])
            value = self.reward(*args) if given is None else self.reward(*args, sources=given[start:stop])
            parts.append(checked_output(value, stop - start, f"{self.__qualname__} on {stop - start} frames"))
        keys = list(parts[0])
        if any(list(p) != keys for p in parts):
            raise ValueError(
                f"{self.__qualname__}: the wrapped reward returned different components on different calls "
                f"({[sorted(map(str, p)) for p in parts]})"
            )
        out = {key: self._reduce(torch.cat([p[key] for p in parts]).view(batch, n)) for key in keys}
        return out[None] if keys == [None] else out  # type: ignore[return-value]

    def _reduce(self, values: Tensor) -> Tensor:
        """(B, n) fp32 per frame -> (B,): mean or min over the frames; NaN when any frame is NaN."""
        failed = torch.isnan(values).any(dim=1)
        reduced = values.mean(dim=1) if self.reduce == "mean" else values.amin(dim=1)
        return torch.where(failed, torch.nan, reduced)


@register_reward("temporal_consistency")
class TemporalConsistencyReward:
    """One minus the mean absolute change between consecutive frames, in [0, 1].

    For a video x_0 … x_{F-1} in [0, 1] (each frame first area-averaged to ``size`` × ``size`` when
    ``size`` is set)::

        score = 1 − 1/(F−1) · Σ_{t=0}^{F−2} mean_{c,y,x} |x_{t+1} − x_t|

    This is VBench's temporal-flickering score (Huang et al., 2024, "VBench", the ``temporal_flickering``
    dimension: ``(255 − MAE) / 255`` with MAE the mean absolute difference of consecutive uint8 frames)
    on [0, 1] values. A static video scores 1: it measures flicker, not quality, so weigh it beside a
    reward that asks for content and motion (a video trained on it alone stops moving).

    Args:
        size: area-average each frame to ``size`` × ``size`` pixels first (``adaptive_avg_pool2d``), so
            fine texture and noise weigh less than the change of larger structures; ``None`` compares
            frames at full resolution, as VBench does.

    Raises:
        ValueError: naming the setting for a ``size`` below 1; on a call, for images (4-D) instead of
            videos, or videos of fewer than 2 frames.
    """

    modalities = frozenset({"video"})
    core_components: tuple[str | None, ...] = ()

    def __init__(self, size: int | None = None) -> None:
        if size is not None and size < 1:
            raise ValueError(f"{_TEMPORAL}.size ({size}) must be at least 1, or null for full resolution")
        self.size = size

    def __call__(self, videos: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        """(B,) fp32 in [0, 1]; NaN for a video with a non-finite pixel."""
        check_videos(videos, f"reward 'temporal_consistency' ({_TEMPORAL})")
        batch, frames = videos.shape[:2]
        if frames < 2:
            raise ValueError(
                f"reward 'temporal_consistency' ({_TEMPORAL}) compares consecutive frames and got videos of "
                f"{frames} frame: generate at least 2 frames, or drop this reward"
            )
        x = videos.detach().float()  # (B, F, 3, H, W) fp32
        finite = torch.isfinite(x).flatten(1).all(dim=1)  # (B,)
        x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
        if self.size is not None:
            x = F.adaptive_avg_pool2d(x.flatten(0, 1), self.size).unflatten(0, (batch, frames))
        change = (x[:, 1:] - x[:, :-1]).abs().mean(dim=(2, 3, 4))  # (B, F-1) mean |x_{t+1} - x_t|
        score = 1.0 - change.mean(dim=1)  # (B,) fp32
        return torch.where(finite, score, torch.nan)
