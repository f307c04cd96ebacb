"""Group advantages, the policy losses (Flow-GRPO, GRPO-Guard, Flow-DPPO, DiffusionNFT), and the KL (pure).

Every function takes tensors and returns tensors; the module and the metrics hold the state. The
per-sample statistics the metrics need come back as a :class:`PolicyStats`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "NFT_DECAY_SCHEDULES",
    "DPPOStats",
    "GDPOAdvantages",
    "NFTStats",
    "PolicyStats",
    "diversity_multipliers",
    "flow_dppo_loss",
    "flow_grpo_loss",
    "gardo_uncertainty",
    "gated_kl_weights",
    "gaussian_step_kl",
    "gdpo_advantages",
    "group_advantages",
    "grpo_guard_loss",
    "kl_to_reference",
    "nft_loss",
    "nft_old_policy_decay",
    "nft_reward_probability",
    "nft_sample_times",
    "ratio_norm_loss",
    "win_rates",
]


def _check_group_settings(group_ids: Tensor, std: str, eps: float) -> None:
    """The checks every group normalisation shares: integer group ids, a known ``std``, ``eps`` ≥ 0."""
    if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if std not in ("global", "group"):
        raise ValueError(f"std ({std!r}) must be 'global' or 'group'")
    if not eps >= 0:
        raise ValueError(f"eps ({eps}) must be >= 0")


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
    _check_group_settings(group_ids, std, eps)
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


class GDPOAdvantages(NamedTuple):
    """What :func:`gdpo_advantages` gives back."""

    advantages: Tensor
    """(N,) in the components' floating dtype; 0 where ``scored`` is False."""
    scored: Tensor
    """(N,) bool: samples with at least one finite weighted component (the rest have no advantage)."""
    empty_groups: Tensor
    """(C,) int64: per component, the groups in which it scored no sample (left out of them)."""


