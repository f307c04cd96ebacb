"""The objectives that learn from images, on the objective seam (:class:`~lit_flowgrpo.objective.Objective`):
supervised flow matching (:class:`SFT`) and Diffusion-DPO (:class:`DiffusionDPO`, offline from the data
module's pairs or online from a rollout's groups). The math is :mod:`lit_flowgrpo.algorithms.data_losses`;
the batch they walk is :class:`~lit_flowgrpo.data_batch.DataBatch`.
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
    WeightingScheme,
    diffusion_dpo_loss,
    flow_matching_errors,
    sft_loss,
    training_sigma,
)
from lit_flowgrpo.data_batch import DataBatch
from lit_flowgrpo.errors import flag
from lit_flowgrpo.kl import KLSettings
from lit_flowgrpo.metrics import DiagnosticsSettings, DictMetric, DPODiagnostics, SFTDiagnostics
from lit_flowgrpo.objective import Objective, build_objective
from lit_flowgrpo.policies.base import index_embeds
from lit_flowgrpo.rollout import Record, Sampler, initial_noise, per_sample_generators
from lit_flowgrpo.visit import Visit, VisitContext

__all__ = ["SFT", "DiffusionDPO", "FlowMatchingOnImages", "WithSFT"]


@dataclass(repr=False)
class FlowMatchingOnImages(Objective):
    """The base of the objectives that regress v_θ on given clean latents x0 (the data module's images,
    or a rollout's own samples): each visit draws, per sample, a training noise level σ and a fresh ε
    as diffusers' SD3 training scripts do (:func:`~lit_flowgrpo.algorithms.training_sigma`), seeded
    from (rollout, inner epoch, sample id, visit), so a draw never depends on the micro-batch, the rank
    or a resume; and forwards the conditional model (no CFG) at x_σ = (1 − σ)·x0 + σ·ε.

    Args:
        weighting_scheme: diffusers' ``weighting_scheme`` of SD3 training: ``logit_normal`` (the SD3
            paper's and the scripts' default), ``mode``, ``cosmap``, ``sigma_sqrt`` or ``none``.
        logit_mean: the logit-normal's mean (scripts' default 0).
        logit_std: its std (default 1).
        mode_scale: ``mode``'s scale (default 1.29).
        shift: the training scheduler's shift (SD3.5's scheduler config: 3.0; a toy model trained on
            unshifted σ: 1.0).
        num_train_timesteps: the training scheduler's number of noise levels (1000).
        visits_per_sample: noise draws (forward/backward passes) per sample and inner epoch.
    """

    records: ClassVar[tuple[Record, ...]] = ()

    weighting_scheme: WeightingScheme = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    shift: float = 3.0
    num_train_timesteps: int = 1000
    visits_per_sample: int = 1

    learns_from: ClassVar[str] = "data"

    def problems(self, sde_type: str, flag_path: str = "") -> list[str]:
        a = f"{flag_path or flag('objective')}."
        p = []
        if self.weighting_scheme not in ("logit_normal", "mode", "sigma_sqrt", "cosmap", "none"):
            p.append(f"{a}weighting_scheme ({self.weighting_scheme!r}) must be one of diffusers' SD3 schemes")
        if not self.logit_std > 0:
            p.append(f"{a}logit_std ({self.logit_std}) must be > 0 (SD3's scripts use 1.0)")
        if not self.shift > 0:
            p.append(f"{a}shift ({self.shift}) must be > 0 (SD3.5's scheduler: 3.0)")
        if self.num_train_timesteps < 1 or self.visits_per_sample < 1:
            p.append(f"{a}num_train_timesteps and {a}visits_per_sample must be at least 1")
        return p

    def sampler_problems(self, sampler: Sampler, kl: KLSettings) -> list[str]:
        if kl.on:
            return [
                f"{flag('kl')}.coef ({kl.coef}) must be 0 or null with {type(self).__name__}: its loss has no "
                "KL term to the reference (Diffusion-DPO's closeness to the reference is its own β)"
            ]
        return []

    def train_sigmas(self) -> Tensor:
        """(num_train_timesteps,) fp32: the training scheduler's sigmas, 1 down to 1/N, shifted (diffusers'
        ``FlowMatchEulerDiscreteScheduler``, as the SD3 scripts index them)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=self.num_train_timesteps, shift=self.shift
        )
        return scheduler.sigmas.float()

    def visits(self, batch: Any) -> Sequence[int]:
        return range(self.visits_per_sample)

    def draws(
        self, ctx: VisitContext, sample_ids: Tensor, shape: Sequence[int], device: Any
    ) -> tuple[Tensor, Tensor]:
        """(σ (N,), ε (N, *shape)) of one visit to the samples ``sample_ids``, each row from its own seed
        (``ctx.seed`` is fixed per rollout and inner epoch, and differs between visits)."""
        sigmas = self.train_sigmas()
        base = [(ctx.seed * 1_000_003 + int(s)) % 2**62 for s in sample_ids.tolist()]
        sigma = torch.stack(
            [
                training_sigma(
                    self.weighting_scheme,
                    sigmas,
                    torch.Generator().manual_seed(b),
                    logit_mean=self.logit_mean,
                    logit_std=self.logit_std,
                    mode_scale=self.mode_scale,
                )
                for b in base
            ]
        ).to(device)  # (N,) fp32
        seeds = torch.tensor([(b * 1_000_003 + 1) % 2**62 for b in base])
        noise = initial_noise(shape, per_sample_generators(seeds, device), device)
        return sigma, noise

    def _visit_seed(self, ctx: VisitContext, v: int) -> VisitContext:
        """The context whose seed is this visit's (each visit draws afresh)."""
        return dataclasses.replace(ctx, seed=(ctx.seed * 1_000_033 + v) % 2**62)


