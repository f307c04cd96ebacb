"""DiffusionNFT (Zheng et al. 2025, arXiv:2509.16117): negative-aware fine-tuning on the forward process
(pure): the optimality probability, the visited noise levels, the old policy's decay and the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from lit_flowgrpo.algorithms.losses import per_batch

__all__ = [
    "NFT_DECAY_SCHEDULES",
    "NFTRewardMode",
    "NFTStats",
    "nft_loss",
    "nft_old_policy_decay",
    "nft_reward_probability",
    "nft_sample_times",
]


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
    sig = per_batch(torch.as_tensor(sigma, device=v_theta.device), "sigma", batch).float()  # (B,) fp32
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
