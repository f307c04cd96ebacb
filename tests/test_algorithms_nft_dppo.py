"""Flow-DPPO and DiffusionNFT against float64 re-derivations written here from the formulas.

Tolerances. Where a comparison uses inputs on a dyadic grid (k·2⁻⁶ with small k, σ and β powers of
two or few-bit fractions), every fp32 addition, subtraction and multiplication of the elementwise
math is exact, so only the reductions and divisions round: a mean over D non-negative terms (pairwise
summation, at most ⌈log2 D⌉ + 1 roundings relative to the result), a division (1) and an exp (≤ 2 ulp).
The tolerance is that count times fp32's epsilon, with a factor 2 for margin.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.distributions import Normal, kl_divergence

from lit_flowgrpo.algorithms import (
    NFT_DECAY_SCHEDULES,
    DPPOStats,
    flow_dppo_loss,
    gaussian_step_kl,
    nft_loss,
    nft_old_policy_decay,
    nft_reward_probability,
    nft_sample_times,
)
from lit_flowgrpo.sde import sd3_sigmas

EPS32 = float(np.finfo(np.float32).eps)


def _grid(gen: torch.Generator, shape: tuple[int, ...], bits: int = 6, top: int = 64) -> torch.Tensor:
    """fp32 values k·2⁻ᵇⁱᵗˢ with |k| ≤ top: sums, differences and small products of them are exact."""
    k = torch.randint(-top, top + 1, shape, generator=gen)
    return k.float() / 2**bits


def _reduction_rtol(elements: int, extra_ops: int = 4) -> float:
    """fp32 relative error bound of a mean of ``elements`` non-negative terms plus ``extra_ops``
    roundings (divisions, exp), doubled for margin."""
    return 2 * (math.ceil(math.log2(max(elements, 2))) + 1 + extra_ops) * EPS32


# ----------------------------------------------------------------------------------------------
# Flow-DPPO: the step KL
# ----------------------------------------------------------------------------------------------


def test_gaussian_step_kl_is_the_closed_form_kl_over_the_element_count() -> None:
    """D·KL_mean equals the summed KL of the per-element Gaussians N(μ, s²) (the paper's Eq. 14 form)."""
    gen = torch.Generator().manual_seed(0)
    shape = (5, 3, 4, 4)
    d = 3 * 4 * 4
    mu_old = _grid(gen, shape)
    mu = _grid(gen, shape)
    std = torch.tensor([0.5, 0.75, 1.0, 1.25, 1.5])
    sqrt_dt = torch.tensor([0.25, 0.5, 0.125, 1.0, 0.375])
    s = (std * sqrt_dt).double().view(-1, 1, 1, 1).expand(shape)
    exact = kl_divergence(Normal(mu_old.double(), s), Normal(mu.double(), s)).sum(dim=(1, 2, 3))  # (B,) f64
    got = gaussian_step_kl(mu, mu_old, std, sqrt_dt)
    assert got.dtype == torch.float32 and got.shape == (5,)
    torch.testing.assert_close(got.double() * d, exact, rtol=_reduction_rtol(d), atol=0.0)
    # Symmetric for equal variances, and the Flow-GRPO-code form without sqrt_dt.
    torch.testing.assert_close(gaussian_step_kl(mu_old, mu, std, sqrt_dt), got, rtol=0.0, atol=0.0)
    no_dt = ((mu.double() - mu_old.double()) ** 2).mean(dim=(1, 2, 3)) / (2 * std.double() ** 2)
    torch.testing.assert_close(
        gaussian_step_kl(mu, mu_old, std).double(), no_dt, rtol=_reduction_rtol(d), atol=0.0
    )


def test_gaussian_step_kl_on_policy_is_zero() -> None:
    mu = torch.randn(3, 2, 5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(gaussian_step_kl(mu, mu.clone(), 0.7, 0.3), torch.zeros(3))


# ----------------------------------------------------------------------------------------------
# Flow-DPPO: the loss
# ----------------------------------------------------------------------------------------------


def _numpy_dppo(log_prob, old, adv, mu, mu_old, std, sqrt_dt, threshold, adv_clip_max=5.0):
    """Flow-DPPO in float64 from the paper's Eq. 18 and the reference code's reductions."""
    lp, lo = log_prob.double().numpy(), old.double().numpy()
    a = np.clip(adv.double().numpy(), -adv_clip_max, adv_clip_max)
    diff = mu.double().numpy() - mu_old.double().numpy()
    s = std.double().numpy() * sqrt_dt.double().numpy()
    kl = (diff.reshape(len(lp), -1) ** 2).mean(axis=1) / (2 * s**2)
    r = np.exp(lp - lo)
    drop = (kl >= threshold) & (((r > 1) & (a > 0)) | ((r < 1) & (a < 0)))
    per = np.where(drop, 0.0, -a * r)
    return per.mean(), per, kl, drop, r, a


def _dppo_case():
    """Eight samples: step KLs ~0.1·δ or ~10·δ alternately, ratios on both sides of 1."""
    gen = torch.Generator().manual_seed(2)
    n, shape = 8, (8, 4, 6, 6)
    threshold = 1e-3
    std = torch.tensor([0.5, 0.75, 1.0, 1.25, 0.5, 0.75, 1.0, 1.25])
    sqrt_dt = torch.full((n,), 0.25)
    mu_old = _grid(gen, shape)
    # μ_θ − μ_old ≈ c·s·z on the grid, so KL ≈ c²/2 with c² = 2·δ·{0.1, 10}.
    scale = torch.tensor([0.1, 10.0] * 4).mul(2 * threshold).sqrt() * std * sqrt_dt
    step = torch.round(scale.view(-1, 1, 1, 1) * torch.randn(shape, generator=gen) * 2**12) / 2**12
    mu = mu_old + step
    log_prob = torch.tensor([0.02, -0.03, -0.01, 0.04, 0.05, 0.01, -0.02, -0.06])
    old = torch.zeros(n)
    adv = torch.tensor([1.5, -2.0, 0.75, -0.25, 3.0, 1.0, 6.0, -0.5])
    return log_prob, old, adv, mu, mu_old, std, sqrt_dt, threshold


def test_flow_dppo_loss_matches_float64_rederivation() -> None:
    log_prob, old, adv, mu, mu_old, std, sqrt_dt, threshold = _dppo_case()
    log_prob.requires_grad_(True)
    loss, stats = flow_dppo_loss(
        log_prob, old, adv, mu, mu_old, std, sqrt_dt, kl_mask_threshold=threshold, adv_clip_max=5.0
    )
    ref_loss, per, kl, drop, r, a = _numpy_dppo(
        log_prob.detach(), old, adv, mu, mu_old, std, sqrt_dt, threshold
    )
    high = kl >= threshold
    # The case exercises every branch: low KL kept, high KL dropped both ways, high KL corrective kept.
    assert (~high).any() and (drop & (a > 0)).any() and (drop & (a < 0)).any() and (high & ~drop).any()
    assert np.all(np.abs(kl / threshold - 1) > 0.5)  # every mask decision is far from the boundary

    assert isinstance(stats, DPPOStats)
    np.testing.assert_allclose(stats.step_kl.double().numpy(), kl, rtol=_reduction_rtol(4 * 6 * 6), atol=0)
    np.testing.assert_array_equal(stats.high_kl.numpy(), high)
    np.testing.assert_array_equal((stats.clip_active_high | stats.clip_active_low).numpy(), drop)
    np.testing.assert_array_equal(stats.clip_active_high.numpy(), drop & (a > 0))
    np.testing.assert_array_equal(stats.outside_high.numpy(), high & (r > 1))
    np.testing.assert_array_equal(stats.outside_low.numpy(), high & (r < 1))
    np.testing.assert_allclose(stats.ratio.double().numpy(), r, rtol=4 * EPS32, atol=0)
    assert torch.equal(stats.log_ratio, stats.raw_log_ratio)
    assert stats.advantages[6] == 5.0  # clipped
    # −A·r: one product and an exp per term (≤ 4 ulp), then a mean of 8 mixed-sign terms.
    scale = np.abs(a * r)
    np.testing.assert_allclose(
        stats.pg_loss.double().numpy(), per, rtol=0, atol=float(8 * EPS32 * scale.max())
    )
    assert abs(loss.item() - ref_loss) <= 16 * EPS32 * scale.mean()

    # The gradient: ∂loss/∂log p_θ,i = −A_i·r_i·keep_i / N (the KL is a mask, not a penalty).
    (grad,) = torch.autograd.grad(loss, log_prob)
    expected = np.where(drop, 0.0, -a * r) / len(r)
    np.testing.assert_allclose(
        grad.double().numpy(), expected, rtol=0, atol=float(8 * EPS32 * scale.max() / len(r))
    )
    assert torch.equal(grad[torch.from_numpy(drop)], torch.zeros(int(drop.sum())))


def test_flow_dppo_sends_no_gradient_through_the_means() -> None:
    log_prob, old, adv, mu, mu_old, std, sqrt_dt, threshold = _dppo_case()
    mu = mu.clone().requires_grad_(True)
    log_prob.requires_grad_(True)
    loss, _ = flow_dppo_loss(log_prob, old, adv, mu, mu_old, std, sqrt_dt, kl_mask_threshold=threshold)
    grad_lp, grad_mu = torch.autograd.grad(loss, (log_prob, mu), allow_unused=True)
    assert grad_mu is None and grad_lp is not None


def test_flow_dppo_on_policy_is_the_plain_policy_gradient() -> None:
    gen = torch.Generator().manual_seed(3)
    mu = torch.randn(6, 2, 3, 3, generator=gen)
    log_prob = torch.randn(6, generator=gen).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 2.0, -0.5, 0.0, 3.0])
    loss, stats = flow_dppo_loss(
        log_prob, log_prob.detach(), adv, mu, mu.clone(), 0.8, 0.3, kl_mask_threshold=0.0
    )
    assert torch.equal(stats.step_kl, torch.zeros(6))
    assert torch.equal(stats.ratio, torch.ones(6))
    # δ = 0 makes every step "high KL", yet ratio = 1 exactly is neither above nor below 1: all kept.
    assert stats.high_kl.all() and not (stats.clip_active_high | stats.clip_active_low).any()
    assert loss.item() == pytest.approx(-adv.double().mean().item(), abs=4 * EPS32)
    (grad,) = torch.autograd.grad(loss, log_prob)
    torch.testing.assert_close(grad, -adv / 6, rtol=2 * EPS32, atol=0.0)


