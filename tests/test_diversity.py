"""GroupDiversity and ReferenceDrift against float64 brute force (every pair, every sample), under split
updates and under two simulated ranks that run torchmetrics' own reduction."""

from __future__ import annotations

import copy
import doctest
import itertools
import math

import numpy as np
import pytest
import torch
from torch import Tensor

import lit_flowgrpo.diversity as diversity_module
from lit_flowgrpo.diversity import GroupDiversity, ReferenceDrift, pooled_pixels

F = 12
# A rank (or a fresh validation) that made no update still computes: torchmetrics warns, by design here.
pytestmark = pytest.mark.filterwarnings("ignore:.*compute.*was called before the ``update``")


def _batch(seed: int = 0) -> tuple[Tensor, Tensor]:
    """Features of groups of sizes 1 to 6 (sparse global ids, interleaved), one group of identical
    rows, one row of NaN; values far from 0, where Σ‖x‖² − n‖mean‖² would lose digits."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 2, 3, 4, 5, 6, 6, 3, 2]
    ids = torch.cat([torch.full((s,), 11 * i + 4, dtype=torch.int64) for i, s in enumerate(sizes)])
    x = 100.0 + torch.randn(ids.numel(), F, generator=gen, dtype=torch.float64)
    x[ids == 4 + 11 * 7] = x[ids == 4 + 11 * 7][0]  # a collapsed group: diversity exactly 0
    x[5, 3] = math.nan  # left out, counted
    perm = torch.randperm(ids.numel(), generator=gen)
    return x[perm], ids[perm]


def _distance(a: np.ndarray, b: np.ndarray, kind: str) -> float:
    if kind == "mse":
        return float(np.mean((a - b) ** 2))
    return float(1.0 - a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _diversity_reference(x: Tensor, ids: Tensor, kind: str) -> dict[str, float]:
    """Every ordered pair i ≠ j of every group, in float64 numpy."""
    x, ids = x.numpy(), ids.numpy()
    ok = np.isfinite(x).all(axis=1)
    per_group = []
    for g in np.unique(ids[ok]):
        rows = x[ok & (ids == g)]
        pairs = [_distance(rows[i], rows[j], kind) for i, j in itertools.permutations(range(len(rows)), 2)]
        if pairs:
            per_group.append(np.mean(pairs))
    return {
        "diversity": float(np.mean(per_group)) if per_group else math.nan,
        "groups": float(len(per_group)),
        "nonfinite_count": float((~ok).sum()),
    }


def _close(got: dict[str, Tensor], want: dict[str, float], rel: float = 1e-9) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        g = float(got[key])
        assert (math.isnan(g) and math.isnan(value)) or g == pytest.approx(value, rel=rel, abs=1e-12), key


# Tolerance: features near 100 with spreads near 1. The brute force's differences are exact (both
# operands within a factor 2: Sterbenz); the metric's merged means are off by a few ulps of 100
# (~1e-14) against deviations near 1, so each M2 is good to ~1e-13 relative (cosine: unit vectors,
# deviations near 1e-2, ~1e-12). 1e-9 leaves a wide margin and still catches any wrong formula.
@pytest.mark.parametrize("kind", ["mse", "cosine"])
def test_group_diversity_matches_every_pair(kind: str) -> None:
    x, ids = _batch()
    metric = GroupDiversity(F, distance=kind)
    metric.update(x, ids)
    want = _diversity_reference(x, ids, kind)
    _close(metric.compute(), want, rel=1e-9)
    assert want["groups"] == 8 and want["nonfinite_count"] == 1


def test_collapsed_group_scores_exactly_zero() -> None:
    metric = GroupDiversity(3)
    row = torch.tensor([[0.1, 1 / 3, 0.7]], dtype=torch.float64)
    metric.update(row.repeat(5, 1), torch.zeros(5, dtype=torch.int64))
    assert float(metric.compute()["diversity"]) == 0.0


@pytest.mark.parametrize("kind", ["mse", "cosine"])
def test_group_diversity_is_split_invariant(kind: str) -> None:
    x, ids = _batch(seed=3)
    whole = GroupDiversity(F, distance=kind)
    whole.update(x, ids)
    want = {k: float(v) for k, v in whole.compute().items()}
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        perm = torch.randperm(len(ids), generator=gen)
        cuts = sorted(torch.randint(0, len(ids), (4,), generator=gen).tolist())
        split = GroupDiversity(F, distance=kind)
        for chunk in torch.tensor_split(perm, cuts):  # empty chunks included
            split.update(x[chunk], ids[chunk])
        _close(split.compute(), want, rel=1e-12)


def _as_ranks(metrics: list) -> list[dict[str, Tensor]]:
    """Each metric is one rank: its states are gathered with torchmetrics' own reduction
    (``_sync_dist`` with a gather that returns every rank's tensor, in rank order), then computed."""
    sent = []
    for metric in metrics:
        calls: list[Tensor] = []
        copy.deepcopy(metric)._sync_dist(lambda t, group=None, calls=calls: calls.append(t) or [t])
        sent.append(calls)
    out = []
    for metric in metrics:
        count = itertools.count()

        def gather(t: Tensor, group=None, count=count) -> list[Tensor]:
            i = next(count)
            return [calls[i] for calls in sent]

        metric._sync_dist(gather)
        out.append(metric.compute())
    return out


@pytest.mark.parametrize("empty_rank", [False, True])
def test_group_diversity_two_ranks_equal_one(empty_rank: bool) -> None:
    x, ids = _batch(seed=5)
    single = GroupDiversity(F)
    single.update(x, ids)
    want = {k: float(v) for k, v in single.compute().items()}
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(1))
    ranks = [GroupDiversity(F), GroupDiversity(F)]
    if empty_rank:  # rank 1 saw nothing: its empty rows must still gather with rank 0's
        for chunk in torch.tensor_split(perm, 3):
            ranks[0].update(x[chunk], ids[chunk])
    else:  # interleaved: every group of 3 or more spans both ranks
        for chunk in torch.tensor_split(perm[::2], 2):
            ranks[0].update(x[chunk], ids[chunk])
        ranks[1].update(x[perm[1::2]], ids[perm[1::2]])
        spans = set(ids[perm[::2]].tolist()) & set(ids[perm[1::2]].tolist())
        assert len(spans) >= 5
    for got in _as_ranks(ranks):
        _close(got, want, rel=1e-12)


