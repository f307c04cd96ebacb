"""The update stage: its settings and the whole loop over one rollout batch.

One rollout batch is walked ``num_inner_epochs`` times; each walk cuts the kept samples into
micro-batches and makes the objective's visits to each (today: every trained step), with an optimizer
step after each of ``optimizer_steps_per_rollout`` contiguous chunks of those (micro-batch, visit)
pairs (Flow-GRPO's gradient accumulation, with each kept sample weighing alike in a step's loss,
whatever its micro-batch and rank). The objective computes what one visit costs
(:meth:`~lit_flowgrpo.objective.Objective.visit`); the module hands the loop its backward, its
optimizer step and its logging (:class:`UpdateHooks`), so Lightning's precision and DDP hooks stay
in the path.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torchmetrics import Metric

from lit_flowgrpo.distributed import DataParallel, balanced_counts, load_balance
from lit_flowgrpo.errors import flag
from lit_flowgrpo.objective import Objective, VisitContext
from lit_flowgrpo.rollout import RolloutBatch

__all__ = [
    "IdleRollouts",
    "UpdateHooks",
    "UpdateResult",
    "UpdateSettings",
    "clip_and_step",
    "run_update",
]


@dataclass
class UpdateSettings:
    """How the update walks one rollout batch.

    Args:
        num_inner_epochs: passes over each rollout batch.
        micro_batch_size: samples per forward/backward in the update.
        optimizer_steps_per_rollout: optimizer steps per inner epoch; gradients accumulate over the
            (micro-batch, step) pairs in between (Flow-GRPO takes 2).
        train_cfg: apply CFG in the update too; off, the update scores the rollout (made with CFG)
            under the conditional model alone, which is off-policy by construction.
        max_grad_norm: gradient clipping norm (``None``: no clipping, still logged).
        on_policy_tol: tolerance of the on-policy check, mean |ratio − 1| at the first micro-batch
            before any update; ``None``: 1e-6 when the transformer holds and computes fp32, 1e-3
            otherwise.
        balance_load: before the update, move kept samples from the ranks that hold more to those
            that hold fewer, so that every rank trains ⌊K/R⌋ or ⌈K/R⌉ of the K kept samples.
            Dropped samples (zero advantage under ``advantage.filter_zero``, or no finite reward)
            leave ranks uneven, and every rank runs as many micro-batch passes as the most loaded
            one. The moved samples' trained latents, log-probs and prompt conditioning travel by
            all-gather. No effect on one rank.
    """

    num_inner_epochs: int = 1
    micro_batch_size: int = 4
    optimizer_steps_per_rollout: int = 2
    train_cfg: bool = True
    max_grad_norm: float | None = 1.0
    on_policy_tol: float | None = None
    balance_load: bool = False

    def problems(self, flag_path: str = "") -> list[str]:
        flag_path = flag_path or flag("update")
        p = [
            f"{flag_path}.{name} ({getattr(self, name)}) must be at least 1"
            for name in ("num_inner_epochs", "micro_batch_size", "optimizer_steps_per_rollout")
            if getattr(self, name) < 1
        ]
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            p.append(f"{flag_path}.max_grad_norm ({self.max_grad_norm}) must be > 0, or null for no clipping")
        return p

    def batch_problems(self, samples_per_step: int, ranks: int) -> list[str]:
        """The rollout batch against the data-parallel ranks and the micro-batch (known at setup)."""
        if samples_per_step % ranks:
            return [
                f"--data.init_args.prompts_per_step × --data.init_args.group_size ({samples_per_step}) must be a "
                f"multiple of the number of data-parallel ranks ({ranks})"
            ]
        if (samples_per_step // ranks) % self.micro_batch_size:
            return [
                f"{flag('update')}.micro_batch_size ({self.micro_batch_size}) must divide the per-rank batch "
                f"({samples_per_step} samples / {ranks} ranks = {samples_per_step // ranks}): change either"
            ]
        return []

    def on_policy_tolerance(self, fp32: bool) -> float:
        """``on_policy_tol`` resolved: 1e-6 when the transformer holds and computes fp32, else 1e-3."""
        if self.on_policy_tol is not None:
            return self.on_policy_tol
        return 1e-6 if fp32 else 1e-3

    def chunks(self, num_micro: int, num_trained: int) -> list[list[tuple[int, int]]]:
        """The (micro-batch, trained step) pairs of one inner epoch, in ``optimizer_steps_per_rollout``
        contiguous chunks as equal as possible: an optimizer step after each."""
        units = [(m, j) for m in range(num_micro) for j in range(num_trained)]
        parts = max(1, min(self.optimizer_steps_per_rollout, len(units)))
        size, extra = divmod(len(units), parts)
        out, start = [], 0
        for i in range(parts):
            end = start + size + (1 if i < extra else 0)
            out.append(units[start:end])
            start = end
        return [c for c in out if c]

    def live_rows(self, kept: int, m: int) -> int:
        """How many of micro-batch ``m``'s rows are real samples on a rank that keeps ``kept``."""
        return max(0, min(self.micro_batch_size, kept - m * self.micro_batch_size))

    def micro_batch(self, order: Tensor, m: int, batch: int) -> tuple[Tensor, int]:
        """Indices of micro-batch ``m`` of ``order`` and how many are real: the first ``live``. The
        rest pad with rows whose loss is not counted, so every rank runs the same number of passes."""
        size = self.micro_batch_size
        idx = order[m * size : (m + 1) * size]
        live = len(idx)
        if live < size:
            idx = torch.cat([idx, torch.arange(size - live, device=order.device) % batch])
        return idx, live


