"""GARDO's three controls (arXiv:2512.24138) against float64 re-derivations: the uncertainty gate of the
KL penalty, its adaptive fraction, the diversity-aware advantage, and the moving KL reference (refreshed
or EMA) with its checkpoint."""

from __future__ import annotations

import math

import pytest
import torch
from test_advantages_gdpo import _Ranks, _Sent
from torch import nn

from lit_flowgrpo.advantages import AdvantageSettings, DiversityBonus, KLGateController
from lit_flowgrpo.algorithms import diversity_multipliers, gardo_uncertainty, gated_kl_weights, win_rates
from lit_flowgrpo.data import GroupSampler
from lit_flowgrpo.distributed import DataParallel
from lit_flowgrpo.kl import KLGate, KLSettings, ReferenceSettings
from lit_flowgrpo.parts import AfterUpdate
from lit_flowgrpo.rewards.base import MultiReward, RewardOutput
from lit_flowgrpo.weights import LoraSettings, TrainableWeights, WeightsSettings

NAN = float("nan")


# -- the pure functions --------------------------------------------------------------------------------


def _win_rates(scores: list[float]) -> list[float]:
    ok = [s for s in scores if math.isfinite(s)]
    out = []
    for s in scores:
        if not math.isfinite(s):
            out.append(NAN)
        elif len(ok) == 1:
            out.append(0.5)
        else:
            beats = sum(1 for t in ok if t < s) + 0.5 * (sum(1 for t in ok if t == s) - 1)
            out.append(beats / (len(ok) - 1))
    return out


def _close(got: list[float], want: list[float], rel: float) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (math.isnan(g) and math.isnan(w)) or g == pytest.approx(w, rel=rel, abs=1e-7)


def test_win_rates_are_the_pairwise_count_with_half_ties() -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (23,), generator=g).double().tolist()  # many ties
    scores[3] = scores[17] = NAN
    # Counts over at most 22 others: exact in fp32 after one division (2^-24 relative).
    _close(win_rates(torch.tensor(scores)).tolist(), _win_rates(scores), rel=2**-23)
    assert win_rates(torch.tensor([NAN, 2.0])).tolist()[1] == 0.5
    assert torch.isnan(win_rates(torch.tensor([NAN, NAN]))).all()


def test_uncertainty_is_the_proxy_win_rate_over_the_auxiliary_mean() -> None:
    g = torch.Generator().manual_seed(1)
    proxy = torch.rand(16, generator=g).tolist()
    aux = torch.rand(2, 16, generator=g).tolist()
    aux[1][5] = NAN  # left out of sample 5's mean
    wp, wa = _win_rates(proxy), [_win_rates(a) for a in aux]
    want = []
    for i in range(16):
        judged = [w[i] for w in wa if math.isfinite(w[i])]
        want.append(wp[i] - math.fsum(judged) / len(judged))
    _close(gardo_uncertainty(torch.tensor(proxy), torch.tensor(aux)).tolist(), want, rel=2**-22)
    # The samples the proxy ranks above the judges are the positive ones: a reversed judge flips them all.
    u = gardo_uncertainty(torch.arange(6.0), torch.arange(6.0).flip(0)[None])
    assert (u[3:] > 0).all() and (u[:3] < 0).all()
    with pytest.raises(ValueError, match="auxiliary must be"):
        gardo_uncertainty(torch.zeros(4), torch.zeros(4))


