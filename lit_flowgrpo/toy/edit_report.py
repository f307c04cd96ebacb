"""How well a toy editing model edits: held-out accuracy by edit kind, and a source | base | tuned picture.

    python -m lit_flowgrpo.toy.edit_report --checkpoint CKPT [CKPT ...] --num-seeds 2 --num-steps 10

prints, per checkpoint, ``strict`` / ``edit`` / ``preserve`` on the shipped held-out list (250 editing
records × the seeds) overall and by edit kind, as one JSON line each. It samples as the quickstart's
validation does (the deterministic Euler ODE, CPU-drawn noise per (record, seed)), so it calibrates
the pretraining (the base must leave room to learn) and compares runs without a fit.

    python -m lit_flowgrpo.toy.edit_report --curves RUN/metrics.csv [RUN/metrics.csv ...] --out curves.png

draws the hacking view instead: per rollout, the training samples' ``edit`` (the proxy) against
``preserve`` and ``strict`` (gold), one panel per run (drawn with PIL: matplotlib is an optional extra).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lit_flowgrpo.conditioning import ConditionImages, resolve_condition_paths
from lit_flowgrpo.rollout import Sampler
from lit_flowgrpo.toy.edit_policy import ToyEditPolicy
from lit_flowgrpo.toy.edit_reward import ShapesEditReward
from lit_flowgrpo.toy.edit_world import edit_prompt_file, load_edit_records
from lit_flowgrpo.toy.evaluate import sample_seed

COMPONENTS = ("strict", "edit", "preserve", "partial")


def held_out_records() -> list[dict[str, Any]]:
    """The shipped held-out editing records, their source paths made absolute."""
    records = load_edit_records("val")
    resolve_condition_paths(records, edit_prompt_file("val"), "--records")
    return records


def evaluate_edits(
    policy: ToyEditPolicy,
    records: Sequence[Mapping[str, Any]],
    seeds: Sequence[int],
    *,
    num_steps: int = 10,
    guidance: float = 1.0,
    batch_size: int = 256,
) -> dict[str, Any]:
    """``{"strict", "edit", "preserve", "partial", "n", "by_kind": {tag: {...}}}`` of a loaded policy on
    ``records`` × ``seeds`` samples (records with absolute ``condition_images``)."""
    rows = [(r, sample_seed(s, i)) for s in seeds for i, r in enumerate(records)]
    store = ConditionImages()
    sampler = Sampler(
        eval_num_steps=num_steps, guidance_scale=guidance, height=32, width=32, batch_size=batch_size
    )
    conditions = store.conditions([r for r, _ in rows])
    images = sampler.evaluate(
        policy,
        [r["prompt"] for r, _ in rows],
        torch.tensor([s for _, s in rows], dtype=torch.int64),
        noise_device="cpu",
        to_cpu=True,
        conditions=conditions,
    )
    scores = ShapesEditReward()(images, [r["prompt"] for r, _ in rows], [dict(r) for r, _ in rows])
    tags = np.array([r["tag"] for r, _ in rows])
    out: dict[str, Any] = {k: float(scores[k].mean()) for k in COMPONENTS} | {"n": len(rows)}
    out["by_kind"] = {
        tag: {k: float(scores[k][torch.from_numpy(tags == tag)].mean()) for k in COMPONENTS}
        for tag in dict.fromkeys(tags.tolist())
    }
    return out


CURVES = {"edit": (240, 170, 40), "preserve": (80, 160, 250), "strict": (60, 200, 90)}
"""The components the hacking view draws, and their colours."""


def read_curves(metrics_csv: str) -> dict[str, list[tuple[int, float]]]:
    """``{component: [(rollout, training mean), ...]}`` of :data:`CURVES` from a run's ``metrics.csv``."""
    import csv

    out: dict[str, list[tuple[int, float]]] = {k: [] for k in CURVES}
    with open(metrics_csv, encoding="utf-8") as f:
        for row in csv.DictReader(f):
            for k in CURVES:
                value = row.get(f"critic/rewards/shapes_edit/{k}/mean")
                if value:
                    out[k].append((int(row["step"]), float(value)))
    return out


def curves_picture(runs: Sequence[str], labels: Sequence[str] | None = None) -> Any:
    """One panel per run's ``metrics.csv``: per rollout, ``edit`` against ``preserve`` and ``strict`` of the
    rollout's own samples, in [0, 1]."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    w, h, pad = 360, 220, 36
    canvas = Image.new("RGB", (len(runs) * (w + pad) + pad, h + 2 * pad + 16), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for i, run in enumerate(runs):
        curves = read_curves(run)
        last = max((s for points in curves.values() for s, _ in points), default=1) or 1
        x0, y0 = pad + i * (w + pad), pad
        draw.rectangle([x0, y0, x0 + w, y0 + h], outline=(0, 0, 0))
        for v in (0.0, 0.5, 1.0):
            y = y0 + h - v * h
            draw.line([x0, y, x0 + w, y], fill=(225, 225, 225))
            draw.text((x0 - 24, y - 5), f"{v:.1f}", fill=(0, 0, 0), font=font)
        draw.text((x0, y0 - 16), labels[i] if labels else run, fill=(0, 0, 0), font=font)
        draw.text((x0 + w - 60, y0 + h + 4), f"rollout {last}", fill=(0, 0, 0), font=font)
        for k, points in curves.items():
            xy = [(x0 + s / last * w, y0 + h - v * h) for s, v in points]
            if len(xy) > 1:
                draw.line(xy, fill=CURVES[k], width=2)
    x = pad
    draw.text((x, h + 2 * pad), "training samples per rollout:", fill=(0, 0, 0), font=font)
    x += 180
    for k, colour in CURVES.items():
        draw.line([x, h + 2 * pad + 6, x + 16, h + 2 * pad + 6], fill=colour, width=2)
        draw.text((x + 20, h + 2 * pad), k, fill=(0, 0, 0), font=font)
        x += 90
    return canvas


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--checkpoint", nargs="+", default=[None], help="toy editing checkpoints (default: shipped)"
    )
    parser.add_argument("--num-seeds", type=int, default=2)
    parser.add_argument("--num-steps", type=int, default=10)
    parser.add_argument("--guidance", type=float, nargs="+", default=[1.0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--curves", nargs="+", help="metrics.csv files: draw the hacking view instead")
    parser.add_argument("--labels", nargs="+", help="a panel title per --curves file")
    parser.add_argument("--out", default="edit_curves.png", help="where --curves writes its picture")
    args = parser.parse_args(argv)
    if args.curves:
        curves_picture(args.curves, args.labels).save(args.out)
        print(args.out)
        return
    records = held_out_records()
    for checkpoint in args.checkpoint:
        policy = ToyEditPolicy(pretrained=checkpoint)
        policy.load()
        policy.to(args.device)
        for guidance in args.guidance:
            start = time.perf_counter()
            result = evaluate_edits(
                policy, records, list(range(args.num_seeds)), num_steps=args.num_steps, guidance=guidance
            )
            result |= {"checkpoint": checkpoint or "shipped", "guidance": guidance}
            result["seconds"] = round(time.perf_counter() - start, 1)
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