@dataclass
class UpdateHooks:
    """What the update loop asks of its host (the module)."""

    backward: Callable[[Tensor], None]
    """Backward of a loss (``LightningModule.manual_backward``: precision and DDP hooks)."""
    optimizer_step: Callable[[], bool]
    """Clip, step and zero the gradients; ``True`` if the weights changed."""
    log: Callable[[dict[str, float]], None]
    """Log per-step values."""
    clock: Callable[[], float]
    """Seconds (after a device synchronize), for the reference forward's stage time."""


@dataclass
class UpdateResult:
    """What one update did on this rank."""

    batch: RolloutBatch
    """The batch this rank trained (after load balancing: its kept samples first)."""
    trained: Tensor
    """(K,) the sample ids this rank trained."""
    kept_per_rank: list[int]
    """Kept samples per rank, as the update trained them (after load balancing)."""
    forwards: dict[str, int] = field(default_factory=lambda: {"update": 0, "ref": 0})
    """Single-sample transformer forwards of the θ passes and of the reference."""
    reference_s: float = 0.0
    """Seconds in the reference forwards."""
    optimizer_steps: int = 0
    """Optimizer steps that changed the weights."""
    loss_sums: Tensor | None = None
    """(4,) on the device: Σ loss, Σ pg_loss, Σ kl, non-finite losses over the visits."""
    num_losses: int = 0


def run_update(
    settings: UpdateSettings,
    objective: Objective,
    ctx: VisitContext,
    batch: RolloutBatch,
    hooks: UpdateHooks,
    diagnostics: Metric,
    *,
    dp: DataParallel,
    generator: torch.Generator,
    on_policy_tol: float,
    forwards_per_sample: int,
) -> UpdateResult:
    """Walk ``batch``: epochs × chunks × (micro-batch, visit), an optimizer step after each chunk.

    Args:
        settings: how to walk it.
        objective: what each visit computes, and which visits it makes.
        ctx: the networks and the CFG scale of the visits (its ``reference_timer`` is replaced by
            one that adds to :attr:`UpdateResult.reference_s`).
        batch: this rank's rollout batch.
        hooks: the host's backward, optimizer step, logging and clock.
        diagnostics: the objective's metric, updated in place.
        dp: the data-parallel peers (every peer runs the same number of backward passes).
        generator: the CPU generator of the epochs' shuffles.
        on_policy_tol: tolerance of the on-policy check (:meth:`UpdateSettings.on_policy_tolerance`).
        forwards_per_sample: transformer forwards per sample and visit (2 under batched CFG).
    """
    device = batch.advantages.device
    n_visits = len(objective.visits(batch))
    kept = batch.keep.nonzero().flatten()  # one host read per rollout; none inside the loops below
    # Every rank runs the same number of backward passes (DDP all-reduces inside each), so the
    # micro-batch count is the largest over ranks; a rank with fewer kept samples pads with
    # zero-weight ones.
    kept_per_rank = dp.gather(torch.tensor([float(len(kept))], device=device)).tolist()
    hooks.log(load_balance([n * n_visits for n in kept_per_rank]))
    if settings.balance_load and dp.size > 1:
        batch, kept, kept_per_rank = _balance(
            batch, kept, [int(n) for n in kept_per_rank], n_visits, dp, hooks
        )
    result = UpdateResult(
        batch=batch, trained=batch.sample_ids[kept], kept_per_rank=[int(n) for n in kept_per_rank]
    )
    result.loss_sums = torch.zeros(4, device=device)
    n_micro = math.ceil(max(kept_per_rank) / settings.micro_batch_size)
    if not (n_micro and n_visits):
        return result

    @contextmanager
    def reference_timer() -> Iterator[None]:
        start = hooks.clock()
        yield
        result.reference_s += hooks.clock() - start

    ctx = dataclasses.replace(ctx, reference_timer=reference_timer)
    visits = list(objective.visits(batch))
    first = True
    for epoch in range(settings.num_inner_epochs):
        order = kept[torch.randperm(len(kept), generator=generator).to(kept.device)]
        # A seed per (rollout, inner epoch) that draws nothing from ``generator``, so the shuffles
        # stay as they were: objectives that draw per visit (DiffusionNFT) derive theirs from it.
        epoch_ctx = dataclasses.replace(ctx, seed=generator.initial_seed() * 1_009 + epoch)
        for chunk in settings.chunks(n_micro, n_visits):
            # An optimizer step's loss is the mean over every (sample, visit) its chunk trains, on
            # every peer: a visit's loss (a mean over its live rows) weighs live / (the chunk's live
            # rows on all peers), times the peers, whose gradients DDP and FSDP2 average. Weighing each
            # micro-batch alike would give the samples of a short last micro-batch, and of a peer that
            # kept fewer, more weight than the rest.
            chunk_rows = sum(settings.live_rows(n, m) for n in result.kept_per_rank for m, _ in chunk)
            for m, v in chunk:
                idx, live = settings.micro_batch(order, m, len(batch))
                out = objective.visit(epoch_ctx, batch, idx, live, visits[v])
                result.forwards["update"] += forwards_per_sample * len(idx)
                result.forwards["ref"] += (
                    forwards_per_sample * len(idx) if objective.uses_reference or ctx.measure_reference else 0
                )
                if first:
                    _on_policy_check(out.on_policy_error, on_policy_tol, dp, hooks)
                    first = False
                # Accumulated on the device: no host read per (micro-batch, visit).
                result.loss_sums += torch.stack(
                    [out.loss.detach(), out.pg_loss.detach(), out.kl.detach(), (~out.loss.isfinite()).float()]
                )
                result.num_losses += 1
                # × sp under sequence parallelism: the gradient reduction averages the sp partial
                # gradients of each sample instead of summing them (DataParallel.gradient_scale).
                hooks.backward(out.loss * (live * dp.size / chunk_rows) * dp.gradient_scale)
                if out.diagnostics is not None:
                    diagnostics.update(**out.diagnostics)
            result.optimizer_steps += int(hooks.optimizer_step())
    return result


