"""Policy objectives: Flow-GRPO, both GRPO-Guard forms, Flow-DPPO and DiffusionNFT as small dataclasses
behind one interface.

An objective declares what the update needs of it, and the update loop (:mod:`lit_flowgrpo.update`)
only asks (STYLE.md 13):

- :attr:`Objective.records`: what the rollout must record for the loss (the transitions, μ_old), and
  :meth:`Objective.rollout_records` what it records with the diagnostics' needs added;
- :attr:`Objective.sde_types`: the SDE steps its loss is defined for;
- :meth:`Objective.visits`: which visits the update makes per micro-batch (each trained step, or
  DiffusionNFT's noise levels);
- :meth:`Objective.visit`: the loss of one visit (its types, :mod:`lit_flowgrpo.visit`, are re-exported here);
- :meth:`Objective.diagnostics`: the metric it logs (:mod:`lit_flowgrpo.metrics`: ``PolicyRatioStats``,
  ``FlowDPPOStats`` for Flow-DPPO, ``NFTDiagnostics`` for DiffusionNFT);
- :meth:`Objective.old_policy_decay`: η of the old policy's refresh after so many optimizer steps
  (``None``: no old policy); a pure function: an objective holds settings, never run state.

Settings are dataclass fields, so a subclass changes a default in one line and :meth:`settings` is
``dataclasses.asdict``. The math is the pure functions of :mod:`lit_flowgrpo.algorithms`; this file
only chooses and wires them. A new ratio objective is a new subclass, not a branch in the loop::

    @dataclass
    class MyObjective(RatioObjective):
        name = "my_objective"

        def policy_loss(self, scored: ScoredStep) -> tuple[Tensor, PolicyStats]: ...
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from lit_flowgrpo.algorithms import (
    NFT_DECAY_SCHEDULES,
    DPPOStats,
    NFTRewardMode,
    PolicyStats,
    flow_dppo_loss,
    flow_grpo_loss,
    gaussian_step_kl,
    grpo_guard_loss,
    kl_to_reference,
    nft_loss,
    nft_old_policy_decay,
    nft_reward_probability,
    nft_sample_times,
    ratio_norm_loss,
)
from lit_flowgrpo.errors import flag
from lit_flowgrpo.kl import KLSettings
from lit_flowgrpo.metrics import (
    DiagnosticsSettings,
    DictMetric,
    FlowDPPOStats,
    NFTDiagnostics,
    PolicyRatioStats,
    clip_range_problems,
    resolve_clip_range_high,
)
from lit_flowgrpo.policies.base import index_embeds
from lit_flowgrpo.rollout import Record, RolloutBatch, Sampler, initial_noise, per_sample_generators
from lit_flowgrpo.visit import ScoredStep, Visit, VisitContext

__all__ = [
    "DiffusionNFT",
    "FlowDPPO",
    "FlowGRPO",
    "GRPOGuard",
    "GRPOGuardRatioNorm",
    "Objective",
    "RatioObjective",
    "ScoredStep",
    "Visit",
    "VisitContext",
    "available_objectives",
    "build_objective",
]

_REGISTRY: dict[str, type[Objective]] = {}


class Objective:
    """The loss of the policy update, and what it needs from the rollout and the update loop.

    Subclasses are dataclasses of their settings; this base holds none.
    """

    name: ClassVar[str] = ""
    #: What the rollout must record of its trained steps (:data:`lit_flowgrpo.rollout.RECORDS`).
    records: ClassVar[tuple[Record, ...]] = ("transitions",)
    #: The SDE step types whose transition this objective's loss is defined for (empty: any).
    sde_types: ClassVar[tuple[str, ...]] = ()
    #: Whether an old policy is kept (a copy of the trained weights) that the rollout samples with and
    #: that is soft-updated after each update with :meth:`old_policy_decay`'s η (DiffusionNFT).
    old_policy: ClassVar[bool] = False
    #: What the update trains on: ``rollout``, or images: ``data``/``data_pairs``/``rollout_pairs`` (data_objective.py).
    learns_from: ClassVar[str] = "rollout"
    #: β of the KL regulariser when ``--model.init_args.kl.coef`` is left null: the published value.
    default_kl_coef: ClassVar[float] = 0.0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            _REGISTRY[cls.name] = cls

    def problems(self, sde_type: str, flag_path: str = "") -> list[str]:
        """Problems with these settings, and with the sampler's ``sde_type`` (empty when fine)."""
        if self.sde_types and sde_type not in self.sde_types:
            return [
                f"--model.init_args.objective={type(self).__module__}.{type(self).__qualname__} needs "
                f"{flag('sampler')}.sde_type in {list(self.sde_types)} (got {sde_type!r}): its loss is "
                "defined for that step only; use FlowGRPO with other steps"
            ]
        return []

    def sampler_problems(self, sampler: Sampler, kl: KLSettings) -> list[str]:
        """Problems with the sampler's settings for this objective and the run's KL regulariser (β
        resolved; empty when fine)."""
        return []

    def old_policy_decay(self, optimizer_steps: int) -> float | None:
        """η of the old policy's refresh θ_old ← η·θ_old + (1 − η)·θ after ``optimizer_steps`` optimizer
        steps; ``None`` for an objective without an old policy (:attr:`old_policy` false)."""
        return None

    def rollout_records(self, diagnostics: DiagnosticsSettings) -> tuple[Record, ...]:
        """What the rollout records: :attr:`records`, plus what the diagnostics ask of it."""
        return self.records

    def visits(self, batch: RolloutBatch) -> Sequence[int]:
        """The visits the update makes to each micro-batch, in order."""
        raise NotImplementedError

    def visit(self, ctx: VisitContext, batch: RolloutBatch, idx: Tensor, live: int, v: int) -> Visit:
        """The loss of visit ``v`` to samples ``idx`` of ``batch``; the first ``live`` rows count, the
        rest are padding that keeps every rank's backward count equal."""
        raise NotImplementedError

    def diagnostics(
        self, num_steps: int, settings: DiagnosticsSettings, process_group: Any = None
    ) -> DictMetric:
        """The metric that :attr:`Visit.diagnostics` updates (a :class:`~lit_flowgrpo.metrics.DictMetric`),
        reducing over ``process_group`` (the data-parallel peers; ``None``: every rank)."""
        raise NotImplementedError

    def diagnostics_values(self, metric: DictMetric, optimizer_steps: int) -> dict[str, float]:
        """The logged values of the metric (a collective: every rank calls it), after ``optimizer_steps``
        optimizer steps; everything logged is computed from these two, so logging needs no run state."""
        return metric.logged_values()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(self).items())  # type: ignore[call-overload]
        return f"{type(self).__name__}({args})"

    def settings(self) -> dict[str, Any]:
        """Plain values for checkpoints and loggers: the dataclass fields and the ``name``."""
        return {"name": self.name, **dataclasses.asdict(self)}  # type: ignore[call-overload]

    def hparams(self) -> dict[str, Any]:
        """``class_path`` + ``init_args``: the form the CLI parses back (checkpoints store it)."""
        cls = type(self)
        return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": dataclasses.asdict(self)}  # type: ignore[call-overload]


