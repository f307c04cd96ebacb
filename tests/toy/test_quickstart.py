"""A shortened quickstart through the real CLI: it completes, validates before and after training,
logs the validation keys, prints the accuracy line and writes the base-vs-tuned picture.

The learning gain itself is measured by the full run (see configs/quickstart.yaml's header), not here.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

from lit_flowgrpo.cli import FlowGRPOCLI

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("config", ["quickstart.yaml", "quickstart_guard.yaml"])
def test_shortened_quickstart(config, tmp_path, capsys):
    # As short as the assertions allow: one rollout batch of one small group set between the two
    # validations, each of 4 held-out prompts in one batch.
    FlowGRPOCLI(
        args=[
            "fit",
            "--config",
            str(REPO / "configs" / config),
            "--trainer.max_steps=1",
            "--trainer.val_check_interval=1",
            f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            f"--data.init_args.train={REPO / 'lit_flowgrpo/toy/assets/train.jsonl'}",
            f"--data.init_args.val={REPO / 'lit_flowgrpo/toy/assets/val.jsonl'}",
            "--data.init_args.prompts_per_step=2",
            "--data.init_args.group_size=4",
            "--data.init_args.max_val_prompts=4",
            "--data.init_args.val_seeds=1",
            "--data.init_args.val_batch_size=4",
            # The configs' micro-batch (32) must divide the rollout batch: without this, one rollout
            # would need 32 samples, 4x the 8 used here.
            "--model.init_args.update.micro_batch_size=8",
        ]
    )
    out = capsys.readouterr().out
    line = re.search(r"held-out strict accuracy: (\d\.\d{3}) -> (\d\.\d{3})", out)
    assert line, out[-2000:]
    # Each validation prints its line as it ends: the base first, then the one after the rollout.
    steps = re.findall(r"held-out strict accuracy (of the base model|after 1 rollout): (\d\.\d{3})\n", out)
    assert [when for when, _ in steps] == ["of the base model", "after 1 rollout"], out[-2000:]
    assert (steps[0][1], steps[-1][1]) == line.groups()
    (metrics,) = tmp_path.glob("*/version_0/metrics.csv")
    with open(metrics) as f:
        rows = list(csv.DictReader(f))
    strict = [
        (int(r["step"]), float(r["val/shapes/strict/mean"])) for r in rows if r.get("val/shapes/strict/mean")
    ]
    partial = [float(r["val/shapes/partial/mean"]) for r in rows if r.get("val/shapes/partial/mean")]
    # Two validations, in order: the base (logged at step 0 by HeldOutReport) and the one after the
    # rollout (Lightning logs it at the index of that batch, 0 too).
    assert [s for s, _ in strict] == [0, 0]
    # 4 prompts × 1 seed of 0/1 scores: each strict mean is a multiple of 1/4. A sample that meets
    # every condition scores 1 partial too, so the partial mean is never below the strict one.
    assert all(4 * v == round(4 * v) for _, v in strict)
    assert len(partial) == 2 and all(p >= s for p, (_, s) in zip(partial, strict, strict=True))
    # The printed line rounds to 3 decimals: within 5e-4 of the logged values.
    assert float(line.group(1)) == pytest.approx(strict[0][1], abs=5e-4)
    assert float(line.group(2)) == pytest.approx(strict[-1][1], abs=5e-4)
    assert any(r.get("critic/rewards/shapes/strict/mean") for r in rows)
    assert (metrics.parent / "base_vs_tuned.png").is_file()
