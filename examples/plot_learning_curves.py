"""Plot Flow-GRPO and GRPO-Guard learning curves of the quickstart side by side.

Proxy (the training reward on the rollout batches) against held-out accuracy (deterministic samples
of unseen prompts), over rollout batches, one colour per run:

    lit-flowgrpo fit --config configs/quickstart.yaml
    lit-flowgrpo fit --config configs/quickstart_guard.yaml
    python examples/plot_learning_curves.py runs/quickstart runs/quickstart_guard

Each argument is a run folder holding a CSVLogger ``metrics.csv`` (the newest one below it is used).
Runs given the same ``--labels`` entry (seeds of one algorithm) share a colour: each is drawn thin,
their mean thick.
The picture goes next to the first run's ``metrics.csv`` unless ``--out`` says where.
Needs matplotlib (``pip install 'lit-flowgrpo[plot]'``).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


def newest_metrics(run: Path) -> Path:
    files = sorted(run.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise SystemExit(f"{run}: no metrics.csv below it (run with the CSV logger)")
    return files[-1]


def read_series(run: Path, key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    with open(newest_metrics(run)) as f:
        for row in csv.DictReader(f):
            if row.get(key):
                steps.append(int(float(row["step"])))
                values.append(float(row[key]))
    return steps, values


def _smoothed(steps: list[int], values: list[float], k: int) -> tuple[list[int], list[float]]:
    """Trailing moving average over ``k`` points."""
    k = max(1, min(k, len(values)))
    return steps[k - 1 :], [sum(values[i - k + 1 : i + 1]) / k for i in range(k - 1, len(values))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (one per algorithm)")
    parser.add_argument("--labels", nargs="*", help="legend labels (default: folder names)")
    parser.add_argument("--proxy", default="critic/rewards/shapes/strict/mean", help="training-reward key")
    parser.add_argument("--heldout", default="val-core/shapes/strict/mean@1", help="held-out key")
    parser.add_argument(
        "--smooth", type=int, default=5, help="moving average of the proxy over this many rollouts"
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="picture to write (default: learning_curves.png beside the first run's metrics)",
    )
    opts = parser.parse_args()
    out = opts.out or newest_metrics(opts.runs[0]).parent / "learning_curves.png"

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = opts.labels or [r.name for r in opts.runs]
    if len(labels) != len(opts.runs):
        raise SystemExit(f"--labels gives {len(labels)} labels for {len(opts.runs)} runs")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for i, label in enumerate(dict.fromkeys(labels)):
        group = [run for run, name in zip(opts.runs, labels, strict=True) if name == label]
        colour = colours[i % len(colours)]
        for ax, key, smooth in ((axes[0], opts.proxy, opts.smooth), (axes[1], opts.heldout, 1)):
            curves = [_smoothed(*read_series(run, key), smooth) for run in group]
            for steps, values in curves if len(curves) > 1 else []:
                ax.plot(steps, values, color=colour, alpha=0.25, linewidth=0.8)
            common = sorted(set.intersection(*(set(steps) for steps, _ in curves)))
            mean = [sum(dict(zip(*c, strict=True))[s] for c in curves) / len(curves) for s in common]
            name = f"{label} (mean of {len(curves)})" if len(curves) > 1 else label
            ax.plot(common, mean, "-" if ax is axes[0] else "o-", color=colour, linewidth=2, label=name)
    window = f", mean of {opts.smooth}" if opts.smooth > 1 else ""
    axes[0].set_title(f"proxy: training reward (rollouts, strict{window})")
    axes[1].set_title("held-out strict accuracy (ODE samples)")
    for ax in axes:
        ax.set_xlabel("rollout batch")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
