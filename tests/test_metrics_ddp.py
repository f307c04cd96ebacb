"""One process vs two gloo ranks on the same data: every metric value must agree (groups span ranks)."""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from lit_flowgrpo.diversity import GroupDiversity, ReferenceDrift
from lit_flowgrpo.metrics import FlowDPPOStats, PolicyRatioStats, RewardGroupStats

WORLD = 2


def _rewards(seed: int) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    group_ids = torch.arange(24).repeat_interleave(4) * 5 + 2  # 24 groups of 4, sparse global ids
    n = group_ids.numel()
    rewards = torch.rand(n, generator=gen, dtype=torch.float64)
    rewards[group_ids == 7] = 0.3  # an all-equal group
    rewards[[4, 50]] = math.nan
    return {
        "rewards": rewards,
        "group_ids": group_ids,
        "advantages": torch.randn(n, generator=gen, dtype=torch.float64),
        "ocr": torch.rand(n, generator=gen, dtype=torch.float64),
    }


def _tokens(seed: int) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    steps, samples = 5, 40
    sample_id = torch.arange(samples).repeat_interleave(steps)
    step = torch.arange(steps).repeat(samples)
    old = -1.0 + 0.2 * torch.randn(samples * steps, generator=gen)
    new = old + 0.02 * (1 + step) * torch.randn(samples * steps, generator=gen)
    new[7] = math.nan
    return {
        "log_prob": new,
        "old_log_prob": old,
        "advantages": torch.randn(samples, generator=gen)[sample_id],
        "step": step,
        "sample_id": sample_id,
        "std_dev_t": 0.3 + torch.rand(samples * steps, generator=gen),
        "sqrt_dt": torch.full((samples * steps,), 0.2),
        "step_kl": 1e-6 * (1 + step) * torch.rand(samples * steps, generator=gen),
    }


def _feed_rewards(metric: RewardGroupStats, data: dict[str, Tensor], idx: Tensor) -> None:
    metric.update(
        data["rewards"][idx], data["group_ids"][idx], data["advantages"][idx], {"ocr": data["ocr"][idx]}
    )


def _feed_tokens(metric: PolicyRatioStats, data: dict[str, Tensor], idx: Tensor) -> None:
    part = {k: v[idx] for k, v in data.items()}
    metric.update(part.pop("log_prob"), part.pop("old_log_prob"), part.pop("advantages"), **part)


def _dppo_tokens(seed: int) -> dict[str, Tensor]:
    data = _tokens(seed)
    r = data["log_prob"] - data["old_log_prob"]  # sign of log r; NaN compares False
    high = data["step_kl"] > 2e-6
    data.update(high_kl=high, pos_rm=high & (r > 0) & (data["advantages"] > 0))
    data["neg_rm"] = high & (r < 0) & (data["advantages"] < 0)
    return data


def _features(seed: int) -> dict[str, Tensor]:
    # ids first: the sharding reads the sample count from the first tensor
    gen = torch.Generator().manual_seed(seed)
    group_ids = torch.arange(12).repeat_interleave(5) * 3 + 1  # 12 groups of 5, spread over both ranks
    features = torch.rand(group_ids.numel(), 7, generator=gen, dtype=torch.float64)
    features[9, 2] = math.nan
    return {"group_ids": group_ids, "sample_ids": torch.arange(group_ids.numel()), "features": features}


def _feed_features(metric: GroupDiversity | ReferenceDrift, data: dict[str, Tensor], idx: Tensor) -> None:
    if isinstance(metric, ReferenceDrift):
        metric.update(data["sample_ids"][idx], data["features"][idx])
    else:
        metric.update(data["features"][idx], data["group_ids"][idx])


def _drift() -> ReferenceDrift:
    metric = ReferenceDrift(distance="cosine")
    gen = torch.Generator().manual_seed(9)
    # ids 50..59 have no reference
    metric.set_reference(torch.arange(50), torch.rand(50, 7, generator=gen, dtype=torch.float64))
    return metric


