"""`FlowGRPOModule`: sample → score → advantages → update → log, one rollout batch per training step.

Each stage has one owner that validates its settings once (DESIGN.md, "One training step"):

- :class:`~lit_flowgrpo.rollout.Sampler` draws the rollout and the validation samples;
- the reward (:mod:`lit_flowgrpo.rewards`) scores the images;
- :class:`AdvantageSettings` turn every rank's rewards into group advantages;
- :class:`~lit_flowgrpo.objective.Objective` declares what the rollout records, which visits the
  update makes and what one visit costs;
- :func:`~lit_flowgrpo.update.run_update` walks the batch as :class:`UpdateSettings` say (inner
  epochs, micro-batches, optimizer steps, clipping);
- :class:`~lit_flowgrpo.distributed.DataParallel` is the view of the data-parallel peers;
- :class:`~lit_flowgrpo.lora.TrainableWeights` decides what is trained, the KL reference and export.

Optimization is manual: one batch feeds several optimizer steps.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torchmetrics import Metric
from torchmetrics.aggregation import MeanMetric, SumMetric

from lit_flowgrpo.advantages import AdvantageSettings
from lit_flowgrpo.data import PromptBatch
from lit_flowgrpo.distributed import DataParallel
from lit_flowgrpo.errors import SettingsError, flag
from lit_flowgrpo.lora import LoraSettings, ReferenceSettings, TrainableWeights
from lit_flowgrpo.metrics import DiagnosticsSettings, RewardGroupStats
from lit_flowgrpo.objective import FlowGRPO, Objective, VisitContext
from lit_flowgrpo.performance import PerformanceSettings
from lit_flowgrpo.policies.base import FlowPolicy, reward_modality_problems
from lit_flowgrpo.rewards.base import MultiReward, RewardOutput, as_reward
from lit_flowgrpo.rewards.overlap import RewardQueue
from lit_flowgrpo.rollout import RolloutBatch, Sampler, cfg_forwards
from lit_flowgrpo.sequence_parallel import attach_sequence_parallel, sequence_parallel_problems, size_problems
from lit_flowgrpo.step_output import STAGES, StepOutput, ValidationOutput
from lit_flowgrpo.strategies import shard_networks, sharding, strategy_problems
from lit_flowgrpo.update import (
    IdleRollouts,
    UpdateHooks,
    UpdateResult,
    UpdateSettings,
    clip_and_step,
    run_update,
)

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
            ``FlowGRPO`` or ``GRPOGuard``, with their clip and KL settings); ``None``: ``FlowGRPO()``.
        sampler: how rollouts and validation samples are drawn.
        advantage: from rewards to advantages.
        update: how the update walks each rollout batch.
        lora: LoRA settings; ``None`` is a full fine-tune of the transformer.
        reference_copy: full fine-tune only: keep a frozen copy of the initial transformer as the
            KL reference (with LoRA the reference is the same network with the adapter disabled).
        reference: where the KL reference sits: the initial model, or one refreshed or averaged
            along the run (GARDO's adaptive reference; :class:`~lit_flowgrpo.lora.ReferenceSettings`),
            and whether a full fine-tune's frozen copy is kept in host memory (``offload``, fsdp2).
        master_dtype: the dtype the trained weights are kept in: ``float32`` (the default: master
            weights, computing in the compute dtype under autocast) or ``model`` (a full fine-tune
            trains the policy's dtype, bf16, in place, and loses updates smaller than its rounding;
            saves 2 bytes per parameter and 4 of AdamW's). A LoRA adapter is always float32.
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
        lora: LoraSettings | None = LoraSettings(),
        reference_copy: bool = False,
        reference: ReferenceSettings = ReferenceSettings(),
        master_dtype: Literal["float32", "model"] = "float32",
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
        self.weights = TrainableWeights(
            lora,
            reference_copy=reference_copy,
            seed=seed,
            old_policy=self.objective.old_policy,
            reference_settings=dataclasses.replace(reference),
            master_dtype=master_dtype,
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
        self.hparams["lora"] = None if lora is None else dataclasses.asdict(lora)
        self.hparams["reference"] = dataclasses.asdict(reference)
        self.hparams["objective"] = self.objective.hparams()

        self.reward_stats = RewardGroupStats()
        self.objective_stats = self.objective.diagnostics(self.sampler.num_steps, self.diagnostics)
        self.val_means = nn.ModuleDict()  # val-{core,aux}/<component>/mean@1, created on first use
        self.val_unscored = nn.ModuleDict()  # val-aux/<component>/unscored_count
        self._counters = {"skipped_optimizer_steps": 0, "nonfinite_losses": 0, "dropped_samples": 0}
        self._idle = IdleRollouts(self.advantage.max_idle_rollouts)
        self._configured = False

    @property
    def lora(self) -> LoraSettings | None:
        return self.weights.lora

    @property
    def sequence_parallel(self) -> int:
        """Ranks that share each sample's tokens (``performance.sequence_parallel``); what
        :class:`~lit_flowgrpo.distributed.DataParallel` asks to tell data-parallel peers apart."""
        return self.performance.sequence_parallel

    def _problems(self) -> list[str]:
        """Every settings problem, each naming its flag, found before any weight is read."""
        p = self.sampler.problems() + self.advantage.problems(reward=self.reward) + self.update.problems()
        p += self.performance.problems(
            full_fine_tune=self.weights.lora is None,
            masked_prompts=getattr(self.policy, "masked_prompts", False),
        )
        p += self.objective.problems(self.sampler.sde_type)
        p += self.objective.sampler_problems(self.sampler, measure_reference=self.diagnostics.reference_kl)
        p += self.weights.problems(
            self.objective.uses_reference or self.diagnostics.reference_kl,
            getattr(self.policy, "declared_networks", 1),
        )
        p += self.policy.problems() + self.sampler.image_size_problems(self.policy)
        p += self.reward.settings_problems() + reward_modality_problems(self.policy, self.reward)
        if self.advantage.kl_gate is not None and not self.objective.uses_reference:
            p.append(
                f"{flag('advantage')}.kl_gate gates the KL penalty, but there is none: set "
                f"{flag('objective')}.kl_coef > 0 (GARDO's OCR recipe: 0.04), or drop the gate"
            )
        if self.sampler.guidance_scale > 1 and not self.update.train_cfg:
            rank_zero_warn(
                f"{flag('update')}.train_cfg=false with guidance_scale={self.sampler.guidance_scale}: the update "
                "scores CFG samples under the conditional model only, so the ratio starts off-policy"
            )
        return p

    def setup(self, stage: str) -> None:
        # Cross-checks against the data and the world size, still before configure_model loads weights.
        dm = getattr(self.trainer, "datamodule", None)
        problems = sequence_parallel_problems(
            self.sequence_parallel, self.trainer.world_size, self.trainer.strategy, self.policy, self.sampler
        )
        if problems:  # before anything asks for the data-parallel view, which needs sp to divide the world
            raise SettingsError("invalid settings:\n  " + "\n  ".join(problems))
        if dm is not None and stage == "fit" and hasattr(dm, "samples_per_step"):
            problems += self.update.batch_problems(dm.samples_per_step, self.data_parallel.size)
        if dm is not None and isinstance(self.reward, MultiReward):
            parts = {"--data.init_args.train": "train_records", "--data.init_args.val": "val_records"}
            problems += self.reward.prompt_problems(
                {f: list(getattr(dm, a, None) or []) for f, a in parts.items()}
            )
        problems += strategy_problems(
            self.trainer, dm, self.performance, offload_reference=self.weights.reference_settings.offload
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
        self._split_sequences()
        shape = self.policy.attention_shape(self.sampler.height, self.sampler.width)
        device = self._trainer.strategy.root_device if self._trainer is not None else self.device
        dtypes = dict(model_dtype=weights.model_dtype, master_dtype=weights.master_dtype)
        # The inputs in the compute dtype: the masters and their copies see the same tensors.
        self.policy.compute_dtype = self.performance.resolved_dtype(
            self.policy.transformer, weights.model_dtype
        )
        for network in self.policy.trainable_networks:
            self.performance.apply(network, shape, device, **dtypes)
        for network in weights.copies:
            self.performance.apply_to_copy(network, shape, device, **dtypes)
        self.performance.apply_to_decoder(getattr(self.policy, "vae", None))
        self._configured = True
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.parameters())
        rank_zero_info(f"trainable parameters: {trainable:,} of {total:,}")
        # After the adapter is attached, so that its weights shard with their blocks.
        reference = weights.reference_network
        shard_networks(
            self._trainer,
            self.policy.trainable_networks,
            weights.copies,
            master_dtype=weights.master_dtype,
            compute_dtype=self.performance.resolved_dtype(self.policy.transformer, weights.model_dtype),
            offloaded=[reference] if reference is not None and weights.reference_settings.offload else [],
        )

    def _split_sequences(self) -> None:
        """``performance.sequence_parallel``: diffusers' context-parallel hooks on every transformer the
        rollout, the update and the reference run (before compiling, so the compiled blocks see them),
        and the metrics reduced over data-parallel peers only, since the ranks of a group hold the same
        samples and would count them sp times."""
        sp = self.sequence_parallel
        if sp == 1 or self._trainer is None:
            return  # without a trainer (export, evaluation in Python) one process runs the whole sequence
        # Again with the loaded configs: a hub id's first look, and the checkpoint's own numbers.
        problems = size_problems(self.policy.sequence_parallel_problems, sp, self.sampler)
        if problems:
            raise SettingsError("invalid settings:\n  " + "\n  ".join(problems))
        device = self._trainer.strategy.root_device
        for network in (*self.policy.trainable_networks, *self.weights.copies):
            attach_sequence_parallel(network, sp, device)
        group = self.data_parallel.group
        for metric in self.modules():
            if isinstance(metric, Metric):
                metric.process_group = group

    def on_fit_start(self) -> None:
        # Frozen networks stay in eval mode on purpose (none may drop out); Lightning reports that on
        # every run and has no switch for it, so its message alone is filtered, in this process.
        warnings.filterwarnings("ignore", message=_EVAL_MODE_NOTICE, category=UserWarning)

    # ----------------------------------------------------------------------------------------------
    # Training
    # ----------------------------------------------------------------------------------------------

    def training_step(self, batch: PromptBatch, batch_idx: int) -> StepOutput:
        timings = dict.fromkeys(STAGES, 0.0)
        start = t = self._clock()
        embeds = self.policy.encode_prompts(batch.prompts)
        # Each chunk is scored as it is decoded (the reward's `overlap`): "reward" is the wait after it.
        with RewardQueue(self.reward, batch.prompts, batch.metadata) as scores:
            # The objective's sampling policy (DiffusionNFT's old policy; else the trained weights).
            with (
                self.weights.sampling(self.policy),
                self.performance.sampling_weights(*self.policy.trainable_networks),
            ):
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
            timings["gen"], t = self._clock() - t, self._clock()
            rewards = scores.result(images)
        timings["reward"], t = self._clock() - t, self._clock()
        advantages, keep, kl_weights = self._advantages(rewards, batch, images)
        rollout = RolloutBatch(traj, embeds, advantages, batch.sample_ids.to(self.device), keep, kl_weights)
        timings["adv"], t = self._clock() - t, self._clock()
        done = self._update(rollout, batch.step)
        timings["ref"] = done.reference_s
        timings["update_actor"] = self._clock() - t - timings["ref"]
        timings["step"] = self._clock() - start
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
        )

    @property
    def data_parallel(self) -> DataParallel:
        """This rank among its data-parallel peers."""
        return DataParallel.of(self._trainer)

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _advantages(
        self, rewards: RewardOutput, batch: PromptBatch, images: Tensor
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Group advantages from every rank's rewards; returns this rank's (advantages, keep mask, KL
        weights)."""
        group_ids = batch.group_ids.to(self.device)
        adv = self.advantage.for_batch(rewards, group_ids, self.reward, self.data_parallel, images)
        self._counters["dropped_samples"] += adv.dropped
        keep = adv.scored if adv.keep is None else adv.keep  # scored, and non-zero under filter_zero
        # Every sample goes in, so the metric counts the unscored ones (critic/rewards/nonfinite_count);
        # it reduces groups exactly across ranks.
        components = {k: v.to(self.device) for k, v in rewards.components.items()}
        self.reward_stats.update(rewards.total.to(self.device), group_ids, adv.values, components=components)
        # Per-reward failure rates and latencies of this rank; the advantage stage's over all ranks.
        values = {k: v for k, v in rewards.log_dict().items() if k.startswith("reward/")}
        self.log_dict({**values, **adv.log}, on_step=True, on_epoch=False)
        return adv.values, keep, adv.kl_weights if self.advantage.kl_gate is not None else None

    def _update(self, rollout: RolloutBatch, step: int) -> UpdateResult:
        opt, sched = self.optimizers(), self.lr_schedulers()
        for network in self.policy.trainable_networks:
            network.train()
        transformer = self.policy.transformer
        fp32 = self.performance.computes_fp32(transformer, self.weights.model_dtype)
        guidance = self.sampler.guidance_scale if self.update.train_cfg else 1.0
        done = run_update(
            self.update,
            self.objective,
            VisitContext(
                self.policy, self.weights, guidance, measure_reference=self.diagnostics.reference_kl
            ),
            rollout,
            UpdateHooks(
                backward=self.manual_backward,
                optimizer_step=lambda: self._optimizer_step(opt, sched),
                log=lambda values: self.log_dict(values, on_step=True, on_epoch=False),
                clock=self._clock,
            ),
            self.objective_stats,
            dp=self.data_parallel,
            generator=torch.Generator().manual_seed(self.seed * 7_919 + step),
            on_policy_tol=self.update.on_policy_tolerance(fp32),
            forwards_per_sample=cfg_forwards(self.policy, guidance),
        )
        self._idle.observe(done.optimizer_steps)
        # After the whole update (DiffusionNFT's old-policy refresh), given the optimizer steps so far.
        self.objective.after_update(self.weights, self.policy, self.global_step)
        # The moving reference (GARDO's refresh, or an EMA), from this update's mean KL over every rank.
        self._losses = self._mean_losses(done)
        kl = self._losses["actor/kl_loss"] if self._losses["count"] else float("nan")
        self.weights.after_update(self.policy, self.global_step, kl)
        return done

    def _mean_losses(self, done: UpdateResult) -> dict[str, float]:
        """The update's mean losses over every rank's micro-batches (``actor/loss``, ``pg_loss``,
        ``kl_loss``) and their ``count``; counts the non-finite ones."""
        assert done.loss_sums is not None
        # Summed over the ranks (one gather, fp64; the step's one read of the loss sums), so every rank
        # holds what one process would, and the moving reference decides on the same KL on every rank.
        sums = torch.cat(
            [done.loss_sums.double(), done.loss_sums.new_tensor([done.num_losses], dtype=torch.float64)]
        )
        loss, pg_loss, kl_loss, nonfinite, count = self.data_parallel.stack(sums).sum(0).tolist()
        self._counters["nonfinite_losses"] += int(nonfinite)
        n = max(count, 1)
        return {
            "actor/loss": loss / n,
            "actor/pg_loss": pg_loss / n,
            "actor/kl_loss": kl_loss / n,
            "count": count,
        }

    def _optimizer_step(self, opt: Any, sched: Any) -> bool:
        """Clip and step; ``False`` if a non-finite gradient skipped the step."""
        params = [p for p in self.parameters() if p.requires_grad and p.grad is not None]
        self._grad_norm = clip_and_step(params, opt, sched, self.update.max_grad_norm)
        if math.isfinite(self._grad_norm):
            return True
        self._counters["skipped_optimizer_steps"] += 1
        rank_zero_warn("non-finite gradient norm: optimizer step skipped, weights untouched")
        return False

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._grad_norm = float("nan")

    def _log_step(self) -> None:
        # The update's mean losses as _update computed them for the moving reference: logging changes nothing.
        values = {k: v for k, v in self._losses.items() if k.startswith("actor/")}
        values |= {
            "actor/kl_coef": self.objective.kl_coef,
            "actor/grad_norm": self._grad_norm,
            "actor/reference_refreshes": float(self.weights.refreshes),
        }
        values.update({f"actor/{k}": float(v) for k, v in self._counters.items()})
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
            rewards = {k: float(v) for k, v in self.reward_stats.compute_prefixed().items()}
            objective = self.objective.diagnostics_values(self.objective_stats)
        self.log_dict(rewards, on_step=True, on_epoch=False)
        self.log_dict(objective, on_step=True, on_epoch=False)
        self.reward_stats.reset()
        self.objective_stats.reset()

    # ----------------------------------------------------------------------------------------------
    # Validation
    # ----------------------------------------------------------------------------------------------

    def validation_step(self, batch: PromptBatch, batch_idx: int) -> ValidationOutput:
        with self.performance.sampling_weights(*self.policy.trainable_networks):
            images = self.sampler.evaluate(self.policy, list(batch.prompts), batch.seeds)
        rewards = self.reward(images, list(batch.prompts), list(batch.metadata))
        for name, values in rewards.components.items():
            key = name.replace("/", "__")
            if key not in self.val_means:
                # Created lazily: components are known only once the reward has run.
                group = self.data_parallel.group  # data-parallel peers: a sequence-parallel group counts once
                self.val_means[key] = MeanMetric(nan_strategy="ignore", process_group=group).to(self.device)
                self.val_unscored[key] = SumMetric(process_group=group).to(self.device)
            values = values.to(self.device)
            self.val_means[key].update(values)
            self.val_unscored[key].update((~torch.isfinite(values)).float())
            # The reward declares which components are accuracy (val-core/) and which are not (val-aux/).
            mean_key, unscored_key = self.reward.validation_keys(name)
            # Name the attributes: Lightning's lookup of metric attributes is cached at the first log.
            log = dict(on_step=False, on_epoch=True)
            self.log(mean_key, self.val_means[key], metric_attribute=f"val_means.{key}", **log)
            self.log(unscored_key, self.val_unscored[key], metric_attribute=f"val_unscored.{key}", **log)
        return ValidationOutput(
            images=images.detach(),
            prompts=list(batch.prompts),
            rewards=rewards.components,
            sample_ids=batch.sample_ids,
        )

    # ----------------------------------------------------------------------------------------------
    # Optimizers, checkpoints, export
    # ----------------------------------------------------------------------------------------------

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"no trainable parameter: set {flag('lora')} or train the full transformer")
        if self.optimizer_factory is None:
            optimizer = torch.optim.AdamW(params, lr=3e-4, weight_decay=1e-4)
        else:
            optimizer = self.optimizer_factory(params)
        if self.lr_scheduler_factory is None:
            # A constant schedule, so LearningRateMonitor logs the rate under its DESIGN.md name.
            scheduler = torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
        else:
            scheduler = self.lr_scheduler_factory(optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "actor/lr"},
        }

    def _trainable_keys(self) -> set[str]:
        return {name for name, p in self.named_parameters() if p.requires_grad}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Only the trainable weights (the LoRA adapter, or the transformer of a full fine-tune): the
        # frozen base is re-read from `pretrained`, so a 12B model's checkpoint stays adapter-sized.
        keys = self._trainable_keys()
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keys}
        checkpoint["lit_flowgrpo"] = {
            "trainable_keys": sorted(keys),
            "counters": dict(self._counters),
            "idle_rollouts": self._idle.count,
            # The old policy of DiffusionNFT and a moving KL reference (not trainable, so not in the
            # state dict above), and the KL gate's controller.
            "old_policy": self.weights.old_state_dict(self.policy),
            "reference": self.weights.reference_state_dict(self.policy),
            "kl_gate": None if self.advantage.kl_gate is None else self.advantage.kl_gate.state_dict(),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.strict_loading = False  # the frozen base is not in the checkpoint
        expected = self._trainable_keys()
        missing = expected - set(checkpoint["state_dict"])
        if expected and missing:
            raise SettingsError(
                f"the checkpoint lacks {len(missing)} trainable tensors (e.g. {sorted(missing)[:3]}): it was "
                "written with other LoRA settings or another policy; resume with the run's own config"
            )
        # Checked here, before Lightning's load_state_dict, which would list every tensor of another shape.
        saved = checkpoint["state_dict"]
        other = sorted(
            (name, tuple(saved[name].shape), tuple(p.shape))
            for name, p in self.named_parameters()
            if name in expected and torch.is_tensor(saved[name]) and saved[name].shape != p.shape
        )
        if other:
            name, was, now = other[0]
            raise SettingsError(
                f"the checkpoint's trainable tensors have other shapes than this run's ({len(other)} of "
                f"{len(expected)}, e.g. {name}: checkpoint {list(was)}, this run {list(now)}): it was written "
                f"with another {flag('lora')}.rank or another policy; resume with the run's own config"
            )
        ours = checkpoint.get("lit_flowgrpo", {})
        self._counters.update(ours.get("counters", {}))
        self._idle.count = ours.get("idle_rollouts", 0)
        if self.weights.old_policy:
            if not ours.get("old_policy"):
                raise ValueError(
                    f"the checkpoint holds no old policy, which {type(self.objective).__name__} needs: it was "
                    "written by a run with another objective; resume with the run's own config"
                )
            self.weights.load_old_state_dict(self.policy, ours["old_policy"])
        self.weights.load_reference_state_dict(self.policy, ours.get("reference", {}))
        if self.advantage.kl_gate is not None and ours.get("kl_gate"):
            self.advantage.kl_gate.load_state_dict(ours["kl_gate"])

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
                f"export_lora needs a LoRA run ({flag('lora')}); use export() for a full fine-tune"
            )
        self.export(path, overwrite=overwrite)