def _balance(
    batch: RolloutBatch, kept: Tensor, counts: list[int], n_visits: int, dp: DataParallel, hooks: UpdateHooks
) -> tuple[RolloutBatch, Tensor, list[int]]:
    """``balance_load``: move kept samples between ranks so each trains ⌊K/R⌋ or ⌈K/R⌉."""
    after = balanced_counts(counts)
    hooks.log(
        {
            "global_load/balanced_min": float(min(after) * n_visits),
            "global_load/balanced_max": float(max(after) * n_visits),
        }
    )
    if after == counts:
        return batch, kept, counts
    rows, n_kept = dp.balance(batch.rows(), kept, counts)
    rows["keep"] = torch.arange(len(rows["keep"]), device=kept.device) < n_kept
    return batch.with_rows(rows), torch.arange(n_kept, device=kept.device), after


def _on_policy_check(err: Tensor, tol: float, dp: DataParallel, hooks: UpdateHooks) -> None:
    value = float(dp.mean(err))
    hooks.log({"actor/on_policy_ratio_err": value})
    if value > tol:
        rank_zero_warn(
            f"on-policy check: mean |ratio − 1| = {value:.3g} before any update (tolerance {tol:g}). {ON_POLICY_CAUSES}"
        )


def clip_and_step(params: list[Tensor], optimizer: Any, scheduler: Any, max_norm: float | None) -> float:
    """Clip the gradients to ``max_norm`` (their global norm, also over FSDP2 shards), then step the
    optimizer and scheduler, unless the norm is not finite: then the weights stay as they were.
    Returns the norm (one host read per optimizer step, to decide)."""
    limit = max_norm if max_norm is not None else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, limit) if params else torch.zeros(())
    value = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor under FSDP2
    if math.isfinite(value):
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return value


@dataclass
class IdleRollouts:
    """Consecutive rollouts that changed no weight. Such rollouts do not advance ``max_steps``, so a
    run of them would spin forever: stop after ``limit``."""

    limit: int
    count: int = 0

    def observe(self, optimizer_steps: int) -> None:
        if optimizer_steps:
            self.count = 0
            return
        self.count += 1
        why = (
            "every sample was unscored, filtered as zero-advantage, or every gradient was non-finite; "
            "see critic/rewards/nonfinite_count, reward/failure_rate and actor/skipped_optimizer_steps"
        )
        if self.count >= self.limit:
            raise RuntimeError(
                f"{self.count} rollouts in a row made no optimizer step ({why}). Stopping: such a run never "
                f"reaches max_steps ({flag('advantage')}.max_idle_rollouts={self.limit})"
            )
        rank_zero_warn(f"this rollout made no optimizer step ({why})")


#: What usually moves the first ratio away from 1 (the on-policy check's warning).
ON_POLICY_CAUSES = (
    "The update recomputes the rollout's log-probs with different numerics: usual causes are a different "
    f"batch size under bf16/TF32 ({flag('sampler')}.batch_size vs {flag('update')}.micro_batch_size), dropout "
    "or other train-mode layers, CFG in the rollout but not in the update (train_cfg=false), or "
    "non-deterministic kernels. Clipping treats this error as policy change."
)
