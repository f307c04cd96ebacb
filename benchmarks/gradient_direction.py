"""Does the on-policy Flow-GRPO gradient raise the reward? A step along it, measured with paired noise.

A training curve mixes the gradient's direction with the optimizer, the step size and the sampling
noise of each rollout. This separates the first: on one large rollout of the shapes world (image or
video toy model, the quickstart's sampler), it takes the Flow-GRPO policy gradient at ratio 1,
``g = −Σ A_i Σ_j ∇ log p(x_{j+1} | x_j) / (N·S)`` with group-normalised advantages, then moves the
weights to ``θ + α·d`` for a few ``α`` and scores fresh samples drawn with the same prompts and seeds
at every ``α`` (common random numbers), both by the rollout's own SDE sampler and by the ODE of
validation. ``d`` is Adam's first step, ``−scale·sign(g)`` (``--mode sign``: what one optimizer step of
the quickstart does), or ``−g`` rescaled to the same length (``--mode grad``). Each ``α`` prints the
paired difference from ``α = 0`` and its standard error::

    python benchmarks/gradient_direction.py --world video --guidance 3 --device cuda --out g3.json
    python benchmarks/gradient_direction.py --world video --guidance 1 --device cuda --out g1.json

A gradient that carries the reward's signal raises both rewards for small ``α > 0`` and lowers them
for ``α < 0``; curvature lowers both sides alike. The README ("The shapes world in video") has what
this found on the video world: the signal at guidance 1, none at 3.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lit_flowgrpo.rewards.images import to_numpy_hwc
from lit_flowgrpo.rollout import Sampler
from lit_flowgrpo.toy import ToyPolicy, ToyVideoPolicy
from lit_flowgrpo.toy.reward import ShapesReward, ShapesVideoReward

ASSETS = Path(__file__).resolve().parents[1] / "lit_flowgrpo" / "toy" / "assets"
_VERIFIER: Any = None  # the reward's verifier, read by the scoring workers (forked after it is set)


def _verify(chunk: tuple[np.ndarray, list[dict]]) -> tuple[np.ndarray, np.ndarray]:
    return _VERIFIER.score_batch(*chunk)


class World:
    """The policy, reward and sampler of one shapes world, and its scoring of samples."""

    def __init__(self, opts: argparse.Namespace) -> None:
        global _VERIFIER
        self.video = opts.world == "video"
        path = ASSETS / ("video_train.jsonl" if self.video else "train.jsonl")
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if not self.video:  # the image world has hundreds of training prompts: a fixed draw of them
            random.Random(0).shuffle(records)
        self.records = records[: opts.prompts]
        self.policy = ToyVideoPolicy() if self.video else ToyPolicy()
        self.policy.load()
        self.policy.to(opts.device)
        _VERIFIER = (ShapesVideoReward() if self.video else ShapesReward()).verifier
        size = 16 if self.video else 32
        self.sampler = Sampler(
            num_steps=10,
            eval_num_steps=10,
            noise_level=opts.noise_level,
            guidance_scale=opts.guidance,
            eval_guidance_scale=opts.eval_guidance,
            sde_window_size=opts.window_size or None,
            sde_window_range=tuple(opts.window) if opts.window_size else None,
            height=size,
            width=size,
            frames=6 if self.video else 1,
            batch_size=None if opts.device != "cpu" else 128,
        )
        self.reward = opts.reward
        context = multiprocessing.get_context("fork")  # the workers read _VERIFIER as set above
        self.pool = ProcessPoolExecutor(opts.workers, mp_context=context) if opts.workers else None

    def score(self, samples: torch.Tensor, records: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """(reward, strict) per sample: the quickstart's strict + 0.5·partial, strict alone, or the
        mean brightness (a dense control)."""
        samples = samples.detach().float().cpu()
        pixels = to_numpy_hwc(samples.flatten(0, 1) if self.video else samples)
        if self.video:
            pixels = pixels.reshape(*samples.shape[:2], *pixels.shape[1:])
        chunks = [(pixels[i : i + 64], records[i : i + 64]) for i in range(0, len(records), 64)]
        parts = list(self.pool.map(_verify, chunks)) if self.pool else [_verify(c) for c in chunks]
        strict = torch.from_numpy(np.concatenate([p[0] for p in parts])).float()
        partial = torch.from_numpy(np.concatenate([p[1] for p in parts])).float()
        if self.reward == "brightness":
            return samples.flatten(1).mean(1), strict
        return strict + (0.5 * partial if self.reward == "sum" else 0.0), strict


def policy_gradient(world: World, opts: argparse.Namespace) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The on-policy Flow-GRPO gradient of the denoiser's weights from one rollout of
    ``prompts × group`` samples, and what the rollout scored."""
    policy, group = world.policy, opts.group
    records = [r for r in world.records for _ in range(group)]
    embeds = policy.encode_prompts([r["prompt"] for r in records])
    seeds = torch.arange(len(records)) + 10_000
    shared = (torch.arange(len(records)) // group + 777) if opts.shared_start else None
    traj, samples = world.sampler.rollout(policy, embeds, seeds, step=0, seed=0, initial_seeds=shared)
    reward, strict = world.score(samples, records)
    grouped = reward.view(-1, group)
    adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
    adv = adv.flatten().to(opts.device)
    net = policy.transformer
    params = list(net.parameters())
    for p in params:
        p.grad = None
    n, steps = len(records), traj.num_trained
    net.train()
    for j in range(steps):
        for start in range(0, n, 256):
            idx = torch.arange(start, min(start + 256, n), device=opts.device)
            sigma = torch.full((len(idx),), float(traj.sigmas[j]), device=opts.device)
            rows = {k: v[idx] for k, v in embeds.items()}
            velocity = policy.velocity(traj.latents[idx, j].float(), sigma, rows, opts.guidance)
            loss = -(adv[idx] * traj.score(velocity, j, idx).log_prob).sum() / (n * steps)
            loss.backward()
    net.eval()
    grads = [p.grad.detach().clone() for p in params]
    for p in params:
        p.grad = None
    stats = {
        "samples": n,
        "trained_steps": traj.step_indices.tolist(),
        "reward": float(reward.mean()),
        "strict": float(strict.mean()),
        "groups_with_zero_std": float((grouped.std(1) == 0).float().mean()),
        "grad_norm": float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads))),
    }
    return grads, stats