def _high_kl_case(sign: float, ratio_above_one: bool):
    """Four samples far outside a δ = 1e-3 trust region, one advantage sign, one ratio side."""
    mu_old = torch.zeros(4, 2, 2)
    mu = torch.full((4, 2, 2), 0.5)  # KL = 0.25 / (2·0.25²) = 2 with std 1, sqrt_dt 0.25
    step = 0.01 if ratio_above_one else -0.01
    log_prob = torch.full((4,), step).requires_grad_(True)
    adv = sign * torch.tensor([0.5, 1.0, 2.0, 4.0])
    return log_prob, torch.zeros(4), adv, mu, mu_old


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_flow_dppo_all_one_sign_groups(sign: float) -> None:
    """An all-positive (all-negative) group pushed further out is dropped whole; pulled back, kept whole."""
    aggressive = sign > 0  # A > 0 with ratio > 1, or A < 0 with ratio < 1
    log_prob, old, adv, mu, mu_old = _high_kl_case(sign, ratio_above_one=aggressive)
    loss, stats = flow_dppo_loss(log_prob, old, adv, mu, mu_old, 1.0, 0.25, kl_mask_threshold=1e-3)
    assert torch.equal(stats.step_kl, torch.full((4,), 2.0))
    assert (stats.clip_active_high | stats.clip_active_low).all()
    assert loss.item() == 0.0
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert torch.equal(grad, torch.zeros(4))

    log_prob, old, adv, mu, mu_old = _high_kl_case(sign, ratio_above_one=not aggressive)
    loss, stats = flow_dppo_loss(log_prob, old, adv, mu, mu_old, 1.0, 0.25, kl_mask_threshold=1e-3)
    assert stats.high_kl.all() and not (stats.clip_active_high | stats.clip_active_low).any()
    r = math.exp(log_prob[0].item())
    expected = -(adv.double() * r).mean().item()
    assert loss.item() == pytest.approx(expected, rel=8 * EPS32)


