"""Group advantages, the Flow-GRPO and GRPO-Guard policy losses, and the KL to the reference (pure).

Every function takes tensors and returns tensors; the module and the metrics hold the state. The
per-sample statistics the metrics need come back as a :class:`PolicyStats`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "PolicyStats",
    "flow_grpo_loss",
    "group_advantages",
    "grpo_guard_loss",
    "kl_to_reference",
    "ratio_norm_loss",
]


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    std: Literal["global", "group"] = "global",
    eps: float = 1e-4,
) -> Tensor:
    """GRPO advantages: the reward minus its group's mean, over a population standard deviation.

    A(i) = (r_i − mean_{g(i)}) / (std + eps), where std is the population std of the rewards of
    group g(i) (``"group"``) or of all rewards (``"global"``). This is Flow-GRPO's
    ``PerPromptStatTracker`` (``flow_grpo/stat_tracking.py``: ``np.std`` + 1e-4, ``global_std``).
    A group of one, or a group whose rewards tie, gets advantage 0.

    Args:
        rewards: (N,) finite rewards; drop failed samples before calling.
        group_ids: (N,) integer group of each sample (samples of one prompt share an id).
        std: ``"global"`` or ``"group"`` normalisation.
        eps: added to the std so a tied group does not divide by zero.

    Returns:
        (N,) advantages in the rewards' floating dtype (fp32 for integer rewards).
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids {tuple(group_ids.shape)} must have the shape of rewards {tuple(rewards.shape)}"
        )
    if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if std not in ("global", "group"):
        raise ValueError(f"std ({std!r}) must be 'global' or 'group'")
    if not eps >= 0:
        raise ValueError(f"eps ({eps}) must be >= 0")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError(
            "rewards contain NaN or inf: drop the samples whose reward failed before computing advantages"
        )
    out_dtype = rewards.dtype if rewards.dtype.is_floating_point else torch.float32
    if rewards.numel() == 0:
        return rewards.to(out_dtype)

    r = rewards.to(torch.float64)  # the sums are exact enough for any batch size
    _, group = torch.unique(group_ids, return_inverse=True)  # (N,) dense ids 0..G-1
    num_groups = int(group.max()) + 1
    count = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, group, torch.ones_like(r))
    total = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, group, r)
    centred = r - (total / count)[group]  # (N,) fp64
    if std == "group":
        sq = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, group, centred**2)
        scale = torch.sqrt(sq / count)[group]
    else:
        scale = r.std(correction=0)
    return (centred / (scale + eps)).to(out_dtype)


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
    """Advantages after clipping to ±adv_clip_max."""
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
    std_dev_t = _per_batch(std_dev_t, "std_dev_t", n)
    sqrt_dt = _per_batch(sqrt_dt, "sqrt_dt", n)

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
    var = _per_batch(std_dev_t, "std_dev_t", batch).float() ** 2
    if sqrt_dt is not None:
        var = var * _per_batch(sqrt_dt, "sqrt_dt", batch).float() ** 2
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
    high = clip_range if clip_range_high is None else clip_range_high
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


def _check_loss_args(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    clip_range: float,
    clip_range_high: float | None,
    adv_clip_max: float,
) -> None:
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
    if not clip_range >= 0:
        raise ValueError(f"clip_range ({clip_range}) must be >= 0 (Flow-GRPO uses 1e-4)")
    if clip_range_high is not None and not clip_range_high >= 0:
        raise ValueError(f"clip_range_high ({clip_range_high}) must be >= 0, or None to use clip_range")
    if not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max ({adv_clip_max}) must be > 0 (Flow-GRPO uses 5.0)")


def _per_batch(value: Tensor | float, name: str, batch: int) -> Tensor:
    """(B,) from a scalar, a (B,) or a (B, 1, ..., 1) tensor."""
    value = torch.as_tensor(value)
    if value.numel() == 1:
        return value.reshape(1).expand(batch)
    if value.numel() != batch or (value.ndim >= 1 and value.shape[0] != batch):
        raise ValueError(
            f"{name} has shape {tuple(value.shape)}: give a scalar or one value per sample ({batch},)"
        )
    return value.reshape(batch)
