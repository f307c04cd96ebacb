"""Policy objectives: Flow-GRPO and GRPO-Guard as small classes behind one interface.

An objective owns the settings of the loss (clip range, advantage clip, KL coefficient and form),
validates them once, and turns one scored micro-batch of one denoising step into a loss. The math is
the pure functions of :mod:`lit_flowgrpo.algorithms`; this file only chooses and wires them.

A new objective is a new subclass (registered by its ``name``), not a branch in the update loop::

    class MyObjective(Objective):
        name = "my_objective"

        def policy_loss(self, scored: ScoredStep) -> tuple[Tensor, PolicyStats]: ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from lit_flowgrpo.algorithms import (
    PolicyStats,
    flow_grpo_loss,
    grpo_guard_loss,
    kl_to_reference,
    ratio_norm_loss,
)

__all__ = [
    "FlowGRPO",
    "GRPOGuard",
    "GRPOGuardRatioNorm",
    "Objective",
    "ScoredStep",
    "available_objectives",
    "build_objective",
]

_REGISTRY: dict[str, type[Objective]] = {}


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
    """(N, *latent) μ_old, recorded when the objective asked for it (:attr:`Objective.needs_old_mean`)."""
    std_dev_t: Tensor
    """(N,) the step's diffusion coefficient."""
    sqrt_dt: Tensor
    """(N,) √|dt| of the step."""


class Objective:
    """The loss of the policy update: a clipped policy term plus β·KL to the reference policy.

    Args:
        clip_range: ε of the ratio clip.
        clip_range_high: ε_high of the upper clip; ``None`` uses ``clip_range``.
        adv_clip_max: advantages are clipped to ±this.
        kl_coef: β of the KL penalty (0 turns the reference forward off).
        kl_with_dt: the paper's KL, which also divides by |dt|, instead of the published code's.
    """

    name: ClassVar[str] = ""
    #: The rollout must record μ_old for this objective.
    needs_old_mean: ClassVar[bool] = False
    #: The SDE step types whose transition this objective's ratio is defined for (empty: any).
    sde_types: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            _REGISTRY[cls.name] = cls

    def __init__(
        self,
        clip_range: float = 1e-4,
        clip_range_high: float | None = None,
        adv_clip_max: float = 5.0,
        kl_coef: float = 0.0,
        kl_with_dt: bool = False,
    ) -> None:
        self.clip_range = clip_range
        self.clip_range_high = clip_range_high
        self.adv_clip_max = adv_clip_max
        self.kl_coef = kl_coef
        self.kl_with_dt = kl_with_dt

    def problems(self, sde_type: str, flag: str = "--model.objective") -> list[str]:
        """Problems with these settings, and with the sampler's ``sde_type`` (empty when fine)."""
        p = []
        a = f"{flag}.init_args."
        # The metric and the clamp need a proper interval (1 − ε, 1 + ε_high) around 1.
        if not 0 < self.clip_range < 1:
            p.append(
                f"{a}clip_range ({self.clip_range}) must lie in (0, 1): Flow-GRPO uses 1e-4, GRPO-Guard ~2e-6"
            )
        if self.clip_range_high is not None and not self.clip_range_high > 0:
            p.append(f"{a}clip_range_high ({self.clip_range_high}) must be > 0, or null to use clip_range")
        if not self.adv_clip_max > 0:
            p.append(f"{a}adv_clip_max ({self.adv_clip_max}) must be > 0 (Flow-GRPO uses 5.0)")
        if not self.kl_coef >= 0:
            p.append(f"{a}kl_coef ({self.kl_coef}) must be >= 0")
        if self.sde_types and sde_type not in self.sde_types:
            p.append(
                f"{flag} {type(self).__name__} needs --model.sampler.sde_type in {list(self.sde_types)} "
                f"(got {sde_type!r}): its ratio is defined for that step only; use FlowGRPO with other steps"
            )
        return p

    @property
    def uses_reference(self) -> bool:
        return self.kl_coef > 0

    def policy_loss(self, scored: ScoredStep) -> tuple[Tensor, PolicyStats]:
        """The clipped policy term (a scalar) and its per-sample statistics."""
        raise NotImplementedError

    def kl(self, scored: ScoredStep, ref_prev_sample_mean: Tensor) -> Tensor:
        """(N,) KL(μ_θ ‖ μ_ref) of the step's Gaussian transitions (DESIGN.md, Conventions)."""
        return kl_to_reference(
            scored.prev_sample_mean,
            ref_prev_sample_mean,
            scored.std_dev_t,
            sqrt_dt=scored.sqrt_dt if self.kl_with_dt else None,
        )

    def settings(self) -> dict[str, Any]:
        """Plain values for checkpoints and loggers."""
        return {
            "name": self.name,
            "clip_range": self.clip_range,
            "clip_range_high": self.clip_range_high,
            "adv_clip_max": self.adv_clip_max,
            "kl_coef": self.kl_coef,
            "kl_with_dt": self.kl_with_dt,
        }

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings().items() if k != "name")
        return f"{type(self).__name__}({args})"