def gdpo_advantages(
    components: Tensor,
    weights: Tensor | Sequence[float],
    group_ids: Tensor,
    *,
    std: Literal["global", "group"] = "group",
    eps: float = 1e-4,
) -> GDPOAdvantages:
    """GDPO advantages: each reward component normalised on its own within its group, then weighted,
    summed and normalised over the batch.

    GDPO (Liu et al., 2026, "Group reward-Decoupled Normalization Policy Optimization", arXiv:2601.05242,
    §3.1): A_k(i) = (r_k(i) − mean_{g(i)} r_k) / (s_k + eps), S(i) = Σ_k w_k·A_k(i) (the weights as the
    paper's §3.2 applies them: on the normalised components), A(i) = S(i) / (std_batch S + eps).

    - ``s_k`` is the population std of component k within group g(i) (``std="group"``, the paper's) or
      over the whole batch (``"global"``, Flow-GRPO's global std, per component); ``eps`` as in
      :func:`group_advantages`.
    - The batch step divides by the batch's population std only. The paper also subtracts the batch
      mean of S, which is 0 by construction here (every A_k is centred within its group over the
      samples it scored, so each group's Σ_i w_k·A_k(i) vanishes): subtracting its rounding would turn a
      tied group's exact 0 into a tiny number that ``filter_zero`` could no longer recognise.
    - A component that is NaN for a sample is left out of that sample's sum: its NaN enters neither
      its group's mean nor its std (a failed score is never a 0), and the sample's other components
      keep their weights. That counts the missing component at its group's mean, no evidence either
      way; renormalising the other weights would instead claim it agrees with them.
    - A component that is NaN for a whole group is left out of that group (``empty_groups`` counts
      them); a sample with no finite component has no advantage (``scored`` is False, advantage 0).

    Args:
        components: (C, N) each weighted component's value per sample, NaN where it failed.
        weights: (C,) the weight of each component (non-zero).
        group_ids: (N,) integer group of each sample.
        std: the scale of each component's normalisation, as above.
        eps: added to each std.

    Returns:
        :class:`GDPOAdvantages`.

    Example:
        >>> strict = torch.tensor([1.0, 0.0, 1.0, 1.0])
        >>> partial = torch.tensor([1.0, 0.5, float("nan"), 0.5])
        >>> out = gdpo_advantages(torch.stack([strict, partial]), [1.0, 0.5], torch.tensor([0, 0, 1, 1]))
        >>> [round(a, 4) for a in out.advantages.tolist()]
        [1.4141, -1.4141, 0.0, 0.0]
        >>> out.scored.tolist(), out.empty_groups.tolist()
        ([True, True, True, True], [0, 0])
    """
    if components.ndim != 2:
        raise ValueError(f"components must be 2-D (C, N), got shape {tuple(components.shape)}")
    weights = torch.as_tensor(weights, dtype=torch.float64, device=components.device)
    if weights.shape != (components.shape[0],):
        raise ValueError(
            f"weights {tuple(weights.shape)} must have one entry per component ({components.shape[0]})"
        )
    if group_ids.shape != components.shape[1:]:
        raise ValueError(
            f"group_ids {tuple(group_ids.shape)} must have shape (N,) = ({components.shape[1]},)"
        )
    _check_group_settings(group_ids, std, eps)
    out_dtype = components.dtype if components.dtype.is_floating_point else torch.float32
    count_c, n = components.shape
    if n == 0:
        empty = torch.zeros(count_c, dtype=torch.long, device=components.device)
        return GDPOAdvantages(components.new_zeros(0, dtype=out_dtype), group_ids.bool(), empty)

    finite = torch.isfinite(components)  # (C, N)
    r = torch.where(finite, components.to(torch.float64), 0.0)  # fp64: exact enough for any batch
    ones = finite.to(torch.float64)
    _, group = torch.unique(group_ids, return_inverse=True)  # (N,) dense ids 0..G-1
    num_groups = int(group.max()) + 1

    def per_group(x: Tensor) -> Tensor:  # (C, N) -> (C, G) sums over each group's samples
        return torch.zeros(count_c, num_groups, dtype=x.dtype, device=x.device).index_add_(1, group, x)

    count = per_group(ones)
    mean = per_group(r) / count.clamp_min(1)
    centred = torch.where(finite, r - mean[:, group], 0.0)  # (C, N), 0 where the component failed
    if std == "group":
        scale = torch.sqrt(per_group(centred**2) / count.clamp_min(1))[:, group]
    else:
        n_k = ones.sum(dim=1, keepdim=True).clamp_min(1)
        spread = torch.where(finite, r - r.sum(dim=1, keepdim=True) / n_k, 0.0)
        scale = torch.sqrt((spread**2).sum(dim=1, keepdim=True) / n_k)  # (C, 1)
    combined = (weights[:, None] * (centred / (scale + eps))).sum(dim=0)  # (N,) fp64
    scored = finite.any(dim=0)
    batch_std = combined[scored].std(correction=0) if bool(scored.any()) else combined.new_zeros(())
    advantages = torch.where(scored, combined / (batch_std + eps), 0.0)
    return GDPOAdvantages(advantages.to(out_dtype), scored, (count == 0).sum(dim=1))


def win_rates(scores: Tensor) -> Tensor:
    """Each sample's win rate against the rest of the batch: the fraction of the other scored samples
    it beats, a tie counting half.

    w_i = (#{j ≠ i: s_j < s_i} + ½·#{j ≠ i: s_j = s_i}) / (n − 1) over the n finite scores; NaN where
    s_i is not finite, 0.5 for a lone finite score. A rank statistic: rewards on different scales
    become comparable, which is what GARDO's disagreement between reward models needs.

    >>> win_rates(torch.tensor([0.1, 0.5, 0.5, float("nan")]))
    tensor([0.0000, 0.7500, 0.7500,    nan])
    """
    s = scores.detach().to(torch.float64)
    ok = torch.isfinite(s)
    out = torch.full_like(s, float("nan"))
    n = int(ok.sum())
    if n == 0:
        return out.to(scores.dtype if scores.dtype.is_floating_point else torch.float32)
    v = s[ok]
    below = (v[None, :] < v[:, None]).sum(dim=1).to(torch.float64)  # (n,) O(n²): n is one batch
    ties = (v[None, :] == v[:, None]).sum(dim=1).to(torch.float64) - 1  # minus itself
    out[ok] = (below + 0.5 * ties) / (n - 1) if n > 1 else torch.full_like(v, 0.5)
    return out.to(scores.dtype if scores.dtype.is_floating_point else torch.float32)


