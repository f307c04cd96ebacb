"""The update stage: its settings, the walk over one rollout batch, and the loss of one micro-batch.

One rollout batch is walked ``num_inner_epochs`` times; each walk cuts the kept samples into
micro-batches and visits every (micro-batch, trained step) pair, with an optimizer step after each of
``optimizer_steps_per_rollout`` contiguous chunks of those pairs (Flow-GRPO's gradient accumulation).
The module runs the loop (it owns the backward, the optimizer and the logging); this file owns what
the loop visits and what one visit computes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lit_flowgrpo.algorithms import PolicyStats
from lit_flowgrpo.lora import TrainableWeights
from lit_flowgrpo.objective import Objective, ScoredStep
from lit_flowgrpo.policies.base import Embeds, FlowPolicy, index_embeds
from lit_flowgrpo.rollout import Trajectory

__all__ = [
    "IdleRollouts",
    "MicroStep",
    "UpdateSettings",
    "balance_moves",
    "clip_and_step",
    "load_balance",
    "micro_step",
    "receive_rows",
    "send_rows",
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

    def problems(self, flag: str = "--model.update") -> list[str]:
        p = [
            f"{flag}.{name} ({getattr(self, name)}) must be at least 1"
            for name in ("num_inner_epochs", "micro_batch_size", "optimizer_steps_per_rollout")
            if getattr(self, name) < 1
        ]
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            p.append(f"{flag}.max_grad_norm ({self.max_grad_norm}) must be > 0, or null for no clipping")
        return p

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
class MicroStep:
    """What one (micro-batch, trained step) visit computed."""

    loss: Tensor
    """Scalar: policy loss + β·KL (padding rows excluded)."""
    pg_loss: Tensor
    kl: Tensor
    stats: PolicyStats | None
    """Per-sample statistics of the live rows (``None`` when every row was padding)."""
    new_log_prob: Tensor
    """(live,) log p_θ of the live rows, detached."""


def micro_step(
    policy: FlowPolicy,
    objective: Objective,
    weights: TrainableWeights,
    traj: Trajectory,
    embeds: Embeds,
    advantages: Tensor,
    idx: Tensor,
    live: int,
    j: int,
    guidance: float,
    reference_timer: Callable[[], Any],
) -> MicroStep:
    """Re-score trained step ``j`` of samples ``idx`` under the current policy (and the reference,
    when the objective has a KL term) and return the loss of the first ``live`` rows.

    ``reference_timer`` is a context-manager factory wrapped around the reference forward (the module
    times it as the ``ref`` stage).
    """
    x, cond = traj.latents[idx, j], index_embeds(embeds, idx)
    sigma = torch.full((len(idx),), float(traj.sigmas[j]), device=x.device)
    ref_mean = None
    if objective.uses_reference:
        # Before the θ forward: a full fine-tune's reference swaps in weights the θ graph would save.
        with reference_timer(), torch.no_grad(), weights.reference(policy):
            ref_mean = traj.score(policy.velocity(x, sigma, cond, guidance), j, idx).prev_sample_mean
    step = traj.score(policy.velocity(x, sigma, cond, guidance), j, idx)
    zero = torch.zeros((), device=x.device)
    if not live:
        # Padding only keeps every rank's backward count equal; touching the graph lets DDP see
        # every parameter.
        pg_loss = step.log_prob.sum() * 0.0
        return MicroStep(pg_loss, pg_loss, zero, None, step.log_prob.detach()[:0])
    rows = idx[:live]
    scored = ScoredStep(
        log_prob=step.log_prob[:live],
        old_log_prob=traj.log_probs[rows, j],
        advantages=advantages[rows],
        prev_sample_mean=step.prev_sample_mean[:live],
        old_prev_sample_mean=None if traj.prev_sample_means is None else traj.prev_sample_means[rows, j],
        std_dev_t=traj.std_dev_t[rows, j],
        sqrt_dt=traj.sqrt_dt[rows, j],
    )
    pg_loss, stats = objective.policy_loss(scored)
    kl = objective.kl(scored, ref_mean[:live]).mean() if ref_mean is not None else zero
    loss = pg_loss + objective.kl_coef * kl
    return MicroStep(loss, pg_loss, kl, stats, step.log_prob.detach()[:live])


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
                f"reaches max_steps (--model.advantage.max_idle_rollouts={self.limit})"
            )
        rank_zero_warn(f"this rollout made no optimizer step ({why})")


#: What usually moves the first ratio away from 1 (the on-policy check's warning).
ON_POLICY_CAUSES = (
    "The update recomputes the rollout's log-probs with different numerics: usual causes are a different "
    "batch size under bf16/TF32 (--model.sampler.batch_size vs --model.update.micro_batch_size), dropout "
    "or other train-mode layers, CFG in the rollout but not in the update (train_cfg=false), or "
    "non-deterministic kernels. Clipping treats this error as policy change."
)


def load_balance(loads: list[float]) -> dict[str, float]:
    """``global_load/*``: the update's work per rank, (sample, trained step) pairs after filtering,
    the diffusion analogue of veRL's ``global_seqlen/*``."""
    low, high = min(loads), max(loads)
    values = {"min": low, "max": high, "mean": sum(loads) / len(loads), "minmax_diff": high - low}
    return {f"global_load/{k}": v for k, v in values.items()}


def balance_moves(counts: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(source, destination, n)`` moves that leave every rank with ⌊K/R⌋ or ⌈K/R⌉ of the K
    samples ``counts`` holds. The ranks holding most keep the ⌈K/R⌉ places, so as few samples move
    as possible; the moves are a pure function of ``counts``, the same on every rank."""
    ranks, total = len(counts), sum(counts)
    base, extra = divmod(total, ranks)
    target = [base] * ranks
    for r in sorted(range(ranks), key=lambda r: (-counts[r], r))[:extra]:
        target[r] += 1
    give = [[r, counts[r] - target[r]] for r in range(ranks) if counts[r] > target[r]]
    take = [[r, target[r] - counts[r]] for r in range(ranks) if counts[r] < target[r]]
    moves, i, j = [], 0, 0
    while i < len(give) and j < len(take):
        n = min(give[i][1], take[j][1])
        moves.append((give[i][0], take[j][0], n))
        give[i][1] -= n
        take[j][1] -= n
        i += give[i][1] == 0
        j += take[j][1] == 0
    return moves


def send_rows(
    rows: dict[str, Tensor], kept: Tensor, moves: list[tuple[int, int, int]], rank: int
) -> dict[str, Tensor]:
    """This rank's outgoing block of every per-sample tensor: its last kept samples that ``moves``
    sends away, padded to the largest block any rank sends (an all-gather needs equal shapes)."""
    width = max((sum(n for s, _, n in moves if s == r) for r in {s for s, _, _ in moves}), default=0)
    mine = sum(n for s, _, n in moves if s == rank)
    sent = kept[len(kept) - mine :]
    out = {}
    for name, t in rows.items():
        block = t.new_zeros((width, *t.shape[1:]))
        block[:mine] = t[sent]
        out[name] = block
    return out


def receive_rows(
    rows: dict[str, Tensor],
    kept: Tensor,
    moves: list[tuple[int, int, int]],
    rank: int,
    gathered: dict[str, Tensor],
) -> tuple[dict[str, Tensor], int]:
    """Every per-sample tensor after the moves, and how many leading rows are now this rank's kept
    samples: the kept ones it did not send, then those it received (in source-rank order).

    ``gathered[name]`` is (R, width, ...): every rank's :func:`send_rows` block. The rows that follow
    the kept ones (this rank's dropped and sent samples) are only material for the update's padding
    rows, whose loss is never counted; they keep every row count at least this rank's batch size.
    """
    mine = sum(n for s, _, n in moves if s == rank)
    stay = kept[: len(kept) - mine]
    rest = torch.ones(len(next(iter(rows.values()))), dtype=torch.bool, device=kept.device)
    rest[stay] = False
    offset: dict[int, int] = {}
    pieces: list[tuple[int, int, int]] = []  # (source, start, n) of the blocks addressed here
    for source, dest, n in moves:
        start = offset.get(source, 0)
        if dest == rank:
            pieces.append((source, start, n))
        offset[source] = start + n
    out = {
        name: torch.cat([t[stay], *(gathered[name][s, a : a + n] for s, a, n in pieces), t[rest]])
        for name, t in rows.items()
    }
    return out, len(stay) + sum(n for _, _, n in pieces)