def step_direction(grads: list[torch.Tensor], mode: str, scale: float) -> list[torch.Tensor]:
    """Adam's first step (``scale`` per weight, against the sign of the loss gradient), or the
    negative gradient rescaled to that step's length."""
    if mode == "sign":
        return [-scale * torch.sign(g) for g in grads]
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    numel = sum(g.numel() for g in grads)
    return [-g / norm.to(g.dtype) * scale * numel**0.5 for g in grads]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", choices=["video", "image"], default="video")
    p.add_argument("--guidance", type=float, default=3.0, help="CFG of rollout, gradient and evaluation")
    p.add_argument("--eval_guidance", type=float, help="CFG of the ODE evaluation (default: --guidance)")
    p.add_argument("--noise_level", type=float, default=0.7)
    p.add_argument("--window", type=int, nargs=2, default=[0, 8], help="the SDE window's range")
    p.add_argument("--window_size", type=int, default=5, help="0: every step but the last trained")
    p.add_argument("--reward", choices=["sum", "strict", "brightness"], default="sum")
    p.add_argument("--prompts", type=int, default=32, help="training prompts (the video world has 32)")
    p.add_argument("--group", type=int, default=32, help="samples per prompt in the gradient's rollout")
    p.add_argument("--eval_seeds", type=int, default=32, help="samples per prompt at each α")
    p.add_argument("--shared_start", action="store_true", help="a group shares its initial noise")
    p.add_argument("--mode", choices=["sign", "grad"], default="sign")
    p.add_argument("--scale", type=float, default=5e-5, help="the step per weight (the config's lr)")
    p.add_argument("--alphas", type=float, nargs="+", default=[-4.0, -2.0, 0.0, 2.0, 4.0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--workers", type=int, default=2, help="processes that run the verifier (0: none)")
    p.add_argument("--out", type=Path, help="write the settings and results as JSON")
    opts = p.parse_args()
    torch.manual_seed(0)
    world = World(opts)
    grads, stats = policy_gradient(world, opts)
    print(json.dumps({"gradient_rollout": stats}), flush=True)
    direction = step_direction(grads, opts.mode, opts.scale)
    params = list(world.policy.transformer.parameters())
    base = [q.detach().clone() for q in params]
    records = [r for r in world.records for _ in range(opts.eval_seeds)]
    prompts = [r["prompt"] for r in records]
    embeds = world.policy.encode_prompts(prompts)
    seeds = torch.arange(len(records)) + 50_000
    scored = {}
    for alpha in sorted(set(opts.alphas) | {0.0}):
        with torch.no_grad():
            for q, b, d in zip(params, base, direction, strict=True):
                q.copy_(b + alpha * d)
        _, sde = world.sampler.rollout(world.policy, embeds, seeds, step=0, seed=0)
        ode = world.sampler.evaluate(world.policy, prompts, seeds)
        scored[alpha] = (*world.score(sde, records), *world.score(ode, records))
    with torch.no_grad():
        for q, b in zip(params, base, strict=True):
            q.copy_(b)
    names = ("sde_reward", "sde_strict", "ode_reward", "ode_strict")
    rows = []
    for alpha, values in scored.items():
        row: dict[str, Any] = {"alpha": alpha}
        for name, v, v0 in zip(names, values, scored[0.0], strict=True):
            diff = (v - v0).double()
            row[name] = float(v.mean())
            row[name + "_diff"] = float(diff.mean())
            row[name + "_diff_se"] = float(diff.std() / len(diff) ** 0.5) if len(diff) > 1 else 0.0
        rows.append(row)
        print(
            f"alpha {alpha:+.2f}: SDE reward {row['sde_reward']:.4f} "
            f"({row['sde_reward_diff']:+.4f} ± {row['sde_reward_diff_se']:.4f}), ODE reward "
            f"{row['ode_reward']:.4f} ({row['ode_reward_diff']:+.4f} ± {row['ode_reward_diff_se']:.4f})",
            flush=True,
        )
    if opts.out:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()}
        opts.out.write_text(
            json.dumps({"settings": settings, "gradient_rollout": stats, "steps": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