def gardo_uncertainty(proxy: Tensor, auxiliary: Tensor) -> Tensor:
    """How much more the trained (proxy) reward thinks of each sample than the auxiliary rewards do.

    u_i = w_proxy(i) − mean_k w_aux_k(i), with w the :func:`win_rates` over the batch (GARDO,
    arXiv:2512.24138, Sec. 4.1: the reward's uncertainty from its disagreement with auxiliary reward
    models, as ranks). u > 0: the proxy rates the sample above what the others see in it, the samples a
    gamed reward over-rates. An auxiliary score that is missing (NaN) is left out of that sample's mean;
    NaN where the proxy or every auxiliary is missing.

    Args:
        proxy: (N,) the trained reward of every sample.
        auxiliary: (K, N) K ≥ 1 auxiliary rewards of the same samples.

    Note: GARDO's released script ranks in descending order and subtracts the other way round, which
    gates the samples the proxy under-rates; the paper's text and its aim are the samples it over-rates,
    which is what this computes.
    """
    if auxiliary.ndim != 2 or auxiliary.shape[1] != proxy.shape[0] or auxiliary.shape[0] < 1:
        raise ValueError(
            f"auxiliary must be (K, N) with K >= 1 and N = {proxy.shape[0]} samples; got {tuple(auxiliary.shape)}"
        )
    w_aux = torch.stack([win_rates(a) for a in auxiliary]).to(torch.float64)  # (K, N)
    return (win_rates(proxy).to(torch.float64) - w_aux.nanmean(dim=0)).float()  # (N,)


