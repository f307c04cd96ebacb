"""RewardGroupStats and PolicyRatioStats against numpy references, split invariance, docs and logging."""

from __future__ import annotations

import doctest
import importlib
import math
import pkgutil

import numpy as np
import pytest
import torch
from torch import Tensor

import lit_flowgrpo.metrics as metrics_module
from lit_flowgrpo.metrics import PolicyRatioStats, RewardGroupStats


def _assert_close(got: dict[str, Tensor], want: dict[str, float], atol: float = 1e-9) -> None:
    assert set(got) == set(want), f"keys differ: {sorted(set(got) ^ set(want))}"
    for key, value in want.items():
        g = float(got[key])
        if math.isnan(value):
            assert math.isnan(g), f"{key}: {g} != nan"
        else:
            assert g == pytest.approx(value, abs=atol, rel=1e-9), f"{key}: {g} != {value}"


# ---------------------------------------------------------------- RewardGroupStats


def _reward_reference(rewards, group_ids, advantages, tol, threshold, components=None) -> dict[str, float]:
    """Per-sample numpy reference: group with a dict, std with np.std (ddof=0)."""
    rewards, group_ids, advantages = (np.asarray(x) for x in (rewards, group_ids, advantages))
    ok = np.isfinite(rewards)
    r, g, a = rewards[ok], group_ids[ok], advantages[ok]
    groups = {int(i): r[g == i] for i in np.unique(g)}
    stds = np.array([np.std(v) for v in groups.values()])
    zero = np.array([bool(np.all(v == v[0])) for v in groups.values()]) if tol == 0 else stds <= tol
    out = {
        "mean": r.mean(),
        "std": r.std(),
        "max": r.max(),
        "min": r.min(),
        "count": r.size,
        "nonfinite_count": int((~ok).sum()),
        "zero_std_ratio": zero.mean(),
        "std_mean": stds.mean(),
        "group_size": np.mean([v.size for v in groups.values()]),
        "num_groups": len(groups),
        "advantages/mean": a.mean(),
        "advantages/std": a.std(),
        "advantages/max": a.max(),
        "advantages/min": a.min(),
        "advantages/effective_ratio": np.mean(np.abs(a) > threshold),
    }
    for name, values in (components or {}).items():
        values = np.asarray(values)
        out[f"{name}/mean"] = values[np.isfinite(values)].mean()
    return {k: float(v) for k, v in out.items()}


def _reward_batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 1, 2, 3, 4, 4, 5, 6, 6, 6, 3, 2, 5]
    group_ids = torch.cat([torch.full((s,), 7 * i + 3, dtype=torch.int64) for i, s in enumerate(sizes)])
    rewards = (torch.randn(group_ids.numel(), generator=gen, dtype=torch.float64) * 2 + 5).clone()
    rewards[group_ids == 3 + 7 * 3] = 0.1  # all equal, where Σr² − (Σr)²/n does not round to 0
    rewards[group_ids == 3 + 7 * 4] = 1.0 / 3.0
    rewards[[5, 17, 30]] = torch.tensor([math.nan, math.inf, -math.inf], dtype=torch.float64)
    rewards[group_ids == 3 + 7 * 11] = math.nan  # a group with no finite reward disappears
    advantages = torch.randn(group_ids.numel(), generator=gen, dtype=torch.float64)
    advantages[::4] = 0.0
    components = {
        "ocr": torch.rand(group_ids.numel(), generator=gen, dtype=torch.float64),
        "pick/score": torch.randn(group_ids.numel(), generator=gen, dtype=torch.float64),
    }
    components["ocr"][[1, 2]] = math.nan
    perm = torch.randperm(group_ids.numel(), generator=gen)  # groups interleaved, as GroupSampler shuffles
    return rewards[perm], group_ids[perm], advantages[perm], {k: v[perm] for k, v in components.items()}


@pytest.mark.parametrize("tol", [0.0, 0.05, 0.9])
def test_reward_group_stats_matches_numpy(tol: float) -> None:
    rewards, group_ids, advantages, components = _reward_batch()
    metric = RewardGroupStats(tol=tol, adv_threshold=0.3)
    metric.update(rewards, group_ids, advantages, components)
    want = _reward_reference(rewards, group_ids, advantages, tol, 0.3, components)
    _assert_close(metric.compute(), want)
    assert want["num_groups"] == 12 and want["nonfinite_count"] == 3 + 2


