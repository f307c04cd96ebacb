"""GDPO advantage aggregation (``--model.init_args.advantage.aggregation=gdpo``) against a float64
re-derivation written here with Python's own arithmetic (``math.fsum``, ``statistics.pstdev``): each
component normalised within its group over the samples it scored, weighted, summed, and normalised
over the batch, the batch mean subtracted as the paper writes it. Then the NaN cases, the default
``sum`` left exactly as it was, and N ranks against one (emulated, and over two gloo processes)."""

from __future__ import annotations

import math
import os
import socket
import statistics
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from lit_flowgrpo.advantages import AdvantageSettings
from lit_flowgrpo.algorithms import gdpo_advantages, group_advantages
from lit_flowgrpo.data import GroupSampler
from lit_flowgrpo.distributed import DataParallel
from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.rewards.base import CallableReward, MultiReward, RewardOutput

NAN = math.nan
EPS = 1e-4
# Both sides compute in float64 on numbers of order 1, each value through a few dozen roundings
# of 2^-53: 1e-12 leaves a wide margin and still catches any change of formula.
TIGHT = dict(rel=1e-12, abs=1e-12)


def reference(
    components: list[list[float]], weights: list[float], ids: list[int], std: str, eps: float = EPS
) -> tuple[list[float], list[bool], list[int]]:
    """(advantages, scored, groups each component left empty), the paper's steps one by one."""
    n, groups = len(ids), sorted(set(ids))
    per: list[list[float | None]] = [[None] * n for _ in components]
    empty = []
    for k, values in enumerate(components):
        everywhere = [v for v in values if math.isfinite(v)]
        empty.append(0)
        for g in groups:
            members = [i for i in range(n) if ids[i] == g and math.isfinite(values[i])]
            if not members:
                empty[k] += 1
                continue
            mine = [values[i] for i in members]
            mean = math.fsum(mine) / len(mine)
            scale = statistics.pstdev(mine if std == "group" else everywhere)
            for i in members:
                per[k][i] = (values[i] - mean) / (scale + eps)
    scored = [any(per[k][i] is not None for k in range(len(components))) for i in range(n)]
    combined = [
        math.fsum(w * a[i] for w, a in zip(weights, per, strict=True) if a[i] is not None) for i in range(n)
    ]
    batch = [c for c, s in zip(combined, scored, strict=True) if s]
    mean, spread = math.fsum(batch) / len(batch), statistics.pstdev(batch)
    adv = [(c - mean) / (spread + eps) if s else 0.0 for c, s in zip(combined, scored, strict=True)]
    return adv, scored, empty


def _data() -> tuple[list[list[float]], list[float], list[int]]:
    """3 components on 5 groups of 5 (sparse ids, one group of one): continuous, 0/1 and a third
    with a negative weight; one group ties in every component (its advantages are exactly 0)."""
    gen = torch.Generator().manual_seed(0)
    ids = [7] * 5 + [100] * 5 + [-3] + [42] * 5 + [5] * 5 + [9] * 5
    n = len(ids)
    aesthetic = (torch.randn(n, generator=gen, dtype=torch.float64) * 3 + 5).tolist()
    strict = (torch.rand(n, generator=gen) > 0.5).double().tolist()
    length = torch.rand(n, generator=gen, dtype=torch.float64).tolist()
    for k, values in enumerate((aesthetic, strict, length)):
        for i in range(n):
            if ids[i] == 9:
                values[i] = float(k)  # the tied group
    return [aesthetic, strict, length], [1.0, 0.5, -0.25], ids


def _run(components, weights, ids, std, dtype=torch.float64):
    return gdpo_advantages(
        torch.tensor(components, dtype=dtype), weights, torch.tensor(ids), std=std, eps=EPS
    )


@pytest.mark.parametrize("std", ["group", "global"])
def test_matches_the_float64_rederivation(std: str) -> None:
    components, weights, ids = _data()
    got = _run(components, weights, ids, std)
    want, scored, empty = reference(components, weights, ids, std)
    assert got.advantages.dtype == torch.float64
    assert got.advantages.tolist() == pytest.approx(want, **TIGHT)
    assert (
        got.scored.tolist() == scored == [True] * len(ids) and got.empty_groups.tolist() == empty == [0] * 3
    )
    # Tied in every component, a group's advantages are exactly 0 (filter_zero can skip them), and so
    # is a group of one; the batch's advantages have mean 0 and std 1 (up to the eps).
    assert torch.equal(got.advantages[torch.tensor(ids) == 9], torch.zeros(5, dtype=torch.float64))
    assert got.advantages[10] == 0
    assert float(got.advantages.mean()) == pytest.approx(0.0, abs=1e-12)


