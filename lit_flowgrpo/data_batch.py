"""What the objectives that learn from images train on: :class:`DataBatch`, the clean latents x0 of this
rank's samples (and a pair's rejected latents) with their conditioning, built either from a data module's
images (:func:`encode_images`) or from a rollout's own samples paired by reward within their groups
(:func:`rollout_pairs`).

Its rows keep the rollout's (or the data batch's) order, so each row's place in the batch of all ranks,
which decides its optimizer step (:meth:`~lit_flowgrpo.update.UpdateSettings.steps_of`), is the same
for one process and for N ranks; rows that train nothing (no pair) are marked in ``keep``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from lit_flowgrpo.algorithms import preference_pairs
from lit_flowgrpo.data import PromptBatch
from lit_flowgrpo.distributed import DataParallel
from lit_flowgrpo.errors import flag
from lit_flowgrpo.image_data import ImageBatch, ImageDataModule
from lit_flowgrpo.policies.base import Embeds, FlowPolicy, latent_shape_of
from lit_flowgrpo.rollout import RolloutBatch
from lit_flowgrpo.step_output import StageClock, StepOutput

__all__ = [
    "DataBatch",
    "data_problems",
    "data_step",
    "data_step_output",
    "encode_images",
    "images_batch",
    "rollout_pairs",
    "stage_timings",
]


@dataclass
class DataBatch:
    """This rank's clean latents and conditioning, as the update walks them (the update's batch, as a
    :class:`~lit_flowgrpo.rollout.RolloutBatch` is for the RL objectives)."""

    latents: Tensor
    """(B, *latent) fp32: x0 of each sample (a pair's chosen one)."""
    embeds: Embeds
    """Conditioning, one row per sample."""
    sample_ids: Tensor
    """(B,) int64: each sample's id in the step (seeds its draws; the metrics' key)."""
    keep: Tensor
    """(B,) bool: the rows the update trains."""
    rejected: Tensor | None = None
    """(B, *latent) fp32: a pair's rejected x0; ``None`` for SFT."""

    def __len__(self) -> int:
        return len(self.keep)

    @property
    def advantages(self) -> Tensor:
        """(B,) zeros: no advantage weighs a data objective (the update reads its device and length)."""
        return torch.zeros(len(self.keep), device=self.keep.device)

    def rows(self) -> dict[str, Tensor]:
        """Every per-sample tensor, by a name that :meth:`with_rows` reads back."""
        out = {"latents": self.latents, "sample_ids": self.sample_ids, "keep": self.keep}
        out.update({f"embeds.{k}": v for k, v in self.embeds.items()})
        if self.rejected is not None:
            out["rejected"] = self.rejected
        return out

    def with_rows(self, rows: dict[str, Tensor]) -> DataBatch:
        embeds = {k: rows[f"embeds.{k}"] for k in self.embeds}
        return DataBatch(rows["latents"], embeds, rows["sample_ids"], rows["keep"], rows.get("rejected"))


@dataclass
class RolloutWithImages(RolloutBatch):
    """A rollout batch whose samples also carry their records' images as clean latents (an RL objective
    with the SFT loss beside it: :class:`~lit_flowgrpo.data_objective.WithSFT`)."""

    images: Tensor | None = None
    """(B, *latent) fp32: x0 of each sample's record image."""

    def rows(self) -> dict[str, Tensor]:
        assert self.images is not None
        return {**super().rows(), "images": self.images}

    def with_rows(self, rows: dict[str, Tensor]) -> RolloutWithImages:
        base = super().with_rows(rows)
        return RolloutWithImages(
            **{f.name: getattr(base, f.name) for f in fields(base)}, images=rows["images"]
        )


def beside_rollout(
    source: str,
    rollout: RolloutBatch,
    rewards: Tensor,
    batch: PromptBatch,
    policy: FlowPolicy,
    dp: DataParallel,
    log: Callable,
) -> RolloutBatch | RolloutWithImages | DataBatch:
    """What the update walks after a rollout, by the objective's ``learns_from``: the rollout itself
    (``rollout``), online DPO's pairs (``rollout_pairs``: :func:`rollout_pairs`), or the rollout with the
    records' images encoded beside it (``rollout_images``)."""
    if source == "rollout_pairs":
        return rollout_pairs(rollout.trajectory.final, rollout.embeds, rewards, batch, dp, log)
    if source == "rollout_images":
        if not isinstance(batch, ImageBatch) or batch.images is None:
            raise TypeError(
                "an RL objective with SFT beside it needs --data=lit_flowgrpo.image_data.ImageDataModule"
            )
        images = _encode_cached(policy, batch, "image", rollout.advantages.device)
        return RolloutWithImages(**{f.name: getattr(rollout, f.name) for f in fields(rollout)}, images=images)
    return rollout


@torch.no_grad()
def encode_images(policy: FlowPolicy, images: Tensor) -> Tensor:
    """(B, *latent) fp32: the latents x0 of images (B, 3, H, W) in [0, 1], each family's
    :meth:`~lit_flowgrpo.policies.base.FlowPolicy.encode_images` (its VAE, normalisation and packing; pixel
    space for a family without a VAE), checked against the layout its ``velocity`` takes. A video family
    takes an image as a clip of one frame. A family that cannot encode says which and why.
    """
    if policy.modality == "video" and images.dim() == 4:
        images = images[:, None]  # (B, 1, 3, H, W): one frame
    latents = policy.encode_images(images).float()
    frames = images.shape[1] if policy.modality == "video" else 1
    want = latent_shape_of(policy, images.shape[-2], images.shape[-1], frames)
    if tuple(latents.shape) != (len(images), *want):
        raise ValueError(
            f"{type(policy).__name__}.encode_images gave latents of shape {tuple(latents.shape[1:])}, but its "
            f"velocity takes {want}: the encoding is not the inverse of its decode"
        )
    return latents


def images_batch(policy: FlowPolicy, batch: Any, device: torch.device, pairs: bool) -> DataBatch:
    """The :class:`DataBatch` of a data module's :class:`~lit_flowgrpo.image_data.ImageBatch`: its prompts
    and images (with ``pairs``, a pair's rejected ones too) encoded by the policy, every row kept."""
    if not isinstance(batch, ImageBatch) or batch.images is None:
        raise TypeError(
            "an objective that learns from images needs --data=lit_flowgrpo.image_data.ImageDataModule"
        )
    latents = _encode_cached(policy, batch, "image", device)
    rejected = (
        _encode_cached(policy, batch, "rejected", device) if pairs and batch.rejected is not None else None
    )
    keep = torch.ones(len(batch), dtype=torch.bool, device=device)
    return DataBatch(
        latents, policy.encode_prompts(batch.prompts), batch.sample_ids.to(device), keep, rejected
    )


def _encode_cached(policy: FlowPolicy, batch: ImageBatch, which: str, device: torch.device) -> Tensor:
    """The latents of the batch's ``which`` images: encoded, or, under the data module's latent cache,
    read from it where encoded before (the rest encoded in one call and kept)."""
    images = batch.images if which == "image" else batch.rejected
    assert images is not None
    cache = batch.latent_cache
    if cache is None or policy.vae is None or batch.record_ids is None:  # pixels cost nothing to "encode"
        return encode_images(policy, images.to(device))
    keys = [(int(r), which) for r in batch.record_ids.tolist()]
    new = [i for i, k in enumerate(keys) if k not in cache.store]
    if new:
        fresh = encode_images(policy, images[new].to(device)).cpu()
        for i, latent in zip(new, fresh, strict=True):
            cache.store[keys[i]] = latent.clone()
    return torch.stack([cache.store[k] for k in keys]).to(device)


def data_step_output(
    batch: ImageBatch, data: DataBatch, done: Any, timings: dict[str, float], frames: int
) -> StepOutput:
    """What a step on the data module's images returns to the callbacks: its images, no reward (NaN)."""
    nan = torch.full((len(data),), math.nan, device=data.keep.device)
    assert batch.images is not None  # images_batch checked it
    return StepOutput(
        timings=timings,
        num_images=len(data),
        frames_per_sample=frames,
        transformer_forwards={
            "gen": 0,
            "old_log_prob": 0,
            "ref": done.forwards["ref"],
            "update_actor": done.forwards["update"],
        },
        images=batch.images.to(data.keep.device),
        prompts=list(batch.prompts),
        rewards=nan,
        sample_ids=data.sample_ids,
        advantages=torch.zeros_like(nan),
        keep=data.keep,
        trained_sample_ids=done.trained,
        kept_per_rank=done.kept_per_rank,
    )


def rollout_pairs(
    final: Tensor,
    embeds: Embeds,
    rewards: Tensor,
    batch: PromptBatch,
    dp: DataParallel,
    log: Callable[..., Any] | None = None,
) -> DataBatch:
    """Online Diffusion-DPO's pairs from this step's rollout: in each group (over every rank) the sample
    with the highest reward is chosen and the one with the lowest rejected
    (:func:`~lit_flowgrpo.algorithms.preference_pairs`). The pair trains on the rank that holds its
    chosen sample, in that sample's row; the rejected latents travel by one all-gather of the final
    latents.

    Args:
        final: (B, *latent) this rank's final latents.
        embeds: their conditioning.
        rewards: (B,) this rank's total rewards (NaN: unscored).
        batch: this rank's prompt batch (its group and sample ids).
        dp: the data-parallel peers.
        log: ``LightningModule.log``, given the pairs over every rank (``actor/dpo_online_pairs``).

    Returns:
        The batch: B rows, ``keep`` on the rows that hold a chosen sample.
    """
    device, group_ids, sample_ids = final.device, batch.group_ids, batch.sample_ids
    all_rewards = dp.gather(rewards.float().to(device))
    all_groups = dp.gather(group_ids.to(device))
    all_ids = dp.gather(sample_ids.to(device))
    all_final = final if dp.size == 1 else torch.cat(list(dp.stack(final).unbind(0)))
    chosen, rejected = preference_pairs(all_rewards.cpu(), all_groups.cpu(), all_ids.cpu())
    first = dp.rank * len(final)  # this rank's rows in the gathered order (rank-major)
    keep = torch.zeros(len(final), dtype=torch.bool, device=device)
    rejected_latents = final.clone()
    for c, r in zip(chosen.tolist(), rejected.tolist(), strict=True):
        if first <= c < first + len(final):
            keep[c - first] = True
            rejected_latents[c - first] = all_final[r]
    if log is not None:
        log("actor/dpo_online_pairs", float(len(chosen)), on_step=True, on_epoch=False)
    return DataBatch(final.float(), embeds, sample_ids.to(device), keep, rejected_latents.float())


def data_problems(objective: Any, sampler: Any, dm: Any, full_fine_tune: bool, kl: Any) -> list[str]:
    """The objective against the data module and the weights, at setup (before any weight is read):
    images for the objectives that learn from them, pairs for offline Diffusion-DPO, the images' size the
    sampler's, a frozen reference for a full fine-tune whose loss uses one."""
    name, source = type(objective).__name__, objective.learns_from
    p = []
    # Both forms of Diffusion-DPO (the objectives that learn from pairs) compute with the reference.
    if source in ("data_pairs", "rollout_pairs") and full_fine_tune and not kl.reference.copy:
        p.append(
            f"{name} with a full fine-tune ({flag('weights')}.lora=null) needs {flag('kl')}.reference.copy=true: "
            "its loss compares with a frozen copy of the initial transformer"
        )
    if dm is None:
        return p
    if source == "rollout_images" and not isinstance(dm, ImageDataModule):
        return [
            *p,
            f"--data={type(dm).__name__}: {name} learns beside images, use lit_flowgrpo.image_data.ImageDataModule",
        ]
    if source not in ("data", "data_pairs"):
        if isinstance(dm, ImageDataModule) and dm.group_size < 2:
            p.append(
                f"--data.init_args.group_size ({dm.group_size}) must be at least 2 with {name}: it compares a group"
            )
        if source != "rollout_images":
            return p
    if not isinstance(dm, ImageDataModule):
        return [
            *p,
            f"--data={type(dm).__name__}: {name} learns from images, use lit_flowgrpo.image_data.ImageDataModule",
        ]
    if source == "data_pairs" and not dm.pairs:
        p.append(
            f"--data.init_args.pairs must be true with {name}(pairs=data): it learns from preference pairs"
        )
    if sampler.frames != 1:
        p.append(
            f"{flag('sampler')}.frames ({sampler.frames}) must be 1 with {name}: the data module's records are "
            "images, which a video family learns as clips of one frame"
        )
    if (dm.height, dm.width) != (sampler.height, sampler.width):
        p.append(
            f"--data.init_args.height/width ({dm.height}x{dm.width}) must be the sampler's {flag('sampler')}.height/"
            f"width ({sampler.height}x{sampler.width}): the model learns the images at the size it samples"
        )
    return p


def stage_timings(clock: StageClock, reference_s: float) -> dict[str, float]:
    """The step's stage times, the reference's forwards (``ref``) taken out of ``update_actor``."""
    clock.end()
    timings = clock.timings
    timings["ref"], timings["update_actor"] = reference_s, timings["update_actor"] - reference_s
    return timings


def data_step(
    policy: FlowPolicy, batch: Any, clock: StageClock, update: Callable, log_step: Callable, objective: Any
) -> StepOutput:
    """A training step on the data module's images (SFT, offline Diffusion-DPO): encode (the ``gen``
    stage), then the module's ``update`` of the :class:`DataBatch` and its ``log_step`` without rewards.
    Images only (the families that learn from images), one frame each."""
    data = images_batch(policy, batch, clock.device, pairs=objective.learns_from == "data_pairs")
    clock.begin("update_actor")
    done = update(data, batch.step, clock)
    log_step(rewards=False)
    return data_step_output(batch, data, done, stage_timings(clock, done.reference_s), 1)
