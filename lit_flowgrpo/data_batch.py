"""What the objectives that learn from images train on: :class:`DataBatch`, the clean latents x0 of this
rank's samples (and a pair's rejected latents) with their conditioning, built either from a data module's
images (:func:`encode_images`) or from a rollout's own samples paired by reward within their groups
(:func:`rollout_pairs`).

Its rows keep the rollout's (or the data batch's) order, so each row's place in the batch of all ranks,
which decides its optimizer step (:meth:`~lit_flowgrpo.update.UpdateSettings.steps_of`), is the same
for one process and for N ranks; rows that train nothing (no pair) are marked in ``keep``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lit_flowgrpo.algorithms import preference_pairs
from lit_flowgrpo.distributed import DataParallel
from lit_flowgrpo.policies.base import Embeds, FlowPolicy

__all__ = ["DataBatch", "encode_images", "rollout_pairs"]


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


@torch.no_grad()
def encode_images(policy: FlowPolicy, images: Tensor) -> Tensor:
    """(B, *latent) fp32: the latents x0 of images (B, 3, H, W) in [0, 1], the inverse of the policy's
    ``decode``.

    A family without a VAE (``policy.vae is None``) decodes in pixel space, x0 = 2·image − 1. A family
    with one: the mean of the VAE's latent distribution (deterministic, so a cached latent is the one
    recomputed; diffusers' SD3 scripts draw ``latent_dist.sample()``, whose spread is the VAE's
    small posterior std), shifted and scaled as SD3's pipeline and training scripts do,
    (z − shift_factor)·scaling_factor. A family whose latents are laid out otherwise (FLUX.1's and
    Qwen-Image's packed tokens, video) is refused: its layout is not this one.
    """
    vae = policy.vae
    if vae is None:
        return images.float() * 2.0 - 1.0
    if policy.modality != "image":
        raise ValueError(f"{type(policy).__name__}: learning from images is built for image families")
    pixels = (images * 2.0 - 1.0).to(device=next(vae.parameters()).device, dtype=vae.dtype)
    dist = vae.encode(pixels).latent_dist
    config = vae.config
    shift = getattr(config, "shift_factor", None) or 0.0
    latents = (dist.mode().float() - shift) * config.scaling_factor
    want = tuple(policy.latent_shape(images.shape[-2], images.shape[-1]))
    if tuple(latents.shape[1:]) != want:
        raise ValueError(
            f"{type(policy).__name__}'s latents are laid out as {want}, the VAE gives {tuple(latents.shape[1:])}: "
            "learning from images is built for SD3's layout (unpacked VAE latents)"
        )
    return latents


def rollout_pairs(
    final: Tensor,
    embeds: Embeds,
    rewards: Tensor,
    group_ids: Tensor,
    sample_ids: Tensor,
    dp: DataParallel,
) -> tuple[DataBatch, int]:
    """Online Diffusion-DPO's pairs from this step's rollout: in each group (over every rank) the sample
    with the highest reward is chosen and the one with the lowest rejected
    (:func:`~lit_flowgrpo.algorithms.preference_pairs`). The pair trains on the rank that holds its
    chosen sample, in that sample's row; the rejected latents travel by one all-gather of the final
    latents.

    Args:
        final: (B, *latent) this rank's final latents.
        embeds: their conditioning.
        rewards: (B,) this rank's total rewards (NaN: unscored).
        group_ids: (B,) int64.
        sample_ids: (B,) int64, unique over the ranks.
        dp: the data-parallel peers.

    Returns:
        The batch (B rows, ``keep`` on the rows that hold a chosen sample) and the pairs over every rank.
    """
    device = final.device
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
    batch = DataBatch(final.float(), embeds, sample_ids.to(device), keep, rejected_latents.float())
    return batch, len(chosen)
