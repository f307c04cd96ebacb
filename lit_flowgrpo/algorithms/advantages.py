"""From rewards to advantages (pure): group normalisation, GDPO, and GARDO's uncertainty, KL gate and
diversity multipliers.

Every function takes every rank's values of one rollout batch and returns tensors; the advantage stage
(:mod:`lit_flowgrpo.advantages`) gathers them, holds the gate controller's state and reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "GDPOAdvantages",
    "diversity_multipliers",
    "gardo_uncertainty",
    "gated_kl_weights",
    "gdpo_advantages",
    "group_advantages",
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
    micro-batch instead (:class:`~lit_flowgrpo.kl.KLGate` converts). A sample with NaN
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
