"""Losses that learn from given images (pure): supervised flow matching (SFT) and Diffusion-DPO in its
flow-matching form, the training noise levels they visit, and the preference pairs of a rollout's groups.

Conventions (DESIGN.md): x_σ = (1 − σ)·x0 + σ·ε, the network predicts the velocity v = ε − x0.

Sources:

- SFT: diffusers' ``examples/dreambooth/train_dreambooth_sd3.py`` and ``train_dreambooth_lora_sd3.py``
  (and the SD3 paper, Esser et al. 2024, §3.1): σ from ``compute_density_for_timestep_sampling``
  (logit-normal, mode or uniform) as an index ⌊u·N⌋ into the training scheduler's N = 1000 sigmas,
  which the scheduler has shifted (``FlowMatchEulerDiscreteScheduler.from_pretrained``: SD3.5's shift 3),
  the loss mean_n(mean_elements(w(σ_n)·(v_θ − (ε − x0))²)) with w from
  ``compute_loss_weighting_for_sd3``. Both diffusers functions are called, not rewritten. Those two
  scripts default to ``--precondition_outputs 1``: the loss on the x0 estimate x_σ − σ·v_θ against x0,
  which is σ²·(v_θ − (ε − x0))² (x_σ − x0 = σ·(ε − x0)); ``precondition=True`` gives that, the default
  (False) the velocity loss of flow_grpo's ``scripts/train_sd3_sft.py`` (the same σ draw, w = 1).
- Diffusion-DPO: Wallace et al. 2023 (arXiv:2311.12908), eq. 14, as its released training script and
  diffusers' ``examples/research_projects/diffusion_dpo/train_diffusion_dpo.py`` compute it: chosen (w)
  and rejected (l) image noised with the same ε at the same σ; e = mean_elements((pred − target)²) for
  the trained model and the reference; ``inside = −β/2 · ((e_w − e_l) − (e_w^ref − e_l^ref))``;
  loss = mean over pairs of −log σ(inside); implicit accuracy = share of inside > 0. The flow-matching
  form, with the velocity ε − x0 as the target instead of ε, is what flow_grpo's
  ``scripts/train_sd3_dpo.py``, Flow-Factory's ``trainers/dpo.py`` and verl-omni's ``DPOLoss``
  (``docs/algo/diffusion_dpo.md``) compute, each exactly so: the per-sample mean over all elements of
  the squared error, −0.5·β, ``-logsigmoid(...).mean()`` over pairs, one ε shared by a pair, and σ
  drawn logit-normal (0, 1) as an index into the shifted training sigmas (flow_grpo, verl-omni;
  Flow-Factory draws t from a shifted logit-normal directly). The paper's T·ω(λ_t) factor is folded
  into β as in every released script. β: 100 in flow_grpo's and Flow-Factory's SD3.5 recipes and
  verl-omni's Qwen-Image one (verl-omni's config default 2000); 5000 in the paper's SD1.5/SDXL runs,
  on ε errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "DPOStats",
    "WeightingScheme",
    "diffusion_dpo_loss",
    "flow_matching_errors",
    "preference_pairs",
    "sft_loss",
    "training_sigma",
]

#: diffusers' names (``compute_density_for_timestep_sampling`` / ``compute_loss_weighting_for_sd3``):
#: ``logit_normal`` and ``mode`` shape where σ is drawn, ``sigma_sqrt`` and ``cosmap`` weigh the loss,
#: ``none`` draws σ uniformly with weight 1.
WeightingScheme = Literal["logit_normal", "mode", "sigma_sqrt", "cosmap", "none"]


def training_sigma(
    scheme: WeightingScheme,
    train_sigmas: Tensor,
    generator: torch.Generator,
    *,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
) -> Tensor:
    """One training noise level σ (a 0-d fp32 tensor) drawn as diffusers' SD3 training scripts draw it.

    u ~ ``compute_density_for_timestep_sampling(scheme, 1, ...)`` in [0, 1), then σ =
    ``train_sigmas[int(u · N)]``, ``train_sigmas`` the scheduler's N training sigmas in its own order
    (``FlowMatchEulerDiscreteScheduler(shift=s).sigmas``: from 1 down to 1/N, shifted).

    >>> from diffusers import FlowMatchEulerDiscreteScheduler
    >>> sigmas = FlowMatchEulerDiscreteScheduler(shift=3.0).sigmas
    >>> s = training_sigma("logit_normal", sigmas, torch.Generator().manual_seed(0))
    >>> 0 < float(s) <= 1
    True
    """
    from diffusers.training_utils import compute_density_for_timestep_sampling

    u = compute_density_for_timestep_sampling(
        scheme, 1, logit_mean=logit_mean, logit_std=logit_std, mode_scale=mode_scale, generator=generator
    )
    index = (u * len(train_sigmas)).long().clamp_(max=len(train_sigmas) - 1)  # as the scripts index
    return train_sigmas[index[0]].float()


def flow_matching_errors(
    velocity: Tensor, x0: Tensor, noise: Tensor, weights: Tensor | None = None
) -> Tensor:
    """(N,) fp32: each sample's mean over its elements of w·(v − (ε − x0))² (w: (N,) or ``None`` for 1)."""
    target = noise.float() - x0.float()  # v = ε − x0
    sq = (velocity.float() - target) ** 2
    if weights is not None:
        sq = weights.float().view(-1, *([1] * (sq.ndim - 1))) * sq
    return sq.mean(dim=tuple(range(1, sq.ndim)))


