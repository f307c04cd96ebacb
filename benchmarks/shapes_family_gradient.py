"""Does the on-policy gradient of one prompt family raise that family? A step along it, on paired noise.

RL on the 1000-step base shipped from 2026-11-28 to 2026-12-01 raised counting, two objects, colours and
single objects, and left colour binding (``color_attr``) and position where they were
(docs/shapes_world.md); the figures below were taken on that base. This asks whether the
policy gradient carries a first-order signal for a family at all: it takes the Flow-GRPO gradient of
``benchmarks/gradient_direction.py`` (``policy_gradient``: one rollout, group-normalised advantages,
ratio 1) from the family's own training prompts only, moves the weights by ``α`` times Adam's first
step along it (``step_direction``; ``--mode grad``: the gradient itself, rescaled to that step's
length), and scores fresh ODE samples at every ``α`` with the same prompts and noise (common random
numbers): the family's training prompts with new seeds, and its held-out prompts.
Each ``α`` prints the paired difference from ``α = 0`` and its standard error::

    python benchmarks/shapes_family_gradient.py --family position --out position.json

A family the gradient can teach should rise at small ``α > 0``, one that the model cannot express stay
within its standard error; a control family that RL does raise (counting) says whether the step is
small enough for that reading (docs/shapes_world.md: at 2 to 4 sign steps it was not). The sampler is the main job's (10 steps, CFG-free, noise 0.7), the
trained steps Flow-GRPO-Fast's window (5 of the first 8), the reward strict + 0.5·partial.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gradient_direction as gd  # the benchmarks folder is not a package

from lit_flowgrpo.toy import world as toy_world


def _family(split: str, family: str) -> list[dict[str, Any]]:
    return [r for r in toy_world.load_prompts(split) if r["tag"] == family]


def _scored(world: gd.World, records: list[dict], seeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    samples = world.sampler.evaluate(world.policy, [r["prompt"] for r in records], seeds)
    return world.score(samples, records)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", required=True, choices=toy_world.FAMILIES)
    p.add_argument("--prompts", type=int, default=32, help="training prompts of the family in the rollout")
    p.add_argument("--group", type=int, default=8, help="samples per prompt in the gradient's rollout")
    p.add_argument("--eval_seeds", type=int, default=8, help="new samples per training prompt at each α")
    p.add_argument("--val_seeds", type=int, default=4, help="samples per held-out prompt at each α")
    p.add_argument("--guidance", type=float, default=1.0)
    p.add_argument("--scale", type=float, default=3e-5, help="the step per weight (the main job's lr)")
    p.add_argument("--alphas", type=float, nargs="+", default=[-2.0, 0.0, 2.0, 4.0])
    p.add_argument("--mode", choices=["sign", "grad"], default="sign", help="as gradient_direction.py's")
    p.add_argument("--device", default="cpu")
    p.add_argument("--workers", type=int, default=0, help="processes that run the verifier (0: none)")
    p.add_argument("--out", type=Path)
    opts = p.parse_args()
    # gradient_direction's World and policy_gradient read these settings: the main job's sampler
    settings = argparse.Namespace(
        world="image", guidance=opts.guidance, eval_guidance=None, noise_level=0.7, window=[0, 8],
        window_size=5, reward="sum", prompts=opts.prompts, group=opts.group, shared_start=False,
        device=opts.device, workers=opts.workers,
    )  # fmt: skip
    torch.manual_seed(0)
    world = gd.World(settings)
    train = _family("train", opts.family)
    random.Random(0).shuffle(train)
    world.records = train[: opts.prompts]
    grads, stats = gd.policy_gradient(world, settings)
    print(json.dumps({"family": opts.family, "gradient_rollout": stats}), flush=True)
    direction = gd.step_direction(grads, opts.mode, opts.scale)
    params = list(world.policy.transformer.parameters())
    base = [q.detach().clone() for q in params]
    sets = {
        "train_prompts": [r for r in world.records for _ in range(opts.eval_seeds)],
        "held_out_prompts": [r for r in _family("val", opts.family) for _ in range(opts.val_seeds)],
    }
    seeds = {name: torch.arange(len(rs)) + 50_000 + 100_000 * i for i, (name, rs) in enumerate(sets.items())}
    scored: dict[float, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for alpha in sorted(set(opts.alphas) | {0.0}):
        with torch.no_grad():
            for q, b, d in zip(params, base, direction, strict=True):
                q.copy_(b + alpha * d)
        scored[alpha] = {name: _scored(world, rs, seeds[name]) for name, rs in sets.items()}
    with torch.no_grad():
        for q, b in zip(params, base, strict=True):
            q.copy_(b)
    rows = []
    for alpha, by_set in scored.items():
        row: dict[str, Any] = {"alpha": alpha}
        for name, (reward, strict) in by_set.items():
            for metric, v in (("reward", reward), ("strict", strict)):
                diff = (v - scored[0.0][name][metric == "strict"]).double()
                row[f"{name}/{metric}"] = float(v.mean())
                row[f"{name}/{metric}_diff"] = float(diff.mean())
                row[f"{name}/{metric}_diff_se"] = float(diff.std() / len(diff) ** 0.5)
        rows.append(row)
        print(
            f"{opts.family} alpha {alpha:+.1f}: "
            + "; ".join(
                f"{name} strict {row[f'{name}/strict']:.3f} ({row[f'{name}/strict_diff']:+.3f} ± "
                f"{row[f'{name}/strict_diff_se']:.3f}), reward {row[f'{name}/reward_diff']:+.4f} ± "
                f"{row[f'{name}/reward_diff_se']:.4f}"
                for name in sets
            ),
            flush=True,
        )
    if opts.out:
        opts.out.write_text(
            json.dumps(
                {"settings": {k: str(v) for k, v in vars(opts).items()}, "gradient_rollout": stats,
                 "samples": {k: len(v) for k, v in sets.items()}, "steps": rows},
                indent=1,
            )
        )  # fmt: skip


if __name__ == "__main__":
    main()
