"""Advantages, the Flow-GRPO and GRPO-Guard losses and the KL against independent references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.distributions import Normal, kl_divergence

from lit_flowgrpo.algorithms import (
    flow_grpo_loss,
    group_advantages,
    grpo_guard_loss,
    kl_to_reference,
    ratio_norm_loss,
)
from lit_flowgrpo.objective import GRPOGuardRatioNorm, ScoredStep, build_objective
from lit_flowgrpo.sde import sde_step_with_logprob

# ----------------------------------------------------------------------------------------------
# Advantages
# ----------------------------------------------------------------------------------------------


def _numpy_advantages(rewards: np.ndarray, ids: np.ndarray, std: str, eps: float = 1e-4) -> np.ndarray:
    """A loop over groups in float64, as Flow-GRPO's PerPromptStatTracker computes it."""
    out = np.zeros_like(rewards, dtype=np.float64)
    for g in np.unique(ids):
        member = ids == g
        r = rewards[member]
        scale = np.std(rewards) if std == "global" else np.std(r)
        out[member] = (r - r.mean()) / (scale + eps)
    return out


@pytest.mark.parametrize("std", ["global", "group"])
def test_group_advantages_match_numpy(std: str) -> None:
    rng = np.random.default_rng(0)
    ids = np.array([7, 7, 7, 7, 100, 100, 100, 100, -3, 42, 42, 5, 5, 5])  # -3: a group of one
    rewards = rng.normal(size=ids.shape)
    rewards[11:14] = 0.25  # a tied group
    got = group_advantages(torch.tensor(rewards, dtype=torch.float32), torch.tensor(ids), std=std)
    expected = _numpy_advantages(rewards.astype(np.float32).astype(np.float64), ids, std)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-6)
    assert got[8] == 0  # group of one
    assert torch.equal(got[11:14], torch.zeros(3))  # ties


def test_group_advantages_all_equal_rewards_are_zero() -> None:
    got = group_advantages(torch.full((6,), 3.0), torch.tensor([0, 0, 0, 1, 1, 1]), std="global")
    assert torch.equal(got, torch.zeros(6))


def test_group_advantages_known_numbers() -> None:
    # Group 0: rewards 1, 3 → mean 2, population std 1 → ±1/(1+eps).
    got = group_advantages(torch.tensor([1.0, 3.0]), torch.tensor([0, 0]), std="group", eps=0.0)
    assert torch.equal(got, torch.tensor([-1.0, 1.0]))


@pytest.mark.parametrize(
    ("rewards", "ids", "kwargs", "match"),
    [
        (torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]), {}, "rewards contain NaN"),
        (torch.tensor([1.0, float("inf")]), torch.tensor([0, 0]), {}, "rewards contain NaN"),
        (torch.tensor([1.0, 2.0]), torch.tensor([0, 0, 1]), {}, "group_ids"),
        (torch.tensor([1.0, 2.0]), torch.tensor([0.0, 1.0]), {}, "group_ids must be an integer"),
        (torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long), {}, "rewards must be 1-D"),
        (torch.tensor([1.0, 2.0]), torch.tensor([0, 0]), {"std": "batch"}, "std"),
        (torch.tensor([1.0, 2.0]), torch.tensor([0, 0]), {"eps": -1.0}, "eps"),
    ],
)
def test_group_advantages_bad_input(rewards, ids, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, ids, **kwargs)


# ----------------------------------------------------------------------------------------------
# Flow-GRPO loss
# ----------------------------------------------------------------------------------------------


