"""The advantage stage as transforms over named columns: what each declares, the one gather of their
union, the named error for a column a batch lacks, and the KL gate's controller as a part with state
(its checkpoint entry in the form checkpoints already hold)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from lit_flowgrpo.advantages import (
    AdvantageSettings,
    AdvantageState,
    Columns,
    DiversityBonus,
    DiversityScaling,
    DropZeroAdvantages,
    FailureBudget,
    GatedKL,
    GDPONormalisation,
    GroupNormalisation,
    KLGateController,
    MissingColumnError,
)
from lit_flowgrpo.distributed import DataParallel
from lit_flowgrpo.kl import KLGate, KLSettings
from lit_flowgrpo.parts import AfterUpdate, Part, Parts
from lit_flowgrpo.rewards.base import MultiReward, RewardOutput

WEIGHTS = {"t/proxy": 1.0, "t/strict": 0.5, "t/judge": 0.0}


class _Table:
    """A reward of three components looked up by sample id."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.table = {k: torch.rand(n, generator=g) for k in ("proxy", "strict", "judge")}

    def __call__(self, images, prompts, metadata):
        return {k: v[[m["id"] for m in metadata]] for k, v in self.table.items()}


def _batch(n: int = 24) -> tuple[MultiReward, RewardOutput, Tensor, Tensor]:
    reward = MultiReward(WEIGHTS, rewards={"t": _Table(n)}, max_workers=1)
    ids = torch.arange(n)
    images = torch.rand(n, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    return reward, reward(images, [""] * n, [{"id": int(i)} for i in ids]), ids // 6, images


def _gate(**kw) -> KLGate:
    return KLGate(proxy="t/proxy", auxiliary=["t/judge"], **kw)


def test_each_transform_declares_the_columns_it_reads() -> None:
    reward, scores, _, _ = _batch()
    everything = AdvantageSettings(
        aggregation="gdpo", filter_zero=True, diversity_bonus=DiversityBonus(pool=2)
    )
    gate = KLGateController(_gate())
    steps = everything.transforms(reward, scores.components, gate)
    assert [type(s) for s in steps] == [
        GDPONormalisation,
        FailureBudget,
        DiversityScaling,
        DropZeroAdvantages,
        GatedKL,
    ]
    assert [s.columns for s in steps] == [
        ("group_ids", "t/proxy", "t/strict"),  # the non-zero terms of the reward
        (),
        ("group_ids", "features"),
        (),
        ("t/proxy", "t/judge"),
    ]
    plain = AdvantageSettings().transforms(reward, scores.components)
    assert [type(s) for s in plain] == [GroupNormalisation, FailureBudget]
    assert plain[0].columns == ("total", "group_ids")
    # The gate's transform moves the run's one controller, the part the module checkpoints.
    assert steps[-1].controller is gate


class _Recording:
    """A strategy of two ranks that hold the same samples; records what each gather sends."""

    def __init__(self) -> None:
        self.sent: list[Tensor] = []

    def all_gather(self, x: Tensor, group=None) -> Tensor:
        self.sent.append(x.clone())
        return torch.stack([x, x])


def test_the_stage_gathers_the_union_of_the_declared_columns_once() -> None:
    reward, scores, group_ids, images = _batch()
    settings = AdvantageSettings(diversity_bonus=DiversityBonus(pool=2))
    strategy = _Recording()
    gate = KLGateController(_gate(adaptive=False))
    out = settings.for_batch(scores, group_ids, reward, DataParallel(0, 2, strategy), images, gate=gate)
    (sent,) = strategy.sent  # one collective
    # In the order the transforms first name them: total, group_ids (the normalisation), the 2·2·3
    # pooled features (the bonus), proxy and judge (the gate); t/strict, read by none, stays home.
    assert sent.shape == (2 + 12 + 2, 24)
    assert torch.equal(sent[0], scores.total) and torch.equal(sent[1], group_ids.float())
    assert torch.equal(sent[2:14], DiversityBonus(pool=2).features(images).T)
    assert torch.equal(sent[14], scores.components["t/proxy"])
    assert torch.equal(sent[15], scores.components["t/judge"])
    assert out.values.shape == (24,) and out.kl_weights.shape == (24,)
    # Two ranks of identical samples: each sees what one process with both copies sees.
    one = AdvantageSettings(diversity_bonus=DiversityBonus(pool=2))
    both = RewardOutput(
        torch.cat([scores.total] * 2), {k: torch.cat([v] * 2) for k, v in scores.components.items()}
    )
    whole = one.for_batch(
        both,
        torch.cat([group_ids] * 2),
        reward,
        DataParallel(),
        torch.cat([images] * 2),
        gate=KLGateController(_gate(adaptive=False)),
    )
    assert torch.equal(out.values, whole.values[:24]) and out.log == whole.log


def test_a_column_the_batch_lacks_is_named_with_the_ones_it_has() -> None:
    reward, scores, group_ids, _ = _batch()
    settings = AdvantageSettings(diversity_bonus=DiversityBonus(pool=2))
    with pytest.raises(MissingColumnError) as caught:
        settings.for_batch(scores, group_ids, reward, DataParallel())  # no images: no features
    said = str(caught.value)
    assert said.startswith("--model.init_args.advantage.diversity_bonus needs the column(s) ['features']")
    assert "(its columns: ['total', 'group_ids', 't/proxy', 't/strict', 't/judge'])" in said
    assert "pass images to for_batch" in said
    # A gate on a component the reward did not produce (problems() refuses it first, when it knows the
    # reward's weights): named before any collective.
    strategy = _Recording()
    gate = KLGateController(KLGate(proxy="t/proxy", auxiliary=["t/aesthetic"]))
    with pytest.raises(
        MissingColumnError, match=r"^--model\.init_args\.kl\.gate needs the column\(s\) \['t/aesthetic'\]"
    ):
        AdvantageSettings().for_batch(scores, group_ids, reward, DataParallel(0, 2, strategy), gate=gate)
    assert strategy.sent == []
    # And after the gather, a lookup of an absent column says which there are.
    with pytest.raises(MissingColumnError, match=r"no column 'x' in this batch \(its columns: total\)"):
        Columns({"total": torch.zeros(3)})["x"]
    assert isinstance(caught.value, ValueError)


def test_a_component_named_like_a_built_in_column_is_refused() -> None:
    reward = MultiReward({"t/proxy": 1.0}, rewards={"t": _Table(4)}, max_workers=1)
    scores = RewardOutput(torch.zeros(4), {"total": torch.zeros(4), "t/proxy": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"components \['total'\] share a name"):
        AdvantageSettings().for_batch(scores, torch.zeros(4, dtype=torch.long), reward, DataParallel())


def test_the_transforms_in_turn_are_the_stage() -> None:
    reward, scores, group_ids, images = _batch()

    settings = AdvantageSettings(filter_zero=True, diversity_bonus=DiversityBonus(pool=2))

    def gate() -> KLGateController:
        return KLGateController(_gate(adaptive=False))

    out = settings.for_batch(scores, group_ids, reward, DataParallel(), images, gate=gate())
    columns = Columns(
        {
            "total": scores.total,
            "group_ids": group_ids,
            "t/proxy": scores.components["t/proxy"],
            "t/judge": scores.components["t/judge"],
            "features": DiversityBonus(pool=2).features(images),
        }
    )
    state = AdvantageState.start(columns, torch.device("cpu"))
    for step in settings.transforms(reward, scores.components, gate()):
        state = step(state)
    assert torch.equal(out.values, state.values) and torch.equal(out.kl_weights, state.kl_weights)
    assert torch.equal(out.keep, state.keep) and out.log == state.log


# -- the KL gate's controller, a part ------------------------------------------------------------------


def _uncertain(spread: float) -> tuple[Tensor, Tensor]:
    proxy = torch.arange(10.0)
    return proxy, torch.cat([proxy[:5], proxy[5:] - spread * 10])[None]


def test_the_controller_is_a_part_the_module_registers_once_per_run(tiny_sd3_path: str) -> None:
    import dataclasses

    from lit_flowgrpo import FlowGRPOModule, Sampler
    from lit_flowgrpo.policies import SD3Policy

    def module(kl: KLSettings) -> FlowGRPOModule:
        reward = MultiReward(WEIGHTS, rewards={"t": _Table(4)}, max_workers=1)
        return FlowGRPOModule(SD3Policy(tiny_sd3_path), reward, sampler=Sampler(height=32, width=32), kl=kl)

    settings = KLSettings(coef=0.04, gate=_gate())
    run = module(settings)
    part = run.kl_gate
    assert isinstance(part, Part) and isinstance(part, KLGateController) and part.key == "kl_gate"
    assert [p for p in run.parts if p.key == "kl_gate"] == [part]  # registered once, checkpointed with them
    assert run.kl_gate is part  # the same object every time
    plain = module(KLSettings(coef=0.04))
    assert plain.kl_gate is None and all(p.key != "kl_gate" for p in plain.parts)
    # Another run of the same settings has its own controller; the settings hold no run state.
    other = module(settings)
    assert other.kl_gate is not part and other.kl.gate == settings.gate
    assert dataclasses.asdict(settings)["gate"] == dataclasses.asdict(_gate())
    assert settings == KLSettings(coef=0.04, gate=_gate())
    # It moves in the advantage stage, not after the update.
    part.weights(*_uncertain(0.5))
    before = part.state_dict()
    part.after_update(AfterUpdate(policy=None, optimizer_steps=1, update_steps=1))
    assert part.state_dict() == before


def test_the_controllers_state_round_trips_and_old_checkpoints_load() -> None:
    gate = KLGateController(_gate(window=3))
    for spread in (0.5, 0.9, 1.5, 0.1):
        gate.weights(*_uncertain(spread))
    state = gate.state_dict()
    assert set(state) == {"fraction", "risks"} and isinstance(state["fraction"], float)
    assert len(state["risks"]) == 3 and all(isinstance(r, float) for r in state["risks"])
    parts = Parts([KLGateController(_gate(window=3))])
    parts.load_state_dict({"kl_gate": state})
    (again,) = parts
    assert again.state_dict() == state
    # Both go on alike from there.
    assert gate.weights(*_uncertain(2.0))[1] == again.weights(*_uncertain(2.0))[1]
    # What today's checkpoints hold under lit_flowgrpo.kl_gate, written by hand (ints and a tuple too).
    old = KLGateController(_gate())
    old.load_state_dict({"fraction": 0.121, "risks": (1, 2.5)})
    assert old.state_dict() == {"fraction": 0.121, "risks": [1.0, 2.5]}
    # A checkpoint without an entry (written without a gate): the controller starts where it starts.
    fresh = KLGateController(_gate(fraction=0.15))
    for absent in (None, {}):
        fresh.load_state_dict(absent)
        assert fresh.state_dict() == {"fraction": 0.15, "risks": []}
    Parts([fresh]).load_state_dict({})
    assert fresh.state_dict() == {"fraction": 0.15, "risks": []}
    with pytest.raises(ValueError, match=r"kl_gate entry lacks \['risks'\]"):
        fresh.load_state_dict({"fraction": 0.1})


def test_a_batch_without_positive_uncertainty_moves_nothing() -> None:
    gate = KLGateController(_gate())
    proxy = torch.arange(6.0)
    weights, log = gate.weights(proxy, proxy[None])  # judged alike: u = 0 everywhere
    assert gate.state_dict() == {"fraction": 0.1, "risks": []} and log["actor/kl_gated_fraction"] == 0.0
    assert torch.equal(weights, torch.zeros(6))
    assert not math.isnan(log["actor/kl_gate_target"])
