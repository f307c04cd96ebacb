"""Prompts in, groups out: `PromptDataModule` and the `GroupSampler` behind it.

GRPO compares samples of the same prompt, so a batch is built group-first: M prompts per step,
each repeated K times, the M·K samples shuffled and dealt out to the ranks. A group may span ranks;
the module gathers rewards before computing advantages, so that is fine.

Everything is a pure function of (seed, step): the prompts of step s, the order of its samples and
each sample's id (which seeds its noise) never depend on the number of ranks or on what ran before,
so a resumed run draws exactly what an uninterrupted one would; so does the seed of a group's shared
initial noise (``same_initial_noise``), a function of (seed, step, group id). The datasets are
iterable, so Lightning never injects its `DistributedSampler` between the groups.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import lightning as L
import torch
from jsonargparse.typing import Path_fr
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from lit_flowgrpo.conditioning import CONDITION_KEY, Condition, ConditionImages, resolve_condition_paths
from lit_flowgrpo.distributed import DataParallel
from lit_flowgrpo.errors import SettingsError


@dataclass
class PromptBatch:
    """The samples one rank generates in one step."""

    prompts: list[str]
    metadata: list[dict[str, Any]]
    group_ids: Tensor
    """(B,) int64: the prompt's index among this step's M prompts; equal ids share a group."""
    sample_ids: Tensor
    """(B,) int64: the sample's index among this step's M·K samples (seeds its noise)."""
    step: int
    """Index of this rollout batch in the sampler's stream (validation: the batch index)."""
    seeds: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    """(B,) int64: per-sample noise seed, derived from (seed, step, sample id)."""
    initial_seeds: Tensor | None = None
    """(B,) int64 or ``None``: the seed of each sample's initial noise when the samples of a group
    share it (``same_initial_noise``), derived from (seed, step, group id); ``seeds`` then draws only
    the noise of the stochastic steps. ``None``: ``seeds`` draws the initial noise too."""
    conditions: list[Condition] | None = None
    """One per sample: the images its record conditions it on (editing sources, a first frame), at their
    files' size; ``None`` for text-only records (:mod:`lit_flowgrpo.conditioning`)."""

    def __len__(self) -> int:
        return len(self.prompts)


def read_prompts(path: str, flag: str) -> list[dict[str, Any]]:
    """Prompt records from ``.txt`` (one prompt per line) or ``.jsonl`` (a ``prompt`` field plus metadata).

    UTF-8 text, with or without a byte-order mark. Raises :class:`SettingsError` naming ``flag``, the
    file and what is wrong with it.
    """
    if os.path.isdir(path):
        raise SettingsError(f"{flag} ({path}) is a folder: give a .txt (one prompt per line) or .jsonl file")
    if not os.path.isfile(path):
        raise SettingsError(
            f"{flag} ({path}) does not exist: give a .txt (one prompt per line) or .jsonl file"
        )
    if not path.endswith((".txt", ".jsonl")):
        raise SettingsError(f"{flag} ({path}) must end in .txt (one prompt per line) or .jsonl")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise SettingsError(f"{flag} ({path}) cannot be read: {err.strerror}") from None
    text = _decode(raw, path, flag)
    records: list[dict[str, Any]] = []
    if path.endswith(".jsonl"):
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise SettingsError(
                    f"{flag} ({path}) line {n} is not valid JSON ({e.msg}, column {e.colno}): each line of a "
                    '.jsonl file is one object, e.g. {"prompt": "a red cube"}'
                ) from None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise SettingsError(
                    f'{flag} ({path}) line {n} has no string "prompt" field: each line is an object such as '
                    '{"prompt": "a red cube"}'
                )
            records.append(record)
    else:
        records = [{"prompt": line.strip()} for line in text.splitlines() if line.strip()]
    if not records:
        raise SettingsError(f"{flag} ({path}) holds no prompts: add at least one non-empty line")
    return records