def test_flow_dppo_zero_advantage_has_no_loss_and_no_gradient() -> None:
    log_prob, old, _, mu, mu_old = _high_kl_case(1.0, ratio_above_one=True)
    loss, stats = flow_dppo_loss(log_prob, old, torch.zeros(4), mu, mu_old, 1.0, 0.25, kl_mask_threshold=1e-3)
    assert loss.item() == 0.0 and not (stats.clip_active_high | stats.clip_active_low).any()
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert torch.equal(grad.abs(), torch.zeros(4))


def test_flow_dppo_kl_exactly_at_the_threshold_is_outside_the_trust_region() -> None:
    """KL ≥ δ is "high" (both references compare with ≥): KL = 0.5 exactly in fp32 here."""
    mu_old = torch.zeros(2, 3, 4)
    mu = torch.full((2, 3, 4), 0.5)  # Δμ² = 0.25, s² = (1·0.5)² = 0.25: KL = 0.25 / 0.5 = 0.5 exactly
    log_prob = torch.tensor([0.01, 0.01])
    adv = torch.tensor([1.0, 1.0])
    _, at = flow_dppo_loss(log_prob, torch.zeros(2), adv, mu, mu_old, 1.0, 0.5, kl_mask_threshold=0.5)
    assert torch.equal(at.step_kl, torch.full((2,), 0.5))
    assert at.high_kl.all() and at.clip_active_high.all()
    just_above = float(np.nextafter(np.float32(0.5), np.float32(1.0)))
    _, below = flow_dppo_loss(
        log_prob, torch.zeros(2), adv, mu, mu_old, 1.0, 0.5, kl_mask_threshold=just_above
    )
    assert not below.high_kl.any() and not below.clip_active_high.any()


