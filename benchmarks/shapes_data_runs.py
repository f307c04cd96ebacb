"""Learning from data beside RL on the shapes world: SFT on rendered images, offline Diffusion-DPO on
verifier-labelled pairs, online Diffusion-DPO, Flow-GRPO, and SFT followed by Flow-GRPO, side by side,
with :mod:`benchmarks.shapes_runs`' runner and report.

    python benchmarks/shapes_data_runs.py --seeds 0 1 2 --rollouts 20 --val_every 10 --val_seeds 2 \
        --accelerator cuda --parallel 12 --out runs/data --json runs/data.json --plot runs/data.png

1. writes the data (``lit_flowgrpo.toy.make_image_data``: ``--records`` rendered records and their
   verifier-labelled pairs) under ``<out>/data``;
2. runs the four recipes (``configs/quickstart_{sft,dpo,dpo_online,flowgrpo}.yaml``), every seed, at once;
3. turns each SFT run's last checkpoint into a toy checkpoint (``lit_flowgrpo.toy.from_fit``) and runs
   Flow-GRPO from it (label ``sft_then_grpo``, the same seed), its curve starting where SFT's ended;
4. ``shapes_runs.py report`` over all of them;

and ``python benchmarks/shapes_data_runs.py plot REPORT.json OUT.png SFT_STEPS`` draws the curves.

A step is one optimizer step: a rollout of 64 samples for the RL objectives and online DPO, a batch of
32 records for SFT and offline DPO. The runs share the machine, so their wall times (printed as they end)
are not a speed measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import shapes_runs

PLAN = {
    "sft": ("configs/quickstart_sft.yaml", ["DATA=sft"]),
    "dpo_offline": ("configs/quickstart_dpo.yaml", ["DATA=pairs"]),
    "dpo_online": ("configs/quickstart_dpo_online.yaml", []),
    "flow_grpo": ("configs/quickstart_flowgrpo.yaml", []),
}


def _launch(jobs: list[tuple[Path, list[str]]], parallel: int, threads: int) -> None:
    """Run the commands, ``parallel`` at a time, each logging to its folder's stdout.log (and its command
    to run.json, where the report finds its runs); each run's wall seconds go to its wall.json."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    running: list[tuple[subprocess.Popen, Path, float]] = []
    start = time.monotonic()
    while jobs or running:
        while jobs and len(running) < parallel:
            folder, cmd = jobs.pop(0)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "run.json").write_text(json.dumps({"command": cmd}))
            with open(folder / "stdout.log", "w") as log:
                running.append(
                    (
                        subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env),
                        folder,
                        time.monotonic(),
                    )
                )
        for item in list(running):
            proc, folder, began = item
            if proc.poll() is not None:
                running.remove(item)
                (folder / "wall.json").write_text(
                    json.dumps({"rc": proc.returncode, "wall_s": time.monotonic() - began})
                )
                print(
                    f"{folder.name}: rc={proc.returncode} {time.monotonic() - began:.0f}s (at {time.monotonic() - start:.0f}s)",
                    flush=True,
                )
        time.sleep(1.0)


def plot(report: Path, out: Path, sft_steps: int) -> None:
    """Held-out strict accuracy against optimizer steps, one line per label (the seeds' mean, their range
    shaded), from ``shapes_runs.py report``'s JSON; ``sft_then_grpo`` starts where SFT ended."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = json.loads(report.read_text())["labels"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, entry in labels.items():
        steps = sorted(entry["held_out"], key=int)
        x = [int(k) + (sft_steps if label == "sft_then_grpo" else 0) for k in steps]
        values = [entry["held_out"][k] for k in steps]
        mean = [sum(v) / len(v) for v in values]
        (line,) = ax.plot(x, mean, marker="o", label=label)
        ax.fill_between(
            x, [min(v) for v in values], [max(v) for v in values], alpha=0.15, color=line.get_color()
        )
    ax.set_xlabel("optimizer steps (a rollout, or a batch of records)")
    ax.set_ylabel("held-out strict accuracy")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    if sys.argv[1:2] == ["plot"]:  # plot REPORT_JSON OUT_PNG SFT_STEPS
        plot(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument(
        "--rollouts", type=int, default=20, help="optimizer steps of every run (and of Flow-GRPO after SFT)"
    )
    p.add_argument("--val_every", type=int, default=10)
    p.add_argument("--val_seeds", type=int, default=2)
    p.add_argument("--max_val_prompts", type=int, default=0)
    p.add_argument("--records", type=int, default=1024, help="rendered records (and pairs, at most) to write")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--parallel", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--only", nargs="*", default=None, help="labels to run (default: all, sft_then_grpo included)"
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    opts = p.parse_args()
    opts.extra = []
    from lit_flowgrpo.toy.from_fit import toy_checkpoint_from_fit
    from lit_flowgrpo.toy.make_image_data import write_image_data

    data = write_image_data(str(opts.out / "data"), count=opts.records, seed=0)
    wanted = set(opts.only or [*PLAN, "sft_then_grpo"])
    jobs = []
    for label, (config, overrides) in PLAN.items():
        if label not in wanted and not (label == "sft" and "sft_then_grpo" in wanted):
            continue
        flags = [f"--data.init_args.train={data[o[5:]]}" if o.startswith("DATA=") else o for o in overrides]
        for seed in opts.seeds:
            folder = opts.out / f"{label}__s{seed}"
            jobs.append((folder, shapes_runs.command(config, flags, seed, folder, opts)))
    _launch(jobs, opts.parallel, opts.threads)
    if "sft_then_grpo" in wanted:
        jobs = []
        for seed in opts.seeds:
            last = sorted((opts.out / f"sft__s{seed}").rglob("last.ckpt"))
            if not last:
                print(f"sft__s{seed}: no last.ckpt, no sft_then_grpo run", flush=True)
                continue
            base = opts.out / f"sft_base_s{seed}.safetensors"
            toy_checkpoint_from_fit(str(last[-1]), str(base))
            folder = opts.out / f"sft_then_grpo__s{seed}"
            flags = [f"--model.init_args.policy.init_args.pretrained={base}"]
            jobs.append(
                (folder, shapes_runs.command("configs/quickstart_flowgrpo.yaml", flags, seed, folder, opts))
            )
        _launch(jobs, opts.parallel, opts.threads)
    report = [sys.executable, shapes_runs.__file__, "report", str(opts.out)]
    if opts.json:
        report += ["--json", str(opts.json)]
    if opts.plot:
        report += ["--plot", str(opts.plot)]
    subprocess.run(report, check=False)


if __name__ == "__main__":
    main()
