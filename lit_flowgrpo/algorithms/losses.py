"""The ratio policy losses (Flow-GRPO, GRPO-Guard in both forms, Flow-DPPO) and the KL to the
reference (pure).

Every function takes tensors and returns tensors; the per-sample statistics the metrics need come back
as a :class:`PolicyStats`. Log-probs are means over the non-batch elements (DESIGN.md), so the clip
ranges and the KL thresholds below are in that unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "DPPOStats",
    "PolicyStats",
    "clip_range_problems",
    "flow_dppo_loss",
    "flow_grpo_loss",
    "gaussian_step_kl",
    "grpo_guard_loss",
    "kl_to_reference",
    "ratio_norm_loss",
    "resolve_clip_range_high",
]


@dataclass
class PolicyStats:
    """Per-sample (N,) statistics of one policy-loss evaluation, all detached.

    Names are read by the metrics library: keep them.
    """

    ratio: Tensor
    """The importance ratio the loss clipped."""
    log_ratio: Tensor
    """log(ratio)."""
    raw_log_ratio: Tensor
    """log p_θ − log p_old before any re-centring (equals ``log_ratio`` for Flow-GRPO)."""
    advantages: Tensor
    """The advantages the loss weighed (after its clip to ±adv_clip_max, where it clips)."""
    outside_high: Tensor
    """ratio > 1 + ε_high (bool)."""
    outside_low: Tensor
    """ratio < 1 − ε (bool)."""
    clip_active_high: Tensor
    """A > 0 and ratio > 1 + ε_high: the clip removed this sample's gradient (bool)."""
    clip_active_low: Tensor
    """A < 0 and ratio < 1 − ε: the clip removed this sample's gradient (bool)."""
    pg_loss: Tensor
    """Per-sample unreduced clipped loss max(−A·r, −A·clip(r))."""


def flow_grpo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    clip_range: float,
    clip_range_high: float | None = None,
    adv_clip_max: float = 5.0,
) -> tuple[Tensor, PolicyStats]:
    """Flow-GRPO's clipped surrogate (arXiv:2505.05470; ``flow_grpo/scripts/train_sd3.py``).

    loss = mean(max(−A·r, −A·clip(r, 1−ε, 1+ε_high))), r = exp(log p_θ − log p_old), with A clipped
    to ±adv_clip_max first.

    Args:
        log_prob: (N,) log p_θ of the recorded transitions (differentiable).
        old_log_prob: (N,) log p_old recorded at rollout.
        advantages: (N,) advantages.
        clip_range: ε, the lower (and by default upper) clip width.
        clip_range_high: ε_high for the upper clip; ``None`` uses ``clip_range``.
        adv_clip_max: advantages are clipped to ±this.

    Returns:
        (scalar loss, :class:`PolicyStats`).
    """
    _check_loss_args(log_prob, old_log_prob, advantages, clip_range, clip_range_high, adv_clip_max)
    adv = advantages.clamp(-adv_clip_max, adv_clip_max)
    log_ratio = log_prob - old_log_prob  # (N,)
    ratio = torch.exp(log_ratio)
    return _clipped_surrogate(ratio, log_ratio, log_ratio, adv, clip_range, clip_range_high)