def test_flow_dppo_dropped_overflowing_ratio_keeps_the_gradient_finite() -> None:
    log_prob = torch.tensor([100.0, 0.01]).requires_grad_(True)  # exp(100) overflows fp32
    mu_old = torch.zeros(2, 4)
    mu = torch.full((2, 4), 0.5)
    adv = torch.tensor([1.0, -1.0])
    loss, stats = flow_dppo_loss(log_prob, torch.zeros(2), adv, mu, mu_old, 1.0, 0.25, kl_mask_threshold=1e-3)
    assert torch.isinf(stats.ratio[0]) and stats.clip_active_high[0]
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and grad[0] == 0.0
    assert grad[1].item() == pytest.approx(math.exp(0.01) / 2, rel=4 * EPS32)  # −A·r/N with A = −1


def test_flow_dppo_without_the_kl_coefficient_uses_the_raw_mean_shift() -> None:
    log_prob, old, adv, mu, mu_old, std, sqrt_dt, _ = _dppo_case()
    _, stats = flow_dppo_loss(log_prob, old, adv, mu, mu_old, std, sqrt_dt, add_kl_coefficient=False)
    expected = ((mu.double() - mu_old.double()) ** 2).mean(dim=(1, 2, 3)) / 2
    torch.testing.assert_close(stats.step_kl.double(), expected, rtol=_reduction_rtol(4 * 6 * 6), atol=0.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kl_mask_threshold": -1.0}, "kl_mask_threshold"),
        ({"adv_clip_max": 0.0}, "adv_clip_max"),
    ],
)
def test_flow_dppo_bad_settings(kwargs, match) -> None:
    log_prob, old, adv, mu, mu_old, std, sqrt_dt, _ = _dppo_case()
    with pytest.raises(ValueError, match=match):
        flow_dppo_loss(log_prob, old, adv, mu, mu_old, std, sqrt_dt, **kwargs)


