"""The update stage: its settings and the whole loop over one rollout batch.

One rollout batch is walked ``num_inner_epochs`` times; each walk splits the samples into
``optimizer_steps_per_rollout`` shares (:meth:`UpdateSettings.steps_of`, defined over the batch of all
ranks, so that each optimizer step trains the same samples whatever the number of ranks), cuts each
rank's kept samples of a share into micro-batches and makes the objective's visits to each (today:
every trained step), with an optimizer step after each share (Flow-GRPO's gradient accumulation, with
each kept sample weighing alike in a step's loss, whatever its micro-batch and rank; a step never falls
between the visits of a sample). The objective computes what one visit costs
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

from lit_flowgrpo.data import split_problems
from lit_flowgrpo.data_batch import DataBatch
from lit_flowgrpo.distributed import DataParallel, balanced_counts, load_balance
from lit_flowgrpo.errors import flag
from lit_flowgrpo.objective import Objective, VisitContext
from lit_flowgrpo.parts import AfterUpdate
from lit_flowgrpo.rollout import RolloutBatch

__all__ = [
    "IdleRollouts",
    "UpdateHooks",
    "UpdateResult",
    "UpdateSettings",
    "clip_and_step",
    "optimizers_for",
    "run_update",
]


@dataclass
class UpdateSettings:
    """How the update walks one rollout batch.

    Args:
        num_inner_epochs: passes over each rollout batch.
        micro_batch_size: samples per forward/backward in the update, at most: where a rank trains
            fewer in an optimizer step (``optimizer_steps_per_rollout`` splits its batch), that many.
        optimizer_steps_per_rollout: S, optimizer steps per inner epoch (Flow-GRPO takes 2). Each
            trains a share of the rollout's samples, every visit (trained step) of each, gradients
            accumulated over its micro-batches; which samples is defined over the batch of all ranks
            (:meth:`steps_of`), so one process and N ranks take the same optimizer steps. S must divide
            the samples each rank generates, and ``micro_batch_size``, where smaller, the samples each
            rank trains per step (checked at setup).
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
            all-gather, and each keeps its optimizer step (:meth:`steps_of`). No effect on one rank.
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
        """The rollout batch against the data-parallel ranks (the data's rule,
        :func:`lit_flowgrpo.data.split_problems`), then against the optimizer steps and the micro-batch
        (known at setup): every rule of the batch's divisibility, checked once, here."""
        split = split_problems(samples_per_step, ranks)
        if split:
            return split
        per_rank, steps = samples_per_step // ranks, self.optimizer_steps_per_rollout
        if per_rank % steps:
            # Each rank's rows must be whole blocks of `steps_of`, or one process and N ranks would
            # group the samples into optimizer steps differently.
            return [
                f"{flag('update')}.optimizer_steps_per_rollout ({steps}) must divide the per-rank batch "
                f"({samples_per_step} samples / {ranks} ranks = {per_rank}), so that each optimizer step "
                "trains the same samples on any number of ranks: change either"
            ]
        if (per_rank // steps) % self.micro_size(per_rank):
            return [
                f"{flag('update')}.micro_batch_size ({self.micro_batch_size}) must divide the per-rank batch of "
                f"each optimizer step ({samples_per_step} samples / {ranks} ranks / {steps} "
                f"optimizer_steps_per_rollout = {per_rank // steps}), or be at least that: change either"
            ]
        return []

    def micro_size(self, per_rank: int) -> int:
        """Samples per forward/backward on a rank that generates ``per_rank`` samples a rollout:
        ``micro_batch_size``, or the rank's share of an optimizer step where that is smaller (with 2
        steps a rollout, 2 ranks train half as many samples a step as one process)."""
        return max(1, min(self.micro_batch_size, math.ceil(per_rank / self.optimizer_steps_per_rollout)))

    def on_policy_tolerance(self, fp32: bool) -> float:
        """``on_policy_tol`` resolved: 1e-6 when the transformer holds and computes fp32 (without float8
        base products), else 1e-3."""
        if self.on_policy_tol is not None:
            return self.on_policy_tol
        return 1e-6 if fp32 else 1e-3

    def steps_of(self, num_samples: int, generator: torch.Generator) -> Tensor:
        """(N,) int64: the optimizer step (0 … S − 1) of each of a rollout's N samples in one inner epoch.

        The rule, over the batch of all ranks: a sample's place is its position in the rollout batch
        of every rank, rank-major (rank 0's rows, then rank 1's, ...: the order in which
        :class:`~lit_flowgrpo.data.GroupSampler` deals them, the same for any number of ranks). The
        places are cut into blocks of S consecutive ones, and a permutation of the S steps drawn for
        each block (from ``generator``, the same on every rank) sends one sample of the block to each
        step. So each step trains N/S samples, the same ones whatever the number of ranks, different
        ones in each inner epoch; and since every rank's rows are whole blocks (S divides the per-rank
        batch: :meth:`batch_problems`), every rank trains N/(S·R) of them in each step, with no padding.
        Each step trains every visit of its samples.

        >>> steps = UpdateSettings(optimizer_steps_per_rollout=3).steps_of(6, torch.Generator().manual_seed(0))
        >>> steps.view(2, 3)  # two blocks of 3 places: one sample of each to each step
        tensor([[2, 0, 1],
                [0, 1, 2]])
        """
        steps = self.optimizer_steps_per_rollout
        blocks = math.ceil(num_samples / steps)
        return torch.rand(blocks, steps, generator=generator).argsort(dim=1).flatten()[:num_samples]

    def micro_batch(self, order: Tensor, m: int, batch: int, size: int | None = None) -> tuple[Tensor, int]:
        """Indices of micro-batch ``m`` (of ``size`` samples; ``None``: ``micro_batch_size``) of ``order``
        and how many are real: the first ``live``. The rest pad with rows whose loss is not counted, so
        every rank runs the same number of passes."""
        size = self.micro_batch_size if size is None else size
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

    batch: RolloutBatch | DataBatch
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

    def mean_losses(self, dp: DataParallel) -> tuple[dict[str, float], int]:
        """The update's mean losses over every rank's micro-batches (``actor/loss``, ``pg_loss``,
        ``kl_loss``) with their ``count``, and the non-finite losses of every rank.

        Summed over the ranks (one gather, fp64; the step's one read of the loss sums), so every rank
        holds what one process would, and the moving reference decides on the same KL on every rank."""
        assert self.loss_sums is not None
        count = self.loss_sums.new_tensor([self.num_losses], dtype=torch.float64)
        sums = torch.cat([self.loss_sums.double(), count])
        loss, pg_loss, kl_loss, nonfinite, total = dp.stack(sums).sum(0).tolist()
        n = max(total, 1)
        means = {"actor/loss": loss / n, "actor/pg_loss": pg_loss / n, "actor/kl_loss": kl_loss / n}
        return {**means, "count": total}, int(nonfinite)


def run_update(
    settings: UpdateSettings,
    objective: Objective,
    ctx: VisitContext,
    batch: RolloutBatch | DataBatch,
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
        batch: this rank's rollout batch (or, for an objective that learns from images, its
            :class:`~lit_flowgrpo.data_batch.DataBatch`).
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
    size = settings.micro_size(len(batch))
    # Each row's place in the batch of all ranks (rank-major), which decides its optimizer steps.
    places = dp.rank * len(batch) + torch.arange(len(batch), device=device)
    steps = [
        settings.steps_of(len(batch) * dp.size, generator).to(device)
        for _ in range(settings.num_inner_epochs)
    ]
    # Every rank runs the same number of backward passes (DDP all-reduces inside each), so each
    # optimizer step's micro-batch count is the largest over ranks; a rank with fewer of the step's
    # samples pads with zero-weight rows.
    kept_per_rank = dp.gather(torch.tensor([float(len(kept))], device=device)).tolist()
    hooks.log(load_balance([n * n_visits for n in kept_per_rank]))
    if settings.balance_load and dp.size > 1:
        batch, kept, kept_per_rank, places = _balance(
            batch, kept, [int(n) for n in kept_per_rank], places, n_visits, dp, hooks
        )
    kept = kept[places[kept].argsort()]  # in place order (balancing appends the rows it received)
    result = UpdateResult(
        batch=batch, trained=batch.sample_ids[kept], kept_per_rank=[int(n) for n in kept_per_rank]
    )
    result.loss_sums = torch.zeros(4, device=device)
    if not (kept_per_rank and max(kept_per_rank) and n_visits):
        return result
    n_steps = settings.optimizer_steps_per_rollout
    # (epochs, kept) the step of each kept row, and every rank's count of each (epoch, step): one
    # gather and one host read per rollout.
    step_of_kept = torch.stack([s[places[kept]] for s in steps])
    counts = torch.stack([torch.bincount(row, minlength=n_steps).float() for row in step_of_kept])
    per_rank = dp.gather(counts.flatten()).view(dp.size, -1).tolist()  # (R, epochs × S)

    @contextmanager
    def reference_timer() -> Iterator[None]:
        start = hooks.clock()
        yield
        result.reference_s += hooks.clock() - start

    ctx = dataclasses.replace(ctx, reference_timer=reference_timer)
    visits = list(objective.visits(batch))
    # A row of pairs (Diffusion-DPO's DataBatch) is two images, and each visit runs the reference on both.
    pairs = isinstance(batch, DataBatch) and batch.rejected is not None
    per_row = forwards_per_sample * (2 if pairs else 1)
    first = True
    for epoch in range(settings.num_inner_epochs):
        # A seed per (rollout, inner epoch) that draws nothing from ``generator``, so the shares
        # stay as they were: objectives that draw per visit (DiffusionNFT) derive theirs from it.
        epoch_ctx = dataclasses.replace(ctx, seed=generator.initial_seed() * 1_009 + epoch)
        for step in range(n_steps):
            counts_of_step = [int(row[epoch * n_steps + step]) for row in per_rank]
            if not sum(counts_of_step):
                continue  # every sample of this share was dropped: no step
            rows = kept[step_of_kept[epoch] == step]
            # An optimizer step's loss is the mean over every (sample, visit) it trains, on every
            # peer: a visit's loss (a mean over its live rows) weighs live / (the step's samples on all
            # peers × visits), times the peers, whose gradients DDP and FSDP2 average. Weighing each
            # micro-batch alike would give the samples of a short last micro-batch, and of a peer that
            # kept fewer, more weight than the rest.
            step_rows = sum(counts_of_step) * n_visits
            for m in range(math.ceil(max(counts_of_step) / size)):
                idx, live = settings.micro_batch(rows, m, len(batch), size)
                for v in visits:
                    out = objective.visit(epoch_ctx, batch, idx, live, v)
                    result.forwards["update"] += per_row * len(idx)
                    result.forwards["ref"] += per_row * len(idx) if ctx.kl.runs_reference or pairs else 0
                    if first and out.on_policy_error is not None:  # None: no ratio to check
                        _on_policy_check(out.on_policy_error, live, on_policy_tol, dp, hooks)
                    first = False
                    # Accumulated on the device: no host read per (micro-batch, visit).
                    result.loss_sums += torch.stack(
                        [
                            out.loss.detach(),
                            out.pg_loss.detach(),
                            out.kl.detach(),
                            (~out.loss.isfinite()).float(),
                        ]
                    )
                    result.num_losses += 1
                    # × sp under sequence parallelism: the gradient reduction averages the sp partial
                    # gradients of each sample instead of summing them (DataParallel.gradient_scale).
                    hooks.backward(out.loss * (live * dp.size / step_rows) * dp.gradient_scale)
                    if out.diagnostics is not None:
                        diagnostics.update(**out.diagnostics)
            result.optimizer_steps += int(hooks.optimizer_step())
    return result


def _balance(
    batch: Any,
    kept: Tensor,
    counts: list[int],
    places: Tensor,
    n_visits: int,
    dp: DataParallel,
    hooks: UpdateHooks,
) -> tuple[Any, Tensor, list[int], Tensor]:
    """``balance_load``: move kept samples between ranks so each trains ⌊K/R⌋ or ⌈K/R⌉; each row's
    place (its optimizer steps: :meth:`UpdateSettings.steps_of`) travels with it."""
    after = balanced_counts(counts)
    hooks.log(
        {
            "global_load/balanced_min": float(min(after) * n_visits),
            "global_load/balanced_max": float(max(after) * n_visits),
        }
    )
    if after == counts:
        return batch, kept, counts, places
    rows, n_kept = dp.balance({**batch.rows(), _PLACE: places}, kept, counts)
    places = rows.pop(_PLACE)
    rows["keep"] = torch.arange(len(rows["keep"]), device=kept.device) < n_kept
    return batch.with_rows(rows), torch.arange(n_kept, device=kept.device), after, places


#: The rows' places, carried beside the batch's per-sample tensors when samples move between ranks.
_PLACE = "update.place"


def _on_policy_check(err: Tensor, live: int, tol: float, dp: DataParallel, hooks: UpdateHooks) -> None:
    # Σ err·live / Σ live over the peers: a peer whose first micro-batch is all padding reports 0 for rows
    # it does not hold, which a plain mean over peers would average in.
    if dp.size == 1:
        value = float(err)
    else:
        num, den = dp.mean(torch.stack([err.detach().float() * live, err.new_tensor(float(live))])).tolist()
        value = num / den if den > 0 else 0.0
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


class IdleRollouts:
    """Consecutive rollouts that changed no weight. Such rollouts do not advance ``max_steps``, so a
    run of them would spin forever: stop after ``limit``. A part (:mod:`lit_flowgrpo.parts`): the count
    is saved, so a resumed run keeps counting."""

    key = "idle_rollouts"

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0

    def state_dict(self) -> int:
        return self.count

    def load_state_dict(self, state: int | None) -> None:
        self.count = int(state or 0)

    def after_update(self, done: AfterUpdate) -> None:
        self.observe(done.update_steps)

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


def optimizers_for(
    params: list[Tensor], optimizer: Callable[..., Any] | None, lr_scheduler: Callable[..., Any] | None
) -> dict[str, Any]:
    """``configure_optimizers``' answer for the trainable ``params``: the ``optimizer`` factory's
    (``None``: AdamW(lr=3e-4, weight_decay=1e-4)), stepped with the ``lr_scheduler`` factory's schedule
    once per optimizer step (``None``: a constant one, so that ``LearningRateMonitor`` logs the rate
    under its DESIGN.md name, ``actor/lr``)."""
    if not params:
        raise ValueError(f"no trainable parameter: set {flag('weights')}.lora or train the full transformer")
    opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=1e-4) if optimizer is None else optimizer(params)
    if lr_scheduler is None:
        scheduler = torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=0)
    else:
        scheduler = lr_scheduler(opt)
    return {
        "optimizer": opt,
        "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "actor/lr"},
    }
