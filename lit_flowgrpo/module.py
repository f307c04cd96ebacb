"""`FlowGRPOModule`: sample → score → advantages → update → log, one rollout batch per training step.

Each stage has one owner that validates its settings once (DESIGN.md, "One training step"): the
:class:`~lit_flowgrpo.rollout.Sampler` draws, the reward scores, :class:`AdvantageSettings` make
advantages, the :class:`~lit_flowgrpo.objective.Objective` says what a visit costs (objectives that learn
from images: :mod:`lit_flowgrpo.data_objective`), :func:`~lit_flowgrpo.update.run_update` walks the batch.
Weights and copies: :mod:`lit_flowgrpo.weights`, :mod:`lit_flowgrpo.copies`; every part with state sits in
one :class:`~lit_flowgrpo.parts.Parts` list. Optimization is manual: one batch feeds several optimizer steps.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from lit_flowgrpo.advantages import AdvantageSettings, KLGateController
from lit_flowgrpo.conditioning import conditioning_problems, record_sets, sources_of
from lit_flowgrpo.data import PromptBatch
from lit_flowgrpo.data_batch import DataBatch, beside_rollout, data_problems, data_step, stage_timings
from lit_flowgrpo.distributed import DataParallel
from lit_flowgrpo.errors import SettingsError, flag
from lit_flowgrpo.kl import KLSettings
from lit_flowgrpo.metrics import DiagnosticsSettings, RewardGroupStats
from lit_flowgrpo.metrics.validation import ValidationMeans
from lit_flowgrpo.objective import FlowGRPO, Objective, VisitContext
from lit_flowgrpo.parts import AfterUpdate, Counters, Parts
from lit_flowgrpo.performance import PerformanceSettings
from lit_flowgrpo.placement import build_layout, place
from lit_flowgrpo.policies.base import FlowPolicy, reward_modality_problems
from lit_flowgrpo.rewards.base import MultiReward, RewardOutput, as_reward
from lit_flowgrpo.rewards.overlap import RewardQueue
from lit_flowgrpo.rollout import RolloutBatch, Sampler, cfg_forwards
from lit_flowgrpo.step_output import StageClock, StepOutput, ValidationOutput
from lit_flowgrpo.strategies import sharding, strategy_problems
from lit_flowgrpo.update import (
    IdleRollouts,
    UpdateHooks,
    UpdateResult,
    UpdateSettings,
    clip_and_step,
    optimizers_for,
    run_update,
)
from lit_flowgrpo.weights import LoraSettings, TrainableWeights, WeightsSettings

_EVAL_MODE_NOTICE = r"Found \d+ module\(s\) in eval mode at the start of training"
__all__ = ["AdvantageSettings", "DiagnosticsSettings", "FlowGRPOModule", "LoraSettings", "UpdateSettings"]


class FlowGRPOModule(L.LightningModule):
    """RL fine-tuning of a flow-matching text-to-image model by Flow-GRPO or GRPO-Guard.

    Args:
        policy: the model family (``class_path`` of a :class:`~lit_flowgrpo.policies.base.FlowPolicy`).
        reward: a :class:`~lit_flowgrpo.rewards.MultiReward`, a ``{name: weight}`` mapping of
            registered rewards, or (from Python) any callable
            ``(images, prompts, metadata) -> Tensor (B,) | dict[str, Tensor]``.
        objective: the loss (``class_path`` of an :class:`~lit_flowgrpo.objective.Objective`:
            ``FlowGRPO``, ``GRPOGuard``, ``FlowDPPO``, ``DiffusionNFT``); ``None``: ``FlowGRPO()``.
        sampler: how rollouts and validation samples are drawn.
        advantage: from rewards to advantages.
        update: how the update walks each rollout batch.
        weights: what is trained (a LoRA adapter, or the whole transformer with ``lora: null``) and the
            dtype it is kept in (:class:`~lit_flowgrpo.weights.WeightsSettings`).
        kl: the KL regulariser: β, its form, the reference (initial, refreshed or averaged; a full
            fine-tune's frozen copy) and GARDO's gate (:class:`~lit_flowgrpo.kl.KLSettings`).
        diagnostics: options of the logged ratio/clip/KL statistics.
        performance: how the transformer computes (dtype, compiled blocks, attention kernel), the
            same in rollout and update.
        optimizer: ``None`` gives AdamW(lr=3e-4, weight_decay=1e-4).
        lr_scheduler: optional, stepped once per optimizer step.
        seed: seeds the window choice, the update's shuffling and the LoRA init (noise seeds come
            with the batch).
    """

    def __init__(
        self,
        policy: FlowPolicy,
        reward: MultiReward | dict[str, float] | Callable[..., Any],
        objective: Objective | None = None,
        sampler: Sampler = Sampler(),
        advantage: AdvantageSettings = AdvantageSettings(),
        update: UpdateSettings = UpdateSettings(),
        weights: WeightsSettings = WeightsSettings(),
        kl: KLSettings = KLSettings(),
        diagnostics: DiagnosticsSettings = DiagnosticsSettings(),
        performance: PerformanceSettings = PerformanceSettings(),
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        # Private copies: the defaults above are shared instances.
        self.sampler = dataclasses.replace(sampler)
        self.advantage = dataclasses.replace(advantage)
        self.update = dataclasses.replace(update)
        self.diagnostics = dataclasses.replace(diagnostics)
        self.performance = dataclasses.replace(performance)
        self.objective = FlowGRPO() if objective is None else objective
        self.kl = kl.resolved(self.objective.default_kl_coef)  # β: null takes the objective's published one
        self.weights = TrainableWeights(
            dataclasses.replace(weights),
            seed=seed,
            old_policy=self.objective.old_policy_decay if self.objective.old_policy else None,
            reference=self.kl.reference,
        )
        self.policy = policy
        self.reward = as_reward(reward)
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.seed = seed
        problems = self._problems()
        if problems:
            raise SettingsError("invalid FlowGRPOModule settings:\n  " + "\n  ".join(problems))
        self.save_hyperparameters(ignore=["policy", "reward", "objective", "optimizer", "lr_scheduler"])
        # Plain types only in checkpoints (they load with torch.load(weights_only=True)), in the form
        # the CLI parses back.
        for name in ("sampler", "advantage", "update", "diagnostics", "performance"):
            self.hparams[name] = dataclasses.asdict(getattr(self, name))
        self.hparams["kl"] = dataclasses.asdict(kl)  # as given (coef null stays null), as a resume parses it
        self.hparams["weights"] = dataclasses.asdict(self.weights.settings)
        self.hparams["objective"] = self.objective.hparams()

        self.copies = self.weights.copies
        self.counters = Counters(("skipped_optimizer_steps", "nonfinite_losses", "dropped_samples"))
        self.kl_gate = None if self.kl.gate is None else KLGateController(self.kl.gate)
        # Every part with state: each saves and restores itself and moves after each update, in this
        # order (the idle guard first: a run that made no progress stops before anything moves).
        optional = [p for p in (self.kl_gate, self.counters) if p is not None]
        self.parts = Parts([IdleRollouts(self.advantage.max_idle_rollouts), *self.copies.parts, *optional])
        self._configured = False

    @property
    def lora(self) -> LoraSettings | None:
        return self.weights.lora

    def _problems(self) -> list[str]:
        """Every settings problem, each naming its flag, found before any weight is read."""
        p = self.sampler.problems() + self.advantage.problems(reward=self.reward) + self.update.problems()
        full = self.weights.lora is None  # a full fine-tune
        p += self.performance.problems(full_fine_tune=full, masked_prompts=self.policy.masked_prompts)
        p += self.objective.problems(self.sampler.sde_type)
        p += self.objective.sampler_problems(self.sampler, self.kl)
        p += self.weights.settings.problems(self.policy.declared_networks)
        weights = dict(self.reward.weights) if isinstance(self.reward, MultiReward) else None
        p += self.kl.problems(full_fine_tune=full, reward_weights=weights)
        p += self.policy.problems() + self.sampler.image_size_problems(self.policy)
        p += self.reward.settings_problems() + reward_modality_problems(self.policy, self.reward)
        if self.sampler.guidance_scale > 1 and not self.update.train_cfg:
            rank_zero_warn(
                f"{flag('update')}.train_cfg=false with guidance_scale={self.sampler.guidance_scale}: the update "
                "scores CFG samples under the conditional model only, so the ratio starts off-policy"
            )
        return p

    def setup(self, stage: str) -> None:
        # Cross-checks against the data and the world size, still before configure_model loads weights.
        dm = getattr(self.trainer, "datamodule", None)
        # The (dp, sp) layout first, checked and built once, held by the strategy: every gather of the
        # run (this module's, the data module's, the callbacks') takes its data-parallel view from it.
        layout = build_layout(self.trainer, self.performance.sequence_parallel, self.policy, self.sampler)
        dp = layout.data_parallel
        # The metrics, built with the data-parallel peers they reduce over: the ranks of a
        # sequence-parallel group hold the same samples and would count them sp times.
        self.reward_stats = RewardGroupStats(process_group=dp.group)
        self.objective_stats = self.objective.diagnostics(self.sampler.num_steps, self.diagnostics, dp.group)
        self.validation = ValidationMeans(dp.group)  # val-{core,aux}/<component>/mean@1, unscored counts
        problems: list[str] = []
        if dm is not None and stage == "fit" and hasattr(dm, "samples_per_step"):
            problems += self.update.batch_problems(dm.samples_per_step, dp.size)
        if dm is not None and isinstance(self.reward, MultiReward):
            problems += self.reward.prompt_problems(record_sets(dm))
        problems += data_problems(self.objective, self.sampler, dm, self.weights.lora is None, self.kl)
        problems += conditioning_problems(self.policy, self.reward, self.sampler, dm)
        problems += strategy_problems(
            self.trainer, dm, self.performance, offload_reference=self.kl.reference.offload
        )
        if problems:
            raise SettingsError("invalid settings:\n  " + "\n  ".join(problems))
        check = getattr(self.reward, "check", None)
        if callable(check):
            check()  # remote endpoints answer before the first rollout

    def configure_model(self) -> None:
        if self._configured:
            return
        self.policy.load()
        # Sharded, a full fine-tune's master weights are cast block by block as they are sharded.
        sharded = sharding(self._trainer) is not None
        weights = self.weights
        weights.attach(self.policy, cast=not sharded)
        self._configured = True
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.parameters())
        rank_zero_info(f"trainable parameters: {trainable:,} of {total:,}")
        # Every network in one call: sequence split, compute dtype, compiled blocks, the copies, the
        # decoder, FSDP2 sharding (lit_flowgrpo.placement).
        place(
            self.policy,
            self.copies.networks,
            self.performance,
            self._trainer,
            self.sampler,
            offloaded=self.copies.offloaded,
            model_dtype=weights.model_dtype,
            master_dtype=weights.master_dtype,
            device=self.device,
        )

    def on_fit_start(self) -> None:
        # Frozen networks stay in eval mode on purpose (none may drop out); Lightning reports that on
        # every run and has no switch for it, so its message alone is filtered, in this process.
        warnings.filterwarnings("ignore", message=_EVAL_MODE_NOTICE, category=UserWarning)

    # ----------------------------------------------------------------------------------------------
    # Training
    # ----------------------------------------------------------------------------------------------

    def training_step(self, batch: PromptBatch, batch_idx: int) -> StepOutput:
        clock = StageClock(self.device)
        clock.begin("gen")
        if self.objective.learns_from in ("data", "data_pairs"):  # SFT, offline DPO: images, no rollout
            return data_step(self.policy, batch, clock, self._update, self._log_step, self.objective)
        embeds = self.sampler.encode(self.policy, batch.prompts, batch.conditions)  # at the rollout's size
        # Each chunk is scored as it is decoded (the reward's `overlap`): "reward" is the wait after it.
        with RewardQueue.for_batch(self.reward, batch, self.data_parallel) as scores:
            # The objective's sampling policy (DiffusionNFT's old policy; else the trained weights).
            with self.copies.sampling(), self.performance.sampling_weights(*self.policy.trainable_networks):
                traj, images = self.sampler.rollout(
                    self.policy,
                    embeds,
                    batch.seeds,
                    initial_seeds=batch.initial_seeds,
                    step=batch.step,
                    seed=self.seed,
                    record=self.objective.rollout_records(self.diagnostics),
                    on_chunk=scores.submit,
                )
            clock.begin("reward")
            rewards = scores.result(images)
        clock.begin("adv")
        advantages, keep, kl_weights = self._advantages(rewards, batch, images)
        rollout = RolloutBatch(traj, embeds, advantages, batch.sample_ids.to(self.device), keep, kl_weights)
        clock.begin("update_actor")
        dp, source = self.data_parallel, self.objective.learns_from  # online DPO's pairs; images beside
        rollout = beside_rollout(source, rollout, rewards.total, batch, self.policy, dp, self.log)
        done = self._update(rollout, batch.step, clock)
        timings = stage_timings(clock, done.reference_s)
        self._log_step()
        return StepOutput(
            timings=timings,
            num_images=len(batch),
            frames_per_sample=self.sampler.frames,
            transformer_forwards={
                "gen": traj.transformer_forwards * len(batch),
                "old_log_prob": 0,
                "ref": done.forwards["ref"],
                "update_actor": done.forwards["update"],
            },
            images=images.detach(),
            prompts=list(batch.prompts),
            rewards=rewards.total.detach(),
            sample_ids=rollout.sample_ids,
            advantages=advantages.detach(),
            keep=keep,
            trained_sample_ids=done.trained,
            kept_per_rank=done.kept_per_rank,
            sources=sources_of(batch),
        )

    @property
    def data_parallel(self) -> DataParallel:
        """This rank among its data-parallel peers."""
        return DataParallel.of(self._trainer)

    def _advantages(
        self, rewards: RewardOutput, batch: PromptBatch, images: Tensor
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Group advantages from every rank's rewards; returns this rank's (advantages, keep mask, KL
        weights)."""
        group_ids = batch.group_ids.to(self.device)
        adv = self.advantage.for_batch(
            rewards, group_ids, self.reward, self.data_parallel, images, self.kl_gate
        )
        self.counters.add("dropped_samples", adv.dropped)
        keep = adv.scored if adv.keep is None else adv.keep  # scored, and non-zero under filter_zero
        # Every sample goes in, so the metric counts the unscored ones (critic/rewards/nonfinite_count);
        # it reduces groups exactly across ranks.
        components = {k: v.to(self.device) for k, v in rewards.components.items()}
        self.reward_stats.update(rewards.total.to(self.device), group_ids, adv.values, components=components)
        # Per-reward failure rates and latencies of this rank; the advantage stage's over all ranks.
        values = {k: v for k, v in rewards.log_dict().items() if k.startswith("reward/")}
        self.log_dict({**values, **adv.log}, on_step=True, on_epoch=False)
        return adv.values, keep, adv.kl_weights if self.kl_gate is not None else None

    def _update(self, rollout: RolloutBatch | DataBatch, step: int, clock: StageClock) -> UpdateResult:
        opt, sched = self.optimizers(), self.lr_schedulers()
        for network in self.policy.trainable_networks:
            network.train()
        fp32 = self.performance.computes_fp32(self.policy.transformer, self.weights.model_dtype)
        guidance = self.sampler.guidance_scale if self.update.train_cfg else 1.0
        done = run_update(
            self.update,
            self.objective,
            VisitContext(self.policy, self.copies, guidance, kl=self.kl),
            rollout,
            UpdateHooks(
                backward=self.manual_backward,
                optimizer_step=lambda: self._optimizer_step(opt, sched),
                log=lambda values: self.log_dict(values, on_step=True, on_epoch=False),
                clock=clock.now,
            ),
            self.objective_stats,
            dp=self.data_parallel,
            generator=torch.Generator().manual_seed(self.seed * 7_919 + step),
            on_policy_tol=self.update.on_policy_tolerance(fp32),
            forwards_per_sample=cfg_forwards(self.policy, guidance),
        )
        self._losses, nonfinite = done.mean_losses(self.data_parallel)
        self.counters.add("nonfinite_losses", nonfinite)
        # Every part moves once, from what every rank saw: the idle guard, DiffusionNFT's old policy,
        # a moving KL reference (from this update's mean KL over every rank), and whatever else is
        # registered. The optimizer steps so far include this update's.
        self.parts.after_update(
            AfterUpdate(self.policy, self.global_step, done.optimizer_steps, self._losses)
        )
        return done

    def _optimizer_step(self, opt: Any, sched: Any) -> bool:
        """Clip and step; ``False`` if a non-finite gradient skipped the step."""
        params = [p for p in self.parameters() if p.requires_grad and p.grad is not None]
        self._grad_norm = clip_and_step(params, opt, sched, self.update.max_grad_norm)
        if math.isfinite(self._grad_norm):
            return True
        self.counters.add("skipped_optimizer_steps")
        rank_zero_warn("non-finite gradient norm: optimizer step skipped, weights untouched")
        return False

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._grad_norm = float("nan")

    def _log_step(self, rewards: bool = True) -> None:
        # What the update and the parts left: logging reads state, it changes none.
        values = {k: v for k, v in self._losses.items() if k.startswith("actor/")}
        values |= {
            "actor/kl_coef": self.kl.coef,
            "actor/grad_norm": self._grad_norm,
            "actor/reference_refreshes": float(self.copies.kl_reference.refreshes),
        }
        values.update({f"actor/{k}": float(v) for k, v in self.counters.values.items()})
        # Every value is the same on every rank (the gradient norm after the gradient all-reduce), so
        # nothing is synced: Lightning's fp32 mean over ranks would move even a constant (kl_coef 0.04
        # logged 0.0399999954 on 8 ranks), and would divide the counts by the number of ranks.
        self.log_dict(values, on_step=True, on_epoch=False)
        # The metrics reduce exact sufficient statistics across ranks inside compute() (a collective:
        # every rank calls it here). Logging the Metric objects themselves would log, per step, the
        # rank-local forward value: the very pooled-statistics error these metrics exist to avoid.
        # A rank whose micro-batches were all padding has no update, yet must join the collective.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*compute.*before.*update.*")
            scored = {k: float(v) for k, v in self.reward_stats.compute_prefixed().items()} if rewards else {}
            objective = self.objective.diagnostics_values(self.objective_stats, self.global_step)
        self.log_dict(scored, on_step=True, on_epoch=False)
        self.log_dict(objective, on_step=True, on_epoch=False)
        self.reward_stats.reset()
        self.objective_stats.reset()

    # ----------------------------------------------------------------------------------------------
    # Validation
    # ----------------------------------------------------------------------------------------------

    def validation_step(self, batch: PromptBatch, batch_idx: int) -> ValidationOutput:
        with self.performance.sampling_weights(*self.policy.trainable_networks):
            images = self.sampler.evaluate(self.policy, list(batch.prompts), batch.seeds, batch.conditions)
        rewards = self.reward(images, list(batch.prompts), list(batch.metadata), sources=sources_of(batch))
        for name, key in self.validation.update(rewards.components, self.device):
            # The reward declares which components are accuracy (val-core/) and which are not (val-aux/).
            mean_key, unscored_key = self.reward.validation_keys(name)
            # Name the attributes: Lightning's lookup of metric attributes is cached at the first log.
            log = dict(on_step=False, on_epoch=True)
            self.log(mean_key, self.validation.means[key], metric_attribute=f"validation.means.{key}", **log)
            unscored = self.validation.unscored[key]
            self.log(unscored_key, unscored, metric_attribute=f"validation.unscored.{key}", **log)
        return ValidationOutput(
            images=images.detach(),
            prompts=list(batch.prompts),
            rewards=rewards.components,
            sample_ids=batch.sample_ids,
            sources=sources_of(batch),
        )

    # ----------------------------------------------------------------------------------------------
    # Optimizers, checkpoints, export
    # ----------------------------------------------------------------------------------------------

    def configure_callbacks(self) -> list[L.Callback]:
        # Every fit's checkpoints carry the run card, whoever built the Trainer (lit_flowgrpo.run_card).
        from lit_flowgrpo.callbacks.run_card import run_card_callbacks

        return run_card_callbacks(self.trainer)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        return optimizers_for(params, self.optimizer_factory, self.lr_scheduler_factory)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Only the trainable weights (the LoRA adapter, or the transformer of a full fine-tune): the
        # frozen base is re-read from `pretrained`, so a 12B model's checkpoint stays adapter-sized.
        keys = {name for name, p in self.named_parameters() if p.requires_grad}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keys}
        # Beside them, every part's state under its key (the copies' tensors are this rank's shards
        # under FSDP2, which the strategy saves as such).
        checkpoint["lit_flowgrpo"] = {"trainable_keys": sorted(keys), **self.parts.state_dict()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.strict_loading = False  # the frozen base is not in the checkpoint
        trainable = {n: p for n, p in self.named_parameters() if p.requires_grad}
        self.weights.check_resumed(checkpoint["state_dict"], trainable)
        self.parts.load_state_dict(checkpoint.get("lit_flowgrpo", {}))

    def load_trainable_checkpoint(self, path: str, use_ema: bool = True) -> None:
        """Load a checkpoint's trainable weights (its EMA weights if present and ``use_ema``)."""
        self.configure_model()
        self.weights.load_checkpoint(path, self, use_ema=use_ema)

    def export(self, path: str, overwrite: bool = False) -> str:
        """Write what was trained for the family's diffusers pipeline: the LoRA adapter
        (``pipeline.load_lora_weights(path)``) or, for a full fine-tune, the transformer folder
        (``from_pretrained(path)``). ``path`` must be a new or empty folder unless ``overwrite``, which
        replaces its contents wholly. Returns a line saying what was written."""
        self.configure_model()
        return self.weights.export(self.policy, path, overwrite=overwrite)

    def export_lora(self, path: str, overwrite: bool = False) -> None:
        """Write the LoRA adapter (:meth:`export` of a LoRA run)."""
        if self.lora is None:
            raise ValueError(
                f"export_lora needs a LoRA run ({flag('weights')}.lora); use export() for a full fine-tune"
            )
        self.export(path, overwrite=overwrite)