def _quantile(values: list[float], q: float) -> float:
    """Linear interpolation between order statistics (torch.quantile's and numpy's default)."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


@pytest.mark.parametrize("fraction", [0.1, 0.35, 1.0])
def test_the_gate_penalises_the_top_of_the_overrated_samples_as_their_mean(fraction: float) -> None:
    g = torch.Generator().manual_seed(2)
    u = (torch.rand(40, generator=g) - 0.4).tolist()
    u[7] = NAN  # unjudged: gated
    positive = [x for x in u if math.isfinite(x) and x > 0]
    q = _quantile(positive, 1 - fraction)
    gate = [math.isnan(x) or (x > 0 and x >= q) for x in u]
    w = gated_kl_weights(torch.tensor(u), fraction)
    assert [x > 0 for x in w.tolist()] == gate
    # β·mean_i(w_i·KL_i) is the mean KL over the gated samples, whatever the KL values.
    kl = torch.rand(40, generator=g, dtype=torch.float64)
    gated_mean = math.fsum(k for k, on in zip(kl.tolist(), gate, strict=True) if on) / sum(gate)
    assert (w.double() * kl).mean().item() == pytest.approx(gated_mean, rel=1e-6)
    assert gated_kl_weights(torch.tensor([-0.1, -0.2]), 0.5).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="fraction"):
        gated_kl_weights(torch.zeros(3), 0.0)


def _nearest(features: list[list[float]], distance: str) -> list[float]:
    def dist(a: list[float], b: list[float]) -> float:
        if distance == "cosine":
            na, nb = math.sqrt(math.fsum(x * x for x in a)), math.sqrt(math.fsum(x * x for x in b))
            return max(0.0, 1 - math.fsum(x * y for x, y in zip(a, b, strict=True)) / (na * nb))
        return math.fsum((x - y) ** 2 for x, y in zip(a, b, strict=True)) / len(a)

    return [min(dist(f, o) for j, o in enumerate(features) if j != i) for i, f in enumerate(features)]


@pytest.mark.parametrize("distance", ["cosine", "mse"])
def test_diversity_scales_positive_advantages_by_nearest_neighbour_over_group_mean(distance: str) -> None:
    g = torch.Generator().manual_seed(3)
    features = torch.rand(12, 5, generator=g, dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3])  # group 3: one sample, no neighbour
    adv = torch.tensor([1.0, -1, 2, 0, 0.5, 0.5, -0.2, -0.8, 1, 1, 1, 3])
    features[8:11] = features[8]  # group 2: identical samples, mean distance 0
    got = diversity_multipliers(features, ids, adv, distance=distance).tolist()
    want = [1.0] * 12
    for members in ([0, 1, 2, 3], [4, 5, 6, 7]):
        d = _nearest([features[i].tolist() for i in members], distance)
        mean = math.fsum(d) / len(d)
        for i, di in zip(members, d, strict=True):
            want[i] = di / mean if adv[i] > 0 else 1.0
    _close(got, want, rel=2**-20)  # fp64 inside; cdist's and the matmul's rounding, then fp32
    assert got[8:] == [1.0] * 4


def test_non_finite_features_leave_the_advantage_alone() -> None:
    features = torch.rand(4, 3, dtype=torch.float64)
    features[1, 0] = NAN
    got = diversity_multipliers(features, torch.zeros(4, dtype=torch.long), torch.ones(4))
    assert got[1] == 1.0 and torch.isfinite(got).all()


# -- the settings and the advantage stage -------------------------------------------------------------


def test_the_adaptive_fraction_follows_gardos_controller_and_checkpoints() -> None:
    gate = KLGateController(KLGate(proxy="p", auxiliary=["a"], fraction=0.1, window=3))
    proxy = torch.arange(10.0)

    def batch(spread: float) -> tuple[torch.Tensor, torch.Tensor]:
        # The judge reverses the proxy over the top half: its mean positive uncertainty scales with spread.
        aux = torch.cat([proxy[:5], proxy[5:] - spread * 10])
        return proxy, aux[None]

    seen = []
    for spread in (0.5, 0.9, 1.5, 0.1):
        _, log = gate.weights(*batch(spread))
        seen.append(log["actor/kl_gate_target"])
    # first: no history; higher risk twice: ×1.1 each; lower than every one of the window: ×0.9
    assert seen == pytest.approx([0.1, 0.11, 0.121, 0.1089])
    state = gate.state_dict()
    again = KLGateController(KLGate(proxy="p", auxiliary=["a"], fraction=0.1, window=3))
    again.load_state_dict(state)
    assert again.state_dict() == state and len(state["risks"]) == 3
    fixed = KLGateController(KLGate(proxy="p", auxiliary=["a"], fraction=0.3, adaptive=False))
    assert fixed.weights(*batch(2.0))[1]["actor/kl_gate_target"] == 0.3
    # clipped to the range
    high = KLGateController(KLGate(proxy="p", auxiliary=["a"], fraction=0.2, window=2))
    for spread in (0.2, 0.5, 0.9, 1.4):
        high.weights(*batch(spread))
    assert high.state_dict()["fraction"] == pytest.approx(0.2)


def test_gate_and_bonus_settings_are_refused_with_their_flag() -> None:
    import lit_flowgrpo.toy  # noqa: F401  (registers the shapes world's rewards)

    reward = MultiReward({"shapes_color": 1.0, "shapes/strict": 0.0, "shapes/partial": 0.0})
    weights = dict(reward.weights)
    flag = "--model.init_args.kl.gate"

    def gated(gate: KLGate, coef: float = 0.04) -> list[str]:
        return KLSettings(coef=coef, gate=gate).problems(full_fine_tune=False, reward_weights=weights)

    said = "\n".join(
        gated(KLGate(proxy="shapes_color", auxiliary=["shapes/partial", "aesthetic"], fraction=1.5))
        + AdvantageSettings(diversity_bonus=DiversityBonus(pool=0)).problems(reward=reward)
    )
    assert f"{flag}.fraction (1.5) must lie in (0, 1]" in said
    assert f"{flag} names ['aesthetic'], which the reward does not compute" in said
    assert "--model.init_args.advantage.diversity_bonus.pool (0) must be at least 1" in said
    said = "\n".join(gated(KLGate(proxy="shapes_color")))
    assert f"{flag}.auxiliary is empty" in said
    assert not gated(KLGate(proxy="shapes_color", auxiliary=["shapes/partial"]))
    # A gate of no KL penalty (β = 0) is refused with the flag that sets β.
    (said,) = gated(KLGate(proxy="shapes_color", auxiliary=["shapes/partial"]), coef=0.0)
    assert said.startswith(
        f"{flag} gates the KL penalty, but there is none: set --model.init_args.kl.coef > 0"
    )


def test_a_gate_that_could_never_gate_is_refused() -> None:
    """A gate on a proxy that is not trained on (weight 0), or judged by itself (uncertainty 0 for every
    sample: nothing gated, the KL never applied), is refused before any weight loads, one line each."""
    import lit_flowgrpo.toy  # noqa: F401  (registers the shapes world's rewards)

    flag = "--model.init_args.kl.gate"

    def said_of(gate: KLGate, reward: MultiReward | None = None) -> list[str]:
        weights = None if reward is None else dict(reward.weights)
        return KLSettings(coef=0.04, gate=gate).problems(full_fine_tune=False, reward_weights=weights)

    reward = MultiReward({"shapes_color": 0.0, "shapes/strict": 1.0, "shapes/partial": 0.0})
    said = said_of(KLGate(proxy="shapes_color", auxiliary=["shapes/partial"]), reward)
    assert len(said) == 1 and "\n" not in said[0]
    assert said[0].startswith(f"{flag}.proxy ('shapes_color') has weight 0 in --model.init_args.reward")
    assert "['shapes/strict']" in said[0]  # the fix names the trained components
    reward = MultiReward({"shapes_color": 1.0, "shapes/partial": 0.0})
    said = said_of(KLGate(proxy="shapes_color", auxiliary=["shapes_color", "shapes/partial"]), reward)
    assert len(said) == 1 and said[0].startswith(f"{flag}.auxiliary names the proxy 'shapes_color' itself")
    # Without the reward's weights (a plain callable) the self-judging gate is still refused.
    said = said_of(KLGate(proxy="p", auxiliary=["p"]))
    assert len(said) == 1 and "names the proxy 'p' itself" in said[0]


class _Table:
    """A reward of three components looked up by sample id (the proxy, a judge, the gold)."""

    def __init__(self, n: int, seed: int = 4) -> None:
        g = torch.Generator().manual_seed(seed)
        self.table = {k: torch.rand(n, generator=g) for k in ("proxy", "judge", "gold")}

    def __call__(self, images, prompts, metadata):
        return {k: v[[m["id"] for m in metadata]] for k, v in self.table.items()}


def _images(sample_ids: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    table = torch.rand(64, 3, 8, 8, generator=g)
    return table[sample_ids]


@pytest.mark.parametrize("world", [2, 3])
def test_gate_and_bonus_on_n_ranks_give_each_sample_what_one_process_gives_it(world: int) -> None:
    """A real GroupSampler's dealing (groups span ranks): advantages and KL weights of each sample equal
    the one-process ones, bit for bit, and the gate's controller moves the same on every rank."""
    weights = {"t/proxy": 1.0, "t/judge": 0.0, "t/gold": 0.0}
    reward = MultiReward(weights, rewards={"t": _Table(64)}, max_workers=1)

    def settings() -> tuple[AdvantageSettings, KLGateController]:
        gate = KLGateController(KLGate(proxy="t/proxy", auxiliary=["t/judge"], fraction=0.2))
        return AdvantageSettings(diversity_bonus=DiversityBonus(pool=4)), gate

    def run(w: int, rank: int, parts: list, s: tuple[AdvantageSettings, KLGateController]):
        _, group_ids, sample_ids = GroupSampler(64, 4, 6, w, rank, seed=1).step_indices(2)
        dp = DataParallel(rank, w, _Ranks(parts, rank)) if w > 1 else DataParallel()
        scores: RewardOutput = reward(
            _images(sample_ids), [""] * len(sample_ids), [{"id": int(i)} for i in sample_ids]
        )
        stage, gate = s
        out = stage.for_batch(scores, group_ids, reward, dp, _images(sample_ids), gate=gate)
        return sample_ids, out

    ids, one = run(1, 0, [None], settings())
    by_id = {
        i: (a, k) for i, a, k in zip(ids.tolist(), one.values.tolist(), one.kl_weights.tolist(), strict=True)
    }
    assert 0 < one.log["actor/kl_gated_fraction"] <= 0.2 + 1e-6
    assert one.log["critic/advantages/diversity_scale_max"] > 1
    # The one-process result is the re-derivation: the gate from the components, the bonus on top.
    parts: list = [None] * world
    for rank in range(world):
        with pytest.raises(_Sent):
            run(world, rank, parts, settings())
    for rank in range(world):
        ids, out = run(world, rank, parts, settings())
        assert out.values.tolist() == [by_id[i][0] for i in ids.tolist()]
        assert out.kl_weights.tolist() == [by_id[i][1] for i in ids.tolist()]
        assert out.log == one.log