def gated_kl_weights(uncertainty: Tensor, fraction: float, trained: Tensor | None = None) -> Tensor:
    """GARDO's gate as per-sample weights of the KL penalty: the samples whose uncertainty is positive
    and among the top ``fraction`` of the positive ones get weight 1/(fraction of the trained samples
    gated), the rest 0.

    The gate g_i = [u_i > 0 and u_i ≥ q], q the (1 − ``fraction``) quantile of the positive u (GARDO's
    released script: the ``100 − 100·fraction`` percentile of the non-negative ones), over the whole
    batch as GARDO gates before it drops any sample. The weights are normalised over what the update
    trains (``trained``: scored, and a non-zero advantage under ``filter_zero``), since the update's loss
    is a mean over those rows: w_i = g_i·K/Σ_{trained} g for the K trained samples, 0 for the rest, so
    β·mean_{trained}(w·KL) = β·mean of KL over the gated trained samples exactly, whatever the
    micro-batches and ranks it is split over (normalised over the whole batch instead, the effective β
    would drift with the share of gated samples dropped). GARDO's script takes that mean per
    micro-batch instead (:class:`~lit_flowgrpo.advantages.KLGate` converts). A sample with NaN
    uncertainty (a reward missing) is gated: unjudged is not trusted. All zero when no trained sample
    is gated.

    >>> gated_kl_weights(torch.tensor([-0.2, 0.1, 0.3, 0.2]), fraction=0.5)
    tensor([0., 0., 2., 2.])
    >>> gated_kl_weights(torch.tensor([-0.2, 0.1, 0.3, 0.2]), 0.5, trained=torch.tensor([1, 1, 0, 1]).bool())
    tensor([0., 0., 0., 3.])
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction ({fraction}) must lie in (0, 1]")
    if trained is not None and trained.shape != uncertainty.shape:
        raise ValueError(
            f"trained {tuple(trained.shape)} must have the shape of uncertainty {tuple(uncertainty.shape)}"
        )
    u = uncertainty.detach().to(torch.float64)
    keep = torch.ones_like(u, dtype=torch.bool) if trained is None else trained.to(u.device, torch.bool)
    positive = u[u > 0]
    gate = torch.isnan(u)
    if positive.numel():
        q = torch.quantile(positive, 1 - fraction)
        gate |= (u > 0) & (u >= q)
    gate &= keep
    count = int(gate.sum())
    if count == 0:
        return torch.zeros_like(uncertainty, dtype=torch.float32)
    return (gate.to(torch.float64) * (int(keep.sum()) / count)).float()


def diversity_multipliers(
    features: Tensor, group_ids: Tensor, advantages: Tensor, *, distance: Literal["mse", "cosine"] = "cosine"
) -> Tensor:
    """GARDO's diversity-aware advantage (arXiv:2512.24138, Sec. 4.3): a positive advantage is scaled
    by how far its sample lies from the rest of its group.

    d_i = min_{j ≠ i, g(j) = g(i)} dist(f_i, f_j), the distance to the nearest other sample of the same
    prompt; m_i = d_i / mean_{g(i)}(d) where A_i > 0, 1 elsewhere (GARDO's ``stat_tracking.py``: the
    nearest-neighbour distance over its group mean, applied where the reward is above the group's
    mean). So a good sample that repeats its neighbours gains less than one that found something
    new, and a poor sample is never rewarded for being odd. ``dist``: ``cosine`` 1 − cos (GARDO's, on
    DINOv3 features), ``mse`` the mean squared difference per feature. A group of one, or one whose
    samples are all alike (mean d = 0), gets multiplier 1. Non-finite features give multiplier 1, and so
    does an all-zero feature under ``cosine`` (an all-black image's pooled pixels): it has no direction,
    so no cosine distance; it is left out of its group as a non-finite one is, neither judged nor a
    neighbour. (Taken as the zero vector it would lie at distance 1 from everything, the farthest
    possible for non-negative features, and get the largest bonus of its group; GARDO's own code
    divides by its norm and gets NaN there, which DINOv3 features never reach.)

    What the multipliers scale differs from GARDO's code: its ``stat_tracking.py`` multiplies the raw
    centred reward r_i − mean_{g(i)}(r), this package the advantage after its usual normalisation,
    (r_i − mean)/(std + 1e-4). With ``std: global`` the two differ by the one positive factor
    1/(std + 1e-4) of the batch: the same update direction, at GARDO's β when ours is
    β_GARDO/(std + 1e-4) (with ``std: group`` each group's own std, which also reweights the groups).

    Args:
        features: (N, F) one feature vector per sample.
        group_ids: (N,) integer group of each sample.
        advantages: (N,) the advantages the multipliers will scale (only their sign is read).

    Returns:
        (N,) fp32 multipliers, mean 1 over each group's samples with d (before the sign rule).
    """
    _check_group_settings(group_ids, "global", 0.0)
    if distance not in ("mse", "cosine"):
        raise ValueError(f"distance ({distance!r}) must be 'mse' or 'cosine'")
    x = features.detach().to(torch.float64)
    ok = torch.isfinite(x).all(dim=1)
    if distance == "cosine":
        norm = x.norm(dim=1, keepdim=True)  # (N, 1)
        ok &= norm[:, 0] > 0  # no direction, no cosine: left out as a non-finite feature is
        x = x / norm.clamp_min(torch.finfo(torch.float64).tiny)
    mult = torch.ones(len(x), dtype=torch.float64, device=x.device)
    for g in torch.unique(group_ids[ok]):
        members = torch.nonzero((group_ids == g) & ok).flatten()
        if len(members) < 2:
            continue
        f = x[members]
        # (n_g, n_g): 1 − cos of unit vectors, or the mean squared difference per feature
        dist = (1 - f @ f.T).clamp_min(0) if distance == "cosine" else torch.cdist(f, f) ** 2 / f.shape[1]
        dist.fill_diagonal_(float("inf"))
        nearest = dist.min(dim=1).values  # (n_g,)
        scale = nearest.mean()
        if scale > 0:
            mult[members] = torch.where(advantages[members] > 0, nearest / scale, torch.ones_like(nearest))
    return mult.float()


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
    adv_clip_max: float | None,
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
    if adv_clip_max is not None and not adv_clip_max > 0:
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
    _check_loss_args(log_prob, old_log_prob, advantages, 0.0, None, adv_clip_max)
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


# --------------------------------------------------------------------------------------------------
# DiffusionNFT: negative-aware fine-tuning on the forward process
# --------------------------------------------------------------------------------------------------

NFTRewardMode = Literal["continuous", "positive_only", "negative_only", "one_only", "binary"]

NFT_DECAY_SCHEDULES: dict[str, tuple[int, float, float]] = {
    "copy": (0, 0.0, 0.0),
    "linear_to_0_5": (0, 1e-3, 0.5),
    "delayed_linear_to_0_999": (75, 7.5e-3, 0.999),
}
"""DiffusionNFT's old-policy decay schedules as (delay, rate, cap) for :func:`nft_old_policy_decay`.

``decay_type`` 0, 1, 2 of the reference's ``return_decay`` (``scripts/train_nft_sd3.py``), under
verl-omni's names (``old_policy_decay_schedule``). The reference's default is
``linear_to_0_5``; its OCR recipe uses ``delayed_linear_to_0_999``."""


def nft_old_policy_decay(step: int, *, delay: int = 0, rate: float = 1e-3, cap: float = 0.5) -> float:
    """The decay η of DiffusionNFT's old policy after ``step`` optimizer steps.

    The old policy (the rollout's, and the anchor of the implicit policies in :func:`nft_loss`) is
    a second adapter refreshed once per rollout batch, after the update, as
    θ_old ← η·θ_old + (1 − η)·θ, with η = 0 for step < delay and min((step − delay)·rate, cap)
    after: a copy at first, an increasingly slow average later (the paper's soft update of the
    sampling policy; the reference's ``return_decay`` in ``scripts/train_nft_sd3.py``, called with
    the global optimizer-step count). The defaults are the reference's default schedule
    (``decay_type`` 1); :data:`NFT_DECAY_SCHEDULES` has the published ones by name.

    Args:
        step: optimizer steps taken so far (>= 0).
        delay: steps during which the old policy is a plain copy (η = 0).
        rate: growth of η per step after the delay.
        cap: the largest η.

    Returns:
        η in [0, cap].
    """
    if step < 0:
        raise ValueError(f"step ({step}) must be >= 0")
    if delay < 0:
        raise ValueError(f"delay ({delay}) must be >= 0")
    if not rate >= 0:
        raise ValueError(f"rate ({rate}) must be >= 0")
    if not 0 <= cap <= 1:
        raise ValueError(f"cap ({cap}) must be in [0, 1]: η weighs the old policy in a convex average")
    if step < delay:
        return 0.0
    return min((step - delay) * rate, cap)


def nft_reward_probability(
    advantages: Tensor,
    *,
    adv_clip_max: float = 5.0,
    mode: NFTRewardMode = "continuous",
) -> Tensor:
    """DiffusionNFT's optimality probability r ∈ [0, 1] of each sample, from its advantage.

    The paper (Zheng et al. 2025, arXiv:2509.16117; Sec. 3.3 and Algorithm 1 as verl-omni's
    ``DiffusionNFTLoss._compute_group_advantages`` cites it) maps the raw reward to
    r = 1/2 + 1/2·clip((r_raw − E_{π_old}[r_raw | c]) / Z_c, −1, 1). The reference code
    (``scripts/train_nft_sd3.py``) computes it from the group advantage A = (r_raw − mean_c)/(std + 1e-4)
    of :func:`group_advantages` as r = clip(A, ±M)/(2M) + 1/2 with M = ``adv_clip_max``, i.e. the
    paper's form with Z_c = M·(std + 1e-4). ``mode`` is the reference's ``adv_mode`` ablations, applied
    to the clipped advantage before the map: ``"continuous"`` (the published setting, ``"all"`` in the
    reference) keeps it, ``"positive_only"``/``"negative_only"`` zero the other sign, ``"one_only"``
    makes it 1 where A > 0 and 0 elsewhere, ``"binary"`` takes its sign.

    Args:
        advantages: (N,) advantages (any float dtype).
        adv_clip_max: M, the advantage that maps to r = 1 (published 5).
        mode: see above.

    Returns:
        (N,) r in the advantages' dtype; A = 0 gives exactly 1/2.
    """
    if not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max ({adv_clip_max}) must be > 0 (DiffusionNFT uses 5.0)")
    if not advantages.dtype.is_floating_point:
        raise ValueError(f"advantages must be a floating tensor, got {advantages.dtype}")
    adv = advantages.clamp(-adv_clip_max, adv_clip_max)
    if mode == "positive_only":
        adv = adv.clamp_min(0.0)
    elif mode == "negative_only":
        adv = adv.clamp_max(0.0)
    elif mode == "one_only":
        adv = (adv > 0).to(adv.dtype)
    elif mode == "binary":
        adv = torch.sign(adv)
    elif mode != "continuous":
        raise ValueError(
            f"mode ({mode!r}) must be one of 'continuous', 'positive_only', 'negative_only', 'one_only', 'binary'"
        )
    return (adv / adv_clip_max * 0.5 + 0.5).clamp(0.0, 1.0)


def nft_sample_times(
    sigmas: Tensor,
    batch_size: int,
    *,
    timestep_fraction: float = 0.99,
    generator: torch.Generator | None = None,
) -> Tensor:
    """The noise levels at which DiffusionNFT's update visits each sample.

    The reference (``scripts/train_nft_sd3.py``; verl-omni's ``_select_train_timesteps`` is the same)
    trains on the sampler's own schedule: per sample, a uniformly random permutation of the T
    rollout sigmas, of which the first K = max(1, ⌊T·timestep_fraction⌋) are visited, one forward
    and backward each, each with fresh noise ε (the caller draws it), the losses averaged over the
    K visits. With the published 10 sampling steps and fraction 0.99 that is 9 distinct sigmas of
    10, the left-out one random per sample.

    Args:
        sigmas: (T,) the rollout's sigmas of its T steps, each in (0, 1]: the schedule without its
            terminal 0 (``sd3_sigmas(T)[:-1]``), where σ = 0 would make x_σ = x0 and carry no signal.
        batch_size: B, the number of samples.
        timestep_fraction: the fraction of the T sigmas each sample visits (published 0.99).
        generator: for reproducible draws.

    Returns:
        (B, K) sigmas in ``sigmas``' dtype and device; each row holds K distinct entries.
    """
    if sigmas.ndim != 1 or sigmas.numel() == 0:
        raise ValueError(f"sigmas must be a non-empty 1-D (T,) schedule, got shape {tuple(sigmas.shape)}")
    if not bool(((sigmas > 0) & (sigmas <= 1)).all()):
        raise ValueError("sigmas must lie in (0, 1]: pass the schedule without its terminal 0")
    if batch_size < 1:
        raise ValueError(f"batch_size ({batch_size}) must be >= 1")
    if not 0 < timestep_fraction <= 1:
        raise ValueError(f"timestep_fraction ({timestep_fraction}) must be in (0, 1] (published: 0.99)")
    num_steps = sigmas.numel()
    visits = max(1, int(num_steps * timestep_fraction))  # the reference's int(), not round()
    device = generator.device if generator is not None else sigmas.device
    keys = torch.rand(batch_size, num_steps, generator=generator, device=device)  # (B, T) i.i.d. keys
    order = keys.argsort(dim=1)[:, :visits].to(sigmas.device)  # (B, K) a uniform permutation's head
    return sigmas[order]


@dataclass
class NFTStats:
    """Per-sample (B,) statistics of one DiffusionNFT loss evaluation, all detached, fp32."""

    r: Tensor
    """The optimality probability each sample's loss used."""
    positive_loss: Tensor
    """The implicit positive policy's weighted x0 regression loss (what r multiplies)."""
    negative_loss: Tensor
    """The implicit negative policy's weighted x0 regression loss (what 1 − r multiplies)."""
    loss: Tensor
    """adv_clip_max·(r·positive_loss + (1 − r)·negative_loss)/β: the loss is its mean."""
    positive_error: Tensor
    """mean((v⁺ − v)²): the implicit positive policy's velocity error, unweighted."""
    negative_error: Tensor
    """mean((v⁻ − v)²): the implicit negative policy's velocity error, unweighted."""
    old_deviation: Tensor
    """mean((v_θ − v_old)²): how far the trained policy has moved from the old one here."""


def nft_loss(
    v_theta: Tensor,
    v_old: Tensor,
    x0: Tensor,
    noise: Tensor,
    sigma: Tensor | float,
    r: Tensor,
    *,
    beta: float = 1.0,
    adv_clip_max: float = 5.0,
    adaptive_weight: bool = True,
    adaptive_weight_min: float = 1e-5,
) -> tuple[Tensor, NFTStats]:
    """DiffusionNFT's negative-aware flow-matching loss at one noise level per sample.

    Zheng et al. 2025 (arXiv:2509.16117, the policy-optimization objective of its method section)
    train v_θ on forward-noised final samples x_σ = (1−σ)·x0 + σ·ε, target v = ε − x0, through two
    implicit policies anchored at the old policy v_old (no gradient):

        v⁺ = (1 − β)·v_old + β·v_θ,    v⁻ = (1 + β)·v_old − β·v_θ,
        L = E[r·‖v⁺ − v‖² + (1 − r)·‖v⁻ − v‖²].

    As the reference code computes it (``scripts/train_nft_sd3.py``, the policy loss; verl-omni's
    ``DiffusionNFTLoss`` and UniRL's ``DiffusionNFT._compute_loss_at_t`` are the same), which this
    follows, with three details the paper's formula leaves out:

    - **x0 regression with adaptive weighting.** Each branch is scored on its x0 prediction
      x̂0± = x_σ − σ·v±, L± = mean((x̂0± − x0)²) / w±, with w± = max(mean|x̂0± − x0|, 1e-5), a
      per-sample constant of the backward (the reference takes the mean in float64 against bf16
      underflow; here it is fp32, like all step math). Since x̂0± − x0 = −σ·(v± − v), this is
      L± = σ·mean(e±²)/mean|e±| with e± = v± − v (while the floor does not bind): the paper's
      velocity loss re-weighted per sample and per noise level.
    - **Scale.** The per-sample loss is (r·L⁺ + (1 − r)·L⁻)/β, and the batch mean is multiplied by
      M = ``adv_clip_max``. The gradient wrt v_θ is (2·M·σ²/D)·(r·e⁺/w⁺ − (1 − r)·e⁻/w⁻) per
      sample (D elements, before the batch mean); on-policy (v_θ = v_old, so e⁺ = e⁻ = e and
      w⁺ = w⁻ = w) that is (2σ²/D)·clip(A, ±M)·e/w in the continuous mode of
      :func:`nft_reward_probability`: both factors cancel from the first step's size.
    - **Per element mean.** Squares are averaged over the non-batch elements, the package's unit.

    The implicit policies are computed as v_old ± β·(v_θ − v_old), algebraically the paper's
    forms, so that on-policy (v_θ = v_old) v⁺ = v⁻ = v_old exactly in fp32; the x0 errors as
    σ·(v± − v), algebraically the reference's x_σ − σ·v± − x0 without its cancellation. The
    reference also adds a KL-like regulariser 1e-4·mean((v_θ − v_ref)²) to the reference policy; that
    is the objective's KL term, not part of this loss.

    Args:
        v_theta: (B, ...) the trained policy's velocity at (x_σ, σ) (differentiable).
        v_old: (B, ...) the old policy's velocity at the same point (treated as a constant).
        x0: (B, ...) the final samples of the rollout.
        noise: (B, ...) the ε that made x_σ.
        sigma: (B,) or scalar σ of each sample, in [0, 1].
        r: (B,) optimality probabilities in [0, 1] (:func:`nft_reward_probability`).
        beta: β > 0, the guidance strength (published 1.0; 0.1 in the OCR and multi-reward recipes).
        adv_clip_max: M, the loss scale (published 5; the same M as in :func:`nft_reward_probability`).
        adaptive_weight: the reference's x0 weighting (``True``, published); ``False`` gives
            L± = mean((x̂0± − x0)²).
        adaptive_weight_min: the floor of w± (published 1e-5).

    Returns:
        (scalar fp32 loss, :class:`NFTStats`).
    """
    shape = v_theta.shape
    if v_theta.ndim < 2 or v_old.shape != shape or x0.shape != shape or noise.shape != shape:
        raise ValueError(
            f"v_theta {tuple(shape)}, v_old {tuple(v_old.shape)}, x0 {tuple(x0.shape)} and noise "
            f"{tuple(noise.shape)} must share one batch-first shape (B, ...)"
        )
    batch = shape[0]
    if r.shape != (batch,):
        raise ValueError(f"r must be (B,) = ({batch},), got shape {tuple(r.shape)}")
    if not beta > 0:
        raise ValueError(f"beta ({beta}) must be > 0 (DiffusionNFT uses 1.0, or 0.1)")
    if not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max ({adv_clip_max}) must be > 0 (DiffusionNFT uses 5.0)")
    if not adaptive_weight_min > 0:
        raise ValueError(f"adaptive_weight_min ({adaptive_weight_min}) must be > 0 (DiffusionNFT uses 1e-5)")
    sig = _per_batch(torch.as_tensor(sigma, device=v_theta.device), "sigma", batch).float()  # (B,) fp32
    if not bool(((sig >= 0) & (sig <= 1)).all()):
        raise ValueError("sigma must lie in [0, 1]")
    if not bool(((r >= 0) & (r <= 1)).all()):
        raise ValueError("r must lie in [0, 1]: map advantages with nft_reward_probability")

    elems = tuple(range(1, len(shape)))
    t = sig.view(batch, *([1] * (len(shape) - 1)))  # (B, 1, ...) fp32
    target = noise.float() - x0.float()  # (B, ...) fp32, v = ε − x0
    old_err = v_old.detach().float() - target  # (B, ...) fp32
    step = beta * (v_theta.float() - v_old.detach().float())  # (B, ...) β·(v_θ − v_old), differentiable
    pos_err = old_err + step  # v⁺ − v
    neg_err = old_err - step  # v⁻ − v
    pos_x0_err = t * pos_err  # (B, ...) −(x̂0⁺ − x0)
    neg_x0_err = t * neg_err
    pos_sq = (pos_x0_err**2).mean(dim=elems)  # (B,) fp32
    neg_sq = (neg_x0_err**2).mean(dim=elems)
    if adaptive_weight:
        with torch.no_grad():
            pos_w = pos_x0_err.abs().mean(dim=elems).clamp_min(adaptive_weight_min)  # (B,)
            neg_w = neg_x0_err.abs().mean(dim=elems).clamp_min(adaptive_weight_min)
        pos_loss, neg_loss = pos_sq / pos_w, neg_sq / neg_w
    else:
        pos_loss, neg_loss = pos_sq, neg_sq
    prob = r.float()
    per_sample = adv_clip_max * (prob * pos_loss + (1.0 - prob) * neg_loss) / beta  # (B,) fp32
    with torch.no_grad():
        stats = NFTStats(
            r=prob.detach(),
            positive_loss=pos_loss.detach(),
            negative_loss=neg_loss.detach(),
            loss=per_sample.detach(),
            positive_error=(pos_err**2).mean(dim=elems),
            negative_error=(neg_err**2).mean(dim=elems),
            old_deviation=((v_theta.detach().float() - v_old.float()) ** 2).mean(dim=elems),
        )
    return per_sample.mean(), stats
