"""Plot Flow-GRPO and GRPO-Guard learning curves of the quickstart side by side.

Proxy (the training reward on the rollout batches) against held-out accuracy (deterministic samples
of unseen prompts), over rollout batches, one colour per run:

    lit-flowgrpo fit --config configs/quickstart.yaml
    lit-flowgrpo fit --config configs/quickstart_guard.yaml
    python examples/plot_learning_curves.py runs/quickstart runs/quickstart_guard

Each argument is a run folder holding a CSVLogger ``metrics.csv`` (the newest one below it is used).
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
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for run, label, colour in zip(
        opts.runs, labels, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False
    ):
        steps, values = read_series(run, opts.proxy)
        k = max(1, min(opts.smooth, len(values)))
        averaged = [sum(values[i - k + 1 : i + 1]) / k for i in range(k - 1, len(values))]
        axes[0].plot(steps[k - 1 :], averaged, color=colour, alpha=0.8, label=label)
        steps, values = read_series(run, opts.heldout)
        axes[1].plot(steps, values, "o-", color=colour, label=label)
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