# name -> (metric factory, data, feed); the data is rebuilt from its seed in every process
CASES: dict[str, tuple[Callable[[], object], Callable[[], dict[str, Tensor]], Callable]] = {
    "rewards": (lambda: RewardGroupStats(tol=0.05), lambda: _rewards(0), _feed_rewards),
    "rewards_exact_tol": (lambda: RewardGroupStats(components=["ocr"]), lambda: _rewards(1), _feed_rewards),
    "policy": (
        lambda: PolicyRatioStats(
            clip_range=0.02, clip_range_high=0.03, by_step=True, num_steps=5, top_k_kl=6
        ),
        lambda: _tokens(0),
        _feed_tokens,
    ),
    "dppo": (
        lambda: FlowDPPOStats(clip_range=0.02, by_step=True, num_steps=5),
        lambda: _dppo_tokens(2),
        _feed_tokens,
    ),
    "policy_trajectory": (
        lambda: PolicyRatioStats(clip_range=0.01, clip_level="trajectory", top_k_kl=3),
        lambda: _tokens(1),
        _feed_tokens,
    ),
    "diversity": (lambda: GroupDiversity(7), lambda: _features(0), _feed_features),
    "diversity_no_update": (
        lambda: GroupDiversity(7, distance="cosine"),
        lambda: _features(1),
        _feed_features,
    ),
    "drift": (_drift, lambda: _features(2), _feed_features),
}
# the image metrics compute 3 values each; the RL diagnostics many more
FEW_VALUES = {"diversity", "diversity_no_update", "drift"}
# rank 1 makes no update at all / one update with zero samples: its empty states must still gather
NO_UPDATE_ON_RANK1 = {"rewards_exact_tol", "diversity_no_update"}
EMPTY_UPDATE_ON_RANK1 = {"policy_trajectory"}


def _shards(n: int, case: str) -> list[list[Tensor]]:
    """Micro-batches per rank: an interleaved, uneven split, so groups and trajectories span ranks."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(42))
    if case in NO_UPDATE_ON_RANK1:
        return [list(torch.tensor_split(perm, 3)), []]
    if case in EMPTY_UPDATE_ON_RANK1:
        return [list(torch.tensor_split(perm, 3)), [perm[:0]]]
    cut = int(0.6 * n)
    return [list(torch.tensor_split(perm[:cut], 2)), list(torch.tensor_split(perm[cut:], 3))]


def _values(metric) -> dict:
    values = {k: float(v) for k, v in metric.compute().items()}
    return {"values": values, "top_kl": list(getattr(metric, "top_kl_records", []))}


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        results = {}
        for name, (factory, data_fn, feed) in CASES.items():
            metric, data = factory(), data_fn()
            n = next(iter(data.values())).numel()
            for idx in _shards(n, name)[rank]:
                feed(metric, data, idx)
            results[name] = _values(metric)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# slow: each spawned rank imports the package afresh (seconds); the metric work itself takes under one
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*compute.*was called before the ``update``")
def test_two_gloo_ranks_equal_one_process(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]

    for name, (factory, data_fn, feed) in CASES.items():
        single, data = factory(), data_fn()
        feed(single, data, torch.arange(next(iter(data.values())).numel()))
        want = _values(single)
        assert len(want["values"]) >= (3 if name in FEW_VALUES else 11)
        for r, got in enumerate(ranks):
            got = got[name]
            assert set(got["values"]) == set(want["values"]), (name, r)
            for key, value in want["values"].items():
                g = got["values"][key]
                assert (math.isnan(g) and math.isnan(value)) or g == pytest.approx(
                    value, rel=1e-9, abs=1e-12
                ), (
                    name,
                    r,
                    key,
                    g,
                    value,
                )
            assert len(got["top_kl"]) == len(want["top_kl"])
            for rec_got, rec_want in zip(got["top_kl"], want["top_kl"], strict=True):
                assert rec_got == pytest.approx(rec_want, rel=1e-9), (name, r)
    # the split really spreads groups and trajectories over both ranks
    for name, key in (("rewards", "group_ids"), ("policy", "sample_id"), ("diversity", "group_ids")):
        data = CASES[name][1]()
        on_rank = [set(data[key][torch.cat(idx)].tolist()) for idx in _shards(data[key].numel(), name)]
        assert len(on_rank[0] & on_rank[1]) >= 10
