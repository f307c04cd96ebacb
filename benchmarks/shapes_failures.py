"""Why a toy base fails colour binding and position: each failure split by the condition it misses,
beside what chance would give.

    python benchmarks/shapes_failures.py --seeds 8 --json benchmarks/results/shapes_failures_cpu.json

Samples the held-out ``color_attr`` and ``position`` prompts (``--seeds`` samples each, the main job's
CFG-free 10-step ODE, the evaluation's noise seeds) and reads the verifier's conditions of every sample:
both shapes drawn (the ``count`` conditions), then both colours right, the named pair of colours
drawn the other way round, or another colour; for position, then the relation. Chance for the binding
is 1/2 (two colours, two shapes); chance for a relation is measured: the renderer's placement of the
same two objects with no relation asked, judged by the verifier's rule (``--chance_scenes`` scenes).
A family at chance given the rest is one whose words the model does not use.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from lit_flowgrpo.toy import world
from lit_flowgrpo.toy.evaluate import sample_images, sample_seed
from lit_flowgrpo.toy.policy import ToyPolicy
from lit_flowgrpo.toy.verifier import ShapeVerifier


def _met(result: dict, prefix: str) -> bool:
    return all(c["met"] for c in result["conditions"] if c["name"].startswith(prefix))


def classify(image: np.ndarray, record: dict, verifier: ShapeVerifier) -> list[str]:
    """The counters one (H, W, 3) uint8 sample of a two-object record adds to: ``samples`` and
    ``strict``, then ``shapes_right`` where both shapes are drawn, and then one of ``colours_right``
    (with ``relation_right`` for a position prompt whose relation holds), ``colours_swapped`` (the
    named pair of colours on the wrong shapes) or ``colours_other``."""
    found = verifier.detect(image)
    result = verifier.check(found, record)
    out = ["samples"] + (["strict"] if result["strict"] else [])
    if not _met(result, "count:"):
        return out
    out.append("shapes_right")
    if _met(result, "color:"):
        out.append("colours_right")
        if record["tag"] == "position" and _met(result, "position:"):
            out.append("relation_right")
    elif {o.color for o in found.objects} == {e["color"] for e in record["include"]}:
        out.append("colours_swapped")
    else:
        out.append("colours_other")
    return out


def split_failures(policy: ToyPolicy, seeds: int, verifier: ShapeVerifier) -> dict[str, dict[str, int]]:
    records = [r for r in world.load_prompts("val") if r["tag"] in ("color_attr", "position")]
    rows = [(r, sample_seed(s, i)) for s in range(seeds) for i, r in enumerate(records)]
    images = sample_images(
        policy, [r["prompt"] for r, _ in rows], [s for _, s in rows], num_steps=10, guidance_scale=1.0
    )
    pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    out: dict[str, Counter] = {}
    for (record, _), image in zip(rows, pixels, strict=True):
        out.setdefault(record["tag"], Counter()).update(classify(image, record, verifier))
    return {tag: dict(c) for tag, c in out.items()}


def relation_chance(scenes: int, verifier: ShapeVerifier) -> dict[str, float]:
    """P(the asked relation holds) when the two objects are placed as two unrelated objects are."""
    rng = np.random.default_rng(0)
    records = [r for r in world.load_prompts("val") if r["tag"] == "position"]
    hits: Counter = Counter()
    n: Counter = Counter()
    for k in range(scenes):
        record = records[k % len(records)]
        free = [{key: v for key, v in e.items() if key != "position"} for e in record["include"]]
        image = world.render(world.sample_scene({**record, "include": free}, rng))
        relation = record["include"][1]["position"][0]
        n[relation] += 1
        hits[relation] += _met(verifier.check(verifier.detect(image), record), "position:")
    return {rel: hits[rel] / n[rel] for rel in n} | {"all": sum(hits.values()) / sum(n.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="toy checkpoint (default: the shipped base)")
    p.add_argument("--seeds", type=int, default=8, help="samples per held-out prompt")
    p.add_argument("--chance_scenes", type=int, default=2000)
    p.add_argument("--json", type=Path)
    opts = p.parse_args()
    policy = ToyPolicy(opts.checkpoint)
    policy.load()
    verifier = ShapeVerifier()
    families = split_failures(policy, opts.seeds, verifier)
    chance = relation_chance(opts.chance_scenes, verifier)
    for tag, c in families.items():
        bound = c.get("colours_right", 0) / max(1, c.get("colours_right", 0) + c.get("colours_swapped", 0))
        line = (
            f"{tag}: {c['samples']} samples, strict {c['strict'] / c['samples']:.3f}; shapes right "
            f"{c.get('shapes_right', 0)}; of those colours right {c.get('colours_right', 0)}, the named pair "
            f"swapped {c.get('colours_swapped', 0)}, another colour {c.get('colours_other', 0)}; bound right "
            f"given the named pair {bound:.2f} (chance 0.50)"
        )
        if tag == "position":
            rel = c.get("relation_right", 0) / max(1, c.get("colours_right", 0))
            line += f"; relation right given shapes and colours {rel:.2f} (chance {chance['all']:.3f})"
        print(line)
    print("relation by chance: " + ", ".join(f"{k} {v:.3f}" for k, v in chance.items()))
    if opts.json:
        opts.json.write_text(
            json.dumps(
                {"command": "python benchmarks/shapes_failures.py " + " ".join(
                    f"--{k} {v}" for k, v in vars(opts).items() if v is not None and k != "json"),
                 "checkpoint": opts.checkpoint or "shipped", "families": families,
                 "relation_chance": chance},
                indent=1,
            )
        )  # fmt: skip


if __name__ == "__main__":
    main()