def _decode(raw: bytes, path: str, flag: str) -> str:
    """``raw`` as UTF-8 text (a byte-order mark dropped), or a :class:`SettingsError` saying what it is."""
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        # Windows editors and PowerShell's `>` write UTF-16 with this mark.
        raise SettingsError(f"{flag} ({path}) is UTF-16 text: save it as UTF-8")
    if b"\x00" in raw:
        raise SettingsError(f"{flag} ({path}) is a binary file (it holds NUL bytes): give a UTF-8 text file")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise SettingsError(
            f"{flag} ({path}) is not UTF-8 text (byte 0x{raw[err.start]:02x} on line {line}): save it as UTF-8"
        ) from None


def _mix(*values: int) -> int:
    """A 63-bit hash of integers (splitmix64 rounds), stable across processes and Python versions."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h & 0x7FFFFFFFFFFFFFFF


def sample_seed(seed: int, step: int, sample_id: int) -> int:
    """The noise seed of one sample: independent of rank, batch composition and resume."""
    return _mix(seed, step, sample_id, 0x5EED)


def group_seed(seed: int, step: int, group_id: int) -> int:
    """The seed of a group's shared initial noise: independent of rank, batch composition and resume,
    and of every :func:`sample_seed` (another salt), so the shared start and the stochastic steps'
    noise are drawn from unrelated streams."""
    return _mix(seed, step, group_id, 0x6E0A)


def split_problems(samples_per_step: int, ranks: int) -> list[str]:
    """The rule of a step's batch against the data-parallel ranks, in one place: its M·K samples
    split evenly over them (each rank generates the same number). Checked at setup with the update's
    own rules (:meth:`lit_flowgrpo.update.UpdateSettings.batch_problems`).

    >>> split_problems(12, 4)
    []
    """
    if samples_per_step % ranks:
        return [
            f"--data.init_args.prompts_per_step × --data.init_args.group_size ({samples_per_step}) must be a "
            f"multiple of the number of data-parallel ranks ({ranks}): change either"
        ]
    return []


class GroupSampler:
    """Which prompts each rank generates at each step.

    Prompts are drawn without replacement from a stream of seeded permutations of the prompt set
    (every prompt is seen once before any repeats). Step s takes the stream's items [s·M, (s+1)·M),
    repeats each K times, shuffles the M·K samples with a (seed, s) permutation and gives rank r the
    r-th contiguous slice.

    Args:
        num_prompts: size of the prompt set.
        prompts_per_step: M.
        group_size: K, samples per prompt.
        world_size: number of ranks.
        rank: this rank.
        seed: the run's seed.
    """

    def __init__(
        self, num_prompts: int, prompts_per_step: int, group_size: int, world_size: int, rank: int, seed: int
    ) -> None:
        total = prompts_per_step * group_size
        problems = split_problems(total, world_size)
        if problems:  # the module's setup refuses it first (UpdateSettings.batch_problems)
            raise ValueError(problems[0])
        self.num_prompts = num_prompts
        self.prompts_per_step = prompts_per_step
        self.group_size = group_size
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.per_rank = total // world_size

    def _stream(self, start: int, count: int) -> list[int]:
        out: list[int] = []
        position = start
        while len(out) < count:
            cycle, offset = divmod(position, self.num_prompts)
            gen = torch.Generator().manual_seed(_mix(self.seed, cycle, 0xC1C1E))
            perm = torch.randperm(self.num_prompts, generator=gen).tolist()
            take = min(count - len(out), self.num_prompts - offset)
            out.extend(perm[offset : offset + take])
            position += take
        return out

    def step_indices(self, step: int) -> tuple[list[int], Tensor, Tensor]:
        """(prompt indices, group ids, sample ids) of this rank's samples at ``step``."""
        prompts = self._stream(step * self.prompts_per_step, self.prompts_per_step)
        total = self.prompts_per_step * self.group_size
        gen = torch.Generator().manual_seed(_mix(self.seed, step, 0x5A3F))
        order = torch.randperm(total, generator=gen)  # sample ids in dealing order
        mine = order[self.rank * self.per_rank : (self.rank + 1) * self.per_rank]
        # A step that crosses from one permutation into the next can draw a prompt twice (M ≤ the
        # number of prompts, but the next permutation may start with the last one's tail): both draws
        # are one group of 2K, normalised together, named by the first draw's place in the step.
        first: dict[int, int] = {}
        group_of_draw = torch.tensor([first.setdefault(p, g) for g, p in enumerate(prompts)])
        group_ids = group_of_draw[mine // self.group_size]
        return [prompts[g] for g in group_ids.tolist()], group_ids, mine


class _TrainStream(IterableDataset):
    def __init__(
        self,
        records: list[dict[str, Any]],
        sampler: GroupSampler,
        start_step: int,
        same_initial_noise: bool,
        images: ConditionImages | None = None,
    ) -> None:
        self.records = records
        self.sampler = sampler
        self.start_step = start_step
        self.same_initial_noise = same_initial_noise
        self.images = images

    def __iter__(self) -> Iterator[PromptBatch]:
        step = self.start_step
        while True:
            indices = self.sampler.step_indices(step)
            yield _make_batch(
                self.records, *indices, step, self.sampler.seed, self.same_initial_noise, self.images
            )
            step += 1


def record_metadata(record: dict[str, Any]) -> dict[str, Any]:
    """What a reward sees of a record besides its prompt (its conditioning images travel apart)."""
    return {k: v for k, v in record.items() if k not in ("prompt", CONDITION_KEY)}


def _make_batch(
    records: list[dict[str, Any]],
    indices: list[int],
    group_ids: Tensor,
    sample_ids: Tensor,
    step: int,
    seed: int,
    same_initial_noise: bool = False,
    images: ConditionImages | None = None,
) -> PromptBatch:
    chosen = [records[i] for i in indices]
    metadata = [record_metadata(r) for r in chosen]
    seeds = torch.tensor([sample_seed(seed, step, int(s)) for s in sample_ids], dtype=torch.long)
    initial = None
    if same_initial_noise:
        initial = torch.tensor([group_seed(seed, step, int(g)) for g in group_ids], dtype=torch.long)
    return PromptBatch(
        prompts=[r["prompt"] for r in chosen],
        metadata=metadata,
        group_ids=group_ids.long(),
        sample_ids=sample_ids.long(),
        step=step,
        seeds=seeds,
        initial_seeds=initial,
        conditions=None if images is None else images.conditions(chosen),
    )


class _ValSet(IterableDataset):
    """Every (val prompt, val seed) pair once, split over ranks, in fixed-size batches.

    No ``__len__``: Lightning warns about any sized ``IterableDataset`` (its length may be wrong with
    several workers), and a map-style set would get Lightning's ``DistributedSampler``, which would
    split the already per-rank batches again. Validation simply runs until the set is exhausted.
    """

    def __init__(
        self,
        records: list[dict[str, Any]],
        seeds: int,
        batch_size: int,
        world_size: int,
        rank: int,
        seed: int,
        images: ConditionImages | None = None,
    ) -> None:
        self.records = records
        self.seeds = seeds
        self.batch_size = batch_size
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.images = images

    @property
    def num_samples(self) -> int:
        """Samples this rank evaluates (what a progress bar counts against; not ``__len__``, see above)."""
        return len(self._mine())

    def _mine(self) -> list[int]:
        total = len(self.records) * self.seeds
        return list(range(self.rank, total, self.world_size))

    def __iter__(self) -> Iterator[PromptBatch]:
        mine = self._mine()
        for b, start in enumerate(range(0, len(mine), self.batch_size)):
            items = torch.tensor(mine[start : start + self.batch_size], dtype=torch.long)
            prompt_idx = (items % len(self.records)).tolist()
            chosen = [self.records[i] for i in prompt_idx]
            yield PromptBatch(
                prompts=[r["prompt"] for r in chosen],
                metadata=[record_metadata(r) for r in chosen],
                group_ids=items % len(self.records),
                sample_ids=items,
                step=b,
                # Validation noise depends only on (seed, sample): the same images every validation.
                seeds=torch.tensor([sample_seed(self.seed, -1, int(i)) for i in items], dtype=torch.long),
                conditions=None if self.images is None else self.images.conditions(chosen),
            )


class PromptDataModule(L.LightningDataModule):
    """Prompt sets for RL: grouped training batches and a fixed validation set.

    Args:
        train: training prompts, ``.txt`` (one per line) or ``.jsonl`` (``prompt`` plus metadata for
            the reward, e.g. GenEval specs). A relative path in a config file is read from that file's
            folder if the file is there (jsonargparse's ``Path_fr``), else from the working folder, as
            on the command line: a recipe names its prompts wherever it is installed.
        val: held-out prompts in the same formats; ``None`` for no validation.
        prompts_per_step: M, distinct prompts per rollout batch (all ranks together).
        group_size: K, samples per prompt; GRPO needs at least 2.
        val_seeds: each validation prompt is sampled with this many fixed seeds.
        val_batch_size: samples per validation batch and rank.
        max_val_prompts: use only the first this many validation prompts (``None``: all).
        seed: seeds prompt order and all sampling noise.
        same_initial_noise: the samples of a training group start from one initial noise, drawn per
            group from (seed, step, group id), so their differences come from the stochastic steps
            alone (flow_grpo's ``same_latent``, DanceGRPO's ``use_same_noise``); the stochastic steps'
            noise stays each sample's own. Validation keeps one noise per (prompt, seed) pair.
    """

    def __init__(
        self,
        train: Path_fr | str,
        val: Path_fr | str | None = None,
        prompts_per_step: int = 8,
        group_size: int = 8,
        val_seeds: int = 1,
        val_batch_size: int = 16,
        max_val_prompts: int | None = None,
        seed: int = 0,
        same_initial_noise: bool = False,
    ) -> None:
        super().__init__()
        train, val = os.fspath(train), None if val is None else os.fspath(val)
        problems = []
        if group_size < self.min_group_size:
            problems.append(
                f"--data.init_args.group_size ({group_size}) must be at least {self.min_group_size}: "
                f"{self.group_size_reason}"
            )
        if prompts_per_step < 1:
            problems.append(f"--data.init_args.prompts_per_step ({prompts_per_step}) must be at least 1")
        if val_seeds < 1 or val_batch_size < 1:
            problems.append(
                "--data.init_args.val_seeds and --data.init_args.val_batch_size must be at least 1"
            )
        if max_val_prompts is not None and max_val_prompts < 1:
            # A slice by 0 or a negative number would silently drop all or the last validation prompts.
            problems.append(
                f"--data.init_args.max_val_prompts ({max_val_prompts}) must be at least 1, or null for all"
            )
        if problems:
            raise SettingsError("invalid data settings:\n  " + "\n  ".join(problems))
        self.train_path = train
        self.val_path = val
        self.prompts_per_step = prompts_per_step
        self.group_size = group_size
        self.val_seeds = val_seeds
        self.val_batch_size = val_batch_size
        self.max_val_prompts = max_val_prompts
        self.seed = seed
        self.same_initial_noise = same_initial_noise
        # Read now: an empty or missing prompt file fails before any model is loaded.
        self.train_records = self.read_train(train, "--data.init_args.train")
        self.val_records = read_prompts(val, "--data.init_args.val") if val else []
        if max_val_prompts is not None:
            self.val_records = self.val_records[:max_val_prompts]
        # Conditioning images (editing sources, first frames): made absolute and their headers read now;
        # whether the policy takes them is the module's setup's question (conditioning.condition_problems).
        self.condition_sizes = resolve_condition_paths(self.train_records, train, "--data.init_args.train")
        if val:
            self.condition_sizes |= resolve_condition_paths(self.val_records, val, "--data.init_args.val")
        self.condition_images = ConditionImages() if self.condition_sizes else None
        _check_distinct(self.train_records, prompts_per_step, train)
        self._next_step = 0

    #: The smallest ``group_size`` and why (a subclass whose records train alone allows 1).
    min_group_size: ClassVar[int] = 2
    group_size_reason: ClassVar[str] = "GRPO needs a group to compare within"

    def read_train(self, path: str, flag: str) -> list[dict[str, Any]]:
        """The training records (:func:`read_prompts`; a subclass reads records of its own kind)."""
        return read_prompts(path, flag)

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    def _world(self) -> tuple[int, int]:
        """(data-parallel size, rank): the ranks that share the prompts of a step."""
        dp = DataParallel.of(self.trainer)
        return dp.size, dp.rank

    def train_dataloader(self) -> DataLoader:
        world_size, rank = self._world()
        sampler = GroupSampler(
            len(self.train_records), self.prompts_per_step, self.group_size, world_size, rank, self.seed
        )
        return DataLoader(self.train_stream(sampler, self._next_step), batch_size=None, collate_fn=_identity)

    def train_stream(self, sampler: GroupSampler, start_step: int) -> IterableDataset:
        """The endless stream of this rank's batches from ``start_step`` on (a subclass adds what its
        records carry to each :class:`PromptBatch`)."""
        return _TrainStream(
            self.train_records, sampler, start_step, self.same_initial_noise, self.condition_images
        )

    def val_dataloader(self) -> DataLoader | list:
        if not self.val_records:
            return []
        world_size, rank = self._world()
        valset = _ValSet(
            self.val_records,
            self.val_seeds,
            self.val_batch_size,
            world_size,
            rank,
            self.seed,
            self.condition_images,
        )
        return DataLoader(valset, batch_size=None, collate_fn=_identity)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Called when a batch is consumed (after Lightning's one-batch prefetch), so the position
        # saved in a checkpoint is the next batch the training step has not seen.
        trainer = self.trainer
        if isinstance(batch, PromptBatch) and trainer is not None and trainer.training:
            self._next_step = batch.step + 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"next_step": self._next_step, "seed": self.seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("seed", self.seed) != self.seed:
            raise ValueError(
                f"--data.init_args.seed ({self.seed}) differs from the checkpoint's ({state_dict['seed']}): resume with "
                "the same seed, or start a new run without --ckpt_path"
            )
        self._next_step = int(state_dict["next_step"])


def _check_distinct(records: list[dict[str, Any]], prompts_per_step: int, path: str) -> None:
    """Refuse more prompts per step than the file has distinct prompts; warn about repeated lines.

    A step draws its M prompts from the sampler's stream of permutations, so with M above the number
    of prompts one prompt fills two slots of every step: two groups of the same prompt, each
    normalised on its own, where the user asked for M different prompts. Refused rather than merged
    into one bigger group, which would silently change the group size the settings name.

    A line repeated in the file is a prompt listed twice: drawn twice as often, and now and then as
    two groups in one step. That is a way to weight prompts, so it is allowed, with a warning.
    """
    distinct = len({json.dumps(r, sort_keys=True) for r in records})
    if prompts_per_step > distinct:
        raise SettingsError(
            f"--data.init_args.prompts_per_step ({prompts_per_step}) is more than the {distinct} distinct prompts in "
            f"--data.init_args.train ({path}): a step would hold two groups of one prompt. Set --data.init_args.prompts_per_step "
            f"to at most {distinct} (raise --data.init_args.group_size for more samples per step), or add prompts"
        )
    if distinct < len(records):
        rank_zero_warn(
            f"--data.init_args.train ({path}) lists {len(records) - distinct} prompts more than once: each copy is "
            "drawn as its own prompt (more often, and at times as a second group in the same step); "
            "remove the copies unless that weighting is meant"
        )


def _identity(batch: Any) -> Any:
    return batch