def test_zero_std_is_exact_with_tol_zero() -> None:
    # Equal rewards whose Σ-based variance is not exactly 0, and a pair one ulp apart.
    one_ulp = float(np.nextafter(1.0, 2.0))
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 1 / 3, 1 / 3, 1 / 3, 1.0, one_ulp], dtype=torch.float64)
    group_ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3, 3])
    s, ss, n = 0.1 * 3, 0.1 * 0.1 * 3, 3
    assert ss / n - (s / n) ** 2 != 0.0  # the naive test would miss group 0
    metric = RewardGroupStats(tol=0.0)
    metric.update(rewards, group_ids, torch.zeros(10))
    out = metric.compute()
    assert float(out["zero_std_ratio"]) == 0.75  # groups 0, 1, 2 exactly; group 3 differs by one ulp
    assert float(out["std_mean"]) == pytest.approx(np.std([1.0, one_ulp]) / 4, abs=1e-18)


def test_groups_of_one_and_all_equal_rewards() -> None:
    metric = RewardGroupStats()
    metric.update(torch.full((6,), 2.5), torch.arange(6), torch.zeros(6))
    out = metric.compute()
    assert float(out["zero_std_ratio"]) == 1.0
    assert float(out["std_mean"]) == 0.0 and float(out["std"]) == 0.0
    assert float(out["group_size"]) == 1.0 and float(out["num_groups"]) == 6.0
    assert float(out["advantages/effective_ratio"]) == 0.0


def test_reward_group_stats_is_split_invariant() -> None:
    rewards, group_ids, advantages, components = _reward_batch(seed=3)
    whole = RewardGroupStats(tol=0.01)
    whole.update(rewards, group_ids, advantages, components)
    want = whole.compute()
    gen = torch.Generator().manual_seed(11)
    for _ in range(3):
        perm = torch.randperm(rewards.numel(), generator=gen)
        cuts = sorted(torch.randint(0, rewards.numel(), (4,), generator=gen).tolist())
        split = RewardGroupStats(tol=0.01)
        for chunk in torch.tensor_split(perm, cuts):  # empty chunks included
            split.update(
                rewards[chunk],
                group_ids[chunk],
                advantages[chunk],
                {k: v[chunk] for k, v in components.items()},
            )
        _assert_close(split.compute(), {k: float(v) for k, v in want.items()}, atol=1e-12)


def test_reward_group_stats_all_nonfinite_and_reset() -> None:
    metric = RewardGroupStats()
    metric.update(torch.tensor([math.nan, math.inf]), torch.tensor([0, 0]), torch.zeros(2))
    out = metric.compute()
    assert float(out["nonfinite_count"]) == 2.0 and float(out["count"]) == 0.0
    assert math.isnan(float(out["mean"])) and math.isnan(float(out["zero_std_ratio"]))
    metric.reset()
    metric.update(torch.tensor([1.0, 3.0]), torch.tensor([4, 4]), torch.tensor([-1.0, 1.0]))
    out = metric.compute()
    assert float(out["nonfinite_count"]) == 0.0 and float(out["std"]) == 1.0


def test_reward_group_stats_logged_names() -> None:
    metric = RewardGroupStats()
    metric.update(
        torch.tensor([1.0, 2.0]), torch.tensor([0, 0]), torch.tensor([-1.0, 1.0]), {"ocr": torch.ones(2)}
    )
    keys = set(metric.compute_prefixed())
    expected = {f"critic/rewards/{k}" for k in ("mean", "std", "max", "min", "zero_std_ratio", "std_mean")}
    expected |= {"critic/rewards/group_size", "critic/rewards/ocr/mean"}
    expected |= {f"critic/advantages/{k}" for k in ("mean", "std", "max", "min")}
    assert expected <= keys
    assert not any(k.startswith("critic/rewards/advantages") for k in keys)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"group_ids": torch.tensor([0.0, 1.0])}, "group_ids must be an integer"),
        ({"group_ids": torch.tensor([0, 1, 2])}, "group_ids has shape"),
        ({"advantages": torch.tensor([math.nan, 0.0])}, "advantages has non-finite"),
        ({"rewards": torch.ones(2, 1)}, "rewards has shape"),
        ({"components": {"x": torch.ones(3)}}, r"components\['x'\] has shape"),
    ],
)
def test_reward_group_stats_rejects_bad_input(kwargs: dict, match: str) -> None:
    args = {"rewards": torch.ones(2), "group_ids": torch.tensor([0, 1]), "advantages": torch.zeros(2)}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        RewardGroupStats().update(**args)


