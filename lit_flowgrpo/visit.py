"""What one visit of the policy update is given and computes: the contract between the update loop
(:mod:`lit_flowgrpo.update`) and the objectives (:mod:`lit_flowgrpo.objective`, which re-exports these).

- :class:`VisitContext`: what stays fixed over one update (the networks, the copies of the weights, the
  CFG scale, the reference's clock, the seed of the draws);
- :class:`Visit`: what one visit returns (its loss, the parts logged, the on-policy check, the
  diagnostics' inputs);
- :class:`ScoredStep`: one trained step of a micro-batch scored under the current policy, the input of
  a ratio objective's policy loss.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from lit_flowgrpo.copies import Copies
from lit_flowgrpo.kl import KLSettings
from lit_flowgrpo.policies.base import FlowPolicy

__all__ = ["ScoredStep", "Visit", "VisitContext"]


@dataclass
class VisitContext:
    """What stays fixed over one update: the networks, the CFG scale, the reference timer."""

    policy: FlowPolicy
    copies: Copies
    """The copies of the trained weights (:meth:`~lit_flowgrpo.copies.Copies.reference`: the KL reference;
    :meth:`~lit_flowgrpo.copies.Copies.old`: DiffusionNFT's old policy)."""
    guidance: float
    """CFG scale of the update's forwards (1: the conditional model alone)."""
    reference_timer: Callable[[], AbstractContextManager[Any]] = nullcontext
    """Wrapped around the reference forward (the ``ref`` stage's clock)."""
    kl: KLSettings = field(default_factory=lambda: KLSettings(coef=0.0))
    """The KL regulariser, β resolved: whether a visit runs the reference (:attr:`KLSettings.runs_reference`),
    β and the KL's form."""
    seed: int = 0
    """Fixed per (rollout, inner epoch) by the update loop: an objective that draws per visit
    (DiffusionNFT's noise and noise levels) seeds from it and the sample id, so that a draw does not
    depend on which micro-batch, rank or resume it falls in."""


@dataclass
class Visit:
    """What one visit (one micro-batch at one of the objective's visits) computed."""

    loss: Tensor
    """Scalar: the objective's loss + β·KL (padding rows excluded), differentiable."""
    pg_loss: Tensor
    kl: Tensor
    on_policy_error: Tensor | None
    """Scalar: mean |ratio − 1| of the live rows (0 when every row was padding); ``None`` for an
    objective that has no importance ratio (DiffusionNFT, SFT, Diffusion-DPO): nothing is logged then,
    since a logged 0 would read as a check that passed."""
    diagnostics: dict[str, Tensor] | None
    """Keyword arguments of the diagnostics metric's ``update`` (``None`` when every row was padding)."""


@dataclass
class ScoredStep:
    """One micro-batch of one trained step, scored under the current policy (N live samples)."""

    log_prob: Tensor
    """(N,) log p_θ of the recorded transitions (differentiable)."""
    old_log_prob: Tensor
    """(N,) log p_old recorded at rollout."""
    advantages: Tensor
    """(N,) advantages."""
    prev_sample_mean: Tensor
    """(N, *latent) μ_θ (differentiable)."""
    old_prev_sample_mean: Tensor | None
    """(N, *latent) μ_old, recorded when the objective asked for it (``"means"`` in :attr:`~lit_flowgrpo.objective.Objective.records`)."""
    std_dev_t: Tensor
    """(N,) the step's diffusion coefficient."""
    sqrt_dt: Tensor
    """(N,) √|dt| of the step."""