def test_flow_grpo_loss_matches_manual_numbers() -> None:
    log_prob = torch.tensor([0.0, 0.3, -0.3, 0.01, -0.01, 7.0])
    old = torch.zeros(6)
    adv = torch.tensor([1.0, 2.0, -1.0, -2.0, 1.0, 9.0])
    eps, eps_high = 0.1, 0.2
    loss, stats = flow_grpo_loss(
        log_prob, old, adv, clip_range=eps, clip_range_high=eps_high, adv_clip_max=5.0
    )
    r = np.exp(log_prob.double().numpy())
    a = np.clip(adv.double().numpy(), -5, 5)
    per = np.maximum(-a * r, -a * np.clip(r, 1 - eps, 1 + eps_high))
    np.testing.assert_allclose(stats.pg_loss.numpy(), per, rtol=1e-6)
    assert loss.item() == pytest.approx(per.mean(), rel=1e-6)
    assert stats.advantages[-1] == 5.0
    assert stats.outside_high.tolist() == [False, True, False, False, False, True]
    assert stats.outside_low.tolist() == [False, False, True, False, False, False]
    assert stats.clip_active_high.tolist() == [False, True, False, False, False, True]
    assert stats.clip_active_low.tolist() == [False, False, True, False, False, False]
    assert torch.equal(stats.log_ratio, stats.raw_log_ratio)


def _log_of_exact(target: float) -> torch.Tensor:
    """An fp32 log-ratio whose fp32 exp is exactly ``target`` (rounded to fp32)."""
    goal = torch.tensor(target, dtype=torch.float32)
    x = torch.log(goal)
    for _ in range(64):
        y = torch.exp(x)
        if y == goal:
            return x
        x = torch.nextafter(x, torch.tensor(float("inf")) if y < goal else torch.tensor(float("-inf")))
    raise AssertionError(f"no fp32 log maps exactly onto {target}")


def test_clip_masks_are_exact_at_the_boundaries() -> None:
    eps = 1e-4
    at_high, at_low = _log_of_exact(1 + eps), _log_of_exact(1 - eps)
    # One fp32 step of exp (≈1.2e-7) beyond each bound is outside it.
    log_prob = torch.stack([at_high, at_low, at_high + 2e-7, at_low - 2e-7])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    _, stats = flow_grpo_loss(log_prob, torch.zeros(4), adv, clip_range=eps)
    assert stats.ratio[0] == torch.tensor(1 + eps, dtype=torch.float32)
    assert stats.ratio[1] == torch.tensor(1 - eps, dtype=torch.float32)
    assert stats.ratio[2] > stats.ratio[0] and stats.ratio[3] < stats.ratio[1]
    assert stats.outside_high.tolist() == [False, False, True, False]
    assert stats.outside_low.tolist() == [False, False, False, True]
    assert stats.clip_active_high.tolist() == [False, False, True, False]
    assert stats.clip_active_low.tolist() == [False, False, False, True]


