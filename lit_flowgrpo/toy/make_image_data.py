"""Write the shapes world as image data: rendered images for SFT and verifier-labelled preference pairs
for Diffusion-DPO, each a folder with a JSONL index that :class:`lit_flowgrpo.image_data.ImageDataModule`
reads.

``python -m lit_flowgrpo.toy.make_image_data --out runs/shapes_data`` writes

- ``sft.jsonl``: ``{"prompt", "image", ...record}``, a fresh scene of a train record rendered per line
  (the renderer's ground truth: an image that satisfies its prompt);
- ``pairs.jsonl``: ``{"prompt", "chosen", "rejected", ...record}``: the chosen image a rendered scene of
  the record, the rejected one a scene of another train record that the verifier says fails this
  prompt (strict = 0), while the chosen one passes (strict = 1); lines where either check disagrees
  are not written.

Records are drawn from the world's train prompt list (``toy/assets/train.jsonl``) in its order,
repeated as needed; everything is seeded.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from lit_flowgrpo.toy import world
from lit_flowgrpo.toy.verifier import ShapeVerifier

__all__ = ["main", "write_image_data"]


def write_image_data(out_dir: str, count: int = 512, seed: int = 0) -> dict[str, str]:
    """Write ``count`` SFT records and up to ``count`` pairs under ``out_dir``; returns the two index paths."""
    rng = np.random.default_rng(seed)
    records = world.load_prompts("train")
    verifier = ShapeVerifier()
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    sft, pairs = [], []
    for i in range(count):
        record = records[i % len(records)]
        image = world.render(world.sample_scene(record, rng))
        name = f"images/{i:06d}.png"
        Image.fromarray(image).save(os.path.join(out_dir, name))
        sft.append({**record, "image": name})
        other = records[int(rng.integers(len(records)))]
        if other["prompt"] == record["prompt"]:
            continue
        bad = world.render(world.sample_scene(other, rng))
        strict, _ = verifier.score_batch(np.stack([image, bad]), [record, record])
        if not (strict[0] == 1.0 and strict[1] == 0.0):
            continue
        bad_name = f"images/{i:06d}_rejected.png"
        Image.fromarray(bad).save(os.path.join(out_dir, bad_name))
        pairs.append({**record, "chosen": name, "rejected": bad_name})
    paths = {"sft": os.path.join(out_dir, "sft.jsonl"), "pairs": os.path.join(out_dir, "pairs.jsonl")}
    for key, rows in (("sft", sft), ("pairs", pairs)):
        with open(paths[key], "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/shapes_data", help="the folder to write")
    parser.add_argument("--count", type=int, default=512, help="SFT records (and pairs at most)")
    parser.add_argument("--seed", type=int, default=0)
    args: Any = parser.parse_args(argv)
    paths = write_image_data(args.out, args.count, args.seed)
    for key, path in paths.items():
        with open(path, encoding="utf-8") as f:
            print(f"{key}: {sum(1 for _ in f)} records in {path}")


if __name__ == "__main__":
    main()
