"""GroupSampler and PromptDataModule: groups, rank independence, cycles without repeats, determinism
from (seed, step), and resuming through a real Trainer checkpoint."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lit_flowgrpo.data import GroupSampler, PromptBatch, PromptDataModule, group_seed, sample_seed

# 13 prompts against 3 per step: cycles end mid-step, so steps straddle two permutations.
NUM_PROMPTS, M, K = 13, 3, 4


def _draw(sampler: GroupSampler, step: int) -> list[tuple[int, int, int]]:
    """(sample id, group id, prompt index) of each of this rank's samples at ``step``."""
    prompts, group_ids, sample_ids = sampler.step_indices(step)
    return list(zip(sample_ids.tolist(), group_ids.tolist(), prompts, strict=True))


def _stream(sampler: GroupSampler, steps: int) -> list[int]:
    """The prompt of each draw, step after step: the stream the sampler draws prompts from (sample id
    s is the (s // K)-th draw of its step)."""
    out = []
    for step in range(steps):
        prompt_of = {s // sampler.group_size: p for s, _, p in _draw(sampler, step)}
        assert sorted(prompt_of) == list(range(sampler.prompts_per_step))
        out.extend(prompt_of[d] for d in range(sampler.prompts_per_step))
    return out


def test_a_step_is_m_groups_of_k_samples_of_one_prompt_each() -> None:
    sampler = GroupSampler(NUM_PROMPTS, M, K, world_size=1, rank=0, seed=0)
    for step in range(10):
        draw = _draw(sampler, step)
        assert sorted(s for s, _, _ in draw) == list(range(M * K))  # every sample id once
        assert Counter(g for _, g, _ in draw) == dict.fromkeys(range(M), K)
        assert all(g == s // K for s, g, _ in draw)  # sample id s belongs to group s // K
        assert all(len({p for _, g2, p in draw if g2 == g}) == 1 for _, g, _ in draw)
        # Shuffled: the dealing order is not the plain order of sample ids.
        assert [s for s, _, _ in draw] != list(range(M * K))


@pytest.mark.parametrize("world_size", [2, 3, 4, 6, 12])
def test_ranks_split_the_one_rank_draw(world_size: int) -> None:
    one = GroupSampler(NUM_PROMPTS, M, K, world_size=1, rank=0, seed=5)
    ranks = [GroupSampler(NUM_PROMPTS, M, K, world_size, rank, seed=5) for rank in range(world_size)]
    for step in range(8):
        parts = [_draw(r, step) for r in ranks]
        assert all(len(p) == M * K // world_size for p in parts)
        # In rank order the slices are exactly the one-rank draw: same samples, groups and prompts.
        assert [x for p in parts for x in p] == _draw(one, step)


def test_indivisible_batch_names_the_settings() -> None:
    with pytest.raises(
        ValueError,
        match=r"--data\.init_args\.prompts_per_step × --data\.init_args\.group_size \(12\) must be a "
        r"multiple of the number of data-parallel ranks \(5\)",
    ):
        GroupSampler(NUM_PROMPTS, M, K, world_size=5, rank=0, seed=0)


def test_no_prompt_repeats_within_a_cycle() -> None:
    sampler = GroupSampler(NUM_PROMPTS, M, K, world_size=1, rank=0, seed=3)
    cycles = 4
    stream = _stream(sampler, steps=-(-cycles * NUM_PROMPTS // M))  # enough steps for 4 full cycles
    chunks = [stream[c * NUM_PROMPTS : (c + 1) * NUM_PROMPTS] for c in range(cycles)]
    for chunk in chunks:
        assert sorted(chunk) == list(range(NUM_PROMPTS))  # each prompt exactly once per cycle
    assert len({tuple(c) for c in chunks}) == cycles  # and each cycle in a new order


def test_a_prompt_drawn_twice_in_a_step_is_one_group() -> None:
    # 3 prompts, 2 a step: step 1 takes the first permutation's last prompt and the second's first,
    # which for seed 4 are the same prompt. Its two draws are one group of 2K, not two groups of K
    # each normalised apart.
    sampler = GroupSampler(num_prompts=3, prompts_per_step=2, group_size=2, world_size=1, rank=0, seed=4)
    draw = _draw(sampler, 1)
    assert len({p for _, _, p in draw}) == 1
    assert {g for _, g, _ in draw} == {0}  # the first draw's place names the group
    assert sorted(s for s, _, _ in draw) == [0, 1, 2, 3]  # four samples, each its own noise seed
    for step in range(12):  # and in general: one group id per prompt, one prompt per group id
        pairs = {(g, p) for _, g, p in _draw(sampler, step)}
        assert len(pairs) == len({g for g, _ in pairs}) == len({p for _, p in pairs})


def test_more_prompts_per_step_than_prompts_still_cycles() -> None:
    sampler = GroupSampler(num_prompts=3, prompts_per_step=7, group_size=2, world_size=1, rank=0, seed=1)
    stream = _stream(sampler, steps=3)  # 21 draws: 7 cycles of the 3 prompts
    assert all(sorted(stream[i : i + 3]) == [0, 1, 2] for i in range(0, 21, 3))


def test_draws_are_a_function_of_seed_and_step() -> None:
    sampler = GroupSampler(NUM_PROMPTS, M, K, world_size=2, rank=1, seed=7)
    in_order = [_draw(sampler, step) for step in range(12)]
    fresh = GroupSampler(NUM_PROMPTS, M, K, world_size=2, rank=1, seed=7)
    # Asked out of order, by another instance: the same draws (no hidden state advances).
    assert [_draw(fresh, step) for step in reversed(range(12))] == in_order[::-1]
    other_seed = GroupSampler(NUM_PROMPTS, M, K, world_size=2, rank=1, seed=8)
    assert [_draw(other_seed, step) for step in range(12)] != in_order


# ------------------------------------------------------------------ through PromptDataModule


@pytest.fixture
def prompts_jsonl(tmp_path: Path) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(f'{{"prompt": "prompt {i}", "i": {i}}}\n' for i in range(NUM_PROMPTS)))
    return str(path)


def _rank_batches(dm: PromptDataModule, world_size: int, rank: int, steps: int) -> list[PromptBatch]:
    # The data module reads only world_size and global_rank from its trainer to pick its slice.
    dm.trainer = SimpleNamespace(world_size=world_size, global_rank=rank, training=False)
    loader = iter(dm.train_dataloader())
    return [next(loader) for _ in range(steps)]


def _rows(batch: PromptBatch) -> list[tuple]:
    return [
        (s, g, p, m["i"], seed)
        for s, g, p, m, seed in zip(
            batch.sample_ids.tolist(),
            batch.group_ids.tolist(),
            batch.prompts,
            batch.metadata,
            batch.seeds.tolist(),
            strict=True,
        )
    ]


def test_batches_of_all_ranks_make_the_one_rank_batch(prompts_jsonl: str) -> None:
    dm = PromptDataModule(prompts_jsonl, prompts_per_step=M, group_size=K, seed=11)
    one = _rank_batches(dm, 1, 0, steps=5)
    parts = [_rank_batches(dm, 3, rank, steps=5) for rank in range(3)]
    for step in range(5):
        batches = [p[step] for p in parts]
        assert {b.step for b in batches} == {one[step].step} == {step}
        assert [row for b in batches for row in _rows(b)] == _rows(one[step])
    # Every sample's noise seed comes from (seed, step, sample id) alone.
    assert all(seed == sample_seed(11, 2, s) for s, _, _, _, seed in _rows(one[2]))
    assert len({seed for b in one for *_, seed in _rows(b)}) == 5 * M * K


def test_state_dict_resumes_the_stream(prompts_jsonl: str) -> None:
    dm = PromptDataModule(prompts_jsonl, prompts_per_step=M, group_size=K, seed=2)
    uninterrupted = _rank_batches(dm, 1, 0, steps=9)
    dm._next_step = 4  # as after four consumed batches (set by on_after_batch_transfer)
    restored = PromptDataModule(prompts_jsonl, prompts_per_step=M, group_size=K, seed=2)
    restored.load_state_dict(dm.state_dict())
    resumed = _rank_batches(restored, 1, 0, steps=5)
    assert [(b.step, _rows(b)) for b in resumed] == [(b.step, _rows(b)) for b in uninterrupted[4:]]
    with pytest.raises(
        ValueError, match=r"--data\.init_args\.seed \(3\) differs from the checkpoint's \(2\)"
    ):
        PromptDataModule(prompts_jsonl, seed=3).load_state_dict(dm.state_dict())


class _Recorder(L.LightningModule):
    """Records the batches it trains on; one real optimizer step per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[int, list[tuple]]] = []

    def training_step(self, batch: PromptBatch, batch_idx: int) -> torch.Tensor:
        self.seen.append((batch.step, _rows(batch)))
        return (self.weight - 1.0).square().sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(dm: PromptDataModule, root: Path, max_steps: int, ckpt_path: str | None = None) -> _Recorder:
    module = _Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    if ckpt_path is None:
        trainer.save_checkpoint(root / f"step{max_steps}.ckpt")
    return module


@pytest.mark.filterwarnings("ignore:You passed in a `val_dataloader` but have no `validation_step`")
@pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated")
def test_a_resumed_fit_trains_on_what_an_uninterrupted_one_would(prompts_jsonl: str, tmp_path: Path) -> None:
    def data() -> PromptDataModule:
        return PromptDataModule(prompts_jsonl, prompts_per_step=M, group_size=K, seed=4)

    full = _fit(data(), tmp_path / "full", max_steps=6).seen
    _fit(data(), tmp_path / "first", max_steps=3)
    resumed = _fit(data(), tmp_path / "second", max_steps=6, ckpt_path=str(tmp_path / "first" / "step3.ckpt"))
    assert [step for step, _ in full] == [0, 1, 2, 3, 4, 5]
    # Lightning fetches one batch ahead; the checkpoint still resumes at the first batch not trained on.
    assert resumed.seen == full[3:]


def test_validation_pairs_each_prompt_with_each_seed_once_over_the_ranks(prompts_jsonl: str) -> None:
    dm = PromptDataModule(prompts_jsonl, val=prompts_jsonl, val_seeds=2, val_batch_size=4, seed=9)

    def rows(rank: int) -> list[tuple[int, str, int]]:
        dm.trainer = SimpleNamespace(world_size=3, global_rank=rank, training=False)
        loader = dm.val_dataloader()
        batches = list(loader)
        assert all(len(b) <= 4 for b in batches)
        return [
            (s, p, seed)
            for b in batches
            for s, p, seed in zip(b.sample_ids.tolist(), b.prompts, b.seeds.tolist(), strict=True)
        ]

    items = [row for rank in range(3) for row in rows(rank)]
    # 13 prompts × 2 seeds = 26 samples, each once; sample i is prompt i mod 13.
    assert sorted(s for s, _, _ in items) == list(range(2 * NUM_PROMPTS))
    assert all(p == f"prompt {s % NUM_PROMPTS}" for s, p, _ in items)
    # Each sample has its own noise, the same at every validation (before and after training).
    assert len({seed for *_, seed in items}) == len(items)
    assert [row for rank in range(3) for row in rows(rank)] == items


# ------------------------------------------------------------------ shared initial noise


def test_same_initial_noise_is_one_seed_per_group_whatever_the_ranks(prompts_jsonl: str) -> None:
    dm = PromptDataModule(prompts_jsonl, prompts_per_step=M, group_size=K, seed=11, same_initial_noise=True)
    one = _rank_batches(dm, 1, 0, steps=4)
    for world in (2, 3, 6):
        parts = [_rank_batches(dm, world, rank, steps=4) for rank in range(world)]
        for step in range(4):
            dealt = [
                (s, i)
                for p in parts
                for s, i in zip(p[step].sample_ids.tolist(), p[step].initial_seeds.tolist(), strict=True)
            ]
            # The ranks' slices together are the one-rank batch, initial seeds included.
            assert dealt == list(
                zip(one[step].sample_ids.tolist(), one[step].initial_seeds.tolist(), strict=True)
            )
    for step, batch in enumerate(one):
        by_group = {}
        for g, i in zip(batch.group_ids.tolist(), batch.initial_seeds.tolist(), strict=True):
            by_group.setdefault(g, set()).add(i)
        # One start per group, from (seed, step, group id); distinct across groups and steps.
        assert by_group == {g: {group_seed(11, step, g)} for g in by_group} and len(by_group) == M
        # The stochastic steps' noise stays each sample's own: the per-sample seeds are unchanged.
        assert batch.seeds.tolist() == [sample_seed(11, step, s) for s in batch.sample_ids.tolist()]
        assert not set(batch.seeds.tolist()) & set(batch.initial_seeds.tolist())
    assert len({i for b in one for i in b.initial_seeds.tolist()}) == 4 * M


def test_same_initial_noise_resumes_and_is_off_by_default(prompts_jsonl: str) -> None:
    dm = PromptDataModule(prompts_jsonl, prompts_per_step=M, group_size=K, seed=2, same_initial_noise=True)
    uninterrupted = _rank_batches(dm, 1, 0, steps=6)
    dm._next_step = 4
    restored = PromptDataModule(
        prompts_jsonl, prompts_per_step=M, group_size=K, seed=2, same_initial_noise=True
    )
    restored.load_state_dict(dm.state_dict())
    resumed = _rank_batches(restored, 1, 0, steps=2)
    assert [b.initial_seeds.tolist() for b in resumed] == [
        b.initial_seeds.tolist() for b in uninterrupted[4:]
    ]
    # Off, the batches are those of before the setting existed: no initial seeds, the same samples.
    plain = _rank_batches(PromptDataModule(prompts_jsonl, prompts_per_step=M, group_size=K, seed=2), 1, 0, 6)
    assert all(b.initial_seeds is None for b in plain)
    assert [_rows(b) for b in plain] == [_rows(b) for b in uninterrupted]
    # Validation keeps one noise per (prompt, seed) pair.
    dm = PromptDataModule(prompts_jsonl, val=prompts_jsonl, seed=2, same_initial_noise=True)
    dm.trainer = SimpleNamespace(world_size=1, global_rank=0, training=False)
    assert all(b.initial_seeds is None for b in dm.val_dataloader())