def grpo_guard_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    prev_sample_mean: Tensor,
    old_prev_sample_mean: Tensor,
    std_dev_t: Tensor,
    sqrt_dt: Tensor,
    *,
    clip_range: float,
    clip_range_high: float | None = None,
    adv_clip_max: float = 5.0,
) -> tuple[Tensor, PolicyStats]:
    """GRPO-Guard's regulated clipping (Wang et al. 2025, arXiv:2510.22319; as verl-omni's
    ``GRPOGuardLoss``).

    For one denoising step, with s = mean(std_dev_t)·mean(sqrt_dt) the step's transition std:

    - **RatioNorm.** The Flow-GRPO log-ratio of an off-policy transition contains the mean-shift
      term −mean((μ_θ − μ_old)²)/(2s²), which is ≤ 0 for every sample, so the ratio sits below 1
      and the upper clip rarely fires while the lower clip fires too often.
      GRPO-Guard adds b = mean((μ_θ − μ_old)²)/(2s²) back and scales by s:
      ratio = exp((log p_θ − log p_old + b)·s). With x_next = μ_old + s·ε this scaled log-ratio is
      exactly mean(ε·(μ_θ − μ_old)): zero-mean over the noise, and with the same spread at every
      step.
    - **Cross-step gradient balancing.** The gradient of that log-ratio with respect to μ_θ grows
      as the step's noise shrinks; dividing the loss by mean(sqrt_dt)² = |dt| evens out the
      gradient size across denoising steps.

    The clipped surrogate on that ratio is Flow-GRPO's.

    Args:
        log_prob: (N,) log p_θ of the recorded transitions (differentiable).
        old_log_prob: (N,) log p_old recorded at rollout.
        advantages: (N,) advantages.
        prev_sample_mean: (N, ...) μ_θ (differentiable).
        old_prev_sample_mean: (N, ...) μ_old recorded at rollout.
        std_dev_t: (N,) or scalar diffusion coefficient of this step.
        sqrt_dt: (N,) or scalar √|dt| of this step.
        clip_range: ε (GRPO-Guard uses ~2e-6 in this unit).
        clip_range_high: ε_high; ``None`` uses ``clip_range``.
        adv_clip_max: advantages are clipped to ±this.

    Returns:
        (scalar loss, :class:`PolicyStats`); ``ratio``/``log_ratio`` are the re-centred, scaled
        ones and ``raw_log_ratio`` is log p_θ − log p_old.
    """
    _check_loss_args(log_prob, old_log_prob, advantages, clip_range, clip_range_high, adv_clip_max)
    n = log_prob.shape[0]
    if prev_sample_mean.shape != old_prev_sample_mean.shape or prev_sample_mean.shape[:1] != (n,):
        raise ValueError(
            f"prev_sample_mean {tuple(prev_sample_mean.shape)} and old_prev_sample_mean "
            f"{tuple(old_prev_sample_mean.shape)} must have the same shape, batch first with N={n}"
        )
    std_dev_t = per_batch(std_dev_t, "std_dev_t", n)
    sqrt_dt = per_batch(sqrt_dt, "sqrt_dt", n)

    adv = advantages.clamp(-adv_clip_max, adv_clip_max)
    scale = std_dev_t.mean() * sqrt_dt.mean()  # one transition std per step (verl-omni)
    diff_sq = (prev_sample_mean.float() - old_prev_sample_mean.float()) ** 2
    mean_shift = diff_sq.mean(dim=tuple(range(1, diff_sq.ndim))) if diff_sq.ndim > 1 else diff_sq  # (N,)
    bias = mean_shift / (2 * scale**2)  # RatioNorm: undoes the mean-shift term
    raw_log_ratio = log_prob - old_log_prob
    log_ratio = (raw_log_ratio + bias) * scale
    ratio = torch.exp(log_ratio)
    loss, stats = _clipped_surrogate(ratio, log_ratio, raw_log_ratio, adv, clip_range, clip_range_high)
    return loss / sqrt_dt.mean() ** 2, stats  # cross-step gradient balancing: 1/|dt|