def _noised(x0: Tensor, noise: Tensor, sigma: Tensor) -> Tensor:
    t = sigma.view(-1, *([1] * (x0.ndim - 1)))
    return (1 - t) * x0 + t * noise  # x_σ (DESIGN.md, Conventions)


@dataclass(repr=False)
class SFT(FlowMatchingOnImages):
    """Supervised fine-tuning: the flow-matching loss on the data module's images
    (:func:`~lit_flowgrpo.algorithms.sft_loss`, diffusers' SD3 training scripts' loss and σ
    distribution), through the same module, weights (LoRA or full), callbacks and checkpoints as RL.
    No rollout, no reward: a step is one batch of records (:class:`~lit_flowgrpo.image_data.ImageDataModule`).
    Diagnostics: ``actor/sft_loss`` and the loss by σ band (:class:`~lit_flowgrpo.metrics.SFTDiagnostics`).

    Args:
        sigma_buckets: σ bands of the logged loss.
        precondition_outputs: the loss on the x0 estimate x_σ − σ·v_θ (σ² × the velocity loss), the
            default of diffusers' SD3 DreamBooth scripts (``--precondition_outputs 1``); off: the velocity
            loss of flow_grpo's SFT script.

    The σ distribution and weighting are :class:`FlowMatchingOnImages`'.
    """

    name: ClassVar[str] = "sft"

    sigma_buckets: int = 4
    precondition_outputs: bool = False

    def sampler_problems(self, sampler: Sampler, kl: KLSettings) -> list[str]:
        p = super().sampler_problems(sampler, kl)
        if kl.measure:
            p.append(f"{flag('kl')}.measure must be false with SFT: it runs no reference to measure a KL to")
        return p

    def visit(self, ctx: VisitContext, batch: Any, idx: Tensor, live: int, v: int) -> Visit:
        """Noise samples ``idx`` at this visit's σ and return the flow-matching loss of the first ``live``."""
        x0 = batch.latents[idx]  # (N, *latent) fp32
        sigma, noise = self.draws(self._visit_seed(ctx, v), batch.sample_ids[idx], x0.shape[1:], x0.device)
        velocity = ctx.policy.velocity(_noised(x0, noise, sigma), sigma, index_embeds(batch.embeds, idx), 1.0)
        zero = torch.zeros((), device=x0.device)
        if not live:
            pad = velocity.sum() * 0.0  # padding: touches the graph so DDP sees every parameter
            return Visit(pad, pad, zero, None, None)
        loss, per_sample = sft_loss(
            velocity[:live],
            x0[:live],
            noise[:live],
            sigma[:live],
            self.weighting_scheme,
            precondition=self.precondition_outputs,
        )
        return Visit(loss, loss, zero, None, {"loss": per_sample.detach(), "sigma": sigma[:live]})

    def diagnostics(
        self, num_steps: int, settings: DiagnosticsSettings, process_group: Any = None
    ) -> DictMetric:
        return SFTDiagnostics(self.sigma_buckets, process_group=process_group)