def test_reward_group_stats_rejects_bad_settings_and_new_components() -> None:
    with pytest.raises(ValueError, match="tol"):
        RewardGroupStats(tol=-1.0)
    with pytest.raises(ValueError, match="adv_threshold"):
        RewardGroupStats(adv_threshold=math.nan)
    metric = RewardGroupStats()
    metric.update(torch.ones(2), torch.tensor([0, 1]), torch.zeros(2), {"a": torch.ones(2)})
    with pytest.raises(ValueError, match=r"components \['b'\]"):
        metric.update(torch.ones(2), torch.tensor([0, 1]), torch.zeros(2), {"b": torch.ones(2)})


# ---------------------------------------------------------------- PolicyRatioStats


def _token_batch(n: int = 360, steps: int = 6, seed: int = 0) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    sample_id = torch.arange(n) // steps
    step = torch.arange(n) % steps
    old = -1.0 + 0.3 * torch.randn(n, generator=gen)
    # the spread of the log-ratio grows with the step, as the ratio does at late steps
    new = old + 0.01 * (1 + step) * torch.randn(n, generator=gen)
    adv = torch.randn(n // steps, generator=gen)[sample_id]
    adv[sample_id % 7 == 0] = 0.0
    std_dev_t = 0.2 + torch.rand(n, generator=gen)
    sqrt_dt = torch.full((n,), 0.1) + 0.05 * torch.rand(n, generator=gen)
    guard_ratio = torch.exp((new - old) * 0.8)  # a stand-in for a re-normalised ratio
    new[[3, 100]] = torch.tensor([math.nan, -math.inf])
    perm = torch.randperm(n, generator=gen)
    batch = {
        "log_prob": new,
        "old_log_prob": old,
        "advantages": adv,
        "step": step,
        "sample_id": sample_id,
        "std_dev_t": std_dev_t,
        "sqrt_dt": sqrt_dt,
        "ratio": guard_ratio,
    }
    return {k: v[perm] for k, v in batch.items()}


def _policy_reference(
    b: dict[str, Tensor], eps: float, eps_h: float, use_ratio: bool, gate: bool
) -> dict[str, float]:
    """Per-token numpy reference (np.exp ratio, np.std, torch.distributions for the entropy)."""
    new, old, adv = (b[k].double().numpy() for k in ("log_prob", "old_log_prob", "advantages"))
    d = new - old
    r = b["ratio"].double().numpy() if use_ratio else np.exp(d)
    ok = np.isfinite(d) & np.isfinite(r) & np.isfinite(adv)
    d, r, adv, new, old = d[ok], r[ok], adv[ok], new[ok], old[ok]
    std = (b["std_dev_t"].double() * b["sqrt_dt"].double())[torch.from_numpy(ok)]
    entropy = torch.distributions.Normal(torch.zeros_like(std), std).entropy().numpy()
    above, below = r > 1 + eps_h, r < 1 - eps
    high, low = (above & (adv > 0), below & (adv < 0)) if gate else (above, below)
    k3 = np.exp(d) - d - 1
    return {
        "ratio_mean": r.mean(),
        "ratio_std": r.std(),
        "ratio_max": r.max(),
        "ratio_min": r.min(),
        "pg_clipfrac": np.mean(above | below),
        "pg_clipfrac_higher": above.mean(),
        "pg_clipfrac_lower": below.mean(),
        "clip_ratio": np.mean(high | low),
        "clip_ratio_high": high.mean(),
        "clip_ratio_low": low.mean(),
        "approx_kl": k3.mean(),
        "kl_max": k3.max(),
        "ppo_kl": np.mean(-d),
        "logp_diff_mean": d.mean(),
        "mean_new_logp": new.mean(),
        "mean_old_logp": old.mean(),
        "policy_confidence": math.exp(new.mean()),
        "entropy": entropy.mean(),
        "count": float(ok.sum()),
        "nonfinite_count": float((~ok).sum()),
    }


def _update(
    metric: PolicyRatioStats, b: dict[str, Tensor], use_ratio: bool, idx: Tensor | None = None
) -> None:
    part = b if idx is None else {k: v[idx] for k, v in b.items()}
    metric.update(
        part["log_prob"],
        part["old_log_prob"],
        part["advantages"],
        ratio=part["ratio"] if use_ratio else None,
        step=part["step"],
        sample_id=part["sample_id"],
        std_dev_t=part["std_dev_t"],
        sqrt_dt=part["sqrt_dt"],
    )


@pytest.mark.parametrize(("use_ratio", "gate"), [(False, "advantage"), (True, "advantage"), (False, "none")])
def test_policy_ratio_stats_matches_numpy(use_ratio: bool, gate: str) -> None:
    b = _token_batch()
    metric = PolicyRatioStats(clip_range=0.02, clip_range_high=0.03, clip_gate=gate)  # type: ignore[arg-type]
    _update(metric, b, use_ratio)
    want = _policy_reference(b, 0.02, 0.03, use_ratio, gate == "advantage")
    _assert_close(metric.compute(), want)
    assert 0.05 < want["pg_clipfrac"] < 0.8 and want["clip_ratio"] > 0.0
    # gated by the advantage's sign, fewer tokens lose their gradient than leave the range
    assert (want["clip_ratio"] < want["pg_clipfrac"]) == (gate == "advantage")


def test_policy_ratio_stats_by_step_matches_numpy_per_step() -> None:
    b = _token_batch()
    metric = PolicyRatioStats(clip_range=0.02, by_step=True, num_steps=8)  # steps 6 and 7 never seen
    _update(metric, b, use_ratio=False)
    out = metric.compute()
    want = _policy_reference(b, 0.02, 0.02, False, True)
    for j in range(6):
        at_j = b["step"] == j
        for key, value in _policy_reference(
            {k: v[at_j] for k, v in b.items()}, 0.02, 0.02, False, True
        ).items():
            want[f"by_step/{key}/step_{j}"] = value
    _assert_close(out, want)
    # late steps move more: the per-step diagnostic sees what the pooled one averages away
    assert float(out["by_step/approx_kl/step_5"]) > 10 * float(out["by_step/approx_kl/step_0"])
    assert set(metric.compute_prefixed()) >= {"actor/ratio_mean", "actor_by_step/ratio_mean/step_3"}


def test_ratio_std_is_accurate_near_one() -> None:
    # GRPO-Guard-sized deviations (~1e-7): Σr² − (Σr)²/n over raw ratios would lose every digit.
    gen = torch.Generator().manual_seed(0)
    d = 1e-7 * torch.randn(4000, generator=gen, dtype=torch.float64)
    metric = PolicyRatioStats(clip_range=2e-6)
    metric.update(d, torch.zeros_like(d), torch.ones_like(d))
    want = np.expm1(d.numpy()).std()
    assert float(metric.compute()["ratio_std"]) == pytest.approx(want, rel=1e-6)


def test_trajectory_level_clip_uses_geometric_mean_ratio() -> None:
    b = _token_batch()
    eps = 0.01
    metric = PolicyRatioStats(clip_range=eps, clip_level="trajectory", by_step=True, num_steps=6)
    _update(metric, b, use_ratio=False)
    out = metric.compute()
    d = (b["log_prob"] - b["old_log_prob"]).double().numpy()
    ok = np.isfinite(d)
    sid, adv = b["sample_id"].numpy()[ok], b["advantages"].double().numpy()[ok]
    ids = np.unique(sid)
    ratio = np.array([np.exp(d[ok][sid == i].mean()) for i in ids])
    a = np.array([adv[sid == i].mean() for i in ids])
    high, low = np.mean((ratio > 1 + eps) & (a > 0)), np.mean((ratio < 1 - eps) & (a < 0))
    assert high > 0 and low > 0
    assert float(out["clip_ratio_high"]) == pytest.approx(high, abs=1e-12)
    assert float(out["clip_ratio_low"]) == pytest.approx(low, abs=1e-12)
    assert float(out["clip_ratio"]) == pytest.approx(high + low, abs=1e-12)
    assert not any(k.startswith("by_step/clip_ratio") for k in out)
    # token-level fields are unchanged by the trajectory option
    assert float(out["pg_clipfrac"]) == pytest.approx(
        _policy_reference(b, eps, eps, False, True)["pg_clipfrac"]
    )


def test_top_k_kl_records() -> None:
    b = _token_batch()
    metric = PolicyRatioStats(clip_range=0.02, top_k_kl=5)
    for idx in torch.tensor_split(torch.arange(b["step"].numel()), 7):  # pruned to 5 after every update
        _update(metric, b, use_ratio=True, idx=idx)
    metric.compute()
    d = (b["log_prob"] - b["old_log_prob"]).double().numpy()
    k3 = np.exp(d) - d - 1
    ok = np.isfinite(k3)
    order = np.lexsort((b["step"].numpy()[ok], b["sample_id"].numpy()[ok], -k3[ok]))[:5]
    records = metric.top_kl_records
    assert [r["kl"] for r in records] == pytest.approx(k3[ok][order].tolist(), rel=1e-9)
    assert [r["sample_id"] for r in records] == b["sample_id"].numpy()[ok][order].tolist()
    assert [r["step"] for r in records] == b["step"].numpy()[ok][order].tolist()
    assert [r["ratio"] for r in records] == pytest.approx(b["ratio"].double().numpy()[ok][order].tolist())
    assert [r["old_logp"] for r in records] == pytest.approx(
        b["old_log_prob"].double().numpy()[ok][order].tolist()
    )
    metric.reset()
    assert metric.top_kl_records == []


@pytest.mark.parametrize(
    "options", [{}, {"by_step": True, "num_steps": 6, "top_k_kl": 4, "clip_level": "trajectory"}]
)
def test_policy_ratio_stats_is_split_invariant(options: dict) -> None:
    b = _token_batch(seed=5)
    whole = PolicyRatioStats(clip_range=0.02, **options)
    _update(whole, b, use_ratio=False)
    want = {k: float(v) for k, v in whole.compute().items()}
    gen = torch.Generator().manual_seed(2)
    # the module's order: inner loop over steps, micro-batches of samples
    split = PolicyRatioStats(clip_range=0.02, **options)
    perm = torch.randperm(b["step"].numel(), generator=gen)
    for idx in torch.tensor_split(perm, 9):
        for j in range(6):
            _update(split, b, use_ratio=False, idx=idx[b["step"][idx] == j])
    _assert_close(split.compute(), want, atol=1e-12)
    assert split.top_kl_records == whole.top_kl_records


def test_on_policy_ratio_is_exactly_one() -> None:
    logp = torch.randn(50)
    metric = PolicyRatioStats(clip_range=1e-4)
    metric.update(logp, logp.clone(), torch.randn(50))
    out = metric.compute()
    for key in ("ratio_mean", "ratio_max", "ratio_min", "policy_confidence"):
        assert float(out[key]) == pytest.approx(
            1.0 if key != "policy_confidence" else math.exp(logp.double().mean())
        )
    for key in ("ratio_std", "pg_clipfrac", "clip_ratio", "approx_kl", "kl_max", "ppo_kl"):
        assert float(out[key]) == 0.0
    assert "entropy" not in out


@pytest.mark.parametrize(
    ("init", "match"),
    [
        ({"clip_range": 0.0}, "clip_range"),
        ({"clip_range": 0.2, "clip_range_high": -1.0}, "clip_range_high"),
        ({"clip_range": 0.2, "by_step": True}, "num_steps"),
        ({"clip_range": 0.2, "top_k_kl": -1}, "top_k_kl"),
        ({"clip_range": 0.2, "clip_level": "sequence"}, "clip_level"),
    ],
)
def test_policy_ratio_stats_rejects_bad_settings(init: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PolicyRatioStats(**init)


def test_policy_ratio_stats_rejects_bad_input() -> None:
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="old_log_prob has shape"):
        PolicyRatioStats(clip_range=0.1).update(x, torch.zeros(3), x)
    with pytest.raises(ValueError, match="needs step"):
        PolicyRatioStats(clip_range=0.1, by_step=True, num_steps=2).update(x, x, x)
    with pytest.raises(ValueError, match="num_steps is 2"):
        PolicyRatioStats(clip_range=0.1, by_step=True, num_steps=2).update(x, x, x, step=2)
    with pytest.raises(ValueError, match="needs sample_id"):
        PolicyRatioStats(clip_range=0.1, clip_level="trajectory").update(x, x, x)
    with pytest.raises(ValueError, match="sqrt_dt was given without std_dev_t"):
        PolicyRatioStats(clip_range=0.1).update(x, x, x, sqrt_dt=torch.ones(4))

    # A deterministic (ODE) step has std 0 and no log-prob: excluded and counted, not averaged in
    # (and never read back to the host to raise).
    metric = PolicyRatioStats(clip_range=0.1)
    metric.update(x, x, x, std_dev_t=torch.tensor([0.0, 1.0, 1.0, 0.0]))
    out = metric.compute()
    assert float(out["count"]) == 2 and float(out["nonfinite_count"]) == 2


def test_forward_returns_the_batch_and_accumulates_like_update() -> None:
    rewards, group_ids, advantages, components = _reward_batch()
    halves = torch.tensor_split(torch.arange(rewards.numel()), 2)
    by_forward, by_update = RewardGroupStats(), RewardGroupStats()
    for idx in halves:
        parts = (rewards[idx], group_ids[idx], advantages[idx], {k: v[idx] for k, v in components.items()})
        batch = by_forward(*parts)  # components registered on the fly
        by_update.update(*parts)
    last = _reward_reference(rewards[idx], group_ids[idx], advantages[idx], 0.0, 1e-6, parts[3])
    _assert_close(batch, last)
    _assert_close(by_forward.compute(), {k: float(v) for k, v in by_update.compute().items()}, atol=1e-12)

    b = _token_batch()
    options = {"clip_range": 0.02, "by_step": True, "num_steps": 6, "top_k_kl": 3, "clip_level": "trajectory"}
    by_forward, by_update = PolicyRatioStats(**options), PolicyRatioStats(**options)
    for idx in torch.tensor_split(torch.arange(b["step"].numel()), 3):
        part = {k: v[idx] for k, v in b.items()}
        args = (part.pop("log_prob"), part.pop("old_log_prob"), part.pop("advantages"))
        by_forward(*args, **part)
        by_update.update(*args, **part)
    _assert_close(by_forward.compute(), {k: float(v) for k, v in by_update.compute().items()}, atol=1e-12)
    assert by_forward.top_kl_records == by_update.top_kl_records


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_states_match_cpu() -> None:
    rewards, group_ids, advantages, components = _reward_batch()
    b = _token_batch()
    options = {"clip_range": 0.02, "by_step": True, "num_steps": 6, "top_k_kl": 4, "clip_level": "trajectory"}
    results = []
    for device in ("cpu", "cuda"):
        reward_stats = RewardGroupStats(tol=0.05).to(device)
        ratio_stats = PolicyRatioStats(**options).to(device)
        for idx in torch.tensor_split(torch.arange(rewards.numel()), 3):
            reward_stats.update(
                rewards[idx].to(device),
                group_ids[idx].to(device),
                advantages[idx].float().to(device),
                {k: v[idx].to(device) for k, v in components.items()},
            )
        for idx in torch.tensor_split(torch.arange(b["step"].numel()), 4):
            _update(ratio_stats, {k: v.to(device) for k, v in b.items()}, use_ratio=True, idx=idx.to(device))
        values = {**reward_stats.compute(), **ratio_stats.compute()}
        assert all(v.device.type == device for v in values.values())
        results.append(({k: float(v) for k, v in values.items()}, ratio_stats.top_kl_records))
    _assert_close(results[1][0], results[0][0], atol=1e-12)
    assert results[1][1] == results[0][1]


# ---------------------------------------------------------------- docs and Lightning


def test_doctests_pass() -> None:
    # The package's files, each with its own doctests (doctest.testmod reads one module's own objects).
    attempted = failed = 0
    for info in pkgutil.iter_modules(metrics_module.__path__):
        module = importlib.import_module(f"{metrics_module.__name__}.{info.name}")
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        attempted, failed = attempted + result.attempted, failed + result.failed
    assert attempted >= 10 and failed == 0


@pytest.mark.parametrize("file", ["base", "rewards", "policy", "nft"])
def test_the_package_re_exports_every_public_name(file: str) -> None:
    module = importlib.import_module(f"{metrics_module.__name__}.{file}")
    for name in module.__all__:  # `from lit_flowgrpo.metrics import X` whichever file X lives in
        assert getattr(metrics_module, name) is getattr(module, name) and name in metrics_module.__all__, name


@pytest.mark.filterwarnings("ignore:.*configure_optimizers.*returned `None`")
@pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated")
def test_lightning_logs_the_prefixed_keys(tmp_path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers.logger import Logger

    class Recorder(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[tuple[int, dict[str, float]]] = []

        name = "recorder"
        version = "0"

        def log_hyperparams(self, params, *args, **kwargs) -> None:
            pass

        def log_metrics(self, metrics, step=None) -> None:
            self.rows.append((step, dict(metrics)))

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.ratio_stats = PolicyRatioStats(clip_range=0.1, by_step=True, num_steps=2)
            self.reward_stats = RewardGroupStats()

        def training_step(self, batch, batch_idx):
            logp = batch[0]
            # two micro-batches × two steps, then one log per training step
            for half in logp.chunk(2):
                for j in range(2):
                    self.ratio_stats.update(half + 0.1 * j, half, torch.ones_like(half), step=j)
            self.reward_stats.update(logp, torch.tensor([0, 0, 1, 1]), logp - logp.mean())
            self.log_dict(self.ratio_stats.compute_prefixed(), on_step=True, on_epoch=False)
            self.log_dict(self.reward_stats.compute_prefixed(), on_step=True, on_epoch=False)
            self.ratio_stats.reset()
            self.reward_stats.reset()

        def configure_optimizers(self):
            return None

        def train_dataloader(self):
            data = torch.tensor([[0.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]])
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=None)

    recorder = Recorder()
    trainer = pl.Trainer(
        max_epochs=1,  # two batches; no optimizer, so global_step stays 0
        logger=recorder,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        accelerator="cpu",
    )
    trainer.fit(Module())
    assert len(recorder.rows) == 2
    first, second = recorder.rows[0][1], recorder.rows[1][1]
    # step 0 ratio 1, step 1 ratio e^0.1; the second batch starts from a fresh state
    assert first["actor_by_step/ratio_mean/step_1"] == pytest.approx(math.exp(0.1), rel=1e-6)
    assert first["actor/ratio_mean"] == pytest.approx((1 + math.exp(0.1)) / 2, rel=1e-6)
    assert first["actor/count"] == 8.0 and second["actor/count"] == 8.0
    assert first["critic/rewards/std"] == pytest.approx(np.std([0.0, 1.0, 2.0, 3.0]), rel=1e-6)
    assert first["critic/rewards/zero_std_ratio"] == 0.0 and second["critic/rewards/zero_std_ratio"] == 1.0
    assert second["critic/advantages/max"] == 0.0


# ---------------------------------------------------------------- the exact step KL, Flow-DPPO's mask


def _step_kl_case(n: int = 240, steps: int = 6, seed: int = 5) -> tuple[dict[str, Tensor], np.ndarray]:
    """Tokens with recorded means: μ_θ − μ_old grows with the step; returns the batch and the float64
    reference KL per token, mean((μ_θ − μ_old)²)/(2·(std_dev_t·sqrt_dt)²) computed in numpy."""
    b = _token_batch(n, steps, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    mu_old = torch.randn(n, 2, 3, 3, generator=gen)
    scale = 1e-3 * (1 + b["step"].float()) * b["std_dev_t"] * b["sqrt_dt"]
    mu = mu_old + scale.view(-1, 1, 1, 1) * torch.randn(n, 2, 3, 3, generator=gen)
    from lit_flowgrpo.algorithms import gaussian_step_kl

    b["step_kl"] = gaussian_step_kl(mu, mu_old, b["std_dev_t"], b["sqrt_dt"])  # (N,) fp32, as the visit does
    diff = mu.double().numpy() - mu_old.double().numpy()
    s = b["std_dev_t"].double().numpy() * b["sqrt_dt"].double().numpy()
    return b, (diff.reshape(n, -1) ** 2).mean(axis=1) / (2 * s**2)


def test_step_kl_matches_float64_over_micro_batches_and_steps() -> None:
    b, kl = _step_kl_case()
    metric = PolicyRatioStats(clip_range=0.02, by_step=True, num_steps=6)
    for idx in torch.tensor_split(torch.arange(len(kl)), 7):  # uneven micro-batches
        part = {k: v[idx] for k, v in b.items()}
        metric.update(part.pop("log_prob"), part.pop("old_log_prob"), part.pop("advantages"), **part)
    out = metric.compute()
    d = (b["log_prob"] - b["old_log_prob"]).double().numpy()
    ok = np.isfinite(d)  # the two non-finite log-probs are excluded here too
    assert (~ok).sum() == 2
    # fp32 KL of 18 elements: a few ulps relative
    rtol = 1e-6
    np.testing.assert_allclose(float(out["kl_new_old_mean"]), kl[ok].mean(), rtol=rtol)
    np.testing.assert_allclose(float(out["kl_new_old_max"]), kl[ok].max(), rtol=rtol)
    steps = b["step"].numpy()
    for j in range(6):
        at = ok & (steps == j)
        np.testing.assert_allclose(float(out[f"by_step/kl_new_old_mean/step_{j}"]), kl[at].mean(), rtol=rtol)
        np.testing.assert_allclose(float(out[f"by_step/kl_new_old_max/step_{j}"]), kl[at].max(), rtol=rtol)
    assert float(out["by_step/kl_new_old_mean/step_5"]) > 10 * float(out["by_step/kl_new_old_mean/step_0"])
    assert {"actor/kl_new_old_mean", "actor_by_step/kl_new_old_max/step_2"} <= set(metric.compute_prefixed())


def test_step_kl_is_absent_without_means_and_split_invariant() -> None:
    b, _ = _step_kl_case()
    without = PolicyRatioStats(clip_range=0.02)
    _update(without, b, use_ratio=False)
    assert not any("kl_new_old" in k for k in without.compute())
    whole, parts = PolicyRatioStats(clip_range=0.02), PolicyRatioStats(clip_range=0.02)
    whole.update(b["log_prob"], b["old_log_prob"], b["advantages"], step_kl=b["step_kl"])
    for idx in torch.tensor_split(torch.randperm(len(b["step_kl"])), 5):
        parts.update(
            b["log_prob"][idx], b["old_log_prob"][idx], b["advantages"][idx], step_kl=b["step_kl"][idx]
        )
    a, c = whole.compute(), parts.compute()
    assert float(a["kl_new_old_max"]) == float(c["kl_new_old_max"])
    assert float(a["kl_new_old_mean"]) == pytest.approx(float(c["kl_new_old_mean"]), rel=1e-12)


def _dppo_tokens() -> tuple[dict[str, Tensor], dict[str, np.ndarray]]:
    """Tokens with Flow-DPPO's mask from :func:`flow_dppo_loss`, δ at the median step KL."""
    from lit_flowgrpo.algorithms import flow_dppo_loss, gaussian_step_kl

    b, _ = _step_kl_case()
    del b["ratio"]
    n = len(b["step"])
    gen = torch.Generator().manual_seed(11)
    s = (b["std_dev_t"] * b["sqrt_dt"]).unsqueeze(1)
    mu_old = torch.randn(n, 4, generator=gen)
    mu = mu_old + 1e-2 * s * torch.randn(n, 4, generator=gen)
    threshold = float(gaussian_step_kl(mu, mu_old, b["std_dev_t"], b["sqrt_dt"]).median())
    finite = torch.isfinite(b["log_prob"])
    _, stats = flow_dppo_loss(
        torch.where(finite, b["log_prob"], b["old_log_prob"]),
        b["old_log_prob"],
        b["advantages"],
        mu,
        mu_old,
        b["std_dev_t"],
        b["sqrt_dt"],
        kl_mask_threshold=threshold,
    )
    masks = {"high_kl": stats.high_kl, "pos_rm": stats.clip_active_high, "neg_rm": stats.clip_active_low}
    b.update(masks)
    return b, {k: v.numpy() for k, v in masks.items()}


def test_flow_dppo_stats_count_the_mask_exactly() -> None:
    from lit_flowgrpo.metrics import FlowDPPOStats

    b, m = _dppo_tokens()
    assert m["high_kl"].any() and m["pos_rm"].any() and m["neg_rm"].any()  # every branch is exercised
    whole = FlowDPPOStats(clip_range=0.02, by_step=True, num_steps=6)
    parts = FlowDPPOStats(clip_range=0.02, by_step=True, num_steps=6)
    for metric, splits in ((whole, 1), (parts, 4)):
        for idx in torch.tensor_split(torch.randperm(len(b["step"])), splits):
            part = {k: v[idx] for k, v in b.items()}
            metric.update(part.pop("log_prob"), part.pop("old_log_prob"), part.pop("advantages"), **part)
    out, split = whole.compute(), parts.compute()
    want = {
        "kl_mask_fraction": m["high_kl"].mean(),
        "pos_rm_fraction": m["pos_rm"].mean(),
        "neg_rm_fraction": m["neg_rm"].mean(),
        "masked_fraction": (m["pos_rm"] | m["neg_rm"]).mean(),
    }
    steps = b["step"].numpy()
    for j in range(6):
        at = steps == j
        want[f"by_step/masked_fraction/step_{j}"] = (m["pos_rm"] | m["neg_rm"])[at].mean()
    for key, value in want.items():
        assert float(out[key]) == pytest.approx(value, abs=1e-15), key
        assert float(split[key]) == pytest.approx(value, abs=1e-15), key
    # no clip acts in Flow-DPPO: the clip counters are left out, the ratio's spread stays
    assert not any("clip_ratio" in k for k in out) and "pg_clipfrac" in out and "kl_new_old_mean" in out
    with pytest.raises(ValueError, match="needs high_kl, pos_rm and neg_rm"):
        whole.update(b["log_prob"], b["old_log_prob"], b["advantages"], step=b["step"])