def ratio_norm_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    clip_range: float,
    clip_range_high: float | None = None,
    adv_clip_max: float = 5.0,
    target_std: float,
) -> tuple[Tensor, PolicyStats]:
    """GRPO-Guard as its blog post describes it: ratios normalised per step, gradients balanced
    across steps (the published code's form is :func:`grpo_guard_loss`).

    Over the N samples of one denoising step, with r = exp(log p_θ − log p_old):

    - **RatioNorm.** r̂ = 1 + (r − μ)·k with μ the mean of r and k = min(1, ``target_std``/σ), σ its
      population std. The blog standardises to unit variance (k = 1/σ), which no clip range of
      Flow-GRPO's size survives; here a step's ratios are re-centred on 1 and their spread is
      brought down to ``target_std`` when it is wider, never blown up (on-policy, σ is 0 up to
      rounding, and scaling it up would turn rounding noise into clipping).
    - **Cross-step gradient balancing.** Each sample's term is weighted by w = 1/r̂, so that
      w·∇r̂ = k·∇log r: every step contributes a log-ratio gradient of comparable size, whatever
      its ratio. The blog normalises the weights to sum to one over a sample's steps
      (w_t = (1/r̂_t)/Σ_k 1/r̂_k); the update visits one step per backward, so the sum is taken as
      the number of steps, which the update's average over steps already divides by. That is
      exact on-policy and off by |r̂ − 1| (at most about the clip range where a gradient flows)
      otherwise.

    μ, σ and w are constants of the backward (detached): the normalisation moves which samples the
    clip catches and how much each counts, not the direction of their gradient.

    Args:
        log_prob: (N,) log p_θ of the recorded transitions (differentiable).
        old_log_prob: (N,) log p_old recorded at rollout.
        advantages: (N,) advantages.
        clip_range: ε of the clip on r̂.
        clip_range_high: ε_high; ``None`` uses ``clip_range``.
        adv_clip_max: advantages are clipped to ±this.
        target_std: the largest spread a step's ratios keep after normalisation.

    Returns:
        (scalar loss, :class:`PolicyStats`); ``ratio``/``log_ratio`` are r̂ and log r̂,
        ``raw_log_ratio`` is log p_θ − log p_old.
    """
    _check_loss_args(log_prob, old_log_prob, advantages, clip_range, clip_range_high, adv_clip_max)
    if not target_std > 0:
        raise ValueError(f"target_std ({target_std}) must be > 0 (half the clip range is the default)")
    adv = advantages.clamp(-adv_clip_max, adv_clip_max)
    raw_log_ratio = log_prob - old_log_prob
    ratio = torch.exp(raw_log_ratio)
    with torch.no_grad():
        mean = ratio.mean()
        std = ratio.std(correction=0) if ratio.numel() > 1 else torch.zeros_like(mean)
        shrink = torch.clamp(target_std / std, max=1.0)  # 1 where std is 0 (target/0 = inf)
    normed = 1.0 + (ratio - mean) * shrink
    # r̂ > 0 needs target_std·√N < 1, which any clip-sized target meets; the floor only keeps a
    # misconfigured run's weights and log-ratios finite.
    floor = normed.detach().clamp_min(torch.finfo(normed.dtype).tiny)
    return _clipped_surrogate(
        normed, torch.log(floor), raw_log_ratio, adv, clip_range, clip_range_high, 1.0 / floor
    )


def kl_to_reference(
    prev_sample_mean: Tensor,
    ref_prev_sample_mean: Tensor,
    std_dev_t: Tensor,
    *,
    sqrt_dt: Tensor | None = None,
) -> Tensor:
    """KL between the Gaussian transitions of the policy and the reference, per sample.

    mean((μ_θ − μ_ref)²) / (2·std_dev_t²), as Flow-GRPO's training code computes it
    (``flow_grpo/scripts/train_sd3.py``, ``kl_loss``); with ``sqrt_dt`` it is also divided by
    sqrt_dt², the closed-form KL of the two Gaussians of std std_dev_t·sqrt_dt (the Flow-GRPO paper's form).

    Args:
        prev_sample_mean: (B, ...) μ_θ.
        ref_prev_sample_mean: (B, ...) μ_ref.
        std_dev_t: (B,) or scalar.
        sqrt_dt: optional (B,) or scalar.

    Returns:
        (B,) fp32.
    """
    if prev_sample_mean.shape != ref_prev_sample_mean.shape or prev_sample_mean.ndim < 1:
        raise ValueError(
            f"prev_sample_mean {tuple(prev_sample_mean.shape)} and ref_prev_sample_mean "
            f"{tuple(ref_prev_sample_mean.shape)} must have the same batch-first shape"
        )
    batch = prev_sample_mean.shape[0]
    diff_sq = (prev_sample_mean.float() - ref_prev_sample_mean.float()) ** 2
    mean_sq = diff_sq.mean(dim=tuple(range(1, diff_sq.ndim))) if diff_sq.ndim > 1 else diff_sq  # (B,)
    var = per_batch(std_dev_t, "std_dev_t", batch).float() ** 2
    if sqrt_dt is not None:
        var = var * per_batch(sqrt_dt, "sqrt_dt", batch).float() ** 2
    return mean_sq / (2 * var)


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def _clipped_surrogate(
    ratio: Tensor,
    log_ratio: Tensor,
    raw_log_ratio: Tensor,
    adv: Tensor,
    clip_range: float,
    clip_range_high: float | None,
    weight: Tensor | None = None,
) -> tuple[Tensor, PolicyStats]:
    """PPO's pessimistic clipped objective (Schulman et al. 2017, Eq. 7) and its masks; ``weight``
    (N,), detached, scales each sample's term."""
    high = resolve_clip_range_high(clip_range, clip_range_high)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + high)
    pg_loss = torch.maximum(unclipped, clipped)  # (N,)
    if weight is not None:
        pg_loss = pg_loss * weight
    with torch.no_grad():
        outside_high = ratio > 1.0 + high
        outside_low = ratio < 1.0 - clip_range
        stats = PolicyStats(
            ratio=ratio.detach(),
            log_ratio=log_ratio.detach(),
            raw_log_ratio=raw_log_ratio.detach(),
            advantages=adv.detach(),
            outside_high=outside_high,
            outside_low=outside_low,
            clip_active_high=outside_high & (adv > 0),
            clip_active_low=outside_low & (adv < 0),
            pg_loss=pg_loss.detach(),
        )
    return pg_loss.mean(), stats


