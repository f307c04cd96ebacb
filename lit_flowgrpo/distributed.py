"""The data-parallel view of the trainer's ranks: who this rank's data-parallel peers are, how their
tensors are gathered and averaged, and how kept samples are re-dealt among them.

Without sequence parallelism every rank is a data-parallel peer (DDP, FSDP2), and the view is the
trainer's world. With ``--model.init_args.performance.sequence_parallel`` = sp > 1 the world is a
(dp, sp) grid: the sp consecutive ranks ``d·sp … d·sp + sp − 1`` form one sequence-parallel group that
holds the same samples (the same prompts, seeds, rollouts, rewards and losses) and splits each sample's
tokens inside the transformer (:mod:`lit_flowgrpo.sequence_parallel`); the groups are the data-parallel
peers, ``world / sp`` of them, and rank ``r`` is peer ``r // sp``.

The grid is a :class:`ParallelLayout`, built once per run, collectively, and held by the trainer's
strategy (:func:`lit_flowgrpo.strategies.parallel_layout`), as verl's Ulysses sharding manager is
handed its ``("dp", "sp")`` device mesh: the module, the data module, the metrics and the callbacks get
their :class:`DataParallel` view from it, and read nothing from the LightningModule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "LAYOUT_ATTRIBUTE",
    "DataParallel",
    "ParallelLayout",
    "balance_moves",
    "load_balance",
    "receive_rows",
    "send_rows",
]

#: The mesh's dimension names: data-parallel peers, then diffusers' context-parallel dimensions
#: (``ContextParallelConfig`` looks its ``"ring"`` and ``"ulysses"`` dimensions up by name).
MESH_DIMS = ("dp", "ring", "ulysses")
#: The attribute of a Lightning strategy that holds its run's :class:`ParallelLayout`.
LAYOUT_ATTRIBUTE = "parallel_layout"


@dataclass(frozen=True)
class ParallelLayout:
    """The run's ranks as a (dp, sp) grid, and the device mesh that names it.

    Args:
        rank: this process's rank in the world.
        world: the number of ranks.
        sequence_parallel: ranks per sample (sp); they hold the same samples and split their tokens.
        strategy: the Lightning strategy whose collectives reach the ranks (``None``: one process).
        mesh: the (dp, ring = 1, ulysses = sp) ``DeviceMesh`` when sp > 1 (diffusers' context
            parallelism reads its ``ring`` and ``ulysses`` dimensions); ``None`` otherwise.
    """

    rank: int = 0
    world: int = 1
    sequence_parallel: int = 1
    strategy: Any = None
    mesh: Any = None

    @classmethod
    def build(
        cls, strategy: Any, sequence_parallel: int = 1, rank: int | None = None, world: int | None = None
    ) -> ParallelLayout:
        """The layout of ``strategy``'s ranks (``rank`` of ``world``: the strategy's own unless given)
        with ``sequence_parallel`` ranks per sample.

        With sp > 1 this builds the mesh, which creates process groups collectively: every rank calls
        it at the same point (the strategy's owner does, in the module's ``setup``). Rank r sits at
        (r // sp, 0, r % sp): each sequence-parallel group is sp consecutive ranks (on one node as long
        as sp divides the GPUs per node, so the attention's all-to-all stays on NVLink). The setting is
        checked before, once (:func:`lit_flowgrpo.sequence_parallel.sequence_parallel_problems`); a
        world it does not divide fails here, in the mesh's own check.
        """
        rank = getattr(strategy, "global_rank", 0) if rank is None else rank
        world = getattr(strategy, "world_size", 1) if world is None else world
        mesh = None
        if sequence_parallel > 1:
            from torch.distributed.device_mesh import init_device_mesh

            shape = (world // sequence_parallel, 1, sequence_parallel)
            mesh = init_device_mesh(strategy.root_device.type, shape, mesh_dim_names=MESH_DIMS)
        return cls(rank, world, sequence_parallel, strategy, mesh)

    @property
    def data_parallel(self) -> DataParallel:
        """This rank among its data-parallel peers."""
        sp = self.sequence_parallel
        group = None if self.mesh is None else self.mesh["dp"].get_group()
        return DataParallel(self.rank // sp, self.world // sp, self.strategy, sp, group)


@dataclass(frozen=True)
class DataParallel:
    """This rank's place among its data-parallel peers.

    Args:
        rank: this rank's index among the peers.
        size: how many peers share the batch.
        strategy: the Lightning strategy whose collectives reach the peers (``None``: one process).
        sequence_parallel: ranks per peer, which hold the same samples and split their tokens.
        group: the process group of the peers (``None``: the default group, every rank): with
            sequence parallelism, the ranks at this rank's place in every sequence-parallel group.
            Metrics that reduce over the peers take it as their ``process_group``.
    """

    rank: int = 0
    size: int = 1
    strategy: Any = None
    sequence_parallel: int = 1
    group: Any = None

    @classmethod
    def of(cls, trainer: Any) -> DataParallel:
        """The view of ``trainer``'s ranks, from the layout its strategy holds (every rank a peer when
        it holds none; one process when there is no trainer)."""
        if trainer is None:
            return cls()
        # getattr: stand-in trainers (tests) carry only what their check reads.
        strategy = getattr(trainer, "strategy", None)
        layout = getattr(strategy, LAYOUT_ATTRIBUTE, None)
        if isinstance(layout, ParallelLayout):
            return layout.data_parallel
        return cls(rank=getattr(trainer, "global_rank", 0), size=trainer.world_size, strategy=strategy)

    @property
    def gradient_scale(self) -> float:
        """What each backward's loss is multiplied by so that the optimizer sees the gradient of one
        process.

        Each rank of a sequence-parallel group backpropagates the same loss through its own tokens
        only: its gradient is the part of the full gradient that flows through them (diffusers'
        gather of the output hands each rank its tokens' slice of the output gradient; the attention's
        all-to-all carries the cross-token terms to the rank that owns them), and the sp parts sum to
        the full gradient G. DDP and FSDP2 average the gradients over all dp·sp ranks, which gives
        (1/dp)·Σ_peers G/sp: the data-parallel mean, divided by sp. Hence the factor sp (a power of two
        in practice, so the product is exact)."""
        return float(self.sequence_parallel)

    def stack(self, x: Tensor) -> Tensor:
        """(…) on each peer → (R, …) on every peer, in rank order."""
        if self.size == 1:
            return x.unsqueeze(0)
        return self.strategy.all_gather(x, group=self.group)

    def gather(self, x: Tensor) -> Tensor:
        """(…, B) on each peer → (…, R·B), rank-major, on every peer."""
        if self.size == 1:
            return x
        return torch.cat(list(self.stack(x).unbind(0)), dim=-1)

    def mean(self, x: Tensor) -> Tensor:
        """The mean of ``x`` over the peers."""
        if self.size == 1:
            return x
        return self.strategy.reduce(x, group=self.group, reduce_op="mean")

    def mine(self, x: Tensor, per_rank: int) -> Tensor:
        """This peer's slice of a rank-major gathered (…, R·B) tensor."""
        return x[..., self.rank * per_rank : (self.rank + 1) * per_rank]

    def balance(
        self, rows: dict[str, Tensor], kept: Tensor, counts: Sequence[int]
    ) -> tuple[dict[str, Tensor], int]:
        """Move kept rows between peers so each holds ⌊K/R⌋ or ⌈K/R⌉ of the K kept ones.

        ``rows``: every per-sample tensor of this peer (same first dimension); ``kept``: indices of
        its kept rows; ``counts``: every peer's kept count. Returns the rows after the moves (the kept
        ones first) and how many leading rows are now kept (see :func:`receive_rows`)."""
        moves = balance_moves(counts)
        if not moves:
            return rows, len(kept)
        flags = {name for name, t in rows.items() if t.dtype == torch.bool}  # collectives move numbers
        rows = {name: t.to(torch.uint8) if name in flags else t for name, t in rows.items()}
        blocks = send_rows(rows, kept, moves, self.rank)
        gathered = {name: self.stack(block) for name, block in blocks.items()}  # (R, width, ...)
        rows, n_kept = receive_rows(rows, kept, moves, self.rank, gathered)
        return {name: t.bool() if name in flags else t for name, t in rows.items()}, n_kept


def balanced_counts(counts: Sequence[int]) -> list[int]:
    """Every peer's count after :func:`balance_moves`."""
    after = list(counts)
    for source, dest, n in balance_moves(counts):
        after[source] -= n
        after[dest] += n
    return after


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