def _drift_data(seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ref_ids = torch.randperm(40, generator=gen)[:30]  # ids 0..39, 30 of them with a reference
    ref = torch.rand(30, F, generator=gen, dtype=torch.float64)
    ids = torch.randperm(40, generator=gen)
    x = torch.rand(40, F, generator=gen, dtype=torch.float64)
    x[3, 0] = math.nan
    return ref_ids, ref, ids, x


def _drift_reference(ref_ids: Tensor, ref: Tensor, ids: Tensor, x: Tensor, kind: str) -> dict[str, float]:
    lookup = {int(i): ref[k].numpy() for k, i in enumerate(ref_ids)}
    d = [
        _distance(x[k].numpy(), lookup[int(i)], kind)
        for k, i in enumerate(ids)
        if int(i) in lookup and np.isfinite(x[k].numpy()).all()
    ]
    return {
        "drift": float(np.mean(d)),
        "paired_count": float(len(d)),
        "unpaired_count": float(len(ids) - len(d)),
    }


@pytest.mark.parametrize("kind", ["mse", "cosine"])
def test_reference_drift_matches_every_sample(kind: str) -> None:
    ref_ids, ref, ids, x = _drift_data()
    metric = ReferenceDrift(distance=kind)
    metric.set_reference(ref_ids, ref)
    metric.update(ids, x)
    want = _drift_reference(ref_ids, ref, ids, x, kind)
    _close(metric.compute(), want, rel=1e-12)
    assert want["unpaired_count"] == 10 + 1  # 10 ids without a reference, 1 NaN row with one
    metric.reset()  # a new validation: the reference stays, the sums go
    assert metric.has_reference and float(metric.compute()["paired_count"]) == 0.0


def test_reference_drift_split_and_two_ranks() -> None:
    ref_ids, ref, ids, x = _drift_data(seed=2)
    want = _drift_reference(ref_ids, ref, ids, x, "mse")
    ranks = [ReferenceDrift(), ReferenceDrift()]
    for metric in ranks:
        metric.set_reference(ref_ids, ref)  # every rank holds the whole reference
    for chunk in torch.tensor_split(torch.arange(25), 3):
        ranks[0].update(ids[chunk], x[chunk])
    ranks[1].update(ids[25:], x[25:])
    for got in _as_ranks(ranks):
        _close(got, want, rel=1e-12)


def test_reference_drift_rejects_bad_input() -> None:
    metric = ReferenceDrift()
    with pytest.raises(ValueError, match="no reference"):
        metric.update(torch.arange(2), torch.zeros(2, F))
    with pytest.raises(ValueError, match="distinct"):
        metric.set_reference(torch.tensor([1, 1]), torch.zeros(2, F))
    metric.set_reference(torch.arange(3), torch.zeros(3, F))
    with pytest.raises(ValueError, match="columns"):
        metric.update(torch.arange(2), torch.zeros(2, F + 1))
    with pytest.raises(ValueError, match="distance"):
        ReferenceDrift(distance="l1")  # type: ignore[arg-type]


def test_group_diversity_rejects_bad_input() -> None:
    metric = GroupDiversity(F)
    with pytest.raises(ValueError, match="columns"):
        metric.update(torch.zeros(3, F - 1), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="integer"):
        metric.update(torch.zeros(3, F), torch.zeros(3))
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        metric.update(torch.zeros(3, F), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="num_features"):
        GroupDiversity(0)


def test_pooled_pixels_averages_cells() -> None:
    images = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).reshape(2, 3, 4, 4)
    got = pooled_pixels(images, size=2)  # (2, 3·2·2): each value the mean of a 2×2 cell
    want = images.reshape(2, 3, 2, 2, 2, 2).mean(dim=(3, 5)).flatten(1)
    assert torch.equal(got, want)
    assert torch.equal(pooled_pixels(images, size=None), images.flatten(1))
    assert pooled_pixels(images, size=16).shape == (2, 48)  # never upsampled


def test_doctests_pass() -> None:
    result = doctest.testmod(diversity_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 3 and result.failed == 0
