"""Does a toy video base follow the prompt's direction? Strict accuracy and a direction confusion.

For each checkpoint, the held-out (and optionally the training) video prompts × ``--seeds`` seeds
are drawn with the quickstart's evaluation sampler (10 Euler steps, guidance 3, the seeds
``lit_flowgrpo.toy.evaluate.sample_seed`` gives, as ``HeldOutReport`` draws them), scored by the
``shapes_video`` verifier, and each clip's tracked object is classed by where it went (the larger axis
of its first-to-last displacement; ``still`` under 2 px, ``untracked`` with fewer than two tracked
frames)::

    python benchmarks/video_bases.py lit_flowgrpo/toy/assets/toy_video_base.safetensors \\
        --splits val train --out video_base.json

A run's Lightning checkpoint (``.ckpt``) is read too, and every checkpoint after the first gets its
paired gain over the first (the same prompts and noise), e.g. a quickstart run against its base at
the guidance it trained at::

    python benchmarks/video_bases.py lit_flowgrpo/toy/assets/toy_video_base.safetensors \\
        runs/quickstart_video/checkpoints/last.ckpt --guidance 1 --seeds 32

``direction`` is the fraction of clips that went the named way (chance: 0.25). The verifier's own
``moves`` condition asks more (a quarter of the frame side along the direction), so ``direction``
separates "ignores the direction word" from "moves too little".
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lit_flowgrpo.rollout import Sampler
from lit_flowgrpo.toy import ToyVideoPolicy
from lit_flowgrpo.toy.evaluate import sample_seed
from lit_flowgrpo.toy.video_verifier import VideoVerifier

ASSETS = Path(__file__).resolve().parents[1] / "lit_flowgrpo" / "toy" / "assets"


def went(track: list[list[float] | None]) -> str:
    """Where a tracked object went: right / left / up / down, ``still`` or ``untracked``."""
    points = [p for p in track if p is not None]
    if len(points) < 2:
        return "untracked"
    dx, dy = points[-1][0] - points[0][0], points[-1][1] - points[0][1]
    if max(abs(dx), abs(dy)) < 2:
        return "still"
    if abs(dx) >= abs(dy):
        return "right" if dx > 0 else "left"
    return "down" if dy > 0 else "up"  # image rows count down


def load(path: str) -> ToyVideoPolicy:
    """A toy video checkpoint (``.safetensors``), or a training run's Lightning checkpoint (``.ckpt``:
    its ``policy.net`` weights over the shipped base, as a full fine-tune of the quickstart saves them)."""
    if not path.endswith(".ckpt"):
        policy = ToyVideoPolicy(pretrained=path)
        policy.load()
        return policy
    policy = ToyVideoPolicy()
    policy.load()
    state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    net = {k.split("policy.net.", 1)[1]: v for k, v in state.items() if k.startswith("policy.net.")}
    if not net:
        raise ValueError(f"{path} holds no policy.net weights: not a toy video run's checkpoint")
    policy.net.load_state_dict(net)
    return policy


def evaluate(path: str, split: str, seeds: int, device: str, guidance: float = 3.0) -> dict[str, Any]:
    records = [
        json.loads(line) for line in (ASSETS / f"video_{split}.jsonl").read_text().splitlines() if line
    ]
    policy = load(path)
    policy.to(device)
    frames, size = policy.net.config.frames, policy.net.config.sample_size
    sampler = Sampler(
        eval_num_steps=10, guidance_scale=guidance, height=size, width=size, frames=frames, batch_size=256
    )
    rows = [(r, sample_seed(k, i)) for k in range(seeds) for i, r in enumerate(records)]
    with torch.no_grad():
        clips = sampler.evaluate(
            policy,
            [r["prompt"] for r, _ in rows],
            torch.tensor([s for _, s in rows]),
            noise_device="cpu",
            to_cpu=True,
        )
    pixels = (
        (clips.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 1, 3, 4, 2).numpy()
    )  # (B, F, H, W, 3)
    verifier = VideoVerifier()
    found = verifier.frame.detect_batch(pixels.reshape(-1, *pixels.shape[2:]))
    strict, right = [], []
    confusion: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for b, (record, _) in enumerate(rows):
        result = verifier.check(found[b * frames : (b + 1) * frames], record, size, size)
        want, got = record["include"][0]["motion"], went(result["track"])
        strict.append(float(result["strict"]))
        right.append(got == want)
        confusion[want][got] += 1
    return {
        "clips": len(rows),
        "guidance": guidance,
        "strict": float(np.mean(strict)),
        "strict_by_clip": strict,
        "direction": float(np.mean(right)),
        "confusion": {k: dict(v) for k, v in sorted(confusion.items())},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+")
    p.add_argument("--splits", nargs="+", choices=["val", "train"], default=["val"])
    p.add_argument("--seeds", type=int, default=8, help="seeds per prompt (8: 128 held-out clips)")
    p.add_argument("--guidance", type=float, default=3.0, help="CFG of the evaluation sampler")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {}
    for path in args.checkpoints:
        results[path] = {
            split: evaluate(path, split, args.seeds, device, args.guidance) for split in args.splits
        }
        line = {
            s: f"strict {r['strict']:.3f} direction {r['direction']:.3f}" for s, r in results[path].items()
        }
        print(path, line, flush=True)
    first = args.checkpoints[0]
    for path in args.checkpoints[1:]:  # each against the first, clip by clip (the same prompts and noise)
        for split in args.splits:
            diff = np.subtract(
                results[path][split]["strict_by_clip"], results[first][split]["strict_by_clip"]
            )
            se = float(diff.std(ddof=1) / np.sqrt(len(diff)))
            results[path][split]["gain_vs_first"] = {"mean": float(diff.mean()), "se": se}
            print(f"{path} - {first} ({split}): {diff.mean():+.3f} ± {se:.3f} ({len(diff)} paired clips)")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