@dataclass(repr=False)
class RatioObjective(Objective):
    """A clipped importance ratio of the recorded SDE transitions plus β·KL to the reference; the
    update visits every trained step of every sample.

    Its diagnostics (:class:`~lit_flowgrpo.metrics.PolicyRatioStats`) include the exact step KL
    KL(old‖new) = mean((μ_θ − μ_old)²)/(2·(std_dev_t·√|dt|)²) of each visited step
    (``actor/kl_new_old_mean``/``_max``) whenever μ_old was recorded: always for the objectives
    whose loss needs it, and for every ratio objective under ``diagnostics.step_kl`` (the default),
    which then asks the rollout for μ_old (its memory: :class:`~lit_flowgrpo.metrics.DiagnosticsSettings`).
    The step KL is the transitions' own, with the √|dt| factor, whatever ``kl.with_dt`` says of the
    reference penalty's unit: it is Flow-DPPO's trust-region quantity, comparable with its δ.

    The β·KL to the reference (:class:`~lit_flowgrpo.kl.KLSettings`: β, its form, the reference) is added
    to the loss when β > 0.

    Args:
        clip_range: ε of the ratio clip.
        clip_range_high: ε_high of the upper clip; ``None`` uses ``clip_range``.
        adv_clip_max: advantages are clipped to ±this.
    """

    clip_range: float = 1e-4
    clip_range_high: float | None = None
    adv_clip_max: float = 5.0

    @property
    def clip_high(self) -> float:
        """ε_high resolved once, here: ``clip_range_high``, or ``clip_range`` when that is ``None``. The
        losses and the diagnostics get this value; ``clip_range`` is checked by one rule,
        :func:`~lit_flowgrpo.metrics.clip_range_problems`, in :meth:`problems`."""
        return resolve_clip_range_high(self.clip_range, self.clip_range_high)

    def problems(self, sde_type: str, flag_path: str = "") -> list[str]:
        a = f"{flag_path or flag('objective')}."
        p = clip_range_problems(self.clip_range, self.clip_range_high, prefix=a)
        if self.adv_clip_max is not None and not self.adv_clip_max > 0:
            p.append(f"{a}adv_clip_max ({self.adv_clip_max}) must be > 0 (Flow-GRPO uses 5.0)")
        return p + super().problems(sde_type, flag_path)

    def sampler_problems(self, sampler: Sampler, kl: KLSettings) -> list[str]:
        # CPS's last step has σ_next = 0, so its noise σ_next·sin(ηπ/2) is 0 and the KL to the reference,
        # which divides by it, is NaN or inf there: every gradient of such a rollout is NaN (measured
        # only, at β = 0, the logged KL is). The policy term itself stays finite (CPS's log-prob drops
        # the variance).
        if sampler.sde_type != "cps" or not kl.runs_reference:
            return []
        reaches = sampler.last_step_problem(flag("sampler"))
        if reaches is None:
            return []
        if kl.on:
            which, harm = f"{flag('kl')}.coef {kl.coef}", "every gradient there is NaN"
        else:
            which, harm = f"{flag('kl')}.measure", "the KL measured there is not finite"
        return [
            f"{flag('sampler')}.sde_type=cps with the KL to the reference ({which}) divides by CPS's zero noise "
            f"on the last step, so {harm}: {reaches}, or use sde_type sde"
        ]

    def policy_loss(self, scored: ScoredStep) -> tuple[Tensor, PolicyStats]:
        """The clipped policy term (a scalar) and its per-sample statistics."""
        raise NotImplementedError

    def rollout_records(self, diagnostics: DiagnosticsSettings) -> tuple[Record, ...]:
        if diagnostics.step_kl and "means" not in self.records:
            return (*self.records, "means")
        return self.records

    def diagnostics_inputs(self, stats: PolicyStats) -> dict[str, Tensor]:
        """Extra keyword arguments of the diagnostics metric's ``update``, from the loss's statistics."""
        return {}

    def kl(self, scored: ScoredStep, ref_prev_sample_mean: Tensor, with_dt: bool = False) -> Tensor:
        """(N,) KL(μ_θ ‖ μ_ref) of the step's Gaussian transitions (DESIGN.md, Conventions); ``with_dt``:
        the paper's form, also divided by |dt|."""
        return kl_to_reference(
            scored.prev_sample_mean,
            ref_prev_sample_mean,
            scored.std_dev_t,
            sqrt_dt=scored.sqrt_dt if with_dt else None,
        )

    def visits(self, batch: RolloutBatch) -> Sequence[int]:
        return range(batch.trajectory.num_trained)

    def visit(self, ctx: VisitContext, batch: RolloutBatch, idx: Tensor, live: int, v: int) -> Visit:
        """Re-score trained step ``v`` of samples ``idx`` under the current policy (and the reference,
        when the KL term is on) and return the loss of the first ``live`` rows."""
        traj, j, policy = batch.trajectory, v, ctx.policy
        # fp32 whatever the record's dtype (Sampler.record_dtype): the rollout's step ran on this value.
        x, cond = traj.latents[idx, j].float(), index_embeds(batch.embeds, idx)
        sigma = torch.full((len(idx),), float(traj.sigmas[j]), device=x.device)
        ref_mean = None
        if ctx.kl.runs_reference:
            # Before the θ forward: a full fine-tune's reference swaps in weights the θ graph would save.
            with ctx.reference_timer(), torch.no_grad(), ctx.copies.reference():
                ref_mean = traj.score(policy.velocity(x, sigma, cond, ctx.guidance), j, idx).prev_sample_mean
        step = traj.score(policy.velocity(x, sigma, cond, ctx.guidance), j, idx)
        zero = torch.zeros((), device=x.device)
        if not live:
            # Padding only keeps every rank's backward count equal; touching the graph lets DDP see
            # every parameter.
            pg_loss = step.log_prob.sum() * 0.0
            return Visit(pg_loss, pg_loss, zero, zero, None)
        rows = idx[:live]
        scored = ScoredStep(
            log_prob=step.log_prob[:live],
            old_log_prob=traj.log_probs[rows, j],
            advantages=batch.advantages[rows],
            prev_sample_mean=step.prev_sample_mean[:live],
            old_prev_sample_mean=None if traj.prev_sample_means is None else traj.prev_sample_means[rows, j],
            std_dev_t=traj.std_dev_t[rows, j],
            sqrt_dt=traj.sqrt_dt[rows, j],
        )
        pg_loss, stats = self.policy_loss(scored)
        kl = zero
        if ref_mean is not None:
            kl = batch.kl_term(self.kl(scored, ref_mean[:live], ctx.kl.with_dt), rows)
        # Only a KL the loss uses enters it: a measured one (β = 0) that is not finite must not make 0·inf.
        loss = pg_loss + ctx.kl.coef * kl if ctx.kl.on else pg_loss
        diagnostics = dict(
            log_prob=step.log_prob.detach()[:live],
            old_log_prob=scored.old_log_prob,
            advantages=stats.advantages,
            ratio=stats.ratio,
            step=torch.full((live,), int(traj.step_indices[j]), device=x.device),
            sample_id=batch.sample_ids[rows],
            std_dev_t=scored.std_dev_t,
            sqrt_dt=scored.sqrt_dt,
            **self.diagnostics_inputs(stats),
        )
        if scored.old_prev_sample_mean is not None:
            with torch.no_grad():  # (N,) fp32, the exact KL of the two Gaussian steps (with √|dt|)
                diagnostics["step_kl"] = gaussian_step_kl(
                    scored.prev_sample_mean.detach(),
                    scored.old_prev_sample_mean,
                    scored.std_dev_t,
                    scored.sqrt_dt,
                )
        return Visit(loss, pg_loss, kl, (stats.ratio - 1).abs().mean(), diagnostics)

    #: The metric :meth:`diagnostics` builds.
    diagnostics_metric: ClassVar[type[PolicyRatioStats]] = PolicyRatioStats

    def diagnostics(
        self, num_steps: int, settings: DiagnosticsSettings, process_group: Any = None
    ) -> DictMetric:
        return self.diagnostics_metric.from_settings(
            settings,
            clip_range=self.clip_range,
            clip_range_high=self.clip_high,
            num_steps=num_steps,
            process_group=process_group,
        )