class FlowGRPO(Objective):
    """Flow-GRPO's clipped ratio of the step log-probs (arXiv:2505.05470), ε = 1e-4 by default."""

    name = "flow_grpo"

    def policy_loss(self, scored: ScoredStep) -> tuple[Tensor, PolicyStats]:
        return flow_grpo_loss(
            scored.log_prob,
            scored.old_log_prob,
            scored.advantages,
            clip_range=self.clip_range,
            clip_range_high=self.clip_range_high,
            adv_clip_max=self.adv_clip_max,
        )


class GRPOGuard(Objective):
    """GRPO-Guard's re-centred, step-balanced ratio (arXiv:2510.22319), as the published code computes
    it; ε ≈ 2e-6 in this unit. Needs μ_old from the rollout and the Gaussian ``"sde"`` step."""

    name = "grpo_guard"
    needs_old_mean = True
    sde_types = ("sde",)

    def __init__(
        self,
        clip_range: float = 2e-6,
        clip_range_high: float | None = None,
        adv_clip_max: float = 5.0,
        kl_coef: float = 0.0,
        kl_with_dt: bool = False,
    ) -> None:
        super().__init__(clip_range, clip_range_high, adv_clip_max, kl_coef, kl_with_dt)

    def policy_loss(self, scored: ScoredStep) -> tuple[Tensor, PolicyStats]:
        assert scored.old_prev_sample_mean is not None  # guaranteed by needs_old_mean
        return grpo_guard_loss(
            scored.log_prob,
            scored.old_log_prob,
            scored.advantages,
            scored.prev_sample_mean,
            scored.old_prev_sample_mean,
            scored.std_dev_t,
            scored.sqrt_dt,
            clip_range=self.clip_range,
            clip_range_high=self.clip_range_high,
            adv_clip_max=self.adv_clip_max,
        )


class GRPOGuardRatioNorm(Objective):
    """GRPO-Guard as its blog post describes it (:func:`~lit_flowgrpo.algorithms.ratio_norm_loss`):
    the Flow-GRPO ratio of each step normalised over the batch, and each sample's steps weighted by
    1/r̂. Needs no μ_old and works with any ``sde_type``.

    Where it differs from :class:`GRPOGuard` (the published code's form): that one re-centres each
    ratio analytically (it adds back the mean-shift term −|μ_θ − μ_old|²/(2s²), which needs μ_old)
    and rescales the log-ratio by the step's transition std and the loss by 1/|dt|; this one
    measures the centre and spread of the ratios it sees. What the blog leaves open and how it is
    chosen here:

    - the variance it normalises to: a step's spread is shrunk to ``target_std`` (default half the
      clip range, so the clip bites at about two standard deviations on both sides), never
      inflated: on-policy ratios are 1 up to rounding;
    - whether the statistics and weights carry gradient: they do not (constants of the backward);
    - the batch: the N live samples of one micro-batch at one step, what one backward sees.

    Args:
        clip_range: ε on r̂ (the Flow-GRPO unit: 1e-4 on SD3.5, 1e-3 on the shapes world).
        target_std: the spread r̂ keeps at most; ``None``: ``clip_range / 2``.
        (others as :class:`Objective`)
    """

    name = "grpo_guard_ratio_norm"

    def __init__(
        self,
        clip_range: float = 1e-4,
        clip_range_high: float | None = None,
        adv_clip_max: float = 5.0,
        kl_coef: float = 0.0,
        kl_with_dt: bool = False,
        target_std: float | None = None,
    ) -> None:
        super().__init__(clip_range, clip_range_high, adv_clip_max, kl_coef, kl_with_dt)
        self.target_std = target_std

    @property
    def resolved_target_std(self) -> float:
        return self.clip_range / 2 if self.target_std is None else self.target_std

    def problems(self, sde_type: str, flag: str = "--model.objective") -> list[str]:
        p = super().problems(sde_type, flag)
        if self.target_std is not None and not 0 < self.target_std < 0.1:
            p.append(
                f"{flag}.init_args.target_std ({self.target_std}) must lie in (0, 0.1): it is a spread of "
                "ratios around 1 of the clip range's size; null uses clip_range / 2"
            )
        return p

    def policy_loss(self, scored: ScoredStep) -> tuple[Tensor, PolicyStats]:
        return ratio_norm_loss(
            scored.log_prob,
            scored.old_log_prob,
            scored.advantages,
            clip_range=self.clip_range,
            clip_range_high=self.clip_range_high,
            adv_clip_max=self.adv_clip_max,
            target_std=self.resolved_target_std,
        )

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "target_std": self.target_std}


def available_objectives() -> list[str]:
    return sorted(_REGISTRY)


def build_objective(name: str, **kwargs: Any) -> Objective:
    """An objective by its registered ``name`` (``"flow_grpo"``, ``"grpo_guard"``, ...)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown objective {name!r}: choose one of {available_objectives()}")
    return _REGISTRY[name](**kwargs)
