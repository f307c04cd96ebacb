"""How fast the toy verifier scores rendered images (the ``shapes`` reward's cost per rollout).

    python benchmarks/verifier_speed.py [--batch 64] [--repeat 7]

Prints the best and median wall time of ``ShapeVerifier.score_batch`` over a batch of ground-truth
renders (all six prompt families), and the time per image. Speed is measured here rather than
asserted in a test: on a shared machine a wall-clock bound fails for reasons unrelated to the code.
For reference, 64 images took about 20 ms on one quiet CPU core, and 86 to 103 ms on a busy
2-core machine.
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import numpy as np

from lit_flowgrpo.toy import world
from lit_flowgrpo.toy.verifier import ShapeVerifier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="images per score_batch call")
    parser.add_argument("--repeat", type=int, default=7, help="timed calls (after one warm-up call)")
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    records = [world.sample_record(rng, world.FAMILIES[i % len(world.FAMILIES)]) for i in range(args.batch)]
    images = np.stack([world.render(world.sample_scene(r, rng)) for r in records])
    verifier = ShapeVerifier()
    verifier.score_batch(images, records)  # warm-up: first-call allocations and caches

    times = timeit.Timer(lambda: verifier.score_batch(images, records)).repeat(repeat=args.repeat, number=1)
    best, median = min(times), statistics.median(times)
    print(f"ShapeVerifier.score_batch, {args.batch} images of {images.shape[1]}x{images.shape[2]}:")
    print(f"  best   {best * 1e3:8.2f} ms  ({best / args.batch * 1e6:7.1f} us per image)")
    print(f"  median {median * 1e3:8.2f} ms  ({median / args.batch * 1e6:7.1f} us per image)")


if __name__ == "__main__":
    main()