@dataclass(repr=False)
class FlowGRPO(RatioObjective):
    """Flow-GRPO's clipped ratio of the step log-probs (arXiv:2505.05470), ε = 1e-4 by default."""

    name: ClassVar[str] = "flow_grpo"

    def policy_loss(self, scored: ScoredStep) -> tuple[Tensor, PolicyStats]:
        return flow_grpo_loss(
            scored.log_prob,
            scored.old_log_prob,
            scored.advantages,
            clip_range=self.clip_range,
            clip_range_high=self.clip_high,
            adv_clip_max=self.adv_clip_max,
        )


@dataclass(repr=False)
class GRPOGuard(RatioObjective):
    """GRPO-Guard's re-centred, step-balanced ratio (arXiv:2510.22319), as the published code computes
    it; ε ≈ 2e-6 in this unit. Needs μ_old from the rollout and the Gaussian ``"sde"`` step."""

    name: ClassVar[str] = "grpo_guard"
    records: ClassVar[tuple[Record, ...]] = ("transitions", "means")
    sde_types: ClassVar[tuple[str, ...]] = ("sde",)

    clip_range: float = 2e-6

    def policy_loss(self, scored: ScoredStep) -> tuple[Tensor, PolicyStats]:
        assert scored.old_prev_sample_mean is not None  # recorded: "means" is in records
        return grpo_guard_loss(
            scored.log_prob,
            scored.old_log_prob,
            scored.advantages,
            scored.prev_sample_mean,
            scored.old_prev_sample_mean,
            scored.std_dev_t,
            scored.sqrt_dt,
            clip_range=self.clip_range,
            clip_range_high=self.clip_high,
            adv_clip_max=self.adv_clip_max,
        )