def test_one_gradient_step_moves_log_probs_with_the_advantage_sign() -> None:
    """Toy Gaussian policy: the velocity itself is the parameter, one row per sample."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=gen)
    theta = torch.nn.Parameter(torch.randn(6, 16, generator=gen))
    with torch.no_grad():
        rollout = sde_step_with_logprob(theta, x, 0.8, 0.7, generator=gen)
    adv = torch.tensor([1.0, -1.0, 2.0, -0.5, 0.7, -3.0])

    def log_prob() -> torch.Tensor:
        return sde_step_with_logprob(theta, x, 0.8, 0.7, prev_sample=rollout.prev_sample).log_prob

    before = log_prob().detach()
    loss, _ = flow_grpo_loss(log_prob(), rollout.log_prob, adv, clip_range=1e-4)
    loss.backward()
    with torch.no_grad():
        theta -= 1e-3 * theta.grad
    after = log_prob().detach()
    assert torch.equal(before, rollout.log_prob)  # on-policy before the step
    assert ((after - before).sign() == adv.sign()).all()


# ----------------------------------------------------------------------------------------------
# GRPO-Guard
# ----------------------------------------------------------------------------------------------


def test_grpo_guard_loss_matches_verl_omni_formula() -> None:
    gen = torch.Generator().manual_seed(1)
    n = 5
    mu = torch.randn(n, 2, 3, generator=gen)
    mu_old = mu + 0.01 * torch.randn(n, 2, 3, generator=gen)
    log_prob, old = 0.05 * torch.randn(n, generator=gen), 0.05 * torch.randn(n, generator=gen)
    adv = torch.tensor([1.0, -2.0, 0.5, 6.0, -0.1])
    std_dev_t = torch.full((n,), 1.3)
    sqrt_dt = torch.full((n,), 0.2)
    eps = 1e-3
    loss, stats = grpo_guard_loss(
        log_prob, old, adv, mu, mu_old, std_dev_t, sqrt_dt, clip_range=eps, adv_clip_max=5.0
    )
    # Written out in float64 from verl-omni's GRPOGuardLoss.
    s = 1.3 * 0.2
    b = ((mu.double() - mu_old.double()) ** 2).mean(dim=(1, 2)) / (2 * s**2)
    r = torch.exp((log_prob.double() - old.double() + b) * s)
    a = adv.double().clamp(-5, 5)
    per = torch.maximum(-a * r, -a * r.clamp(1 - eps, 1 + eps))
    torch.testing.assert_close(stats.ratio.double(), r, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(stats.pg_loss.double(), per, rtol=1e-5, atol=1e-7)
    assert loss.item() == pytest.approx((per.mean() / 0.2**2).item(), rel=1e-5)
    torch.testing.assert_close(stats.raw_log_ratio, log_prob - old)


def test_grpo_guard_log_ratio_identity() -> None:
    """The Guard log-ratio of x_next = μ_old + s·ε is exactly mean(ε·(μ_θ − μ_old)).

    Derivation. One SDE step has the same transition std s = std_dev_t·sqrt_dt under θ and under
    the rollout policy (s depends only on σ, σ_next, η), and log p is the mean over the D elements
    of log N(x; μ, s²). With x = μ_old + s·ε the normalising constants cancel and

        log p_θ − log p_old = mean[−(x − μ_θ)² + (x − μ_old)²] / (2s²)
                            = mean[−(s·ε − Δ)² + s²·ε²] / (2s²),   Δ = μ_θ − μ_old
                            = mean[2s·ε·Δ − Δ²] / (2s²)
                            = mean(ε·Δ)/s − mean(Δ²)/(2s²).

    The RatioNorm bias b = mean(Δ²)/(2s²) cancels the second term, and scaling by s gives

        (log p_θ − log p_old + b)·s = mean(ε·Δ),

    which is ``PolicyStats.log_ratio`` of :func:`grpo_guard_loss`.
    """
    gen = torch.Generator().manual_seed(2)
    b, shape = 4, (4, 3, 8, 8)
    x = torch.randn(shape, generator=gen)
    v_old = torch.randn(shape, generator=gen)
    v_new = v_old + 0.5 * torch.randn(shape, generator=gen)
    old = sde_step_with_logprob(v_old, x, 0.7, 0.6, generator=gen)
    new = sde_step_with_logprob(v_new, x, 0.7, 0.6, prev_sample=old.prev_sample)
    s = (old.std_dev_t * old.sqrt_dt)[:, None, None, None]
    eps = (old.prev_sample - old.prev_sample_mean) / s
    _, stats = grpo_guard_loss(
        new.log_prob,
        old.log_prob,
        torch.ones(b),
        new.prev_sample_mean,
        old.prev_sample_mean,
        new.std_dev_t,
        new.sqrt_dt,
        clip_range=0.999,
    )
    expected = (eps.double() * (new.prev_sample_mean.double() - old.prev_sample_mean.double())).mean(
        dim=(1, 2, 3)
    )
    torch.testing.assert_close(stats.log_ratio.double(), expected, rtol=1e-4, atol=1e-7)
    assert expected.abs().min() > 1e-4  # the identity is tested on values well away from 0


# ----------------------------------------------------------------------------------------------
# KL to the reference
# ----------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------
# GRPO-Guard, the blog's form (RatioNorm over the batch, 1/r̂ step weights)
# ----------------------------------------------------------------------------------------------


def _numpy_ratio_norm(log_prob, old, adv, eps, target):
    """The blog form written out in float64: r̂, the per-sample loss and d loss / d log_prob."""
    r = np.exp(log_prob - old)
    k = min(1.0, target / r.std()) if r.std() > 0 else 1.0
    r_hat = 1.0 + (r - r.mean()) * k
    a = np.clip(adv, -5.0, 5.0)
    per = np.maximum(-a * r_hat, -a * np.clip(r_hat, 1 - eps, 1 + eps)) / r_hat
    clipped = ((a > 0) & (r_hat > 1 + eps)) | ((a < 0) & (r_hat < 1 - eps))
    # loss = mean(per); the unclipped term's gradient through r̂ = 1 + (r − μ̄)k with μ̄, k and
    # the weight 1/r̂ held constant: d/d log_prob = −a·k·r/r̂ / N.
    grad = np.where(clipped, 0.0, -a * k * r / r_hat) / len(r)
    return r_hat, per, grad


@pytest.mark.parametrize("spread", [0.05, 1e-5])  # wider than the target (shrunk), narrower (re-centred only)
def test_ratio_norm_loss_matches_numpy(spread: float) -> None:
    rng = np.random.default_rng(3)
    n, eps, target = 16, 1e-3, 5e-4
    old = rng.normal(size=n)
    log_prob = old + spread * rng.normal(size=n) - 3 * spread  # off-policy, centred below 0 like Flow-GRPO's
    adv = rng.normal(size=n) * 2
    x = torch.tensor(log_prob, dtype=torch.float64, requires_grad=True)
    loss, stats = ratio_norm_loss(x, torch.tensor(old), torch.tensor(adv), clip_range=eps, target_std=target)
    loss.backward()
    r_hat, per, grad = _numpy_ratio_norm(log_prob, old, adv, eps, target)
    np.testing.assert_allclose(stats.ratio.numpy(), r_hat, rtol=0, atol=1e-12)
    np.testing.assert_allclose(stats.pg_loss.numpy(), per, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(x.grad.numpy(), grad, rtol=1e-10, atol=1e-15)
    assert stats.ratio.mean().item() == pytest.approx(1.0, abs=1e-12)  # re-centred on 1
    expected_std = target if spread == 0.05 else np.exp(log_prob - old).std()
    assert stats.ratio.std(correction=0).item() == pytest.approx(expected_std, rel=1e-9)
    torch.testing.assert_close(stats.raw_log_ratio, torch.tensor(log_prob - old))
    if spread == 0.05:
        # Flow-GRPO's raw ratios all sit below 1 − ε here; normalised, the clip (ε = 2·target) catches
        # exactly the samples more than two standard deviations out, on either side.
        _, raw_stats = flow_grpo_loss(
            torch.tensor(log_prob), torch.tensor(old), torch.tensor(adv), clip_range=eps
        )
        assert bool(raw_stats.outside_low.all()) and not bool(raw_stats.outside_high.any())
        r = np.exp(log_prob - old)
        z = (r - r.mean()) / r.std()
        np.testing.assert_array_equal(stats.outside_high.numpy(), z > 2)
        np.testing.assert_array_equal(stats.outside_low.numpy(), z < -2)


def test_ratio_norm_loss_on_policy_is_flow_grpo() -> None:
    """On-policy every ratio is 1: no normalisation, weights 1, the same loss and gradient as
    Flow-GRPO's (so the blog form differs only where the update is off-policy)."""
    gen = torch.Generator().manual_seed(4)
    log_prob = torch.randn(8, generator=gen, dtype=torch.float64)
    adv = torch.randn(8, generator=gen, dtype=torch.float64)
    grads, losses = [], []
    for fn, kw in ((ratio_norm_loss, {"target_std": 5e-5}), (flow_grpo_loss, {})):
        x = log_prob.clone().requires_grad_(True)
        loss, _ = fn(x, log_prob, adv, clip_range=1e-4, **kw)
        loss.backward()
        grads.append(x.grad)
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    assert torch.equal(grads[0], grads[1])


