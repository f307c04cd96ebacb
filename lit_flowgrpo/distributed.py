"""The data-parallel view of the trainer's ranks: who this rank's data-parallel peers are, how their
tensors are gathered and averaged, and how kept samples are re-dealt among them.

Without sequence parallelism every rank is a data-parallel peer (DDP, FSDP2 per block), and the view
is the trainer's world. With ``--model.init_args.performance.sequence_parallel`` = sp > 1 the world is
a (dp, sp) grid: the sp consecutive ranks ``d·sp … d·sp + sp − 1`` form one sequence-parallel group
that holds the same samples (the same prompts, seeds, rollouts, rewards and losses) and splits each
sample's tokens inside the transformer (:mod:`lit_flowgrpo.sequence_parallel`); the groups are the
data-parallel peers, ``world / sp`` of them, and rank ``r`` is peer ``r // sp``. This is the one place
that knows it: the module, the data module, the metrics and the callbacks ask it, not
``trainer.global_rank`` / ``world_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "DataParallel",
    "balance_moves",
    "device_mesh",
    "load_balance",
    "receive_rows",
    "send_rows",
]

#: The mesh's dimension names: data-parallel peers, then diffusers' context-parallel dimensions
#: (``ContextParallelConfig`` looks its ``"ring"`` and ``"ulysses"`` dimensions up by name).
MESH_DIMS = ("dp", "ring", "ulysses")
_MESHES: dict[tuple[Any, ...], Any] = {}


@dataclass(frozen=True)
class DataParallel:
    """This rank's place among its data-parallel peers.

    Args:
        rank: this rank's index among the peers.
        size: how many peers share the batch.
        strategy: the Lightning strategy whose collectives reach the peers (``None``: one process).
        sequence_parallel: ranks per peer, which hold the same samples and split their tokens.
    """

    rank: int = 0
    size: int = 1
    strategy: Any = None
    sequence_parallel: int = 1

    @classmethod
    def of(cls, trainer: Any) -> DataParallel:
        """The view of ``trainer``'s ranks (one process when there is no trainer)."""
        if trainer is None:
            return cls()
        # getattr: stand-in trainers (tests) carry only what their check reads.
        rank, strategy = getattr(trainer, "global_rank", 0), getattr(trainer, "strategy", None)
        sp = sequence_parallel_of(trainer)
        world = trainer.world_size
        if world % sp:
            # The module's setup refuses this first, naming the flag; a view of a partial peer would
            # deal samples to ranks that do not exist.
            raise ValueError(f"sequence_parallel ({sp}) does not divide the {world} ranks")
        return cls(rank=rank // sp, size=world // sp, strategy=strategy, sequence_parallel=sp)

    @property
    def group(self) -> Any:
        """The process group of the peers (``None``: the default group, every rank): with sequence
        parallelism, the ranks at this rank's place in every sequence-parallel group."""
        if self.sequence_parallel == 1:
            return None
        return device_mesh(self.sequence_parallel, self.strategy.root_device.type)["dp"].get_group()

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


def sequence_parallel_of(trainer: Any) -> int:
    """Ranks per sample of ``trainer``'s run: what its LightningModule declares as
    ``sequence_parallel`` (``FlowGRPOModule``: ``performance.sequence_parallel``), else 1."""
    module = getattr(trainer, "lightning_module", None)
    sp = getattr(module, "sequence_parallel", 1)
    return sp if isinstance(sp, int) and sp >= 1 else 1


def device_mesh(sequence_parallel: int, device_type: str) -> Any:
    """The (dp, ring = 1, ulysses = sp) device mesh of the world, built once per process group.

    Rank r sits at (r // sp, 0, r % sp): each sequence-parallel group is sp consecutive ranks (on one
    node as long as sp divides the GPUs per node, so the attention's all-to-all stays on NVLink). Every
    rank must call this at the same point the first time (building a mesh creates process groups
    collectively); ``FlowGRPOModule.configure_model`` does.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    key = (dist.group.WORLD, world, sequence_parallel, device_type)  # a new process group, a new mesh
    if key not in _MESHES:
        shape = (world // sequence_parallel, 1, sequence_parallel)
        _MESHES[key] = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    return _MESHES[key]


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
