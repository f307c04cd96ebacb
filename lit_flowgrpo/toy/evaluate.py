"""Accuracy of a toy model on a prompt list: deterministic Euler sampling scored by the ``shapes`` reward.

    python -m lit_flowgrpo.toy.evaluate --split val --num-seeds 8 --num-steps 16 --guidance 4

prints strict / partial accuracy overall and by family (GenEval's tags). Used to calibrate the
pretraining (the base should leave room to learn) and to compare a fine-tuned model with it.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lit_flowgrpo.policies.base import FlowPolicy
from lit_flowgrpo.rewards.base import build_reward
from lit_flowgrpo.rollout import Sampler


def sample_seed(seed: int, index: int) -> int:
    """The initial-noise seed of prompt ``index`` under evaluation seed ``seed`` (well mixed)."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


def sample_images(
    policy: FlowPolicy,
    prompts: Sequence[str],
    noise_seeds: Sequence[int],
    *,
    num_steps: int,
    guidance_scale: float,
    height: int = 32,
    width: int = 32,
    batch_size: int = 256,
) -> Tensor:
    """Images (N, 3, H, W) in [0, 1] on the CPU, sampled with the deterministic Euler ODE.

    The training run's own validation sampler; row i starts from the CPU-drawn noise of
    ``noise_seeds[i]``, so results do not depend on the batch size or the device.
    """
    if len(prompts) != len(noise_seeds):
        raise ValueError(
            f"{len(prompts)} prompts but {len(noise_seeds)} noise seeds: give one seed per prompt"
        )
    sampler = Sampler(
        eval_num_steps=num_steps,
        guidance_scale=guidance_scale,
        height=height,
        width=width,
        batch_size=batch_size,
    )
    seeds = torch.tensor(list(noise_seeds), dtype=torch.int64)
    return sampler.evaluate(policy, list(prompts), seeds, noise_device="cpu", to_cpu=True)


def evaluate_base(
    policy: FlowPolicy,
    records: Sequence[Mapping[str, Any]],
    seeds: Sequence[int],
    num_steps: int,
    guidance: float,
    *,
    batch_size: int = 256,
) -> dict[str, Any]:
    """Strict and partial accuracy of ``policy`` on ``records`` × ``seeds`` samples.

    Args:
        policy: a loaded policy (on any device).
        records: GenEval-style toy records (``prompt``, ``tag``, ``include``, ``exclude``).
        seeds: evaluation seeds; each record is sampled once per seed.
        num_steps: Euler steps.
        guidance: classifier-free guidance scale.
        batch_size: samples per forward.

    Returns:
        ``{"strict", "partial", "n", "by_family": {tag: {"strict", "partial", "n"}}}``; the
        standard error of strict accuracy is ``sqrt(p(1-p)/n)``.
    """
    if not records or not seeds:
        raise ValueError("evaluate_base needs at least one record and one seed")
    rows = [(r, sample_seed(s, i)) for s in seeds for i, r in enumerate(records)]
    prompts = [r["prompt"] for r, _ in rows]
    images = sample_images(
        policy,
        prompts,
        [s for _, s in rows],
        num_steps=num_steps,
        guidance_scale=guidance,
        batch_size=batch_size,
    )
    reward = build_reward("shapes")
    metadata = [dict(r) for r, _ in rows]
    strict, partial = [], []
    for start in range(0, len(rows), 256):
        scores = reward(
            images[start : start + 256], prompts[start : start + 256], metadata[start : start + 256]
        )
        strict.append(torch.as_tensor(scores["strict"], dtype=torch.float32))
        partial.append(torch.as_tensor(scores["partial"], dtype=torch.float32))
    strict_t, partial_t = torch.cat(strict), torch.cat(partial)
    tags = np.array([r["tag"] for r, _ in rows])
    by_family = {}
    for tag in dict.fromkeys(tags.tolist()):
        mask = torch.from_numpy(tags == tag)
        by_family[tag] = {
            "strict": strict_t[mask].mean().item(),
            "partial": partial_t[mask].mean().item(),
            "n": int(mask.sum()),
        }
    return {
        "strict": strict_t.mean().item(),
        "partial": partial_t.mean().item(),
        "n": len(rows),
        "by_family": by_family,
    }


def format_result(result: Mapping[str, Any]) -> str:
    lines = [
        f"all            strict {result['strict']:.3f}  partial {result['partial']:.3f}  n {result['n']}"
    ]
    for tag, r in sorted(result["by_family"].items()):
        lines.append(f"{tag:<14} strict {r['strict']:.3f}  partial {r['partial']:.3f}  n {r['n']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    from lit_flowgrpo.toy import world
    from lit_flowgrpo.toy.policy import ToyPolicy

    parser = argparse.ArgumentParser(prog="python -m lit_flowgrpo.toy.evaluate", description=__doc__)
    parser.add_argument("--checkpoint", default=None, help="toy checkpoint (default: the shipped one)")
    parser.add_argument("--split", default="val", choices=("train", "val"))
    parser.add_argument("--num-seeds", type=int, default=8, help="samples per prompt")
    parser.add_argument(
        "--num-steps", type=int, nargs="+", default=[16], help="Euler steps (several: a sweep)"
    )
    parser.add_argument(
        "--guidance", type=float, nargs="+", default=[4.0], help="CFG scale (several: a sweep)"
    )
    parser.add_argument("--shift", type=float, default=1.0, help="timestep shift of the schedule")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    opts = parser.parse_args(argv)

    policy = ToyPolicy(opts.checkpoint, shift=opts.shift)
    policy.load()
    policy.to(opts.device)
    records = world.load_prompts(opts.split)
    results = []
    for steps in opts.num_steps:
        for guidance in opts.guidance:
            start = time.perf_counter()
            result = evaluate_base(
                policy, records, list(range(opts.num_seeds)), steps, guidance, batch_size=opts.batch_size
            )
            seconds = time.perf_counter() - start
            result.update(
                num_steps=steps, guidance=guidance, shift=opts.shift, split=opts.split, seconds=seconds
            )
            results.append(result)
            print(
                f"== {opts.split}: {steps} steps, guidance {guidance}, shift {opts.shift} ({seconds:.1f} s)"
            )
            print(format_result(result), flush=True)
    if opts.json:
        with open(opts.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
