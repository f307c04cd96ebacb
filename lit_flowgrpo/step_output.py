"""What ``FlowGRPOModule``'s steps hand to the callbacks (``on_train_batch_end`` / ``on_validation_batch_end``).

Typed dicts, not dataclasses: Lightning's manual-optimization loop passes a training step's output on
only when it is a ``Mapping``. Images stay on the module's device; a callback that logs some copies
just those to the host, on the steps it logs.
"""

from __future__ import annotations

import time
from typing import Any, TypedDict

import torch
from torch import Tensor
from typing_extensions import NotRequired

#: Stages of one training step, in the order they run (``timing_s/<stage>``).
STAGES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "step")

#: Stages whose transformer forwards run without backward (rollout, old log-prob, reference).
INFERENCE_STAGES = ("gen", "old_log_prob", "ref")

#: The profiler range of a stage, where it is not ``lit_flowgrpo.<stage>``.
_RANGES = {"update_actor": "update"}


class StageClock:
    """The stages of one training step, timed and marked: :meth:`begin` ends the stage before (its
    seconds into :attr:`timings`) and opens the next one's profiler range, ``lit_flowgrpo.<stage>``
    (``lit_flowgrpo.update`` for ``update_actor``), on the host's and, through it, the GPU's timeline.

    On a GPU the clock reads after a device synchronize, so a stage's seconds are its kernels' too.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.timings = dict.fromkeys(STAGES, 0.0)
        self._stage: str | None = None
        self._range: Any = None
        self._started = self._since = self.now()

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def begin(self, stage: str) -> None:
        self.end()
        self._stage = stage
        self._range = torch.profiler.record_function(f"lit_flowgrpo.{_RANGES.get(stage, stage)}")
        self._range.__enter__()
        self._since = self.now()

    def end(self) -> None:
        """End the open stage, if any; ``timings["step"]`` is the whole step so far."""
        now = self.now()
        if self._stage is not None:
            self.timings[self._stage] += now - self._since
            self._range.__exit__(None, None, None)
            self._stage = self._range = None
        self.timings["step"] = now - self._started


class StepOutput(TypedDict):
    """One rollout batch on this rank."""

    timings: dict[str, float]
    """Seconds spent in each of :data:`STAGES` (after a CUDA synchronize)."""
    num_images: int
    """Samples (images, or videos) this rank generated."""
    frames_per_sample: int
    """Frames of each sample: 1 for images, F for videos (the sampler's ``frames``)."""
    transformer_forwards: dict[str, int]
    """Single-sample transformer forwards per stage (CFG counts twice), for MFU."""
    images: Tensor
    """(B, 3, H, W) in [0, 1], on the module's device; videos: (B, F, 3, H, W)."""
    prompts: list[str]
    rewards: Tensor
    """(B,) total reward (NaN where the sample could not be scored)."""
    sample_ids: Tensor
    """(B,) each rollout sample's id in the step (unique over all ranks)."""
    advantages: Tensor
    """(B,) each sample's advantage."""
    keep: Tensor
    """(B,) bool: the samples kept for the update (finite reward; non-zero advantage under
    ``filter_zero``)."""
    trained_sample_ids: Tensor
    """(K,) the ids of the samples this rank trained (after ``balance_load``, some may come from
    other ranks)."""
    kept_per_rank: list[int]
    """Samples each rank trained (after ``balance_load``)."""
    sources: NotRequired[list[list[Tensor]] | None]
    """Each sample's conditioning images ((3, h, w) in [0, 1]: an edit's source, a first frame), or ``None``
    for text-only records."""


class ValidationOutput(TypedDict):
    """One validation batch on this rank."""

    images: Tensor
    """(B, 3, H, W) in [0, 1], on the module's device; videos: (B, F, 3, H, W)."""
    prompts: list[str]
    rewards: dict[str, Tensor]
    """Each reward component, (B,) (NaN where unscored)."""
    sample_ids: Tensor
    """(B,) the validation sample each row is (a fixed (prompt, seed) pair): the same id is the same
    prompt and noise in every validation, so validations compare sample by sample."""
    sources: NotRequired[list[list[Tensor]] | None]
    """Each sample's conditioning images, or ``None`` for text-only records."""