@dataclass(repr=False)
class DiffusionDPO(FlowMatchingOnImages):
    """Diffusion-DPO (Wallace et al. 2023, arXiv:2311.12908) in its flow-matching form
    (:func:`~lit_flowgrpo.algorithms.diffusion_dpo_loss`): the chosen and the rejected image of a pair
    are noised with the same ε at the same σ, and the loss −log σ(−β/2·((e_w − e_l) − (e_w^ref − e_l^ref)))
    asks the trained model to fit the chosen one better than the reference does, relative to the rejected.

    - ``pairs: data`` (offline): the pairs of an :class:`~lit_flowgrpo.image_data.ImageDataModule` with
      ``pairs: true``; no rollout, no reward.
    - ``pairs: rollout`` (online): each step samples a rollout as RL does, scores it, and pairs within
      each group the best against the worst sample (:func:`~lit_flowgrpo.data_batch.rollout_pairs`); a
      group whose rewards are all equal makes no pair.

    The reference is the KL reference of the weights (:class:`~lit_flowgrpo.copies.Reference`:
    ``kl.reference.mode`` initial, refreshed or ema; a full fine-tune needs ``kl.reference.copy``), used
    here by the loss itself, with ``kl.coef`` left at 0. ``kl.measure`` (which a moving reference needs)
    logs the drift from it as ``actor/kl_loss``: mean((v_θ − v_ref)²) over both images of every pair, the
    form of DiffusionNFT's regulariser, outside the loss. Diagnostics: implicit reward accuracy and
    margin (:class:`~lit_flowgrpo.metrics.DPODiagnostics`).

    Args:
        beta: β on the per-element mean of the velocity error: 100 in flow_grpo's and Flow-Factory's
            SD3.5 recipes and verl-omni's Qwen-Image one (verl-omni's config default: 2000; the paper's
            SD1.5/SDXL runs: 5000, on ε errors).
        pairs: ``data`` or ``rollout`` (above).
        sft_coef: weight of an added SFT term on the chosen image, mean(e_w) (0: the paper's loss).

    The σ distribution is :class:`FlowMatchingOnImages`' (its weighting does not enter the loss: the
    released scripts' errors are unweighted).
    """

    name: ClassVar[str] = "diffusion_dpo"

    beta: float = 100.0
    pairs: Literal["data", "rollout"] = "data"
    sft_coef: float = 0.0

    @property
    def learns_from(self) -> str:  # type: ignore[override]
        return "data_pairs" if self.pairs == "data" else "rollout_pairs"

    def problems(self, sde_type: str, flag_path: str = "") -> list[str]:
        a = f"{flag_path or flag('objective')}."
        p = super().problems(sde_type, flag_path)
        if not (self.beta > 0 and math.isfinite(self.beta)):
            p.append(
                f"{a}beta ({self.beta}) must be a finite number > 0 (SD3.5's flow-matching recipes: 100)"
            )
        if self.pairs not in ("data", "rollout"):
            p.append(f"{a}pairs ({self.pairs!r}) must be data (offline pairs) or rollout (online pairs)")
        if not self.sft_coef >= 0:
            p.append(f"{a}sft_coef ({self.sft_coef}) must be >= 0")
        return p

    def visit(self, ctx: VisitContext, batch: Any, idx: Tensor, live: int, v: int) -> Visit:
        """Noise the pairs ``idx`` alike at this visit's σ and return the DPO loss of the first ``live``."""
        x_w, x_l = batch.latents[idx], batch.rejected[idx]  # (N, *latent) fp32
        n = len(idx)
        sigma, noise = self.draws(self._visit_seed(ctx, v), batch.sample_ids[idx], x_w.shape[1:], x_w.device)
        x = torch.cat([_noised(x_w, noise, sigma), _noised(x_l, noise, sigma)])  # (2N, *latent)
        s2, cond = torch.cat([sigma, sigma]), index_embeds(batch.embeds, torch.cat([idx, idx]))
        # The reference before the θ forward: a full fine-tune's reference swaps in weights the θ graph
        # would save.
        with ctx.reference_timer(), torch.no_grad(), ctx.copies.reference():
            v_ref = ctx.policy.velocity(x, s2, cond, 1.0)
        v_theta = ctx.policy.velocity(x, s2, cond, 1.0)
        zero = torch.zeros((), device=x.device)
        if not live:
            pad = v_theta.sum() * 0.0  # padding: touches the graph so DDP sees every parameter
            return Visit(pad, pad, zero, None, None)
        x0, eps = torch.cat([x_w, x_l]), torch.cat([noise, noise])
        err, ref_err = flow_matching_errors(v_theta, x0, eps), flow_matching_errors(v_ref, x0, eps)  # (2N,)
        loss, stats = diffusion_dpo_loss(
            err[:live], err[n : n + live], ref_err[:live], ref_err[n : n + live], beta=self.beta
        )
        if self.sft_coef:
            loss = loss + self.sft_coef * err[:live].mean()
        kl = zero
        if ctx.kl.measure:  # the drift from the reference, in DiffusionNFT's form mean((v_θ − v_ref)²)
            drift = ((v_theta.detach().float() - v_ref.float()) ** 2).mean(dim=tuple(range(1, x.ndim)))
            kl = torch.cat([drift[:live], drift[n : n + live]]).mean()  # both images of the live pairs
        diagnostics = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
        return Visit(loss, loss, kl, None, diagnostics)

    def diagnostics(
        self, num_steps: int, settings: DiagnosticsSettings, process_group: Any = None
    ) -> DictMetric:
        return DPODiagnostics(process_group=process_group)