@dataclass(repr=False)
class GRPOGuardRatioNorm(RatioObjective):
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

    The other settings are :class:`RatioObjective`'s.
    """

    name: ClassVar[str] = "grpo_guard_ratio_norm"

    target_std: float | None = None

    @property
    def resolved_target_std(self) -> float:
        return self.clip_range / 2 if self.target_std is None else self.target_std

    def problems(self, sde_type: str, flag_path: str = "") -> list[str]:
        p = super().problems(sde_type, flag_path)
        if self.target_std is not None and not 0 < self.target_std < 0.1:
            p.append(
                f"{flag_path or flag('objective')}.target_std ({self.target_std}) must lie in (0, 0.1): it is "
                "a spread of ratios around 1 of the clip range's size; null uses clip_range / 2"
            )
        return p

    def policy_loss(self, scored: ScoredStep) -> tuple[Tensor, PolicyStats]:
        return ratio_norm_loss(
            scored.log_prob,
            scored.old_log_prob,
            scored.advantages,
            clip_range=self.clip_range,
            clip_range_high=self.clip_high,
            adv_clip_max=self.adv_clip_max,
            target_std=self.resolved_target_std,
        )


@dataclass(repr=False)
class FlowDPPO(RatioObjective):
    """Flow-DPPO (Ping et al. 2026, arXiv:2606.11025): the unclipped Flow-GRPO surrogate −A·r, with
    the exact Gaussian KL(old‖new) of each step as the trust region in place of a ratio clip
    (:func:`~lit_flowgrpo.algorithms.flow_dppo_loss`, as UniRL's ``_flowdppo_kl_adv_loss`` and
    verl-omni's ``FlowDPPOLoss`` compute it). A step whose KL is at least δ loses its gradient only
    if the update still pushes it away from the old policy (r > 1 with A > 0, or r < 1 with A < 0);
    corrective updates and steps inside the region keep theirs.

    Needs μ_old from the rollout, and a step whose log-prob is the Gaussian transition's: ``"sde"``
    (the published setting) or ``"dance"``. ``"cps"`` is refused: its log-prob leaves out the
    1/(2s²) of the Gaussian, so its r is not the likelihood ratio the surrogate weighs.

    Args:
        kl_mask_threshold: δ, in the per-element-mean unit of the package's log-probs (published
            1e-5 on SD3.5, UniRL's and verl-omni's default).
        add_kl_coefficient: ``True`` (published) masks on the exact KL, mean(Δμ²)/(2·(std_dev_t·√|dt|)²);
            ``False`` on mean(Δμ²)/2, without the step's variance.
        clip_range: not used by the loss (no ratio is clipped). It stays the ε of the diagnostics'
            ``actor/pg_clipfrac*``: how far the ratios spread around 1, on the Flow-GRPO scale
            (default 1e-4, its SD3.5 value). What the mask removed is ``actor/masked_fraction``.
        clip_range_high: ε_high of the same diagnostic; ``None`` uses ``clip_range``.
        adv_clip_max: ``None`` (the default, as both references): the advantages weigh the loss as
            they come; a number clips them to ±that, as Flow-GRPO's 5.0 does. Unclipped, one success
            in a group of 64 (|A| ≈ 7 with the group's std) keeps its full weight.

    The KL regulariser is as for :class:`RatioObjective`: the β·KL to the reference is added to the
    loss as for the others; the published runs use β = 0.
    """

    name: ClassVar[str] = "flow_dppo"
    records: ClassVar[tuple[Record, ...]] = ("transitions", "means")
    sde_types: ClassVar[tuple[str, ...]] = ("sde", "dance")
    diagnostics_metric: ClassVar[type[PolicyRatioStats]] = FlowDPPOStats

    adv_clip_max: float | None = None  # type: ignore[assignment]
    kl_mask_threshold: float = 1e-5
    add_kl_coefficient: bool = True

    def problems(self, sde_type: str, flag_path: str = "") -> list[str]:
        p = super().problems(sde_type, flag_path)
        if not (self.kl_mask_threshold >= 0 and math.isfinite(self.kl_mask_threshold)):
            p.append(
                f"{flag_path or flag('objective')}.kl_mask_threshold ({self.kl_mask_threshold}) must be a "
                "finite number >= 0: the KL bound of the trust region (Flow-DPPO uses 1e-5 on SD3.5)"
            )
        return p

    def policy_loss(self, scored: ScoredStep) -> tuple[Tensor, PolicyStats]:
        assert scored.old_prev_sample_mean is not None  # recorded: "means" is in records
        return flow_dppo_loss(
            scored.log_prob,
            scored.old_log_prob,
            scored.advantages,
            scored.prev_sample_mean,
            scored.old_prev_sample_mean,
            scored.std_dev_t,
            scored.sqrt_dt,
            kl_mask_threshold=self.kl_mask_threshold,
            add_kl_coefficient=self.add_kl_coefficient,
            adv_clip_max=self.adv_clip_max,
        )

    def diagnostics_inputs(self, stats: PolicyStats) -> dict[str, Tensor]:
        assert isinstance(stats, DPPOStats)  # what policy_loss returns
        return {"high_kl": stats.high_kl, "pos_rm": stats.clip_active_high, "neg_rm": stats.clip_active_low}


def available_objectives() -> list[str]:
    return sorted(_REGISTRY)


def build_objective(name: str, **kwargs: Any) -> Objective:
    """An objective by its registered ``name`` (``"flow_grpo"``, ``"grpo_guard"``, ...)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown objective {name!r}: choose one of {available_objectives()}")
    return _REGISTRY[name](**kwargs)


# --------------------------------------------------------------------------------------------------
# DiffusionNFT: negative-aware fine-tuning on the forward process
# --------------------------------------------------------------------------------------------------

NFTDecay = Literal["copy", "linear_to_0_5", "delayed_linear_to_0_999"]


@dataclass(repr=False)
class DiffusionNFT(Objective):
    """DiffusionNFT (Zheng et al. 2025, arXiv:2509.16117), as NVlabs/DiffusionNFT's
    ``scripts/train_nft_sd3.py`` trains it: the update regresses v_θ on the rollout's final samples,
    forward-noised afresh, through the implicit positive and negative policies anchored at an old
    policy (:func:`~lit_flowgrpo.algorithms.nft_loss`); no log-prob, no transition, no ratio.

    - **Rollout**: sampled with the old policy (a second, slowly averaged copy of the trained weights:
      the reference's ``old`` adapter) and CFG-free (the reference's ``guidance_scale`` 1.0: the
      conditional model is what is trained and sampled); only the final latent x0 is kept.
    - **Visits**: per micro-batch, K = max(1, ⌊T·visit_fraction⌋) visits; at visit k a sample
      sits at the k-th of a per-sample random permutation of the T rollout sigmas
      (:func:`~lit_flowgrpo.algorithms.nft_sample_times`), x_σ = (1 − σ)·x0 + σ·ε with fresh ε seeded
      per (rollout, inner epoch, sample, visit). A visit runs v_old (no grad), v_ref when
      β > 0, and v_θ.
    - **Old-policy refresh**: after each rollout's update, θ_old ← η·θ_old + (1 − η)·θ with
      η = :meth:`old_policy_decay` of the optimizer steps taken so far (Lightning's ``global_step``;
      :func:`~lit_flowgrpo.algorithms.nft_old_policy_decay` of :attr:`schedule`). A step skipped for
      a non-finite gradient moves neither θ nor the schedule, since nothing was learnt to average in;
      the reference skips no step, so the two counts agree wherever none is skipped.

    Args:
        beta: β of the implicit policies (published 1.0; 0.1 in the OCR and multi-reward recipes).
        adv_clip_max: M: advantages clip to ±M and map to r = clip(A, ±M)/(2M) + 1/2; also the loss
            scale (published 5).
        adv_mode: the reference's ``adv_mode`` (``"continuous"``: its ``"all"``, the published one).
        decay: the old policy's decay schedule by its name in
            :data:`~lit_flowgrpo.algorithms.NFT_DECAY_SCHEDULES` (the reference's default
            ``decay_type`` 1 is ``linear_to_0_5``).
        decay_schedule: ``(delay, rate, cap)`` in place of ``decay``'s.
        visit_fraction: the share of the T rollout sigmas each sample visits, K = max(1, ⌊T·fraction⌋)
            of them, in a random order of its own (the reference's ``timestep_fraction``, published
            0.99). Not the sampler's ``timestep_fraction``, which chooses the trained steps of the ratio
            objectives: DiffusionNFT trains on no recorded step.
        adaptive_weight: the reference's per-sample x0 weighting (published on).
        adaptive_weight_min: its floor (published 1e-5).
    """

    name: ClassVar[str] = "diffusion_nft"
    records: ClassVar[tuple[Record, ...]] = ()
    old_policy: ClassVar[bool] = True
    # The reference's regulariser to the reference policy, β·mean((v_θ − v_ref)²): its train.beta 1e-4.
    default_kl_coef: ClassVar[float] = 1e-4

    beta: float = 1.0
    adv_clip_max: float = 5.0
    adv_mode: NFTRewardMode = "continuous"
    decay: NFTDecay = "linear_to_0_5"
    decay_schedule: tuple[int, float, float] | None = None
    visit_fraction: float = 0.99
    adaptive_weight: bool = True
    adaptive_weight_min: float = 1e-5

    def __post_init__(self) -> None:
        if self.decay_schedule is not None:
            self.decay_schedule = tuple(self.decay_schedule)  # type: ignore[assignment]  # YAML gives a list

    @property
    def schedule(self) -> tuple[int, float, float]:
        """(delay, rate, cap) of the old policy's decay, resolved."""
        if self.decay_schedule is not None:
            delay, rate, cap = self.decay_schedule
            return int(delay), float(rate), float(cap)
        return NFT_DECAY_SCHEDULES[self.decay]

    def problems(self, sde_type: str, flag_path: str = "") -> list[str]:
        a = f"{flag_path or flag('objective')}."
        p = []
        if not self.beta > 0:
            p.append(f"{a}beta ({self.beta}) must be > 0 (DiffusionNFT uses 1.0, or 0.1)")
        if not self.adv_clip_max > 0:
            p.append(f"{a}adv_clip_max ({self.adv_clip_max}) must be > 0 (DiffusionNFT uses 5.0)")
        if not 0 < self.visit_fraction <= 1:
            p.append(f"{a}visit_fraction ({self.visit_fraction}) must lie in (0, 1] (published 0.99)")
        if not self.adaptive_weight_min > 0:
            p.append(f"{a}adaptive_weight_min ({self.adaptive_weight_min}) must be > 0 (published 1e-5)")
        if self.decay_schedule is not None:
            if len(self.decay_schedule) != 3:
                p.append(f"{a}decay_schedule ({self.decay_schedule}) must be (delay, rate, cap)")
            else:
                delay, rate, cap = self.decay_schedule
                if not (delay >= 0 and rate >= 0 and 0 <= cap < 1):
                    p.append(
                        f"{a}decay_schedule ({self.decay_schedule}) needs delay >= 0, rate >= 0 and cap in "
                        "[0, 1): η = 1 would freeze the old policy for good (the published caps are 0.5 "
                        "and 0.999); or name one by decay"
                    )
        elif self.decay not in NFT_DECAY_SCHEDULES:
            p.append(f"{a}decay ({self.decay!r}) must be one of {sorted(NFT_DECAY_SCHEDULES)}")
        return p + super().problems(sde_type, flag_path)

    def sampler_problems(self, sampler: Sampler, kl: KLSettings) -> list[str]:
        if sampler.guidance_scale > 1:
            return [
                f"{flag('sampler')}.guidance_scale ({sampler.guidance_scale}) must be 1 with "
                f"--model.init_args.objective={type(self).__module__}.{type(self).__qualname__}: DiffusionNFT "
                "is CFG-free, it samples and trains the conditional model alone (the reference's "
                "guidance_scale 1.0); CFG rollouts would be a policy its loss does not anchor at"
            ]
        return []

    def visits(self, batch: RolloutBatch) -> Sequence[int]:
        schedule = batch.trajectory.schedule
        if schedule is None:
            raise ValueError("DiffusionNFT needs the rollout's sigma schedule (Trajectory.schedule)")
        return range(max(1, int((len(schedule) - 1) * self.visit_fraction)))

    def _draws(self, ctx: VisitContext, batch: RolloutBatch, idx: Tensor, v: int) -> tuple[Tensor, Tensor]:
        """(σ (N,), ε (N, *latent)) of visit ``v`` to samples ``idx``, each row from its own seeds."""
        traj = batch.trajectory
        assert traj.schedule is not None
        sigmas = traj.schedule[:-1]  # (T,) without the terminal 0, CPU fp32
        x0 = traj.final
        ids = batch.sample_ids[idx].tolist()  # one host read per visit
        base = [(ctx.seed * 1_000_003 + int(s)) % 2**62 for s in ids]
        sigma = torch.stack(
            [
                nft_sample_times(
                    sigmas,
                    1,
                    timestep_fraction=self.visit_fraction,
                    generator=torch.Generator().manual_seed(b),
                )[0, v]
                for b in base
            ]
        ).to(x0.device)  # (N,) fp32: the v-th of each sample's permutation (same over its visits)
        seeds = torch.tensor([(b * 1_000_003 + v + 1) % 2**62 for b in base])
        noise = initial_noise(x0.shape[1:], per_sample_generators(seeds, x0.device), x0.device)
        return sigma, noise

    def visit(self, ctx: VisitContext, batch: RolloutBatch, idx: Tensor, live: int, v: int) -> Visit:
        """Forward-noise the final samples ``idx`` at visit ``v``'s σ and return the NFT loss (+ the
        regulariser) of the first ``live`` rows."""
        policy, x0 = ctx.policy, batch.trajectory.final[idx]  # (N, *latent) fp32
        sigma, noise = self._draws(ctx, batch, idx, v)
        t = sigma.view(-1, *([1] * (x0.ndim - 1)))
        x = (1 - t) * x0 + t * noise  # x_σ (DESIGN.md, Conventions)
        cond = index_embeds(batch.embeds, idx)
        # Guidance 1 in every forward: CFG-free. v_old and v_ref before the θ forward: the old policy
        # is swapped into the adapter's own tensors, which the θ graph saves.
        with torch.no_grad(), ctx.copies.old():
            v_old = policy.velocity(x, sigma, cond, 1.0)
        v_ref = None
        if ctx.kl.runs_reference:
            with ctx.reference_timer(), torch.no_grad(), ctx.copies.reference():
                v_ref = policy.velocity(x, sigma, cond, 1.0)
        v_theta = policy.velocity(x, sigma, cond, 1.0)
        zero = torch.zeros((), device=x.device)
        if not live:
            pg_loss = v_theta.sum() * 0.0  # padding: touches the graph so DDP sees every parameter
            return Visit(pg_loss, pg_loss, zero, None, None)
        rows = idx[:live]
        r = nft_reward_probability(batch.advantages[rows], adv_clip_max=self.adv_clip_max, mode=self.adv_mode)
        pg_loss, stats = nft_loss(
            v_theta[:live],
            v_old[:live],
            x0[:live],
            noise[:live],
            sigma[:live],
            r,
            beta=self.beta,
            adv_clip_max=self.adv_clip_max,
            adaptive_weight=self.adaptive_weight,
            adaptive_weight_min=self.adaptive_weight_min,
        )
        kl = zero
        if v_ref is not None:
            # The reference's regulariser: mean((v_θ − v_ref)²) per sample, then over the batch.
            diff = v_theta[:live].float() - v_ref[:live].float()  # (N, *latent) fp32
            kl = batch.kl_term((diff**2).mean(dim=tuple(range(1, diff.ndim))), rows)
        loss = pg_loss + ctx.kl.coef * kl if ctx.kl.on else pg_loss
        diagnostics = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
        # No ratio to check (None: nothing logged); the off-policy gap is the old deviation, logged as such.
        return Visit(loss, pg_loss, kl, None, diagnostics)

    def old_policy_decay(self, optimizer_steps: int) -> float:
        delay, rate, cap = self.schedule
        return nft_old_policy_decay(optimizer_steps, delay=delay, rate=rate, cap=cap)

    def diagnostics(
        self, num_steps: int, settings: DiagnosticsSettings, process_group: Any = None
    ) -> DictMetric:
        return NFTDiagnostics(process_group=process_group)

    def diagnostics_values(self, metric: DictMetric, optimizer_steps: int) -> dict[str, float]:
        values = super().diagnostics_values(metric, optimizer_steps)
        # η of the refresh after the update that reached optimizer_steps: recomputed, not remembered.
        values["actor/nft_old_decay"] = self.old_policy_decay(optimizer_steps)
        return values
