"""Build the toy world's fixed train and validation prompt lists (``toy/assets/{train,val}.jsonl``).

``python -m lit_flowgrpo.toy.make_prompts`` rewrites the shipped files; with the default settings
the output is byte-identical to them (a test checks this).

How the lists are made, per family (stratified: every family gets its share of both lists):

1. The family's distinct prompts without an unseen binding are split train/validation, stratified
   by count (counting) or relation (position), ``val_fraction`` of them to validation. Families with
   fewer than ``min_split`` distinct prompts (``single_object``: 3, ``two_object``: 6) cannot spare
   any: their prompts appear in both lists, and measure drawing rather than composition.
2. Prompts naming an unseen binding (``world.UNSEEN_BINDINGS``) go to validation only, as
   ``val_unseen_fraction`` of the family's validation records.
3. Each list holds ``FAMILY_WEIGHTS[family] × size`` records of the family, spread over its pool in
   proportion to ``world.record_weight`` (largest remainders), so prompts repeat: the list is a
   prompt distribution, which the data module samples without replacement.
4. The validation list is ordered so that every prefix keeps the family mix
   (``--data.init_args.max_val_prompts`` takes a prefix).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from lit_flowgrpo.toy import world

TRAIN_SIZE = 2000
VAL_SIZE = 250


def _apportion(total: int, weights: Sequence[float]) -> list[int]:
    """Integers proportional to ``weights`` summing to ``total`` (largest remainders, ties by order)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = total * w / w.sum()
    counts = np.floor(exact).astype(int)
    order = sorted(range(len(w)), key=lambda i: -(exact[i] - counts[i]))
    for i in order[: total - int(counts.sum())]:
        counts[i] += 1
    return counts.tolist()


def _stratum(record: dict[str, Any]) -> Any:
    if record["tag"] == "counting":
        return record["include"][0]["count"]
    if record["tag"] == "position":
        return record["include"][1]["position"][0]
    return None


def _split(records: list[dict[str, Any]], fraction: float, rng: np.random.Generator) -> tuple[list, list]:
    """(train, val) halves of ``records``, ``fraction`` of each stratum to val (at least one)."""
    strata: dict[Any, list[dict[str, Any]]] = {}
    for r in records:
        strata.setdefault(_stratum(r), []).append(r)
    train, val = [], []
    for group in strata.values():
        group = [group[i] for i in rng.permutation(len(group))]
        n_val = min(max(1, round(fraction * len(group))), len(group) - 1)
        val += group[:n_val]
        train += group[n_val:]
    return train, val


def _draw(pool: list[dict[str, Any]], total: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    """``total`` records spread over ``pool`` in proportion to their weights, in random order."""
    if total == 0:
        return []
    pool = [pool[i] for i in rng.permutation(len(pool))]  # random tie-breaking in the apportionment
    counts = _apportion(total, [world.record_weight(r) for r in pool])
    out = [r for r, n in zip(pool, counts, strict=True) for _ in range(n)]
    return [out[i] for i in rng.permutation(len(out))]


def _interleave(per_family: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One list whose every prefix keeps the families' proportions: item i of a family of n sits at
    (i + 0.5) / n."""
    keyed = []
    for f_index, (_, items) in enumerate(per_family.items()):
        keyed += [((i + 0.5) / len(items), f_index, i, r) for i, r in enumerate(items)]
    return [r for *_, r in sorted(keyed, key=lambda k: k[:3])]


def build_prompt_lists(
    seed: int = 0,
    train_size: int = TRAIN_SIZE,
    val_size: int = VAL_SIZE,
    val_fraction: float = 0.3,
    val_unseen_fraction: float = 1 / 3,
    min_split: int = 10,
) -> dict[str, list[dict[str, Any]]]:
    """The train and validation records (see the module docstring for the recipe).

    Args:
        seed: seeds every shuffle; the shipped lists use 0.
        train_size: records in the training list.
        val_size: records in the validation list.
        val_fraction: share of a family's seen prompts held out for validation.
        val_unseen_fraction: share of a family's validation records that name an unseen binding
            (families with colours only).
        min_split: families with fewer distinct prompts are shared by both lists.

    Returns:
        ``{"train": [...], "val": [...]}``.
    """
    problems = []
    if train_size < len(world.FAMILIES) or val_size < len(world.FAMILIES):
        problems.append(f"train_size and val_size must be at least {len(world.FAMILIES)} (one per family)")
    if not 0 < val_fraction < 1 or not 0 <= val_unseen_fraction < 1:
        problems.append("val_fraction must be in (0, 1) and val_unseen_fraction in [0, 1)")
    if problems:
        raise ValueError("invalid prompt-list settings: " + "; ".join(problems))
    rng = np.random.default_rng(seed)
    families = list(world.FAMILY_WEIGHTS)
    weights = [world.FAMILY_WEIGHTS[f] for f in families]
    train_quota = dict(zip(families, _apportion(train_size, weights), strict=True))
    val_quota = dict(zip(families, _apportion(val_size, weights), strict=True))

    train: dict[str, list[dict[str, Any]]] = {}
    val: dict[str, list[dict[str, Any]]] = {}
    for family in families:
        seen = world.family_records(family, unseen=False)
        unseen = world.family_records(family, unseen=True)
        if len(seen) < min_split:
            train_pool, val_pool = seen, seen
        else:
            train_pool, val_pool = _split(seen, val_fraction, rng)
        n_unseen = round(val_unseen_fraction * val_quota[family]) if unseen else 0
        train[family] = _draw(train_pool, train_quota[family], rng)
        val_records = _draw(val_pool, val_quota[family] - n_unseen, rng) + _draw(unseen, n_unseen, rng)
        val[family] = [val_records[i] for i in rng.permutation(len(val_records))]
    return {"train": _interleave(train), "val": _interleave(val)}


def write_prompt_lists(out_dir: str | None = None, **settings: Any) -> dict[str, str]:
    """Write ``train.jsonl`` and ``val.jsonl`` (one record per line) into ``out_dir``.

    Args:
        out_dir: target folder; ``None`` rewrites the shipped lists.
        **settings: passed to :func:`build_prompt_lists`.

    Returns:
        ``{"train": path, "val": path}``.
    """
    out_dir = out_dir or os.path.dirname(world.prompt_file("train"))
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for split, records in build_prompt_lists(**settings).items():
        path = os.path.join(out_dir, f"{split}.jsonl")
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        paths[split] = path
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=None, help="target folder (default: the shipped assets)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-size", type=int, default=TRAIN_SIZE)
    parser.add_argument("--val-size", type=int, default=VAL_SIZE)
    args = parser.parse_args(argv)
    paths = write_prompt_lists(
        args.out_dir, seed=args.seed, train_size=args.train_size, val_size=args.val_size
    )
    for split, path in paths.items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