@dataclass(repr=False)
class WithSFT(Objective):
    """An RL objective with the SFT loss beside it: loss = the RL objective's + ``coef`` × the flow-matching
    loss on the records' images of the same prompts (an :class:`~lit_flowgrpo.image_data.ImageDataModule`
    with ``group_size`` ≥ 2: each group's prompt brings its record's image). The SFT term holds the policy
    near the data while the reward moves it (the SFT regulariser of a pipeline that fine-tunes, then
    RL-tunes, without leaving the data).

    Each sample the update trains gets one SFT visit after the RL objective's visits (the samples the
    RL objective drops, zero-advantage ones under ``advantage.filter_zero``, get none). The update
    averages over visits, so the RL visits are scaled by (n + 1)/n and the SFT visit by coef·(n + 1):
    what is minimised is the RL loss (its mean over its n visits) + coef × the SFT loss. ``actor/loss``
    is that sum; ``actor/pg_loss`` averages the RL visits' terms with the SFT visit's 0. The diagnostics
    are the RL objective's.

    Args:
        rl: the RL objective by its registered name (``flow_grpo``, ``grpo_guard``, ``flow_dppo``, ...).
        rl_settings: its settings (the fields of its class).
        coef: the SFT loss's weight.
        sft: the SFT term's settings (:class:`SFT`'s fields: σ distribution, weighting, shift).
    """

    name: ClassVar[str] = "with_sft"
    learns_from: ClassVar[str] = "rollout_images"

    rl: str = "flow_grpo"
    rl_settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    coef: float = 0.1
    sft: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self._rl = build_objective(self.rl, **self.rl_settings)
        self._sft = SFT(**self.sft)
        if self._rl.learns_from != "rollout":
            raise ValueError(f"WithSFT's rl ({self.rl!r}) must be an RL objective that learns from a rollout")

    @property
    def records(self) -> tuple[Record, ...]:  # type: ignore[override]
        return self._rl.records

    @property
    def sde_types(self) -> tuple[str, ...]:  # type: ignore[override]
        return self._rl.sde_types

    @property
    def old_policy(self) -> bool:  # type: ignore[override]
        return self._rl.old_policy

    @property
    def default_kl_coef(self) -> float:  # type: ignore[override]
        return self._rl.default_kl_coef

    def problems(self, sde_type: str, flag_path: str = "") -> list[str]:
        a = flag_path or flag("objective")
        p = self._rl.problems(sde_type, f"{a}.rl_settings") + self._sft.problems(sde_type, f"{a}.sft")
        if not (self.coef >= 0 and math.isfinite(self.coef)):
            p.append(f"{a}.coef ({self.coef}) must be a finite number >= 0")
        return p

    def sampler_problems(self, sampler: Sampler, kl: KLSettings) -> list[str]:
        return self._rl.sampler_problems(sampler, kl)

    def old_policy_decay(self, optimizer_steps: int) -> float | None:
        return self._rl.old_policy_decay(optimizer_steps)

    def rollout_records(self, diagnostics: DiagnosticsSettings) -> tuple[Record, ...]:
        return self._rl.rollout_records(diagnostics)

    def visits(self, batch: Any) -> Sequence[int]:
        return range(len(self._rl.visits(batch)) + 1)

    def visit(self, ctx: VisitContext, batch: Any, idx: Tensor, live: int, v: int) -> Visit:
        """The RL objective's visit ``v`` (scaled), or, after its last, the SFT visit to the images."""
        n = len(self._rl.visits(batch))
        if v < n:
            out = self._rl.visit(ctx, batch, idx, live, v)
            return dataclasses.replace(out, loss=out.loss * ((n + 1) / n))
        images = DataBatch(batch.images, batch.embeds, batch.sample_ids, batch.keep)
        out = self._sft.visit(ctx, images, idx, live, 0)
        zero = torch.zeros((), device=out.loss.device)
        return Visit(out.loss * (self.coef * (n + 1)), zero, zero, None, None)

    def diagnostics(
        self, num_steps: int, settings: DiagnosticsSettings, process_group: Any = None
    ) -> DictMetric:
        return self._rl.diagnostics(num_steps, settings, process_group)

    def diagnostics_values(self, metric: DictMetric, optimizer_steps: int) -> dict[str, float]:
        return self._rl.diagnostics_values(metric, optimizer_steps)