def clip_range_problems(clip_range: float, clip_range_high: float | None, prefix: str = "") -> list[str]:
    """The one rule for the clip interval (1 − ε, 1 + ε_high) around 1, which the loss and the clip
    fractions both need; ``prefix`` is the flag's path (``--model.init_args.objective.init_args.``)."""
    p = []
    if not (0.0 < clip_range < 1.0):
        p.append(
            f"{prefix}clip_range ({clip_range}) must lie in (0, 1): Flow-GRPO uses 1e-4, GRPO-Guard ~2e-6"
        )
    if clip_range_high is not None and not (clip_range_high > 0.0 and math.isfinite(clip_range_high)):
        p.append(
            f"{prefix}clip_range_high ({clip_range_high}) must be a finite number > 0, or null to use clip_range"
        )
    return p


def resolve_clip_range_high(clip_range: float, clip_range_high: float | None) -> float:
    """ε_high: ``clip_range_high``, or ``clip_range`` when that is ``None`` (a symmetric clip). The one
    resolution: :attr:`lit_flowgrpo.objective.RatioObjective.clip_high` passes its result to the
    losses and the metric, and a metric built alone (``clip_range_high=None``) reads it the same way."""
    return float(clip_range if clip_range_high is None else clip_range_high)


def _check_loss_args(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    clip_range: float | None,
    clip_range_high: float | None,
    adv_clip_max: float | None,
) -> None:
    """``clip_range=None``: a loss without a ratio clip (Flow-DPPO's trust region)."""
    if log_prob.ndim != 1:
        raise ValueError(f"log_prob must be 1-D (N,), got shape {tuple(log_prob.shape)}")
    if old_log_prob.shape != log_prob.shape:
        raise ValueError(
            f"old_log_prob {tuple(old_log_prob.shape)} must have the shape of log_prob {tuple(log_prob.shape)}"
        )
    if advantages.shape != log_prob.shape:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} must have the shape of log_prob {tuple(log_prob.shape)}"
        )
    problems = [] if clip_range is None else clip_range_problems(clip_range, clip_range_high)
    if problems:  # the objective's and the metric's one rule
        raise ValueError("; ".join(problems))
    if adv_clip_max is not None and not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max ({adv_clip_max}) must be > 0 (Flow-GRPO uses 5.0)")


def per_batch(value: Tensor | float, name: str, batch: int) -> Tensor:
    """(B,) from a scalar, a (B,) or a (B, 1, ..., 1) tensor (public: DiffusionNFT's loss reads its σ so)."""
    value = torch.as_tensor(value)
    if value.numel() == 1:
        return value.reshape(1).expand(batch)
    if value.numel() != batch or (value.ndim >= 1 and value.shape[0] != batch):
        raise ValueError(
            f"{name} has shape {tuple(value.shape)}: give a scalar or one value per sample ({batch},)"
        )
    return value.reshape(batch)