def test_the_stage_is_the_rederivation_of_its_parts() -> None:
    weights = {"t/proxy": 1.0, "t/judge": 0.0}
    table = _Table(24)
    reward = MultiReward(weights, rewards={"t": table}, max_workers=1)
    ids = torch.arange(24)
    group_ids = ids // 6
    scores = reward(_images(ids), [""] * 24, [{"id": int(i)} for i in ids])
    s = AdvantageSettings(diversity_bonus=DiversityBonus(pool=2, distance="mse"))
    gate = KLGateController(KLGate(proxy="t/proxy", auxiliary=["t/judge"], fraction=0.5, adaptive=False))
    out = s.for_batch(scores, group_ids, reward, DataParallel(), _images(ids), gate=gate)
    from lit_flowgrpo.algorithms import group_advantages
    from lit_flowgrpo.diversity import pooled_pixels

    base = group_advantages(table.table["proxy"], group_ids)
    mult = diversity_multipliers(pooled_pixels(_images(ids), 2), group_ids, base, distance="mse")
    assert torch.equal(out.values, base * mult)
    want = gated_kl_weights(gardo_uncertainty(table.table["proxy"], table.table["judge"][None]), 0.5)
    assert torch.equal(out.kl_weights, want)


class _Fixed:
    """A reward of fixed components looked up by sample id."""

    def __init__(self, table: dict[str, torch.Tensor]) -> None:
        self.table = table

    def __call__(self, images, prompts, metadata):
        return {k: v[[m["id"] for m in metadata]] for k, v in self.table.items()}


