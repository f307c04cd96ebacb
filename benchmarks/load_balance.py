"""What balancing the update's work across ranks would save, by simulation of the sampler's dealing.

With ``--model.init_args.advantage.filter_zero`` on, the samples of saturated groups (every reward equal, so
every advantage exactly 0) are dropped before the update. ``GroupSampler`` deals the M·K shuffled
samples of a step evenly to the R ranks, so after the drop the ranks hold different numbers of
samples (logged as ``global_load/*``). Every rank must run the same number of micro-batch passes
(DDP all-reduces inside each backward; FSDP2 gathers inside each forward), so all of them run as
many as the most loaded one needs, padding the rest:

    passes now      = ceil(max_r kept_r / micro_batch)
    passes balanced = ceil(sum_r kept_r / (R * micro_batch))   (moving kept samples between ranks)

``--model.init_args.update.balance_load`` gets the second. This script draws the saturated groups
(each with probability ``z``, the run's ``critic/rewards/zero_std_ratio``) and the dealing many
times and prints the expected passes both ways: the share of the update that balancing saves. Without ``filter_zero`` every rank keeps
its M·K/R samples and there is nothing to balance.

    python benchmarks/load_balance.py                      # the shipped recipes' batch shapes
    python benchmarks/load_balance.py --shape 4 8 2 8      # M K R micro_batch
"""

from __future__ import annotations

import argparse
import math

import numpy as np

#: (name, M prompts per step, K group size, R ranks, update micro-batch) of the shipped recipes.
RECIPES = [
    ("sd35m geneval/ocr/pickscore (8 GPUs)", 48, 24, 8, 9),
    ("sd35m pickscore fast (8 GPUs)", 64, 18, 8, 9),
    ("flux pickscore (8 GPUs)", 48, 24, 8, 3),
    ("qwen-image ocr (4 GPUs)", 32, 16, 4, 16),
    ("2-GPU benchmark shape", 4, 8, 2, 8),
]


def expected_passes(
    m: int, k: int, ranks: int, micro: int, z: float, trials: int, seed: int = 0
) -> tuple[float, float, float]:
    """Mean passes per rank now, balanced, and the mean max-min spread of kept samples."""
    rng = np.random.default_rng(seed)
    if (m * k) % ranks:
        raise SystemExit(f"M*K = {m * k} must divide over {ranks} ranks")
    per_rank = m * k // ranks
    saturated = rng.random((trials, m)) < z  # (trials, M)
    kept_sample = np.repeat(~saturated, k, axis=1)  # (trials, M*K), group order
    order = np.argsort(rng.random((trials, m * k)), axis=1)  # the sampler's shuffle
    dealt = np.take_along_axis(kept_sample, order, axis=1).reshape(trials, ranks, per_rank).sum(axis=2)
    now = np.ceil(dealt.max(axis=1) / micro)
    balanced = np.ceil(dealt.sum(axis=1) / (ranks * micro))
    return float(now.mean()), float(balanced.mean()), float((dealt.max(axis=1) - dealt.min(axis=1)).mean())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shape", nargs=4, type=int, metavar=("M", "K", "R", "MICRO"), help="one batch shape"
    )
    parser.add_argument("--zero-std-ratio", type=float, nargs="+", default=[0.15, 0.3, 0.5])
    parser.add_argument("--trials", type=int, default=20_000)
    opts = parser.parse_args(argv)
    shapes = [("--shape", *opts.shape)] if opts.shape else RECIPES
    print(
        "| batch shape (M x K, R ranks, micro-batch) | zero_std_ratio | passes now | balanced | saved | max-min kept |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name, m, k, ranks, micro in shapes:
        full = math.ceil(m * k / ranks / micro)
        for z in opts.zero_std_ratio:
            now, balanced, spread = expected_passes(m, k, ranks, micro, z, opts.trials)
            saved = 1 - balanced / now if now else 0.0
            print(
                f"| {name}: {m}x{k}, {ranks}, {micro} | {z:.2f} | {now:.2f} of {full} | {balanced:.2f} | "
                f"{saved:.1%} | {spread:.1f} |"
            )


if __name__ == "__main__":
    main()