# --------------------------------------------------------------------------------------------------
# Flow-DPPO: an exact per-step KL trust region in place of the ratio clip
# --------------------------------------------------------------------------------------------------


@dataclass
class DPPOStats(PolicyStats):
    """:class:`PolicyStats` of one Flow-DPPO evaluation, plus the step KL; all (N,), detached.

    There is no ratio clip, so the inherited masks mean the trust region instead:
    ``outside_high``/``outside_low`` are "KL ≥ δ and ratio > 1 / < 1" (outside the trust region,
    whatever the advantage), and ``clip_active_high``/``clip_active_low`` are the samples the mask
    removed (A > 0 and ratio > 1 / A < 0 and ratio < 1, with KL ≥ δ): verl-omni's
    ``pos_rm``/``neg_rm``. ``ratio``, ``log_ratio`` and ``raw_log_ratio`` are the plain Flow-GRPO ones.
    """

    step_kl: Tensor
    """KL(π_old ‖ π_θ) of the step's Gaussian transitions, in the mean-over-elements unit."""
    high_kl: Tensor
    """step_kl ≥ kl_mask_threshold (bool)."""


def gaussian_step_kl(
    prev_sample_mean: Tensor,
    old_prev_sample_mean: Tensor,
    std_dev_t: Tensor | float,
    sqrt_dt: Tensor | float | None = None,
) -> Tensor:
    """KL(π_old ‖ π_θ) between the old and current Gaussian transitions of one step, per sample.

    Both transitions are N(μ, s²·I) with the same s = std_dev_t·sqrt_dt (``sde.py``), so
    KL = ‖μ_old − μ_θ‖² / (2 s²), symmetric in the two means: Flow-DPPO, Ping et al. 2026,
    arXiv:2606.11025, Eq. 14 (as UniRL's ``FlowDPPO/README.md`` numbers it). This returns that KL
    divided by the number D of non-batch elements, mean((μ_θ − μ_old)²) / (2 s²), the unit of this
    package's log-probs and of :func:`kl_to_reference` (the same formula with the old mean in
    place of the reference's), and the unit in which both reference implementations compare it
    with their threshold (UniRL ``_flowdppo_kl_adv_loss``, verl-omni ``FlowDPPOLoss``). Without
    ``sqrt_dt`` the denominator is 2·std_dev_t², the form Flow-GRPO's code uses for its KL.

    Args:
        prev_sample_mean: (B, ...) μ_θ.
        old_prev_sample_mean: (B, ...) μ_old recorded at rollout.
        std_dev_t: (B,) or scalar.
        sqrt_dt: optional (B,) or scalar √|dt|.

    Returns:
        (B,) fp32.
    """
    device = prev_sample_mean.device  # a float or CPU scalar becomes a tensor beside the means
    std = torch.as_tensor(std_dev_t, device=device)
    root = None if sqrt_dt is None else torch.as_tensor(sqrt_dt, device=device)
    return kl_to_reference(prev_sample_mean, old_prev_sample_mean, std, sqrt_dt=root)


