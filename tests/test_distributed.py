"""lit_flowgrpo/distributed.py on one process, and RolloutBatch's one list of per-sample fields
(concatenation and rank balancing move every field). The 2-process gloo runs are in test_ddp.py."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from lit_flowgrpo.distributed import DataParallel, balance_moves, send_rows
from lit_flowgrpo.rollout import RolloutBatch, Trajectory


def trajectory(batch: int, steps: int = 2, means: bool = True, offset: float = 0.0) -> Trajectory:
    def rows(*shape: int) -> Tensor:
        return offset + torch.arange(batch * int(torch.tensor(shape).prod())).float().reshape(batch, *shape)

    return Trajectory(
        latents=rows(steps, 2, 3),
        next_latents=rows(steps, 2, 3) + 0.5,
        log_probs=rows(steps),
        prev_sample_means=rows(steps, 2, 3) + 0.25 if means else None,
        std_dev_t=rows(steps) + 1,
        sqrt_dt=rows(steps) + 2,
        sigmas=torch.tensor([1.0, 0.5]),
        sigmas_next=torch.tensor([0.5, 0.0]),
        step_indices=torch.arange(steps),
        final=rows(2, 3) + 3,
        transformer_forwards=steps,
        noise_level=0.7,
        sde_type="sde",
        sigma_max=None,
    )


def batch_of(n: int, offset: float = 0.0) -> RolloutBatch:
    return RolloutBatch(
        trajectory(n, offset=offset),
        {"prompt_embeds": offset + torch.randn(n, 4, 8), "mask": torch.ones(n, 4, dtype=torch.bool)},
        advantages=offset + torch.arange(n).float(),
        sample_ids=int(offset) + torch.arange(n),
        keep=torch.ones(n, dtype=torch.bool),
    )


def test_one_process_is_the_identity() -> None:
    dp = DataParallel.of(None)
    assert (dp.rank, dp.size, dp.group) == (0, 1, None)
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(dp.gather(x), x)
    assert torch.equal(dp.stack(x), x.unsqueeze(0))
    assert torch.equal(dp.mean(x), x)
    assert torch.equal(dp.mine(x, 3), x)
    rows = {"a": torch.arange(4)}
    out, n = dp.balance(rows, torch.tensor([0, 2]), [2])
    assert n == 2 and out is rows


def test_mine_is_this_ranks_rank_major_slice() -> None:
    gathered = torch.arange(12).reshape(2, 6)  # 3 ranks × 2 samples, rank-major
    assert DataParallel(rank=1, size=3).mine(gathered, 2).tolist() == [[2, 3], [8, 9]]


def test_every_trajectory_field_of_the_batch_dimension_is_a_sample_field() -> None:
    traj = trajectory(5)
    per_sample = {
        f.name
        for f in dataclasses.fields(traj)
        if isinstance(getattr(traj, f.name), Tensor) and getattr(traj, f.name).shape[:1] == (5,)
    }
    assert per_sample == set(Trajectory.SAMPLE_FIELDS)


def test_rollout_batch_rows_name_every_per_sample_field() -> None:
    batch = batch_of(3)
    rows = batch.rows()
    expected = {f"trajectory.{f}" for f in Trajectory.SAMPLE_FIELDS}
    expected |= {"embeds.prompt_embeds", "embeds.mask", "advantages", "sample_ids", "keep"}
    assert set(rows) == expected
    back = batch.with_rows(rows)
    for name, t in back.rows().items():
        assert torch.equal(t, rows[name]), name
    assert back.trajectory.sigmas is batch.trajectory.sigmas  # the shared step settings stay


def test_rollout_batch_cat_joins_every_field() -> None:
    a, b = batch_of(2), batch_of(3, offset=100.0)
    joined = RolloutBatch.cat([a, b])
    assert len(joined) == 5
    for name, t in joined.rows().items():
        assert torch.equal(t, torch.cat([a.rows()[name], b.rows()[name]])), name
    # Trajectory.cat (the rollout's sample chunks) joins the same list, μ_old included.
    traj = Trajectory.cat([a.trajectory, b.trajectory])
    for name, t in traj.sample_rows().items():
        assert torch.equal(t, joined.rows()[f"trajectory.{name}"]), name
    no_means = Trajectory.cat([trajectory(2, means=False), trajectory(1, means=False)])
    assert no_means.prev_sample_means is None and len(no_means.latents) == 3


class _Gathered:
    """A strategy whose all-gather returns, field by field in order, the blocks every rank sent."""

    def __init__(self, blocks: list[dict[str, Tensor]]) -> None:
        self.blocks = blocks
        self.names = list(blocks[0])
        self.calls = 0

    def all_gather(self, block: Tensor, group=None) -> Tensor:
        name = self.names[self.calls]
        self.calls += 1
        return torch.stack([b[name] for b in self.blocks])


def test_balance_moves_every_per_sample_field_between_ranks() -> None:
    batches = [batch_of(4), batch_of(4, offset=100.0)]
    kept = [torch.arange(4), torch.tensor([1])]  # rank 0 keeps 4, rank 1 keeps 1
    counts = [4, 1]
    moves = balance_moves(counts)
    assert moves == [(0, 1, 1)]

    def wire(rows: dict[str, Tensor]) -> dict[str, Tensor]:  # what the collective moves: numbers
        return {n: t.to(torch.uint8) if t.dtype == torch.bool else t for n, t in rows.items()}

    blocks = [
        send_rows(wire(b.rows()), k, moves, r) for r, (b, k) in enumerate(zip(batches, kept, strict=True))
    ]
    strategy = _Gathered(blocks)
    rows, n_kept = DataParallel(rank=1, size=2, strategy=strategy).balance(batches[1].rows(), kept[1], counts)
    assert n_kept == 2
    assert strategy.calls == len(batches[1].rows())  # one all-gather per field
    received = batches[1].with_rows(rows)
    # Rank 1's own kept sample first, then rank 0's last kept sample: every field travelled.
    for name, t in received.rows().items():
        assert torch.equal(t[0], batches[1].rows()[name][1]), name
        assert torch.equal(t[1], batches[0].rows()[name][3]), name
        assert t.dtype == batches[1].rows()[name].dtype, name
