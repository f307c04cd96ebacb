"""Diagnostics of the objectives that learn from given images: the SFT loss by noise level
(:class:`SFTDiagnostics`) and Diffusion-DPO's implicit reward accuracy and margin (:class:`DPODiagnostics`),
from sums and counts, so 1 rank and N ranks agree exactly (up to fp64 summation order)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor

from lit_flowgrpo.metrics.base import DictMetric, check_vector

__all__ = ["DPODiagnostics", "SFTDiagnostics"]


class SFTDiagnostics(DictMetric):
    """The flow-matching loss on data over every (sample, visit) of an update, overall and by σ bucket.

    Logged as ``actor/sft_loss`` (the weighted loss, the mean of the per-sample terms),
    ``actor/sft_sigma_mean`` and ``actor/sft_loss_by_sigma/<lo>-<hi>`` for ``buckets`` equal-width bands of
    σ ∈ [0, 1] (a band no sample fell in is not logged). A loss that falls at low σ and not at high σ has
    learnt detail and not layout, and the other way round.

    >>> m = SFTDiagnostics(buckets=2)
    >>> m.update(loss=torch.tensor([1.0, 3.0, 5.0]), sigma=torch.tensor([0.1, 0.2, 0.9]))
    >>> {k: round(float(v), 3) for k, v in m.compute_prefixed().items()}
    {'actor/sft_loss': 3.0, 'actor/sft_sigma_mean': 0.4, 'actor/sft_loss_by_sigma/0.00-0.50': 2.0, 'actor/sft_loss_by_sigma/0.50-1.00': 5.0}
    """

    higher_is_better = False

    def __init__(self, buckets: int = 4, prefix: str = "actor/", process_group: Any = None) -> None:
        super().__init__(prefix, process_group)
        if buckets < 1:
            raise ValueError(f"buckets ({buckets}) must be at least 1")
        self.buckets = buckets
        self.add_state("sum_loss", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("sum_sigma", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        zeros = torch.zeros(buckets, dtype=torch.float64)
        self.add_state("bucket_loss", default=zeros.clone(), dist_reduce_fx="sum")
        self.add_state("bucket_count", default=zeros.clone(), dist_reduce_fx="sum")

    def update(self, loss: Tensor, sigma: Tensor) -> None:  # type: ignore[override]
        n = check_vector("loss", loss)
        check_vector("sigma", sigma, n)
        loss, sigma = loss.detach().double(), sigma.detach().double().to(loss.device)
        self.sum_loss = self.sum_loss + loss.sum()
        self.sum_sigma = self.sum_sigma + sigma.sum()
        self.count = self.count + n
        band = (sigma * self.buckets).long().clamp_(0, self.buckets - 1)  # σ = 1 falls in the last band
        self.bucket_loss = self.bucket_loss.index_add(0, band, loss)
        self.bucket_count = self.bucket_count.index_add(0, band, torch.ones_like(loss))

    def compute(self) -> dict[str, Tensor]:
        n = _count_or_nan(self.count)  # no sample: NaN, not a 0 that reads as a measured loss
        out = {"sft_loss": self.sum_loss / n, "sft_sigma_mean": self.sum_sigma / n}
        for b in range(self.buckets):
            if self.bucket_count[b] > 0:
                lo, hi = b / self.buckets, (b + 1) / self.buckets
                out[f"sft_loss_by_sigma/{lo:.2f}-{hi:.2f}"] = self.bucket_loss[b] / self.bucket_count[b]
        return out


class DPODiagnostics(DictMetric):
    """Diffusion-DPO's statistics over every pair (and visit) of an update
    (:class:`~lit_flowgrpo.algorithms.DPOStats`).

    Logged as ``actor/dpo_reward_accuracy`` (share of pairs whose implicit reward margin is > 0: the
    trained model, relative to the reference, fits the chosen image better than the rejected one; 0 at
    the start, where model = reference), ``actor/dpo_reward_margin`` (mean margin −β/2·((e_w − e_l) −
    (e_w^ref − e_l^ref))), ``actor/dpo_loss``, ``actor/dpo_model_diff`` and ``actor/dpo_ref_diff``,
    ``actor/dpo_chosen_error`` and ``actor/dpo_rejected_error`` (the trained model's flow-matching errors),
    and ``actor/dpo_pairs`` (the pairs counted). A step without a pair on any rank (online pairs from
    groups whose rewards all tie) logs ``dpo_pairs`` 0 and NaN for the rest: a 0 there would read as
    measured.

    >>> m = DPODiagnostics()
    >>> one = torch.ones(2)
    >>> m.update(loss=one, margin=torch.tensor([-1.0, 3.0]), model_diff=one, ref_diff=one,
    ...          chosen_error=one, rejected_error=one)
    >>> out = m.compute_prefixed()
    >>> float(out["actor/dpo_reward_accuracy"]), float(out["actor/dpo_reward_margin"])
    (0.5, 1.0)
    """

    higher_is_better = True
    STATS: ClassVar[tuple[str, ...]] = (
        "loss",
        "margin",
        "model_diff",
        "ref_diff",
        "chosen_error",
        "rejected_error",
    )

    def __init__(self, prefix: str = "actor/dpo_", process_group: Any = None) -> None:
        super().__init__(prefix, process_group)
        for name in self.STATS:
            self.add_state(f"sum_{name}", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("correct", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, **stats: Tensor) -> None:  # type: ignore[override]
        if set(stats) != set(self.STATS):
            raise ValueError(f"DPODiagnostics.update takes {list(self.STATS)}, got {sorted(stats)}")
        n = check_vector("margin", stats["margin"])
        for name in self.STATS:
            check_vector(name, stats[name], n)
            state = getattr(self, f"sum_{name}")
            setattr(self, f"sum_{name}", state + stats[name].detach().double().sum())
        self.correct = self.correct + (stats["margin"].detach() > 0).double().sum()
        self.count = self.count + n

    def compute(self) -> dict[str, Tensor]:
        n = _count_or_nan(self.count)
        out = {name: getattr(self, f"sum_{name}") / n for name in self.STATS}
        out["reward_margin"] = out.pop("margin")
        out["reward_accuracy"] = self.correct / n
        out["pairs"] = self.count.clone()
        return out


def _count_or_nan(count: Tensor) -> Tensor:
    """``count``, or NaN where it is 0: a mean over nothing is NaN (every rank computes it alike)."""
    return torch.where(count > 0, count, torch.full_like(count, math.nan))
