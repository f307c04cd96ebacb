"""What ``FlowGRPOModule``'s steps hand to the callbacks (``on_train_batch_end`` / ``on_validation_batch_end``).

Typed dicts, not dataclasses: Lightning's manual-optimization loop passes a training step's output on
only when it is a ``Mapping``. Images stay on the module's device; a callback that logs some copies
just those to the host, on the steps it logs.
"""

from __future__ import annotations

from typing import TypedDict

from torch import Tensor

#: Stages of one training step, in the order they run (``timing_s/<stage>``).
STAGES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "step")

#: Stages whose transformer forwards run without backward (rollout, old log-prob, reference).
INFERENCE_STAGES = ("gen", "old_log_prob", "ref")


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