def test_ratio_norm_objective_settings_and_problems() -> None:
    objective = build_objective("grpo_guard_ratio_norm", clip_range=1e-3)
    assert isinstance(objective, GRPOGuardRatioNorm)
    assert objective.resolved_target_std == 5e-4
    assert objective.settings()["target_std"] is None
    assert objective.problems("cps") == []  # needs no μ_old, any step type
    assert "target_std (0.5)" in " ".join(GRPOGuardRatioNorm(target_std=0.5).problems("sde"))
    scored = ScoredStep(
        log_prob=torch.zeros(3),
        old_log_prob=torch.zeros(3),
        advantages=torch.tensor([1.0, -1.0, 0.0]),
        prev_sample_mean=torch.zeros(3, 2),
        old_prev_sample_mean=None,
        std_dev_t=torch.ones(3),
        sqrt_dt=torch.ones(3),
    )
    loss, stats = objective.policy_loss(scored)
    assert loss.item() == 0.0 and torch.equal(stats.ratio, torch.ones(3))
    with pytest.raises(ValueError, match="target_std"):
        ratio_norm_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), clip_range=1e-3, target_std=0.0)


def test_kl_to_reference_matches_gaussian_kl() -> None:
    gen = torch.Generator().manual_seed(3)
    mu = torch.randn(3, 2, 4, generator=gen)
    mu_ref = torch.randn(3, 2, 4, generator=gen)
    std = torch.tensor([0.5, 1.0, 2.0])
    sqrt_dt = torch.tensor([0.1, 0.3, 0.2])
    code_form = kl_to_reference(mu, mu_ref, std)
    manual = ((mu - mu_ref) ** 2).mean(dim=(1, 2)) / (2 * std**2)
    torch.testing.assert_close(code_form, manual)
    # The paper's form is the closed-form KL of the two per-element Gaussians, averaged.
    scale = (std * sqrt_dt)[:, None, None].expand_as(mu)
    exact = kl_divergence(Normal(mu.double(), scale.double()), Normal(mu_ref.double(), scale.double()))
    torch.testing.assert_close(
        kl_to_reference(mu, mu_ref, std, sqrt_dt=sqrt_dt).double(), exact.mean(dim=(1, 2)), rtol=1e-5, atol=0
    )
    assert torch.equal(kl_to_reference(mu, mu, std), torch.zeros(3))


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"old_log_prob": torch.zeros(3)}, "old_log_prob"),
        ({"advantages": torch.zeros(2, 1)}, "advantages"),
        ({"log_prob": torch.zeros(2, 2)}, "log_prob must be 1-D"),
        ({"clip_range": -1e-4}, "clip_range"),
        ({"clip_range_high": -1.0}, "clip_range_high"),
        ({"adv_clip_max": 0.0}, "adv_clip_max"),
    ],
)
def test_flow_grpo_loss_bad_input(kwargs: dict, match: str) -> None:
    args = {"log_prob": torch.zeros(2), "old_log_prob": torch.zeros(2), "advantages": torch.zeros(2)}
    args.update(kwargs)
    clip = args.pop("clip_range", 1e-4)
    with pytest.raises(ValueError, match=match):
        flow_grpo_loss(
            args.pop("log_prob"), args.pop("old_log_prob"), args.pop("advantages"), clip_range=clip, **args
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"old_prev_sample_mean": torch.zeros(2, 5)}, "prev_sample_mean"),
        (
            {"prev_sample_mean": torch.zeros(3, 4), "old_prev_sample_mean": torch.zeros(3, 4)},
            "prev_sample_mean",
        ),
        ({"std_dev_t": torch.ones(3)}, "std_dev_t"),
        ({"sqrt_dt": torch.ones(2, 2)}, "sqrt_dt"),
        ({"clip_range": -1.0}, "clip_range"),
        ({"adv_clip_max": -1.0}, "adv_clip_max"),
    ],
)
def test_grpo_guard_loss_bad_input(kwargs: dict, match: str) -> None:
    args = {
        "prev_sample_mean": torch.zeros(2, 4),
        "old_prev_sample_mean": torch.zeros(2, 4),
        "std_dev_t": torch.ones(2),
        "sqrt_dt": torch.ones(2),
        "clip_range": 1e-4,
        "adv_clip_max": 5.0,
    }
    args.update(kwargs)
    tensors = [args.pop(k) for k in ("prev_sample_mean", "old_prev_sample_mean", "std_dev_t", "sqrt_dt")]
    with pytest.raises(ValueError, match=match):
        grpo_guard_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), *tensors, **args)


def test_kl_bad_input() -> None:
    with pytest.raises(ValueError, match="ref_prev_sample_mean"):
        kl_to_reference(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2))
    with pytest.raises(ValueError, match="std_dev_t"):
        kl_to_reference(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3))
    with pytest.raises(ValueError, match="sqrt_dt"):
        kl_to_reference(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), sqrt_dt=torch.ones(5))