def test_each_component_counts_whatever_its_scale() -> None:
    """Decoupled normalisation: a component's units barely change the advantages, whereas the weighted
    sum of ``sum`` lets the wide component drown the narrow one."""
    components, weights, ids = _data()
    ids_t = torch.tensor(ids)
    stretched = [[1000.0 * v + 3.0 for v in components[0]], *components[1:]]
    base = gdpo_advantages(torch.tensor(components), weights, ids_t, eps=EPS).advantages
    wide = gdpo_advantages(torch.tensor(stretched), weights, ids_t, eps=EPS).advantages
    # Only the eps tells them apart: scaling by 1000 turns c/(s + eps) into c/(s + eps/1000), a
    # relative change below eps/s for the component's smallest non-zero group std s (and as much again
    # through the batch std).
    spreads = [
        statistics.pstdev([v for v, g in zip(components[0], ids, strict=True) if g == k]) for k in set(ids)
    ]
    bound = 2 * EPS / min(s for s in spreads if s > 0)
    torch.testing.assert_close(wide, base, rtol=bound, atol=bound)

    def summed(comps):
        total = torch.tensor(
            [math.fsum(w * c[i] for w, c in zip(weights, comps, strict=True)) for i in range(len(ids))]
        )
        return group_advantages(total, ids_t, std="group")

    assert not torch.allclose(summed(stretched), summed(components), atol=1e-2)


def test_a_component_nan_for_one_sample_is_left_out_of_that_sample_alone() -> None:
    components, weights, ids = _data()
    components[1][2] = NAN  # strict failed on sample 2 (group 7)
    got = _run(components, weights, ids, "group")
    want, scored, _ = reference(components, weights, ids, "group")
    assert got.advantages.tolist() == pytest.approx(want, **TIGHT)
    assert all(scored) and got.scored.all()
    # Never scored as 0: a 0 there would have moved its group's strict mean and std.
    zeroed = [list(c) for c in components]
    zeroed[1][2] = 0.0
    assert abs(float(got.advantages[2]) - reference(zeroed, weights, ids, "group")[0][2]) > 1e-3


def test_a_component_nan_for_a_whole_group_is_left_out_of_that_group_and_counted() -> None:
    components, weights, ids = _data()
    for i in range(len(ids)):
        if ids[i] == 100:
            components[0][i] = NAN
    got = _run(components, weights, ids, "group")
    want, scored, empty = reference(components, weights, ids, "group")
    assert got.advantages.tolist() == pytest.approx(want, **TIGHT)
    assert got.empty_groups.tolist() == empty == [1, 0, 0] and all(scored)
    # That group's samples still train, on their two other components.
    assert got.advantages[torch.tensor(ids) == 100].abs().sum() > 0


def test_a_group_no_component_scored_has_no_advantage() -> None:
    components, weights, ids = _data()
    for values in components:
        for i in range(len(ids)):
            if ids[i] == 42:
                values[i] = NAN
    got = _run(components, weights, ids, "group")
    want, scored, empty = reference(components, weights, ids, "group")
    assert got.advantages.tolist() == pytest.approx(want, **TIGHT)
    in_group = torch.tensor(ids) == 42
    assert got.scored.tolist() == scored and not got.scored[in_group].any() and got.scored[~in_group].all()
    assert got.empty_groups.tolist() == empty == [1, 1, 1]
    assert torch.equal(got.advantages[in_group], torch.zeros(5, dtype=torch.float64))


# -- the stage around it: AdvantageSettings.for_batch on a real MultiReward -------------------------


class Lookup:
    """A dict-valued reward whose components are given per sample id (read from the metadata)."""

    def __init__(self, table: dict[str, list[float]]) -> None:
        self.table = table

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, Tensor]:
        return {k: torch.tensor([v[m["id"]] for m in metadata]) for k, v in self.table.items()}


WEIGHTS = {"judge/aesthetic": 1.0, "judge/strict": 0.5, "judge/length": -0.25, "judge/unused": 0.0}


def _reward(components: list[list[float]]) -> MultiReward:
    table = dict(
        zip(
            ["aesthetic", "strict", "length", "unused"],
            [*components, [NAN] * len(components[0])],
            strict=True,
        )
    )
    return MultiReward(WEIGHTS, rewards={"judge": Lookup(table)}, max_workers=1)


def _score(reward: MultiReward, sample_ids: list[int]) -> RewardOutput:
    return reward(
        torch.zeros(len(sample_ids), 3, 2, 2), [""] * len(sample_ids), [{"id": i} for i in sample_ids]
    )