def test_flow_dppo_bad_shapes() -> None:
    log_prob, old, adv, mu, mu_old, std, sqrt_dt, _ = _dppo_case()
    with pytest.raises(ValueError, match="prev_sample_mean"):
        flow_dppo_loss(log_prob, old, adv, mu, mu_old[:, :2], std, sqrt_dt)
    with pytest.raises(ValueError, match="sqrt_dt"):
        flow_dppo_loss(log_prob, old, adv, mu, mu_old, std, torch.ones(3))
    with pytest.raises(ValueError, match="advantages"):
        flow_dppo_loss(log_prob, old, adv[:4], mu, mu_old, std, sqrt_dt)


# ----------------------------------------------------------------------------------------------
# DiffusionNFT: optimality probability
# ----------------------------------------------------------------------------------------------


def test_nft_reward_probability_is_the_papers_map() -> None:
    """r = 1/2 + 1/2·clip(A/M, −1, 1): the paper's form with Z_c = M·std."""
    adv = torch.tensor([-9.0, -5.0, -2.5, -0.1, 0.0, 0.3, 2.5, 5.0, 7.0])
    a = adv.double().numpy()
    expected = 0.5 + 0.5 * np.clip(a / 5.0, -1, 1)
    got = nft_reward_probability(adv, adv_clip_max=5.0)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.double().numpy(), expected, rtol=0, atol=2 * EPS32)
    assert got[4] == 0.5 and got[1] == 0.0 and got[7] == 1.0 and got[0] == 0.0 and got[-1] == 1.0


@pytest.mark.parametrize(
    ("mode", "fn"),
    [
        ("positive_only", lambda a: np.clip(a, 0, 5)),
        ("negative_only", lambda a: np.clip(a, -5, 0)),
        ("one_only", lambda a: (a > 0).astype(np.float64)),
        ("binary", np.sign),
    ],
)
def test_nft_reward_probability_ablation_modes(mode, fn) -> None:
    adv = torch.tensor([-7.0, -1.0, 0.0, 0.5, 9.0])
    expected = np.clip(fn(np.clip(adv.double().numpy(), -5, 5)) / 5.0 / 2 + 0.5, 0, 1)
    got = nft_reward_probability(adv, mode=mode)
    np.testing.assert_allclose(got.double().numpy(), expected, rtol=0, atol=2 * EPS32)


def test_nft_reward_probability_bad_input() -> None:
    with pytest.raises(ValueError, match="mode"):
        nft_reward_probability(torch.zeros(2), mode="all")
    with pytest.raises(ValueError, match="adv_clip_max"):
        nft_reward_probability(torch.zeros(2), adv_clip_max=0.0)
    with pytest.raises(ValueError, match="floating"):
        nft_reward_probability(torch.zeros(2, dtype=torch.long))


# ----------------------------------------------------------------------------------------------
# DiffusionNFT: the loss
# ----------------------------------------------------------------------------------------------


def _nft_case(beta: float = 0.5):
    gen = torch.Generator().manual_seed(4)
    shape = (6, 3, 5, 5)
    x0, noise, v_old, v_theta = (_grid(gen, shape) for _ in range(4))
    # σ = 2⁻²⁴ makes the floor of the adaptive weight bind; σ = 0 makes the whole loss 0.
    sigma = torch.tensor([1.0, 0.75, 0.5, 0.25, 2.0**-24, 0.0])
    r = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.875, 0.625])
    return v_theta, v_old, x0, noise, sigma, r, beta


