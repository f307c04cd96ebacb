"""Over-optimisation seen in the samples themselves: within-group diversity and drift from the base model.

A reward that is being gamed can keep rising while the images collapse to one answer per prompt, or
wander far from what the base model drew; neither shows in the reward. Two metrics measure the images:

- :class:`GroupDiversity`: the mean pairwise distance between the samples of one prompt group,
  averaged over groups (logged as ``rollout/diversity`` on each rollout, ``val-aux/diversity`` over
  the seeds of each validation prompt);
- :class:`ReferenceDrift`: the mean distance of each sample from the reference sample with the same
  id, the base model's sample of the same prompt and seed (logged as ``val-aux/drift``).

Both compare feature vectors: by default :func:`pooled_pixels` (the image averaged down to a few
pixels a side, no model to download); any callable ``images -> (B, F) features`` can stand in (a
CLIP or DINO embedding, with ``distance="cosine"``).

Why a module of its own rather than part of :mod:`lit_flowgrpo.metrics`: those metrics read the RL
loop's per-sample scalars (rewards, log-probs); these read images through a feature hook and carry a
reference set, and they share nothing with the loop but the exact-reduction machinery
(:mod:`lit_flowgrpo.metrics.base`), which they import.

Exact under any ranks: :class:`GroupDiversity` keeps, per group id a rank saw, the row
(n, mean vector, M2 = Σ‖x − mean‖²), gathered with ``cat`` and merged by id after the gather (Chan,
Golub & LeVeque's combination of moments, applied to vectors); :class:`ReferenceDrift` keeps sums.
So one rank and N ranks, one update and many, give the same number up to fp64 summation order.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_flowgrpo.metrics import DictMetric, check_vector

__all__ = ["Distance", "GroupDiversity", "ReferenceDrift", "pooled_pixels"]

_F64 = torch.float64
Distance = Literal["mse", "cosine"]
"""``mse``: ‖x − y‖²/F, the mean squared difference per feature; ``cosine``: 1 − cos(x, y)."""


def pooled_pixels(images: Tensor, size: int | None = 16) -> Tensor:
    """(B, 3, H, W) images → (B, 3·h·w) features: each image averaged over a ``size``×``size`` grid
    of cells (``adaptive_avg_pool2d``), h = min(size, H), w = min(size, W); ``None`` keeps every pixel.

    Pooling keeps layout and colour and drops the pixel noise that a sampler's last steps leave, so
    two drawings of the same scene are close; it also keeps a reference set of a 512 px model small.

    >>> pooled_pixels(torch.ones(2, 3, 32, 32), size=4).shape
    torch.Size([2, 48])
    """
    if images.ndim != 4:
        raise ValueError(f"images must be (B, C, H, W); got shape {tuple(images.shape)}")
    x = images.detach().float()
    if size is not None:
        if size < 1:
            raise ValueError(f"size ({size}) must be at least 1, or None to keep every pixel")
        x = F.adaptive_avg_pool2d(x, (min(size, x.shape[2]), min(size, x.shape[3])))
    return x.flatten(1)  # (B, F) fp32


def _prepared(features: Tensor, distance: Distance, device: torch.device) -> Tensor:
    """Features as fp64 vectors in the space where the distance is a squared L2 norm (unit vectors
    for ``cosine``: ‖u − v‖² = 2 − 2·cos). A zero vector stays zero."""
    x = features.detach().to(device, _F64)
    if distance == "cosine":
        x = x / x.norm(dim=1, keepdim=True).clamp_min(torch.finfo(_F64).tiny)
    return x


def _check_features(features: Tensor, num_features: int | None = None) -> int:
    if not isinstance(features, Tensor) or features.ndim != 2:
        shape = tuple(features.shape) if isinstance(features, Tensor) else type(features).__name__
        raise ValueError(f"features must be a (N, F) tensor, one row per sample; got {shape}")
    if num_features is not None and features.shape[1] != num_features:
        raise ValueError(
            f"features have {features.shape[1]} columns but the metric was built for num_features="
            f"{num_features}: pass the same feature extractor at every update"
        )
    return features.shape[0]


def _check_distance(distance: str) -> None:
    if distance not in ("mse", "cosine"):
        raise ValueError(f"distance {distance!r} must be 'mse' or 'cosine'")


def _merge_vector_moments(ids: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
    """Merge rows (n, mean (F), M2) that share an id, M2 = Σ‖x − mean‖².

    n = Σ nᵢ, mean = Σ nᵢ·meanᵢ / n, M2 = Σ M2ᵢ + Σ nᵢ·‖meanᵢ − mean‖² (Chan, Golub & LeVeque 1979,
    per coordinate, summed over coordinates). Returns the sorted unique ids and the (G, F + 2) rows.
    """
    uniq, inv = torch.unique(ids, sorted=True, return_inverse=True)
    n_i, mean_i, m2_i = rows[:, 0], rows[:, 1:-1], rows[:, -1]
    n = torch.zeros(uniq.numel(), dtype=rows.dtype, device=rows.device).index_add_(0, inv, n_i)
    mean = torch.zeros((uniq.numel(), mean_i.shape[1]), dtype=rows.dtype, device=rows.device)
    mean = mean.index_add_(0, inv, n_i[:, None] * mean_i) / n[:, None]
    spread = n_i * ((mean_i - mean[inv]) ** 2).sum(dim=1)
    m2 = torch.zeros_like(n).index_add_(0, inv, m2_i + spread)
    return uniq, torch.cat([n[:, None], mean, m2[:, None]], dim=1)


class GroupDiversity(DictMetric):
    r"""Mean pairwise distance between the samples of each group, averaged over the groups.

    For a group g of n_g ≥ 2 samples with (prepared) feature vectors x₁ … x_n, mean m and
    M2 = Σᵢ‖xᵢ − m‖²:

    - the mean over ordered pairs i ≠ j of ‖xᵢ − xⱼ‖² is exactly 2·M2/(n_g − 1)
      (Σ_{i≠j}‖xᵢ − xⱼ‖² = 2·n·M2, over n(n − 1) pairs);
    - ``mse``: d_g = 2·M2/((n_g − 1)·F), the mean squared difference per feature of two samples;
    - ``cosine``: the vectors are normalised first, so ‖uᵢ − uⱼ‖² = 2(1 − cos) and
      d_g = M2/(n_g − 1), the mean of 1 − cos over pairs.

    ``diversity`` = mean over the groups with n_g ≥ 2 of d_g (each group weighs the same, whatever
    its size); ``groups``: how many such groups; ``nonfinite_count``: samples left out because a
    feature was not finite. Groups of one sample have no pair and are left out. NaN with no group.

    Reading it: a fall during training with a reward still rising means the policy is collapsing
    each prompt to one image, a sign of over-optimisation that no reward shows.

    Exact groups across ranks, as :class:`~lit_flowgrpo.metrics.RewardGroupStats` does it: each rank
    reduces its samples to one row (n, mean, M2) per group id it saw; after the ``cat`` gather the
    rows of an id are merged, whatever the split of a group over ranks or micro-batches.

    Args:
        num_features: F, the length of each feature vector (every rank's states must match, even a
            rank that saw no sample).
        distance: ``"mse"`` or ``"cosine"``.
        prefix: prefix of the keys in :meth:`compute_prefixed` (``rollout/``, ``val-aux/``).

    Example:
        >>> metric = GroupDiversity(num_features=2)
        >>> x = torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.0, 2.0], [5.0, 5.0]])
        >>> metric.update(x, torch.tensor([0, 0, 1, 1, 2]))  # group 2 has one sample: no pair
        >>> out = metric.compute()  # group 0: ‖(1, 1)‖²/2 = 1; group 1: ‖(0, 2)‖²/2 = 2
        >>> float(out["diversity"]), float(out["groups"])
        (1.5, 2.0)
    """

    higher_is_better = True

    def __init__(self, num_features: int, distance: Distance = "mse", prefix: str = "rollout/") -> None:
        super().__init__(prefix)
        if not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"num_features ({num_features!r}) must be a positive integer")
        _check_distance(distance)
        self.num_features = num_features
        self.distance = distance
        self.add_state("nonfinite", torch.zeros((), dtype=_F64), dist_reduce_fx="sum")
        self.add_row_state("group_ids", (), torch.int64)
        self.add_row_state("group_rows", (num_features + 2,), _F64)  # (n, mean (F), M2)

    def update(self, features: Tensor, group_ids: Tensor) -> None:
        """Add this rank's samples.

        Args:
            features: (N, F) one feature vector per sample (any float dtype; fp64 inside).
            group_ids: (N,) integer GLOBAL group id per sample (one id for one group on every rank).
        """
        n = _check_features(features, self.num_features)
        check_vector("group_ids", group_ids, n)
        if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
            raise ValueError(f"group_ids must be an integer tensor (int64), got {group_ids.dtype}")
        x = _prepared(features, self.distance, self.device)
        finite = torch.isfinite(x).all(dim=1)
        self.nonfinite += (~finite).sum()
        x, ids = x[finite], group_ids.detach().to(self.device, torch.int64)[finite]
        if not x.shape[0]:
            return
        # Each sample is a part of its own (n = 1, mean = x, M2 = 0); the merge does the rest.
        ones = torch.ones((x.shape[0], 1), dtype=_F64, device=self.device)
        uniq, rows = _merge_vector_moments(ids, torch.cat([ones, x, torch.zeros_like(ones)], dim=1))
        self.group_ids.append(uniq)
        self.group_rows.append(rows)

    def compute(self) -> dict[str, Tensor]:
        """``diversity``, ``groups`` and ``nonfinite_count``, as the class docstring defines them."""
        _, rows = _merge_vector_moments(self.gathered_rows("group_ids"), self.gathered_rows("group_rows"))
        n, m2 = rows[:, 0], rows[:, -1]
        pairs = n >= 2
        scale = 2.0 / self.num_features if self.distance == "mse" else 1.0
        per_group = scale * m2[pairs] / (n[pairs] - 1)  # (G',) fp64
        nan = torch.tensor(math.nan, dtype=_F64, device=self.device)
        return {
            "diversity": per_group.mean() if per_group.numel() else nan,
            "groups": pairs.sum().to(_F64),
            "nonfinite_count": self.nonfinite.clone(),
        }


class ReferenceDrift(DictMetric):
    r"""Mean distance of each sample from the reference sample with the same id.

    The reference is a fixed set of feature vectors keyed by sample id (:meth:`set_reference`): the
    base model's validation samples, whose fixed seeds make sample i of every later validation the
    same prompt and noise as sample i of the base one. Over the N samples that have a reference:

    - ``drift`` = (1/N)·Σᵢ d(xᵢ, refᵢ), d as in :class:`GroupDiversity` (``mse``: ‖x − ref‖²/F;
      ``cosine``: 1 − cos), so drift and diversity are in one unit;
    - ``paired_count`` = N; ``unpaired_count``: samples whose id has no reference or whose features
      are not finite (left out).

    Reading it: 0 for the base model; growing with training. Next to a proxy reward that rises while
    the gold score falls, it says how far from the base model's pictures the policy went to do it.

    The reference is not a metric state: it is never reduced, :meth:`reset` keeps it, and every rank
    must hold the whole set (the ids a rank validates may differ from the base run's split). States
    are sums, reduced with ``sum``: exact under any ranks and splits.

    Args:
        distance: ``"mse"`` or ``"cosine"``.
        prefix: prefix of the keys in :meth:`compute_prefixed`.

    Example:
        >>> metric = ReferenceDrift()
        >>> metric.set_reference(torch.tensor([3, 1]), torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
        >>> metric.update(torch.tensor([1, 3, 7]), torch.tensor([[0.0, 2.0], [1.0, 1.0], [9.0, 9.0]]))
        >>> out = metric.compute()  # id 1: 4/2 = 2; id 3: 0; id 7 has no reference
        >>> float(out["drift"]), float(out["unpaired_count"])
        (1.0, 1.0)
    """

    higher_is_better = False

    def __init__(self, distance: Distance = "mse", prefix: str = "val-aux/") -> None:
        super().__init__(prefix)
        _check_distance(distance)
        self.distance = distance
        self.add_state("sums", torch.zeros(3, dtype=_F64), dist_reduce_fx="sum")  # (N, Σd, unpaired)
        self.reference_ids: Tensor | None = None
        self.reference_features: Tensor | None = None

    def set_reference(self, ids: Tensor, features: Tensor) -> None:
        """Hold ``features`` (R, F) as the reference of the samples ``ids`` (R,), on the CPU."""
        r = _check_features(features)
        check_vector("ids", ids, r)
        order = torch.argsort(ids.detach().cpu())
        sorted_ids = ids.detach().cpu().long()[order]
        if r > 1 and bool((sorted_ids[1:] == sorted_ids[:-1]).any()):
            raise ValueError("reference ids must be distinct: one reference sample per id")
        self.reference_ids = sorted_ids
        self.reference_features = features.detach().cpu()[order]

    @property
    def has_reference(self) -> bool:
        return self.reference_ids is not None

    def update(self, ids: Tensor, features: Tensor) -> None:
        """Add this rank's samples: ``ids`` (N,) their sample ids, ``features`` (N, F)."""
        if self.reference_ids is None or self.reference_features is None:
            raise ValueError("ReferenceDrift has no reference: call set_reference(ids, features) first")
        n = _check_features(features, self.reference_features.shape[1])
        check_vector("ids", ids, n)
        ids = ids.detach().cpu().long()
        if not len(self.reference_ids):
            self.sums[2] += n
            return
        pos = torch.searchsorted(self.reference_ids, ids).clamp_max(len(self.reference_ids) - 1)
        paired = self.reference_ids[pos] == ids
        x = _prepared(features, self.distance, self.device)
        ref = _prepared(self.reference_features[pos], self.distance, self.device)
        d = ((x - ref) ** 2).sum(dim=1)  # (N,) fp64
        d = d / self.reference_features.shape[1] if self.distance == "mse" else d / 2
        ok = paired.to(self.device) & torch.isfinite(d)
        okf = ok.to(_F64)
        self.sums += torch.stack([okf.sum(), torch.where(ok, d, 0.0).sum(), (1 - okf).sum()])

    def compute(self) -> dict[str, Tensor]:
        """``drift``, ``paired_count`` and ``unpaired_count``, as the class docstring defines them."""
        n, total, unpaired = self.sums.unbind()
        return {"drift": total / n, "paired_count": n.clone(), "unpaired_count": unpaired.clone()}
