"""Build the editing world's shipped train and held-out lists (``toy/assets/edit_{train,val}.jsonl``)
and their source images (``toy/assets/edit_{train,val}/NNNN.png``, 32×32 RGB).

``python -m lit_flowgrpo.toy.edit_prompts`` rewrites them; with the default settings the output is
identical to the shipped files (a test checks the records).

Each split draws its sources from its own seed (none is a pretraining stream's), two edits of
different kinds per source (kinds drawn with :data:`~lit_flowgrpo.toy.edit_world.KIND_WEIGHTS` among
those the source allows), so a group's source recurs under another instruction. A source is kept only
where the verifier reads its clean renders exactly (the target render passes ``strict``, the source
render passes ``preserve`` and fails ``edit``): the shapes world's classifier misreads about one
circle in two thousand at some sizes, and a shipped record must be one the verifier can score.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import numpy as np
from PIL import Image

from lit_flowgrpo.toy import edit_world, world
from lit_flowgrpo.toy.edit_verifier import EditVerifier

SOURCES = {"train": 400, "val": 125}
"""Source scenes per split; two records each (800 training records, 250 held out)."""
EDITS_PER_SOURCE = 2
SPLIT_SEEDS = {"train": 101, "val": 202}
"""Each split's seed (pretraining's streams are seeded [seed, rank, worker] with small seeds)."""


def _readable(records: list[dict[str, Any]], verifier: EditVerifier) -> bool:
    source = world.render(records[0]["source"])
    for record in records:
        target = verifier.verify(world.render(record["target"]), record)
        before = verifier.verify(source, record)
        if not (target["strict"] and before["preserve"] and not before["edit"]):
            return False
    return True


def build_split(split: str, sources: int, seed: int) -> list[tuple[list[dict[str, Any]], np.ndarray]]:
    """``sources`` (records, source image) pairs of ``split``: each source's records and its render."""
    rng = np.random.default_rng([seed, 0xED17])
    verifier = EditVerifier()
    out = []
    while len(out) < sources:
        source = edit_world.sample_source(rng)
        possible = edit_world.possible_edits(source)
        kinds = [k for k in edit_world.EDIT_KINDS if possible[k]]
        if len(kinds) < EDITS_PER_SOURCE:
            continue
        p = np.array([edit_world.KIND_WEIGHTS[k] for k in kinds])
        chosen = rng.choice(len(kinds), size=EDITS_PER_SOURCE, replace=False, p=p / p.sum())
        image = f"edit_{split}/{len(out):04d}.png"
        records = [
            edit_world.make_edit_record(source, edit_world.sample_edit(source, rng, kinds[int(k)]), image)
            for k in chosen
        ]
        if _readable(records, verifier):
            out.append((records, world.render(source)))
    return out


def write_split(folder: str, split: str, sources: int, seed: int) -> str:
    """Write ``edit_<split>.jsonl`` and its PNGs under ``folder``; returns the .jsonl path."""
    built = build_split(split, sources, seed)
    os.makedirs(os.path.join(folder, f"edit_{split}"), exist_ok=True)
    path = os.path.join(folder, f"edit_{split}.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for records, image in built:
            Image.fromarray(image).save(
                os.path.join(folder, records[0]["condition_images"][0]), optimize=True
            )
            for record in records:
                f.write(json.dumps(record) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "assets"))
    parser.add_argument("--train-sources", type=int, default=SOURCES["train"])
    parser.add_argument("--val-sources", type=int, default=SOURCES["val"])
    args = parser.parse_args(argv)
    for split, n in (("train", args.train_sources), ("val", args.val_sources)):
        print(write_split(args.out, split, n, SPLIT_SEEDS[split]))


if __name__ == "__main__":
    main()
