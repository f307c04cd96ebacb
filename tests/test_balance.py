"""Balancing the update's kept samples across ranks: the moves, and the exchange simulated for every
rank in one process (the all-gather is a stack of every rank's outgoing block)."""

from __future__ import annotations

import itertools

import pytest
import torch

from lit_flowgrpo.distributed import balance_moves, receive_rows, send_rows
from lit_flowgrpo.update import UpdateSettings


@pytest.mark.parametrize(
    "counts",
    [[5, 1], [0, 7], [3, 3], [9, 0, 0, 3], [1, 1, 0, 0], [4, 4, 4, 0, 0, 1, 2, 9], [0, 0], [2, 1, 0]],
)
def test_moves_balance_and_move_no_more_than_the_surplus(counts: list[int]) -> None:
    moves = balance_moves(counts)
    after = list(counts)
    for source, dest, n in moves:
        assert n > 0 and source != dest
        after[source] -= n
        after[dest] += n
    assert sum(after) == sum(counts)
    assert max(after) - min(after) <= 1
    moved = sum(n for _, _, n in moves)
    # The fewest possible: every sample above ⌈K/R⌉ (above ⌊K/R⌋ for the ranks that are not kept at ⌈K/R⌉) moves once.
    base, extra = divmod(sum(counts), len(counts))
    top = sorted(counts, reverse=True)
    least = sum(max(0, c - base - (i < extra)) for i, c in enumerate(top))
    assert moved == least
    assert balance_moves(counts) == moves  # a pure function: every rank computes the same plan


def test_the_exchange_delivers_every_kept_sample_once() -> None:
    batch, latent = 6, (2, 3)
    keeps = [
        torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.bool),
        torch.tensor([0, 0, 1, 0, 0, 0], dtype=torch.bool),
        torch.tensor([1, 1, 1, 1, 1, 1], dtype=torch.bool),
        torch.tensor([0, 0, 0, 0, 0, 0], dtype=torch.bool),
    ]
    ranks = len(keeps)
    # Sample ids are rank·batch + row; every tensor carries its sample's id so a moved row can be traced.
    rows = []
    for r in range(ranks):
        ids = torch.arange(batch) + r * batch
        rows.append(
            {
                "sample_ids": ids,
                "latents": ids.double().reshape(batch, 1, 1).expand(batch, *latent).clone(),
                "mask": (ids % 2 == 0).to(torch.uint8),
            }
        )
    kept = [k.nonzero().flatten() for k in keeps]
    counts = [len(k) for k in kept]
    moves = balance_moves(counts)
    blocks = [send_rows(rows[r], kept[r], moves, r) for r in range(ranks)]
    gathered = {name: torch.stack([b[name] for b in blocks]) for name in blocks[0]}
    trained = []
    for r in range(ranks):
        out, n_kept = receive_rows(rows[r], kept[r], moves, r, gathered)
        assert len(out["sample_ids"]) >= batch  # padding material stays available
        ids = out["sample_ids"][:n_kept]
        # Every tensor moved with its sample.
        assert torch.equal(out["latents"][:n_kept, 0, 0], ids.double())
        assert torch.equal(out["mask"][:n_kept], (ids % 2 == 0).to(torch.uint8))
        trained.append(ids.tolist())
    assert max(map(len, trained)) - min(map(len, trained)) <= 1
    flat = sorted(itertools.chain.from_iterable(trained))
    want = sorted(int(i) + r * batch for r in range(ranks) for i in kept[r])
    assert flat == want  # each kept sample trained exactly once, nothing else


def test_balance_load_is_off_by_default() -> None:
    assert UpdateSettings().balance_load is False