def _float64_nft(v_theta, v_old, x0, noise, sigma, r, beta, m=5.0, floor=1e-5, adaptive=True):
    """DiffusionNFT's loss in float64, written as the paper's v± and the reference's x0 regression."""
    vt, vo, x, eps = (t.double() for t in (v_theta, v_old, x0, noise))
    t = sigma.double().view(-1, 1, 1, 1)
    xt = (1 - t) * x + t * eps
    target = eps - x
    v_pos = (1 - beta) * vo + beta * vt
    v_neg = (1 + beta) * vo - beta * vt
    dims = (1, 2, 3)
    parts = []
    for v in (v_pos, v_neg):
        x0_hat = xt - t * v
        sq = ((x0_hat - x) ** 2).mean(dim=dims)
        w = (x0_hat - x).abs().mean(dim=dims).clamp_min(floor) if adaptive else torch.ones_like(sq)
        parts.append((sq / w, w, v - target))
    (lp, wp, ep), (ln, wn, en) = parts
    rr = r.double()
    per = m * (rr * lp + (1 - rr) * ln) / beta
    return per.mean(), per, lp, ln, wp, wn, ep, en


@pytest.mark.parametrize("beta", [1.0, 0.5, 0.125])
def test_nft_loss_matches_float64_rederivation(beta: float) -> None:
    v_theta, v_old, x0, noise, sigma, r, beta = _nft_case(beta)
    loss, stats = nft_loss(v_theta, v_old, x0, noise, sigma, r, beta=beta, adv_clip_max=5.0)
    ref, per, lp, ln, _, _, ep, en = _float64_nft(v_theta, v_old, x0, noise, sigma, r, beta)
    d = 3 * 5 * 5
    # A mean of squares over D over a mean of absolutes over D, then a few products: all terms ≥ 0.
    rtol = _reduction_rtol(d, extra_ops=8)
    torch.testing.assert_close(stats.positive_loss.double(), lp, rtol=rtol, atol=0.0)
    torch.testing.assert_close(stats.negative_loss.double(), ln, rtol=rtol, atol=0.0)
    torch.testing.assert_close(stats.loss.double(), per, rtol=rtol, atol=0.0)
    # The batch mean of six non-negative per-sample losses adds its own reduction error.
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref.item()) <= (rtol + _reduction_rtol(6, 0)) * ref.item()
    torch.testing.assert_close(
        stats.positive_error.double(), (ep**2).mean(dim=(1, 2, 3)), rtol=rtol, atol=0.0
    )
    torch.testing.assert_close(
        stats.negative_error.double(), (en**2).mean(dim=(1, 2, 3)), rtol=rtol, atol=0.0
    )
    dev = ((v_theta.double() - v_old.double()) ** 2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(stats.old_deviation.double(), dev, rtol=rtol, atol=0.0)
    assert stats.loss[-1] == 0.0  # σ = 0: x_σ = x0, nothing to regress
    assert torch.equal(stats.r, r)


def test_nft_loss_without_adaptive_weight() -> None:
    v_theta, v_old, x0, noise, sigma, r, beta = _nft_case()
    loss, stats = nft_loss(v_theta, v_old, x0, noise, sigma, r, beta=beta, adaptive_weight=False)
    ref, per, *_ = _float64_nft(v_theta, v_old, x0, noise, sigma, r, beta, adaptive=False)
    torch.testing.assert_close(stats.loss.double(), per, rtol=_reduction_rtol(75, 8), atol=0.0)
    assert abs(loss.item() - ref.item()) <= (_reduction_rtol(75, 8) + _reduction_rtol(6, 0)) * ref.item()


def test_nft_gradient_is_the_closed_form() -> None:
    """∂loss/∂v_θ = (2·M·σ²/(B·D))·(r·e⁺/w⁺ − (1 − r)·e⁻/w⁻), e± = v± − v, w± the detached weights."""
    v_theta, v_old, x0, noise, sigma, r, beta = _nft_case(0.5)
    v_theta = v_theta.clone().requires_grad_(True)
    loss, _ = nft_loss(v_theta, v_old, x0, noise, sigma, r, beta=beta, adv_clip_max=5.0)
    (grad,) = torch.autograd.grad(loss, v_theta)
    _, _, _, _, wp, wn, ep, en = _float64_nft(v_theta.detach(), v_old, x0, noise, sigma, r, beta)
    b, d = 6, 75
    t2 = sigma.double().view(-1, 1, 1, 1) ** 2
    rr = r.double().view(-1, 1, 1, 1)
    wp, wn = wp.view(-1, 1, 1, 1), wn.view(-1, 1, 1, 1)
    expected = 2 * 5.0 * t2 / (b * d) * (rr * ep / wp - (1 - rr) * en / wn)
    size = 2 * 5.0 * t2 / (b * d) * (rr * ep.abs() / wp + (1 - rr) * en.abs() / wn)
    # About ten roundings per element on each branch, plus the weights' reductions.
    bound = (10 + _reduction_rtol(d) / EPS32) * EPS32 * size
    assert bool(((grad.double() - expected).abs() <= bound).all())
    assert bool((grad[-1] == 0).all())  # σ = 0


def test_nft_on_policy_implicit_policies_coincide() -> None:
    """v_θ = v_old: v⁺ = v⁻ = v_old exactly, so both branches score the same, and the gradient is
    (2σ²/(B·D))·M·(2r − 1)·e/w: zero at r = 1/2, the same for every β."""
    _, v_old, x0, noise, sigma, _, _ = _nft_case()
    r = torch.full((6,), 0.5)
    grads = {}
    for beta in (1.0, 0.1):
        v_theta = v_old.clone().requires_grad_(True)
        _, stats = nft_loss(v_theta, v_old, x0, noise, sigma, r, beta=beta)
        assert torch.equal(stats.positive_error, stats.negative_error)
        assert torch.equal(stats.positive_loss, stats.negative_loss)
        assert torch.equal(stats.old_deviation, torch.zeros(6))
        loss, _ = nft_loss(v_theta, v_old, x0, noise, sigma, r, beta=beta)
        (grads[beta],) = torch.autograd.grad(loss, v_theta)
        assert torch.equal(grads[beta], torch.zeros_like(v_old))  # zero advantage: no push either way

    adv = torch.tensor([5.0, -5.0, 2.0, -1.0, 0.5, 0.0])
    r = nft_reward_probability(adv)
    for beta in (1.0, 0.1):
        v_theta = v_old.clone().requires_grad_(True)
        loss, _ = nft_loss(v_theta, v_old, x0, noise, sigma, r, beta=beta)
        (grads[beta],) = torch.autograd.grad(loss, v_theta)
    _, _, _, _, wp, _, ep, _ = _float64_nft(v_old, v_old, x0, noise, sigma, r, 1.0)
    t2 = sigma.double().view(-1, 1, 1, 1) ** 2
    expected = 2 * t2 / (6 * 75) * adv.double().view(-1, 1, 1, 1) * ep / wp.view(-1, 1, 1, 1)
    size = (2 * t2 / (6 * 75) * 5.0 * ep.abs() / wp.view(-1, 1, 1, 1)).max()
    for beta in (1.0, 0.1):
        assert float((grads[beta].double() - expected).abs().max()) <= 32 * EPS32 * float(size)


def test_nft_all_positive_and_all_negative_groups() -> None:
    """r = 1 trains only the positive branch, r = 0 only the negative one."""
    v_theta, v_old, x0, noise, sigma, _, beta = _nft_case()
    for value, part in ((1.0, 2), (0.0, 3)):
        r = torch.full((6,), value)
        loss, stats = nft_loss(v_theta, v_old, x0, noise, sigma, r, beta=beta)
        branch = _float64_nft(v_theta, v_old, x0, noise, sigma, r, beta)[part]
        expected = (5.0 * branch / beta).mean().item()
        assert abs(loss.item() - expected) <= (_reduction_rtol(75, 8) + _reduction_rtol(6, 0)) * expected
        assert stats.positive_loss.gt(0).any() and stats.negative_loss.gt(0).any()  # both still reported


def test_nft_loss_bad_input() -> None:
    v_theta, v_old, x0, noise, sigma, r, _ = _nft_case()
    with pytest.raises(ValueError, match="beta"):
        nft_loss(v_theta, v_old, x0, noise, sigma, r, beta=0.0)
    with pytest.raises(ValueError, match="r must lie"):
        nft_loss(v_theta, v_old, x0, noise, sigma, r + 1.0)
    with pytest.raises(ValueError, match="sigma must lie"):
        nft_loss(v_theta, v_old, x0, noise, sigma + 1.0, r)
    with pytest.raises(ValueError, match="share one batch-first shape"):
        nft_loss(v_theta, v_old[:, :2], x0, noise, sigma, r)
    with pytest.raises(ValueError, match="r must be"):
        nft_loss(v_theta, v_old, x0, noise, sigma, r[:3])


# ----------------------------------------------------------------------------------------------
# DiffusionNFT: times and the old policy's decay
# ----------------------------------------------------------------------------------------------


def test_nft_sample_times_draws_distinct_schedule_sigmas_uniformly() -> None:
    sigmas = sd3_sigmas(10)[:-1]  # the published 10 sampling steps, without the terminal 0
    batch = 4000
    times = nft_sample_times(sigmas, batch, generator=torch.Generator().manual_seed(5))
    assert times.shape == (batch, 9)  # ⌊10·0.99⌋
    assert bool(torch.isin(times, sigmas).all())
    assert all(len(set(row.tolist())) == 9 for row in times[:200])
    # Each sigma is visited by a sample with probability K/T = 0.9 (binomial sd ≈ 0.0047; 5 sd).
    freq = torch.stack([(times == s).any(dim=1).double().mean() for s in sigmas])
    assert float((freq - 0.9).abs().max()) < 5 * math.sqrt(0.9 * 0.1 / batch)
    again = nft_sample_times(sigmas, batch, generator=torch.Generator().manual_seed(5))
    assert torch.equal(times, again)
    assert nft_sample_times(sigmas, 3, timestep_fraction=1.0).shape == (3, 10)
    assert nft_sample_times(sigmas, 3, timestep_fraction=0.01).shape == (3, 1)


def test_nft_sample_times_bad_input() -> None:
    with pytest.raises(ValueError, match="terminal 0"):
        nft_sample_times(sd3_sigmas(10), 2)
    with pytest.raises(ValueError, match="timestep_fraction"):
        nft_sample_times(sd3_sigmas(10)[:-1], 2, timestep_fraction=0.0)
    with pytest.raises(ValueError, match="batch_size"):
        nft_sample_times(sd3_sigmas(10)[:-1], 0)


def test_nft_old_policy_decay_matches_the_published_schedules() -> None:
    def reference(step: int, flat: int, uprate: float, uphold: float) -> float:
        # The reference's return_decay, re-stated: a copy until `flat`, then a capped linear ramp.
        if step < flat:
            return 0.0
        return min((step - flat) * uprate, uphold)

    published = {
        "copy": (0, 0.0, 0.0),
        "linear_to_0_5": (0, 0.001, 0.5),
        "delayed_linear_to_0_999": (75, 0.0075, 0.999),
    }
    assert published == NFT_DECAY_SCHEDULES
    for delay, rate, cap in published.values():
        for step in range(0, 1200, 7):
            assert nft_old_policy_decay(step, delay=delay, rate=rate, cap=cap) == reference(
                step, delay, rate, cap
            )
    assert nft_old_policy_decay(0) == 0.0 and nft_old_policy_decay(100) == pytest.approx(0.1)
    assert nft_old_policy_decay(10_000) == 0.5  # the default schedule's cap
    assert nft_old_policy_decay(75, delay=75, rate=0.0075, cap=0.999) == 0.0
    assert nft_old_policy_decay(300, delay=75, rate=0.0075, cap=0.999) == 0.999


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"step": -1}, "step"),
        ({"step": 1, "cap": 1.5}, "cap"),
        ({"step": 1, "rate": -1.0}, "rate"),
        ({"step": 1, "delay": -2}, "delay"),
    ],
)
def test_nft_old_policy_decay_bad_input(kwargs, match) -> None:
    step = kwargs.pop("step")
    with pytest.raises(ValueError, match=match):
        nft_old_policy_decay(step, **kwargs)