@pytest.mark.parametrize("filter_zero", [True, False])
def test_the_kl_weights_average_to_one_over_the_samples_the_update_trains(filter_zero: bool) -> None:
    """The update's loss is a mean over the samples it trains (scored, and a non-zero advantage under
    filter_zero), so that is where the gated weights must average to 1: then β·mean(w·KL) over those rows
    is the mean KL of the gated ones that are trained, β as set, whatever share of the gated samples
    was dropped. Normalised over the whole batch instead, the gated samples of a saturated group
    (advantage 0) and an unscored one (gated: unjudged) took weight the update never sees."""
    g = torch.Generator().manual_seed(6)
    proxy = torch.rand(24, generator=g)
    judge = torch.rand(24, generator=g)
    proxy[0:6] = 1.0  # a saturated group: advantage 0, filtered; the proxy ranks it top ...
    judge[0:6] = 0.0  # ... and the judge bottom: over-rated, so gated
    proxy[9] = NAN  # unscored: dropped from training, gated (no uncertainty)
    reward = MultiReward(
        {"t/proxy": 1.0, "t/judge": 0.0}, rewards={"t": _Fixed({"proxy": proxy, "judge": judge})}
    )
    ids = torch.arange(24)
    s = AdvantageSettings(filter_zero=filter_zero)
    gate = KLGateController(KLGate(proxy="t/proxy", auxiliary=["t/judge"], fraction=1.0, adaptive=False))
    scores = reward(_images(ids), [""] * 24, [{"id": int(i)} for i in ids])
    out = s.for_batch(scores, ids // 6, reward, DataParallel(), gate=gate)
    # What the update trains, derived here from the advantages (the module trains out.keep).
    trained = torch.isfinite(scores.total) & ((out.values != 0) if filter_zero else True)
    w = out.kl_weights.double()
    # Over the trained rows the weights average to 1 (each is K/n_gated in fp64, rounded once to fp32).
    k = int(trained.sum())
    assert w[trained].mean().item() == pytest.approx(1.0, rel=2**-23)
    gated = w > 0
    assert not gated[~trained].any()  # a sample the update never sees carries no share of β
    u = gardo_uncertainty(proxy, judge[None])
    gate = torch.isnan(u) | ((u > 0) & (u >= u[u > 0].min()))
    assert gate[~trained].any() and (gate & trained).any()  # the case drops gated samples and keeps some
    assert torch.equal(gated, gate & trained)
    assert torch.equal(out.keep, trained)
    kl = torch.rand(24, generator=g, dtype=torch.float64)
    want = math.fsum(kl[gate & trained].tolist()) / int((gate & trained).sum())
    assert (w[trained] * kl[trained]).sum().item() / k == pytest.approx(want, rel=2**-22)
    assert out.log["actor/kl_gated_fraction"] == pytest.approx(float(gate.double().mean()), rel=2**-23)


def test_an_all_zero_feature_has_no_cosine_distance() -> None:
    """Under cosine an all-zero feature (an all-black image's pooled pixels) has no direction: it gets
    multiplier 1 and is nobody's neighbour, as a non-finite one. Taken as the zero vector it lay at
    distance 1 from everything, the farthest possible for non-negative features: the group's largest
    bonus."""
    g = torch.Generator().manual_seed(7)
    features = torch.rand(5, 6, generator=g, dtype=torch.float64)
    features[2] = 0.0
    adv = torch.tensor([1.0, 0.5, 2.0, -1.0, 0.25])
    ids = torch.zeros(5, dtype=torch.long)
    got = diversity_multipliers(features, ids, adv, distance="cosine")
    assert got[2] == 1.0
    # The others as if the black image were not there at all.
    rest = [0, 1, 3, 4]
    alone = diversity_multipliers(features[rest], ids[rest], adv[rest], distance="cosine")
    assert torch.equal(got[rest], alone)
    # Under mse the zero vector is a point like any other.
    assert diversity_multipliers(features, ids, adv, distance="mse")[2] != 1.0


# -- the moving reference ------------------------------------------------------------------------------


class _Policy(nn.Module):
    """The smallest policy TrainableWeights needs: a transformer child with LoRA targets."""

    default_lora_targets = ("proj",)
    default_lora_rank = 32  # FlowPolicy's defaults: the rank when unset, alpha 2·rank
    default_lora_alpha = None

    def unused_modules(self) -> tuple[str, ...]:
        return ()  # FlowPolicy's default

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.transformer = nn.Sequential()
        self.transformer.add_module("proj", nn.Linear(4, 4))

    @property
    def trainable_networks(self) -> tuple[nn.Module, ...]:
        return (self.transformer,)

    def out(self, x: torch.Tensor) -> torch.Tensor:
        return self.transformer(x)


def _trained(weights: TrainableWeights, policy: _Policy) -> dict[str, torch.Tensor]:
    return {n: p for n, p in policy.transformer.named_parameters() if p.requires_grad}


def _refreshed(weights: TrainableWeights, policy: _Policy, optimizer_steps: int, kl: float) -> bool:
    """Move the reference after an update with this KL; whether it was set to the trained weights."""
    reference = weights.copies.kl_reference
    before = reference.refreshes
    reference.after_update(AfterUpdate(policy, optimizer_steps, 1, {"actor/kl_loss": kl, "count": 1}))
    return reference.refreshes > before


def _nudge(weights: TrainableWeights, policy: _Policy, by: float) -> None:
    with torch.no_grad():
        for p in _trained(weights, policy).values():
            p.add_(by)


@pytest.mark.parametrize("lora", [True, False])
def test_a_refreshed_reference_moves_on_schedule_and_on_kl(lora: bool) -> None:
    policy = _Policy()
    weights = TrainableWeights(
        WeightsSettings(lora=LoraSettings(rank=2) if lora else None),
        reference=ReferenceSettings(mode="refreshed", refresh_every=3, refresh_kl=0.5, copy=not lora),
    )
    weights.attach(policy)
    x = torch.randn(5, 4)
    with weights.copies.reference():
        initial = policy.out(x).detach()
    _nudge(weights, policy, 0.1)
    trained = policy.out(x).detach()
    assert not torch.equal(trained, initial)
    with weights.copies.reference():
        assert torch.equal(policy.out(x), initial)  # not yet refreshed
    assert torch.equal(policy.out(x), trained)  # the trained weights are back
    assert not _refreshed(weights, policy, optimizer_steps=2, kl=0.1)  # 2 < 3 steps, KL low
    assert _refreshed(weights, policy, optimizer_steps=3, kl=0.1)  # 3 steps since the start
    with weights.copies.reference():
        assert torch.equal(policy.out(x), trained)
    _nudge(weights, policy, 0.1)
    assert not _refreshed(weights, policy, optimizer_steps=4, kl=float("nan"))  # a broken update
    assert _refreshed(weights, policy, optimizer_steps=4, kl=0.6)  # drifted past refresh_kl
    assert weights.copies.kl_reference.refreshes == 2
    # A checkpoint holds the reference: a fresh run restored from it computes the same reference.
    state = weights.copies.kl_reference.state_dict()
    other_policy = _Policy()
    other = TrainableWeights(
        WeightsSettings(lora=LoraSettings(rank=2) if lora else None),
        reference=ReferenceSettings(mode="refreshed", refresh_every=3, refresh_kl=0.5, copy=not lora),
    )
    other.attach(other_policy)
    other.copies.kl_reference.load_state_dict(state)
    with weights.copies.reference(), other.copies.reference():
        assert torch.equal(policy.out(x), other_policy.out(x))
    assert other.copies.kl_reference.refreshes == 2 and other.copies.kl_reference.steps_at_refresh == 4
    with pytest.raises(ValueError, match="holds no moving KL reference"):
        other.copies.kl_reference.load_state_dict({})


def test_an_ema_reference_trails_the_policy_by_its_decay() -> None:
    policy = _Policy()
    weights = TrainableWeights(
        WeightsSettings(lora=LoraSettings(rank=2)), reference=ReferenceSettings(mode="ema", ema_decay=0.75)
    )
    weights.attach(policy)
    with weights.copies.reference():
        pass  # the stored copy is made on first use, from the adapter as it starts
    start = {n: p.detach().clone().double() for n, p in _trained(weights, policy).items()}
    want = dict(start)
    for step in range(3):
        _nudge(weights, policy, 0.2 * (step + 1))
        _refreshed(weights, policy, optimizer_steps=step + 1, kl=1.0)
        for n, p in _trained(weights, policy).items():
            want[n] = 0.75 * want[n] + 0.25 * p.detach().double()
    for n, ref in weights.copies.kl_reference.adapter().items():
        torch.testing.assert_close(ref.double(), want[n], rtol=4 * 2**-24, atol=1e-7)
    assert weights.copies.kl_reference.refreshes == 0


def test_reference_settings_are_refused_with_their_flag() -> None:
    flag = "--model.init_args.kl.reference"

    def said(settings: ReferenceSettings, uses_reference: bool = True) -> str:
        return "\n".join(settings.problems(uses_reference))

    assert f"{flag}.refresh_every (0) must be at least 1" in said(
        ReferenceSettings("refreshed", refresh_every=0)
    )
    assert f"{flag}.mode=refreshed needs {flag}.refresh_every or {flag}.refresh_kl" in said(
        ReferenceSettings("refreshed")
    )
    assert "only apply to" in said(ReferenceSettings("ema", refresh_every=5))
    assert f"{flag}.ema_decay (1.0) must lie in [0, 1)" in said(ReferenceSettings("ema", ema_decay=1.0))
    assert "--model.init_args.kl.coef > 0" in said(ReferenceSettings("ema"), uses_reference=False)
    # The KL group says whether a KL to the reference is computed: β > 0, or measured at β = 0.
    ema = ReferenceSettings("ema")
    assert any(
        "moves the KL reference" in p
        for p in KLSettings(coef=0.0, reference=ema).problems(full_fine_tune=False)
    )
    assert not KLSettings(coef=0.0, measure=True, reference=ema).problems(full_fine_tune=False)
    assert not KLSettings(coef=0.04, reference=ema).problems(full_fine_tune=False)
    assert said(ReferenceSettings()) == "" and said(ReferenceSettings("refreshed", refresh_kl=3e-4)) == ""