def sft_loss(
    velocity: Tensor,
    x0: Tensor,
    noise: Tensor,
    sigma: Tensor,
    scheme: WeightingScheme,
    *,
    precondition: bool = False,
) -> tuple[Tensor, Tensor]:
    """The flow-matching loss on data and its per-sample terms: (scalar, (N,) fp32).

    loss = mean_n mean_elements(w(σ_n)·(v_θ − (ε − x0))²), w = ``compute_loss_weighting_for_sd3(scheme, σ)``
    (flow_grpo's SFT script; diffusers' SD3 DreamBooth scripts at ``--precondition_outputs 0``). With
    ``precondition`` w is multiplied by σ²: the scripts' default, a loss on x_σ − σ·v_θ against x0.
    """
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    weights = compute_loss_weighting_for_sd3(scheme, sigma.float())
    if precondition:
        weights = weights * sigma.float() ** 2  # (x_σ − σ·v − x0)² = σ²·(v − (ε − x0))²
    per_sample = flow_matching_errors(velocity, x0, noise, weights)
    return per_sample.mean(), per_sample


@dataclass
class DPOStats:
    """Per-pair statistics of :func:`diffusion_dpo_loss`, each (N,) fp32, detached."""

    loss: Tensor
    """−log σ(inside)."""
    margin: Tensor
    """inside = −β/2·((e_w − e_l) − (e_w^ref − e_l^ref)): the implicit reward margin, the logit of the
    modelled preference for the chosen image; > 0 counts as an implicit-reward hit."""
    model_diff: Tensor
    """e_w − e_l of the trained model."""
    ref_diff: Tensor
    """e_w^ref − e_l^ref of the reference."""
    chosen_error: Tensor
    """e_w."""
    rejected_error: Tensor
    """e_l."""


def diffusion_dpo_loss(
    chosen_error: Tensor,
    rejected_error: Tensor,
    ref_chosen_error: Tensor,
    ref_rejected_error: Tensor,
    *,
    beta: float,
) -> tuple[Tensor, DPOStats]:
    """Diffusion-DPO's loss (Wallace et al. 2023, eq. 14; the released script's constants) from the
    per-pair flow-matching errors e = mean_elements((v − (ε − x0))²) of the chosen (w) and rejected (l)
    images, noised alike, under the trained model and the reference.

    inside = −β/2 · ((e_w − e_l) − (e_w^ref − e_l^ref)),  loss = mean(−log σ(inside)).

    At the start (model = reference) inside = 0 and the loss is log 2; lowering e_w or raising e_l
    relative to the reference raises inside.
    """
    model_diff = chosen_error.float() - rejected_error.float()  # (N,)
    ref_diff = ref_chosen_error.float() - ref_rejected_error.float()  # (N,)
    inside = -0.5 * beta * (model_diff - ref_diff)  # (N,) fp32
    per_pair = -F.logsigmoid(inside)
    stats = DPOStats(
        loss=per_pair.detach(),
        margin=inside.detach(),
        model_diff=model_diff.detach(),
        ref_diff=ref_diff.detach(),
        chosen_error=chosen_error.detach().float(),
        rejected_error=rejected_error.detach().float(),
    )
    return per_pair.mean(), stats


def preference_pairs(rewards: Tensor, group_ids: Tensor, sample_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Online pairs from a rollout's groups: in each group the sample with the highest reward is chosen
    and the one with the lowest rejected (ties: the lower sample id); a group whose rewards are all
    equal, or that has fewer than two finite rewards, makes no pair.

    Args:
        rewards: (B,) every sample's reward (NaN: unscored, left out).
        group_ids: (B,) int64.
        sample_ids: (B,) int64, unique.

    Returns:
        (chosen, rejected): (P,) int64 positions in the inputs, one pair per group with a spread,
        ordered by group id.

    >>> r = torch.tensor([0.0, 1.0, 0.5, 0.5, 0.5, 1.0])
    >>> preference_pairs(r, torch.tensor([0, 0, 0, 1, 1, 1]), torch.arange(6))
    (tensor([1, 5]), tensor([0, 3]))
    """
    chosen, rejected = [], []
    finite = rewards.isfinite()
    for g in torch.unique(group_ids, sorted=True).tolist():
        rows = ((group_ids == g) & finite).nonzero().flatten()
        if len(rows) < 2:
            continue
        r, ids = rewards[rows].double(), sample_ids[rows]
        if not float(r.max()) > float(r.min()):
            continue
        # Highest reward first, then the lower sample id; lowest reward first, then the lower id.
        best = rows[torch.tensor(sorted(range(len(rows)), key=lambda i: (-float(r[i]), int(ids[i])))[0])]
        worst = rows[torch.tensor(sorted(range(len(rows)), key=lambda i: (float(r[i]), int(ids[i])))[0])]
        chosen.append(int(best))
        rejected.append(int(worst))
    return torch.tensor(chosen, dtype=torch.long), torch.tensor(rejected, dtype=torch.long)