def test_for_batch_is_the_rederivation_in_fp32_and_reports_gaps(recwarn) -> None:
    components, weights, ids = _data()
    for i in range(len(ids)):
        if ids[i] == 100:
            components[0][i] = NAN  # aesthetic: no sample of group 100
        if ids[i] == 42:
            for values in components:
                values[i] = NAN  # nothing scored group 42
    components[1][3] = NAN
    reward = _reward(components)
    n = len(ids)
    settings = AdvantageSettings(aggregation="gdpo", std="group")
    out = settings.for_batch(_score(reward, list(range(n))), torch.tensor(ids), reward, DataParallel())
    # The rewards arrive in fp32 (RewardOutput's dtype): the re-derivation starts from those values.
    as_fp32 = [torch.tensor(c, dtype=torch.float32).double().tolist() for c in components]
    want, scored, _ = reference(as_fp32, weights, ids, "group")
    # fp64 inside, one rounding to fp32 at the end (2^-24 relative; 2^-23 for margin).
    assert out.values.dtype == torch.float32
    assert out.values.tolist() == pytest.approx(want, rel=2**-23, abs=1e-12)
    assert out.scored.tolist() == scored and out.dropped == 5
    assert out.log == {
        "reward/nan_groups/judge/aesthetic": 2.0,
        "reward/nan_groups/judge/strict": 1.0,
        "reward/nan_groups/judge/length": 1.0,
        "reward/unscored_groups": 1.0,
        "reward/failure_rate": pytest.approx(5 / n),
    }
    said = "\n".join(str(w.message) for w in recwarn)
    assert "reward component 'judge/aesthetic' scored no sample of 2 of 6 groups" in said
    assert "1 of 6 groups have no scored sample" in said and "5 of 26 samples have no finite reward" in said


def test_sum_is_unchanged_bit_for_bit() -> None:
    components, _, ids = _data()
    components[0][4] = NAN
    reward = _reward(components)
    scores = _score(reward, list(range(len(ids))))
    with pytest.warns(UserWarning, match="1 of 26 samples have no finite reward"):
        out = AdvantageSettings(std="group").for_batch(scores, torch.tensor(ids), reward, DataParallel())
    # What the module computed before aggregation existed: the total's group advantages.
    valid = torch.isfinite(scores.total)
    before = torch.zeros(len(ids))
    before[valid] = group_advantages(scores.total[valid], torch.tensor(ids)[valid], std="group")
    assert torch.equal(out.values, before) and torch.equal(out.scored, valid)
    assert out.log == {"reward/failure_rate": 1 - 25 / 26}


class _Sent(Exception):
    """Raised by :class:`_Ranks` once it has recorded what a rank sends (the rest needs every rank's)."""


class _Ranks:
    """Stands in for the strategy of rank ``rank``: a first pass records what each rank sends to the
    all-gather (``parts``), a second one gets every rank's rows back, as the collective returns them."""

    def __init__(self, parts: list[Tensor | None], rank: int) -> None:
        self.parts, self.rank = parts, rank

    def all_gather(self, x: Tensor, group=None) -> Tensor:
        if any(p is None for p in self.parts):
            self.parts[self.rank] = x
            raise _Sent
        torch.testing.assert_close(x, self.parts[self.rank], rtol=0, atol=0, equal_nan=True)
        return torch.stack(self.parts)


@pytest.mark.filterwarnings("ignore:1 of 12 samples have no finite reward")
@pytest.mark.filterwarnings("ignore:1 of 24 samples have no finite reward")
@pytest.mark.parametrize("aggregation", ["sum", "gdpo"])
def test_two_ranks_give_each_sample_what_one_process_gives_it(aggregation: str) -> None:
    """The dealing of a real GroupSampler (groups span ranks): every rank's share equals the one-process
    result of its samples, bit for bit (one gather, in the one-process order)."""
    components, _, _ = _data()
    components[1][3] = NAN
    reward = _reward(components)
    settings = AdvantageSettings(aggregation=aggregation)

    def run(world: int, rank: int, parts: list) -> tuple[Tensor, Tensor, dict]:
        _, group_ids, sample_ids = GroupSampler(20, 4, 6, world, rank, seed=1).step_indices(3)
        dp = DataParallel(rank, world, _Ranks(parts, rank)) if world > 1 else DataParallel()
        out = settings.for_batch(_score(reward, sample_ids.tolist()), group_ids, reward, dp)
        return sample_ids, out.values, out.log

    ids, values, log = run(1, 0, [None])
    one = dict(zip(ids.tolist(), values.tolist(), strict=True))
    parts: list = [None, None]
    for rank in (0, 1):
        with pytest.raises(_Sent):
            run(2, rank, parts)
    for rank in (0, 1):
        ids, values, two_log = run(2, rank, parts)
        assert values.tolist() == [one[i] for i in ids.tolist()]
        assert two_log == log