def flow_dppo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    prev_sample_mean: Tensor,
    old_prev_sample_mean: Tensor,
    std_dev_t: Tensor | float,
    sqrt_dt: Tensor | float,
    *,
    kl_mask_threshold: float = 1e-5,
    add_kl_coefficient: bool = True,
    adv_clip_max: float | None = None,
) -> tuple[Tensor, DPPOStats]:
    """Flow-DPPO's divergence-masked policy loss (Ping et al. 2026, arXiv:2606.11025, Eq. 18).

    With r = exp(log p_θ − log p_old) and KL = :func:`gaussian_step_kl` (fp32, no gradient):

        drop = (KL ≥ δ) ∧ [(r > 1 ∧ A > 0) ∨ (r < 1 ∧ A < 0)],    loss = mean(−A·r·¬drop).

    The unclipped Flow-GRPO surrogate −A·r is kept wherever the step stays inside the trust region
    KL < δ, and outside it wherever the update is corrective (it moves the sample's probability back
    toward the old policy); only a move that is both far from the old policy and still pushing
    further is dropped. The KL is a mask, not a penalty: no gradient flows through μ_θ here, and
    there is no |dt| factor on the loss. This is the published code exactly (UniRL
    ``unirl/algorithms/flowdppo.py``, ``_flowdppo_kl_adv_loss``; verl-omni
    ``verl_omni/trainer/diffusion/diffusion_algos.py``, ``FlowDPPOLoss``; both take the mean over
    samples, ``≥`` at the threshold, and a mean-over-elements KL). The paper writes the KL with the
    squared norm (a sum over elements); the code, followed here, compares the mean with δ, so the
    published δ = 1e-5 is in the mean unit.

    The advantages are taken as they come, as both references take them (neither clips them, in the
    loss or in its advantage step, where their Flow-GRPO losses clip to ±5): one success in a group of
    64 has |A| ≈ 7 and keeps all of it. ``adv_clip_max`` clips them to ±that, as the other ratio losses
    do, when set. One departure, which does not change the loss: a dropped sample's log-ratio is
    replaced by 0 before the exponential, so a dropped sample whose ratio overflows contributes 0 to
    the gradient instead of 0·inf = NaN (the references' ``torch.where`` only protects the forward value).

    Args:
        log_prob: (N,) log p_θ of the recorded transitions (differentiable).
        old_log_prob: (N,) log p_old recorded at rollout.
        advantages: (N,) advantages.
        prev_sample_mean: (N, ...) μ_θ.
        old_prev_sample_mean: (N, ...) μ_old recorded at rollout.
        std_dev_t: (N,) or scalar diffusion coefficient of this step.
        sqrt_dt: (N,) or scalar √|dt| of this step.
        kl_mask_threshold: δ, in the mean-over-elements unit (published default 1e-5,
            ``kl_mask_threshold`` in both references).
        add_kl_coefficient: ``True`` (published default, same name in both references) divides the
            mean-shift by 2·(std_dev_t·sqrt_dt)², the exact KL; ``False`` uses mean((μ_θ − μ_old)²)/2.
        adv_clip_max: advantages are clipped to ±this; ``None`` (the references') leaves them as they are.

    Returns:
        (scalar loss, :class:`DPPOStats`).
    """
    _check_loss_args(log_prob, old_log_prob, advantages, None, None, adv_clip_max)
    n = log_prob.shape[0]
    if prev_sample_mean.shape != old_prev_sample_mean.shape or prev_sample_mean.shape[:1] != (n,):
        raise ValueError(
            f"prev_sample_mean {tuple(prev_sample_mean.shape)} and old_prev_sample_mean "
            f"{tuple(old_prev_sample_mean.shape)} must have the same shape, batch first with N={n}"
        )
    if not kl_mask_threshold >= 0:
        raise ValueError(f"kl_mask_threshold ({kl_mask_threshold}) must be >= 0 (Flow-DPPO uses 1e-5)")

    adv = advantages if adv_clip_max is None else advantages.clamp(-adv_clip_max, adv_clip_max)
    log_ratio = log_prob - old_log_prob  # (N,)
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        scale = (std_dev_t, sqrt_dt) if add_kl_coefficient else (1.0, None)  # False: mean(Δμ²)/2
        step_kl = gaussian_step_kl(prev_sample_mean, old_prev_sample_mean, *scale)  # (N,) fp32
        high_kl = step_kl >= kl_mask_threshold
        outside_high = high_kl & (ratio > 1.0)
        outside_low = high_kl & (ratio < 1.0)
        drop_high = outside_high & (adv > 0)
        drop_low = outside_low & (adv < 0)
        keep = ~(drop_high | drop_low)
    kept_ratio = torch.exp(torch.where(keep, log_ratio, torch.zeros_like(log_ratio)))  # 1 where dropped
    pg_loss = torch.where(keep, -adv * kept_ratio, torch.zeros_like(kept_ratio))  # (N,)
    stats = DPPOStats(
        ratio=ratio,
        log_ratio=log_ratio.detach(),
        raw_log_ratio=log_ratio.detach(),
        advantages=adv.detach(),
        outside_high=outside_high,
        outside_low=outside_low,
        clip_active_high=drop_high,
        clip_active_low=drop_low,
        pg_loss=pg_loss.detach(),
        step_kl=step_kl,
        high_kl=high_kl,
    )
    return pg_loss.mean(), stats
