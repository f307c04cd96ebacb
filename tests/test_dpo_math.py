"""SFT and Diffusion-DPO's pure math against float64 re-derivations written here from the sources
(diffusers' SD3 training scripts, Wallace et al. 2023 and its released script), the online pairs, and
the diagnostics' exactness under any split of the pairs."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from tolerances import EPS32

from lit_flowgrpo.algorithms import (
    diffusion_dpo_loss,
    flow_matching_errors,
    preference_pairs,
    sft_loss,
    training_sigma,
)
from lit_flowgrpo.metrics import DPODiagnostics, SFTDiagnostics

# fp32 inputs to a handful of fp32 operations per element, then a mean over 48 elements: a few ulps
# of the result's size (the pairwise mean adds ⌈log₂ 48⌉ = 6 of them).
RTOL = 16 * EPS32


def _dpo_reference(ew, el, rw, rl, beta):
    """Wallace et al. 2023 eq. 14 as the released script computes it, in float64:
    −log σ(−β/2·((e_w − e_l) − (e_w^ref − e_l^ref))) = log(1 + exp(β/2·(...)))."""
    ew, el, rw, rl = (t.double() for t in (ew, el, rw, rl))
    z = 0.5 * beta * ((ew - el) - (rw - rl))
    per = torch.log1p(torch.exp(z))
    return per.mean(), -z


def test_dpo_loss_matches_the_float64_derivation():
    g = torch.Generator().manual_seed(0)
    ew, el, rw, rl = (torch.rand(64, generator=g) * 0.1 for _ in range(4))
    beta = 500.0
    loss, stats = diffusion_dpo_loss(ew, el, rw, rl, beta=beta)
    want, margin = _dpo_reference(ew, el, rw, rl, beta)
    # The margin is β/2 × a difference of fp32 numbers near 0.1: its error is a few ulps of 0.1·β/2.
    torch.testing.assert_close(stats.margin.double(), margin, rtol=0, atol=8 * EPS32 * 0.1 * beta)
    torch.testing.assert_close(loss.double(), want, rtol=0, atol=8 * EPS32 * 0.1 * beta)
    assert stats.margin.gt(0).any() and stats.margin.lt(0).any()  # both signs are exercised


def test_dpo_starts_at_log2_and_its_gradient_favours_the_chosen_image():
    ew = torch.tensor([0.3, 0.2], requires_grad=True)
    el = torch.tensor([0.1, 0.5], requires_grad=True)
    loss, stats = diffusion_dpo_loss(ew, el, ew.detach(), el.detach(), beta=10.0)
    # model = reference: inside = 0, and −log σ(0) = log 2 rounded to fp32 (one rounding: EPS32 relative).
    assert float(loss.detach()) == pytest.approx(math.log(2), rel=EPS32)
    assert stats.margin.eq(0).all()
    loss.backward()
    # d/de_w of log(1 + exp(β/2·(e_w − e_l − c))) at 0 is β/4 per pair, over the mean of 2 pairs.
    torch.testing.assert_close(ew.grad, torch.full((2,), 10.0 / 4 / 2))
    torch.testing.assert_close(el.grad, torch.full((2,), -10.0 / 4 / 2))


@pytest.mark.parametrize("scheme", ["logit_normal", "mode", "sigma_sqrt", "cosmap", "none"])
def test_sft_loss_matches_the_float64_derivation(scheme):
    g = torch.Generator().manual_seed(1)
    v, x0, eps = (torch.randn(4, 3, 4, 4, generator=g) for _ in range(3))
    sigma = torch.tensor([0.1, 0.4, 0.7, 0.95])
    loss, per = sft_loss(v, x0, eps, sigma, scheme)
    s = sigma.double()
    # diffusers' compute_loss_weighting_for_sd3, re-derived: σ⁻² (sigma_sqrt), 2/(π(1 − 2σ + 2σ²))
    # (cosmap), 1 otherwise (the density schemes shape σ's draw, not the loss).
    w = {"sigma_sqrt": s**-2, "cosmap": 2 / (math.pi * (1 - 2 * s + 2 * s**2))}.get(
        scheme, torch.ones(4, dtype=torch.float64)
    )
    err = ((v.double() - (eps.double() - x0.double())) ** 2).mean(dim=(1, 2, 3))  # target v = ε − x0
    torch.testing.assert_close(per.double(), w * err, rtol=RTOL, atol=0)
    torch.testing.assert_close(loss.double(), (w * err).mean(), rtol=RTOL, atol=0)
    unweighted = flow_matching_errors(v, x0, eps)
    torch.testing.assert_close(unweighted.double(), err, rtol=RTOL, atol=0)


@pytest.mark.parametrize("scheme", ["logit_normal", "sigma_sqrt"])
def test_preconditioned_sft_is_the_sd3_scripts_x0_loss(scheme):
    """diffusers' train_dreambooth_sd3.py at its default --precondition_outputs 1: the prediction
    v·(−σ) + x_σ regressed on x0, weighted by compute_loss_weighting_for_sd3, re-derived in float64."""
    g = torch.Generator().manual_seed(2)
    v, x0, eps = (torch.randn(4, 3, 4, 4, generator=g) for _ in range(3))
    sigma = torch.tensor([0.05, 0.4, 0.7, 1.0])
    loss, per = sft_loss(v, x0, eps, sigma, scheme, precondition=True)
    s, vd, x, e = sigma.double().view(-1, 1, 1, 1), v.double(), x0.double(), eps.double()
    noisy = (1 - s) * x + s * e
    w = s.flatten() ** -2 if scheme == "sigma_sqrt" else torch.ones(4, dtype=torch.float64)
    want = w * ((vd * -s + noisy - x) ** 2).mean(dim=(1, 2, 3))
    # Two more fp32 roundings than the unconditioned loss (σ², and its product): within RTOL.
    torch.testing.assert_close(per.double(), want, rtol=RTOL, atol=0)
    torch.testing.assert_close(loss.double(), want.mean(), rtol=RTOL, atol=0)


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_training_sigma_is_the_scripts_index_into_the_shifted_schedule(shift):
    sigmas = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift).sigmas
    for seed in range(20):
        got = training_sigma("logit_normal", sigmas, torch.Generator().manual_seed(seed))
        # u = sigmoid(n), n ~ N(0, 1) from the same generator; index ⌊u·1000⌋ counts from σ = 1 down:
        # σ_i = s·t/(1 + (s − 1)·t) with t = (1000 − i)/1000 (SD3's shift, Esser et al. 2024 eq. 23).
        n = torch.normal(0.0, 1.0, (1,), generator=torch.Generator().manual_seed(seed))
        i = int(torch.sigmoid(n) * 1000)
        t = (1000 - i) / 1000
        assert float(got) == pytest.approx(shift * t / (1 + (shift - 1) * t), rel=4 * EPS32)


def test_preference_pairs_take_each_groups_best_and_worst():
    rewards = torch.tensor([0.2, 0.9, 0.9, 0.1, 0.5, 0.5, float("nan"), 0.3, 0.7, float("nan")])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 3, 3])
    ids = torch.tensor([7, 3, 1, 9, 0, 2, 4, 5, 6, 8])
    chosen, rejected = preference_pairs(rewards, groups, ids)
    # group 0: 0.9 twice, the lower id (1, position 2) chosen; the lowest 0.1 rejected. Group 1 ties:
    # no pair. Group 2: one finite reward: no pair. Group 3 likewise.
    assert chosen.tolist() == [2] and rejected.tolist() == [3]
    empty = preference_pairs(torch.ones(3), torch.zeros(3, dtype=torch.long), torch.arange(3))
    assert [t.numel() for t in empty] == [0, 0]


def _dpo_stats(seed: int, n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ew, el, rw, rl = (torch.rand(n, generator=g) for _ in range(4))
    _, stats = diffusion_dpo_loss(ew, el, rw, rl, beta=3.0)
    return {k: getattr(stats, k) for k in DPODiagnostics.STATS}


def test_dpo_diagnostics_are_exact_sufficient_statistics():
    parts = [_dpo_stats(s, n) for s, n in ((0, 5), (1, 3), (2, 8))]
    whole = DPODiagnostics()
    for p in parts:
        whole.update(**p)
    # What the sum reduction of two ranks does: states added, whichever rank held which pairs.
    a, b = DPODiagnostics(), DPODiagnostics()
    a.update(**parts[2])
    b.update(**parts[0])
    b.update(**parts[1])
    merged = DPODiagnostics()
    merged.merge_state(a)
    merged.merge_state(b)
    want, got = whole.compute(), merged.compute()
    assert set(want) == set(got)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=4 * torch.finfo(torch.float64).eps, atol=0)
    margins = torch.cat([p["margin"] for p in parts]).double()
    # A count over 16 pairs: exact. The margin's mean: 16 float64 additions in another order, each within
    # eps64 of the running sum, so within 16·eps64·mean|margin|.
    assert float(want["reward_accuracy"]) == float((margins > 0).double().mean())
    bound = 16 * torch.finfo(torch.float64).eps * float(margins.abs().mean())
    assert float(want["reward_margin"]) == pytest.approx(float(margins.mean()), abs=bound)
    assert float(want["pairs"]) == 16


def test_a_step_without_pairs_logs_nan_not_zero():
    # Online pairs from groups that all tie: no pair on any rank. A 0 accuracy or loss would read as
    # measured; the count says 0 and every mean is NaN.
    out = DPODiagnostics().compute()
    assert float(out["pairs"]) == 0 and all(math.isnan(float(v)) for k, v in out.items() if k != "pairs")
    assert math.isnan(float(SFTDiagnostics().compute()["sft_loss"]))


def test_sft_diagnostics_split_by_sigma_band():
    m = SFTDiagnostics(buckets=4)
    m.update(loss=torch.tensor([1.0, 2.0, 4.0, 8.0]), sigma=torch.tensor([0.0, 0.3, 0.3, 1.0]))
    out = m.compute_prefixed()
    assert float(out["actor/sft_loss"]) == 3.75
    assert float(out["actor/sft_loss_by_sigma/0.00-0.25"]) == 1.0
    assert float(out["actor/sft_loss_by_sigma/0.25-0.50"]) == 3.0
    assert float(out["actor/sft_loss_by_sigma/0.75-1.00"]) == 8.0  # σ = 1 in the last band
    assert "actor/sft_loss_by_sigma/0.50-0.75" not in out  # no sample there: not logged