# -- settings -----------------------------------------------------------------------------------------


def test_gdpo_needs_two_weighted_components() -> None:
    one = MultiReward({"judge/strict": 1.0, "judge/aesthetic": 0.0}, rewards={"judge": Lookup({})})
    (problem,) = AdvantageSettings(aggregation="gdpo").problems(reward=one)
    assert problem.startswith("--model.init_args.advantage.aggregation=gdpo normalises each weighted")
    assert "--model.init_args.reward.init_args.weights gives 1 a non-zero weight" in problem
    (problem,) = AdvantageSettings(aggregation="gdpo").problems(
        reward=CallableReward(lambda i, p, m: i.sum())
    )
    assert "--model.init_args.reward is a plain callable" in problem
    assert AdvantageSettings(aggregation="gdpo").problems(reward=_reward([[0.0]] * 3)) == []
    assert AdvantageSettings().problems(reward=one) == []  # sum takes any reward


def test_unknown_aggregation_from_python_lists_the_valid_ones() -> None:
    (problem,) = AdvantageSettings(aggregation="median").problems()  # type: ignore[arg-type]
    assert problem == "--model.init_args.advantage.aggregation ('median') must be one of sum, gdpo"


def test_gdpo_with_one_component_stops_the_module_before_loading(tiny_sd3_path: str) -> None:
    from lit_flowgrpo import FlowGRPOModule, Sampler
    from lit_flowgrpo.policies import SD3Policy

    with pytest.raises(SettingsError, match=r"aggregation=gdpo normalises each weighted reward component"):
        FlowGRPOModule(
            policy=SD3Policy(tiny_sd3_path),
            reward=lambda images, prompts, metadata: images.mean(dim=(1, 2, 3)),
            sampler=Sampler(height=32, width=32),
            advantage=AdvantageSettings(aggregation="gdpo"),
        )


def test_weighted_components_are_the_terms_of_the_total() -> None:
    class Primary(Lookup):
        primary = "strict"

    reward = MultiReward(
        {"judge": 1.0, "judge/strict": 0.5, "judge/length": 0.0, "judge/aesthetic": 2.0},
        rewards={"judge": Primary({"strict": [1.0, 0.0], "length": [0.2, 0.4], "aesthetic": [3.0, 4.0]})},
    )
    scores = _score(reward, [0, 1])
    terms = reward.weighted_components(scores.components)
    # A bare name weights its primary component; two weights of one component add; 0 is left out.
    assert list(terms) == ["judge/strict", "judge/aesthetic"]
    assert [w for w, _ in terms.values()] == [1.5, 2.0]
    total = sum(w * v for w, v in terms.values())
    assert torch.equal(total, scores.total)


# -- two gloo processes ----------------------------------------------------------------------------


class _Collective:
    """The one call DataParallel makes of a strategy, over torch.distributed (gloo)."""

    def all_gather(self, x: Tensor, group=None) -> Tensor:
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x.contiguous())
        return torch.stack(out)


def _gloo_rank(rank: int, port: int, out_dir: str, aggregation: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        components, _, _ = _data()
        components[1][3] = NAN
        reward = _reward(components)
        _, group_ids, sample_ids = GroupSampler(20, 4, 6, 2, rank, seed=1).step_indices(3)
        out = AdvantageSettings(aggregation=aggregation).for_batch(
            _score(reward, sample_ids.tolist()), group_ids, reward, DataParallel(rank, 2, _Collective())
        )
        torch.save((sample_ids, out.values, out.log), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# slow: each spawned rank imports the package afresh (seconds); the advantage work takes milliseconds
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:1 of 24 samples have no finite reward")
def test_two_gloo_ranks_equal_one_process(tmp_path: Path) -> None:
    components, _, _ = _data()
    components[1][3] = NAN
    reward = _reward(components)
    _, group_ids, sample_ids = GroupSampler(20, 4, 6, 1, 0, seed=1).step_indices(3)
    for aggregation in ("gdpo", "sum"):
        out = tmp_path / aggregation
        out.mkdir()
        mp.spawn(_gloo_rank, args=(_free_port(), str(out), aggregation), nprocs=2, join=True)
        one = AdvantageSettings(aggregation=aggregation).for_batch(
            _score(reward, sample_ids.tolist()), group_ids, reward, DataParallel()
        )
        by_id = dict(zip(sample_ids.tolist(), one.values.tolist(), strict=True))
        for rank in (0, 1):
            ids, values, log = torch.load(out / f"rank{rank}.pt")
            assert values.tolist() == [by_id[i] for i in ids.tolist()] and log == one.log
