"""`FlowGRPOModule`: sample → score → advantages → update → log, one rollout batch per training step.

Each stage has one owner that validates its settings once (DESIGN.md, "One training step"):

- :class:`~lit_flowgrpo.rollout.Sampler` draws the rollout and the validation samples;
- the reward (:mod:`lit_flowgrpo.rewards`) scores the images;
- :class:`AdvantageSettings` turn every rank's rewards into group advantages;
- :class:`~lit_flowgrpo.objective.Objective` turns a re-scored micro-batch into a loss;
- :class:`UpdateSettings` set how the update walks the batch (inner epochs, micro-batches, optimizer
  steps, clipping);
- :class:`~lit_flowgrpo.lora.TrainableWeights` decides what is trained, the KL reference and export.

Optimization is manual: one batch feeds several optimizer steps.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torchmetrics.aggregation import MeanMetric, SumMetric

from lit_flowgrpo.advantages import AdvantageSettings
from lit_flowgrpo.data import PromptBatch
from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.lora import LoraSettings, TrainableWeights
from lit_flowgrpo.metrics import DiagnosticsSettings, PolicyRatioStats, RewardGroupStats
from lit_flowgrpo.objective import FlowGRPO, Objective
from lit_flowgrpo.performance import PerformanceSettings
from lit_flowgrpo.policies.base import FlowPolicy
from lit_flowgrpo.rewards.base import MultiReward, RewardOutput, as_reward
from lit_flowgrpo.rollout import Sampler, Trajectory
from lit_flowgrpo.step_output import STAGES, StepOutput, ValidationOutput
from lit_flowgrpo.strategies import strategy_problems
from lit_flowgrpo.update import (
    ON_POLICY_CAUSES,
    IdleRollouts,
    UpdateSettings,
    balance_moves,
    clip_and_step,
    load_balance,
    micro_step,
    receive_rows,
    send_rows,
)

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
        self.weights = TrainableWeights(lora, reference_copy=reference_copy, seed=seed)
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
        settings = self.objective.settings()
        settings.pop("name")
        cls = type(self.objective)
        self.hparams["objective"] = {
            "class_path": f"{cls.__module__}.{cls.__qualname__}",
            "init_args": settings,
        }

        self.reward_stats = RewardGroupStats()
        self.ratio_stats = PolicyRatioStats(
            clip_range=self.objective.clip_range,
            clip_range_high=self.objective.clip_range_high,
            num_steps=self.sampler.num_steps,
            **dataclasses.asdict(self.diagnostics),
        )
        self.val_means = nn.ModuleDict()  # val-{core,aux}/<component>/mean@1, created on first use
        self.val_unscored = nn.ModuleDict()  # val-aux/<component>/unscored_count
        self._counters = {"skipped_optimizer_steps": 0, "nonfinite_losses": 0, "dropped_samples": 0}
        self._idle = IdleRollouts(self.advantage.max_idle_rollouts)
        self._configured = False

    @property
    def lora(self) -> LoraSettings | None:
        return self.weights.lora

    def _problems(self) -> list[str]:
        """Every settings problem, each naming its flag, found before any weight is read."""
        p = self.sampler.problems() + self.advantage.problems() + self.update.problems()
        p += self.performance.problems()
        if self.weights.lora is None:
            # What the performance settings ask of the trained weights, known from the config alone
            # (PerformanceSettings.apply would find it only once the weights are loaded).
            for setting, why in (
                (
                    "fp8_base_matmuls",
                    "converts the frozen linear layers, and a full fine-tune trains them all",
                ),
                ("rollout_merged_lora", "merges a LoRA adapter, and a full fine-tune has none"),
            ):
                if getattr(self.performance, setting):
                    p.append(
                        f"--model.performance.{setting} with a full fine-tune (--model.lora=null): it {why}; "
                        "set --model.lora, or drop the setting"
                    )
        p += self.objective.problems(self.sampler.sde_type)
        p += self.weights.problems(self.objective.uses_reference)
        p += self.policy.problems() + self.policy.image_size_problems(self.sampler.height, self.sampler.width)
        weights = getattr(self.reward, "weights", None)
        if isinstance(weights, dict) and weights and not any(weights.values()):
            p.append(f"--model.reward.weights are all 0 ({weights}): the reward is 0 by construction")
        try:
            _ = self.reward.core_components  # checks each reward's declaration
        except TypeError as err:
            p.append(str(err))
        if self.sampler.guidance_scale > 1 and not self.update.train_cfg:
            rank_zero_warn(
                f"--model.update.train_cfg=false with guidance_scale={self.sampler.guidance_scale}: the update "
                "scores CFG samples under the conditional model only, so the ratio starts off-policy"
            )
        return p

    def setup(self, stage: str) -> None:
        # Cross-checks against the data and the world size, still before configure_model loads weights.
        dm = getattr(self.trainer, "datamodule", None)
        problems: list[str] = []
        if dm is not None and stage == "fit" and hasattr(dm, "samples_per_step"):
            world, total = self.trainer.world_size, dm.samples_per_step
            if total % world:
                problems.append(
                    f"--data.prompts_per_step × --data.group_size ({total}) must be a multiple of the number "
                    f"of ranks ({world})"
                )
            elif (total // world) % self.update.micro_batch_size:
                problems.append(
                    f"--model.update.micro_batch_size ({self.update.micro_batch_size}) must divide the "
                    f"per-rank batch ({total} samples / {world} ranks = {total // world}): change either"
                )
        if dm is not None and isinstance(self.reward, MultiReward):
            records = list(getattr(dm, "train_records", [])) + list(getattr(dm, "val_records", []))
            for name, keys in self.reward.required_metadata().items():
                for key in keys:
                    missing = sum(1 for r in records if key not in r)
                    if missing:
                        problems.append(
                            f"reward {name!r} needs metadata field {key!r}, missing in {missing} of "
                            f"{len(records)} prompts: use a .jsonl prompt file whose records carry it"
                        )
            # Every prompt the run will draw is checked now, not when a rollout first draws it.
            for flag, part in (("--data.train", "train_records"), ("--data.val", "val_records")):
                found = self.reward.problems(list(getattr(dm, part, None) or []))
                problems += [f"{flag}: {line}" for line in found[:10]]
                if len(found) > 10:
                    problems.append(f"{flag}: ... and {len(found) - 10} more")
        problems += strategy_problems(self.trainer, dm, self.performance)
        if problems:
            raise SettingsError("invalid settings:\n  " + "\n  ".join(problems))
        check = getattr(self.reward, "check", None)
        if callable(check):
            check()  # remote endpoints answer before the first rollout

    def configure_model(self) -> None:
        if self._configured:
            return
        self.policy.load()
        self.weights.attach(self.policy)
        self.performance.apply(self.policy.transformer)
        self.performance.apply_to_decoder(getattr(self.policy, "vae", None))
        self._configured = True
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.parameters())
        rank_zero_info(f"trainable parameters: {trainable:,} of {total:,}")
        from lit_flowgrpo.strategies import FSDP2Strategy

        strategy = self._trainer.strategy if self._trainer is not None else None
        if isinstance(strategy, FSDP2Strategy):
            # After the adapter is attached, so that its weights shard with their blocks.
            strategy.shard(self.policy.transformer)
            if self.weights.reference_network is not None:
                strategy.shard(self.weights.reference_network)

    def on_fit_start(self) -> None:
        # The frozen text encoders, VAE and reference stay in eval mode on purpose (a frozen network
        # must not drop out), which Lightning's fit loop reports as "Found N module(s) in eval mode"
        # on every run. Lightning has no switch for that check, so its message alone is filtered (from
        # here on, in this process).
        warnings.filterwarnings(
            "ignore",
            message=r"Found \d+ module\(s\) in eval mode at the start of training",
            category=UserWarning,
        )

    # ----------------------------------------------------------------------------------------------
    # Training
    # ----------------------------------------------------------------------------------------------

    def training_step(self, batch: PromptBatch, batch_idx: int) -> StepOutput:
        timings = dict.fromkeys(STAGES, 0.0)
        start = t = self._clock()
        embeds = self.policy.encode_prompts(batch.prompts)
        with self.performance.sampling_weights(self.policy.transformer):
            traj, images = self.sampler.rollout(
                self.policy,
                embeds,
                batch.seeds,
                step=batch.step,
                seed=self.seed,
                keep_means=self.objective.needs_old_mean,
            )
        timings["gen"], t = self._clock() - t, self._clock()
        rewards = self._score(images, batch)
        timings["reward"], t = self._clock() - t, self._clock()
        advantages, keep = self._advantages(rewards, batch)
        timings["adv"], t = self._clock() - t, self._clock()
        forwards = self._update(traj, embeds, advantages, keep, batch, timings)
        timings["update_actor"] = self._clock() - t - timings["ref"]
        timings["step"] = self._clock() - start
        self._log_step()
        return StepOutput(
            timings=timings,
            num_images=len(batch),
            transformer_forwards={
                "gen": traj.transformer_forwards * len(batch),
                "old_log_prob": 0,
                "ref": forwards["ref"],
                "update_actor": forwards["update"],
            },
            images=images.detach(),
            prompts=list(batch.prompts),
            rewards=rewards.total.detach(),
        )

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _score(self, images: Tensor, batch: PromptBatch) -> RewardOutput:
        return self.reward(images, list(batch.prompts), list(batch.metadata))

    def _advantages(self, rewards: RewardOutput, batch: PromptBatch) -> tuple[Tensor, Tensor]:
        """Group advantages from every rank's rewards; returns this rank's (advantages, keep mask)."""
        local = rewards.total.to(self.device, torch.float32)  # (B,)
        group_ids = batch.group_ids.to(self.device)
        valid = torch.isfinite(local)
        gathered = self._gather(torch.stack([local, group_ids.float()]))  # (2, W·B)
        adv, failure_rate = self.advantage.advantages(gathered[0], gathered[1].long())
        dropped = int((~valid).sum())
        if dropped:
            self._counters["dropped_samples"] += dropped
            rank_zero_warn(
                f"{dropped} of {len(local)} samples have no finite reward: dropped from the advantages"
            )
        rank, size = self.global_rank, len(local)
        mine = adv[rank * size : (rank + 1) * size]
        keep = valid & (mine != 0) if self.advantage.filter_zero else valid
        # Every sample goes in, so the metric counts the unscored ones (critic/rewards/nonfinite_count);
        # it reduces groups exactly across ranks.
        self.reward_stats.update(
            local, group_ids, mine, components={k: v.to(self.device) for k, v in rewards.components.items()}
        )
        # reward/failure_rate over all ranks; per-reward failure rates and latencies of this rank.
        values = {k: v for k, v in rewards.log_dict().items() if k.startswith("reward/")}
        values["reward/failure_rate"] = failure_rate
        self.log_dict(values, on_step=True, on_epoch=False)
        return mine, keep

    def _gather(self, x: Tensor) -> Tensor:
        """(…, B) on each rank → (…, W·B), rank-major, on every rank."""
        if self.trainer.world_size == 1:
            return x
        return torch.cat(list(self.all_gather(x).unbind(0)), dim=-1)

    def _balance(
        self,
        traj: Trajectory,
        embeds: dict[str, Tensor],
        advantages: Tensor,
        sample_ids: Tensor,
        kept: Tensor,
        counts: list[int],
    ) -> tuple[Trajectory, dict[str, Tensor], Tensor, Tensor, Tensor, list[int]]:
        """``update.balance_load``: move kept samples between ranks so each trains ⌊K/R⌋ or ⌈K/R⌉."""
        moves = balance_moves(counts)
        after = list(counts)
        for source, dest, n in moves:
            after[source] -= n
            after[dest] += n
        self.log_dict(
            {
                "global_load/balanced_min": float(min(after) * traj.num_trained),
                "global_load/balanced_max": float(max(after) * traj.num_trained),
            },
            on_step=True,
            on_epoch=False,
        )
        if not moves:
            return traj, embeds, advantages, sample_ids, kept, counts
        fields = ["latents", "next_latents", "log_probs", "std_dev_t", "sqrt_dt", "final"]
        if traj.prev_sample_means is not None:
            fields.append("prev_sample_means")
        rows = {f"traj.{name}": getattr(traj, name) for name in fields}
        rows.update({f"embeds.{k}": v for k, v in embeds.items()})
        rows.update(advantages=advantages, sample_ids=sample_ids)
        flags = {name for name, t in rows.items() if t.dtype == torch.bool}  # collectives move numbers
        rows = {name: t.to(torch.uint8) if name in flags else t for name, t in rows.items()}
        blocks = send_rows(rows, kept, moves, self.global_rank)
        gathered = {name: self.all_gather(block) for name, block in blocks.items()}  # (R, width, ...)
        rows, n_kept = receive_rows(rows, kept, moves, self.global_rank, gathered)
        rows = {name: t.bool() if name in flags else t for name, t in rows.items()}
        traj = dataclasses.replace(traj, **{name: rows[f"traj.{name}"] for name in fields})
        embeds = {k: rows[f"embeds.{k}"] for k in embeds}
        kept = torch.arange(n_kept, device=kept.device)
        return traj, embeds, rows["advantages"], rows["sample_ids"], kept, after

    def _update(
        self,
        traj: Trajectory,
        embeds: dict[str, Tensor],
        advantages: Tensor,
        keep: Tensor,
        batch: PromptBatch,
        timings: dict[str, float],
    ) -> dict[str, int]:
        settings = self.update
        opt, sched = self.optimizers(), self.lr_schedulers()
        self.policy.transformer.train()
        forwards = {"update": 0, "ref": 0}
        cfg = settings.train_cfg and self.sampler.guidance_scale > 1 and self.policy.uses_cfg_batch
        per_forward = 2 if cfg else 1
        guidance = self.sampler.guidance_scale if settings.train_cfg else 1.0
        kept = keep.nonzero().flatten()  # one host read per rollout; none inside the loops below
        # Every rank runs the same number of backward passes (DDP all-reduces inside each), so the
        # micro-batch count is the largest over ranks; a rank with fewer kept samples pads with
        # zero-weight ones.
        kept_per_rank = self._gather(torch.tensor([float(len(kept))], device=self.device)).tolist()
        self.log_dict(
            load_balance([n * traj.num_trained for n in kept_per_rank]), on_step=True, on_epoch=False
        )
        sample_ids = batch.sample_ids.to(self.device)  # once: a copy inside the loop would synchronise
        if settings.balance_load and self.trainer.world_size > 1:
            traj, embeds, advantages, sample_ids, kept, kept_per_rank = self._balance(
                traj, embeds, advantages, sample_ids, kept, [int(n) for n in kept_per_rank]
            )
        n_micro = math.ceil(max(kept_per_rank) / settings.micro_batch_size)
        applied = 0
        if n_micro and traj.num_trained:
            tol = settings.on_policy_tol
            if tol is None:
                transformer = self.policy.transformer
                fp32 = {transformer.dtype, self.performance.resolved_dtype(transformer)} == {torch.float32}
                tol = 1e-6 if fp32 else 1e-3
            gen = torch.Generator().manual_seed(self.seed * 7_919 + batch.step)
            first = True

            @contextmanager
            def reference_timer() -> Iterator[None]:
                start = self._clock()
                yield
                timings["ref"] += self._clock() - start

            for _ in range(settings.num_inner_epochs):
                order = kept[torch.randperm(len(kept), generator=gen).to(kept.device)]
                for chunk in settings.chunks(n_micro, traj.num_trained):
                    for m, j in chunk:
                        idx, live = settings.micro_batch(order, m, len(advantages))
                        out = micro_step(
                            self.policy, self.objective, self.weights, traj, embeds, advantages, idx, live, j,
                            guidance, reference_timer,
                        )  # fmt: skip
                        forwards["update"] += per_forward * len(idx)
                        forwards["ref"] += per_forward * len(idx) if self.objective.uses_reference else 0
                        if first:
                            self._on_policy_check(out.stats.ratio if out.stats is not None else None, tol)
                            first = False
                        # Accumulated on the device: no host read per (micro-batch, step).
                        self._sums += torch.stack(
                            [
                                out.loss.detach(),
                                out.pg_loss.detach(),
                                out.kl.detach(),
                                (~out.loss.isfinite()).float(),
                            ]
                        )
                        self._n_losses += 1
                        self.manual_backward(out.loss / len(chunk))
                        if out.stats is not None:
                            self.ratio_stats.update(
                                out.new_log_prob,
                                traj.log_probs[idx[:live], j],
                                out.stats.advantages,
                                ratio=out.stats.ratio,
                                step=torch.full((live,), int(traj.step_indices[j]), device=self.device),
                                sample_id=sample_ids[idx[:live]],
                                std_dev_t=traj.std_dev_t[idx[:live], j],
                                sqrt_dt=traj.sqrt_dt[idx[:live], j],
                            )
                    applied += self._optimizer_step(opt, sched)
        self._idle.observe(applied)
        return forwards

    def _on_policy_check(self, ratio: Tensor | None, tol: float) -> None:
        err = (ratio - 1).abs().mean() if ratio is not None else torch.zeros((), device=self.device)
        err = float(self._mean_over_ranks(err))
        self.log("actor/on_policy_ratio_err", err, on_step=True, on_epoch=False)
        if err > tol:
            rank_zero_warn(
                f"on-policy check: mean |ratio − 1| = {err:.3g} before any update (tolerance {tol:g}). {ON_POLICY_CAUSES}"
            )

    def _optimizer_step(self, opt: Any, sched: Any) -> int:
        """Clip and step; returns 1 if the weights changed, 0 if a non-finite gradient skipped the step."""
        params = [p for p in self.parameters() if p.requires_grad and p.grad is not None]
        self._grad_norm = clip_and_step(params, opt, sched, self.update.max_grad_norm)
        if math.isfinite(self._grad_norm):
            return 1
        self._counters["skipped_optimizer_steps"] += 1
        rank_zero_warn("non-finite gradient norm: optimizer step skipped, weights untouched")
        return 0

    def _mean_over_ranks(self, x: Tensor) -> Tensor:
        if self.trainer.world_size == 1:
            return x
        return self.trainer.strategy.reduce(x, reduce_op="mean")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._sums = torch.zeros(4, device=self.device)  # loss, pg_loss, kl_loss, non-finite losses
        self._n_losses = 0
        self._grad_norm = float("nan")

    def _log_step(self) -> None:
        loss, pg_loss, kl_loss, nonfinite = self._sums.tolist()  # the step's one read of the loss sums
        n = max(self._n_losses, 1)
        loss, pg_loss, kl_loss = loss / n, pg_loss / n, kl_loss / n
        self._counters["nonfinite_losses"] += int(nonfinite)
        values = {
            "actor/loss": loss,
            "actor/pg_loss": pg_loss,
            "actor/kl_loss": kl_loss,
            "actor/kl_coef": self.objective.kl_coef,
            "actor/grad_norm": self._grad_norm,
        }
        values.update({f"actor/{k}": float(v) for k, v in self._counters.items()})
        # Means of scalars that are the same on every rank after the gradient all-reduce, or
        # averaged over ranks by Lightning's sync.
        self.log_dict(values, on_step=True, on_epoch=False, sync_dist=True)
        # The metrics reduce exact sufficient statistics across ranks inside compute() (a collective:
        # every rank calls it here). Logging the Metric objects themselves would log, per step, the
        # rank-local forward value: the very pooled-statistics error these metrics exist to avoid.
        for metric in (self.reward_stats, self.ratio_stats):
            # A rank whose micro-batches were all padding has no update, yet must join the collective.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*compute.*before.*update.*")
                values = metric.compute_prefixed()
            self.log_dict({k: float(v) for k, v in values.items()}, on_step=True, on_epoch=False)
        # The k (image, step) pairs of highest KL over all ranks (--model.diagnostics.top_k_kl).
        for i, record in enumerate(self.ratio_stats.top_kl_records):
            self.log_dict(
                {f"actor/top_kl/{i}/{k}": float(v) for k, v in record.items()}, on_step=True, on_epoch=False
            )
        for metric in (self.reward_stats, self.ratio_stats):
            metric.reset()

    # ----------------------------------------------------------------------------------------------
    # Validation
    # ----------------------------------------------------------------------------------------------

    def validation_step(self, batch: PromptBatch, batch_idx: int) -> ValidationOutput:
        with self.performance.sampling_weights(self.policy.transformer):
            images = self.sampler.evaluate(self.policy, list(batch.prompts), batch.seeds)
        rewards = self._score(images, batch)
        for name, values in rewards.components.items():
            key = name.replace("/", "__")
            if key not in self.val_means:
                # Created lazily: components are known only once the reward has run.
                self.val_means[key] = MeanMetric(nan_strategy="ignore").to(self.device)
                self.val_unscored[key] = SumMetric().to(self.device)
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
            images=images.detach(), prompts=list(batch.prompts), rewards=rewards.components
        )

    # ----------------------------------------------------------------------------------------------
    # Optimizers, checkpoints, export
    # ----------------------------------------------------------------------------------------------

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        if not params:
            raise ValueError("no trainable parameter: set --model.lora or train the full transformer")
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
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.strict_loading = False  # the frozen base is not in the checkpoint
        expected = self._trainable_keys()
        missing = expected - set(checkpoint["state_dict"])
        if expected and missing:
            raise ValueError(
                f"the checkpoint lacks {len(missing)} trainable tensors (e.g. {sorted(missing)[:3]}): it was "
                "written with other LoRA settings or another policy; resume with the run's own config"
            )
        ours = checkpoint.get("lit_flowgrpo", {})
        self._counters.update(ours.get("counters", {}))
        self._idle.count = ours.get("idle_rollouts", 0)

    def load_trainable_checkpoint(self, path: str, use_ema: bool = True) -> None:
        """Load a checkpoint's trainable weights (its EMA weights if present and ``use_ema``)."""
        self.configure_model()
        self.load_state_dict(self.weights.read_checkpoint(path, self, use_ema=use_ema), strict=False)

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
            raise ValueError("export_lora needs a LoRA run (--model.lora); use export() for a full fine-tune")
        self.export(path, overwrite=overwrite)
