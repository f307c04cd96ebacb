"""A shortened quickstart through the real CLI: it completes, validates before and after training,
logs the validation keys (strict accuracy under val-core/, the rest under val-aux/, with their values
pinned), prints the accuracy line and writes the base-vs-tuned picture.

The learning gain itself is measured by the full run (see configs/quickstart.yaml's header), not here.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from lit_flowgrpo.cli import FlowGRPOCLI
from lit_flowgrpo.rewards.images import to_numpy_hwc

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize(
    "config", ["quickstart.yaml", "quickstart_flowgrpo.yaml", "quickstart_guard.yaml", "quickstart_dppo.yaml"]
)
def test_shortened_quickstart(config, tmp_path, capsys):
    cli = FlowGRPOCLI(args=_short_run(config, tmp_path, max_steps=1, val_check_interval=1))
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
    strict_key, partial_key = "val-core/shapes/strict/mean@1", "val-aux/shapes/partial/mean@1"
    strict = [(int(r["step"]), float(r[strict_key])) for r in rows if r.get(strict_key)]
    partial = [float(r[partial_key]) for r in rows if r.get(partial_key)]
    # one name per value: the pre-split names are gone
    assert not [k for k in rows[0] if k.startswith("val/")], rows[0].keys()
    # Two validations, in order: the base (logged at step 0 by HeldOutReport) and the one after the
    # rollout (Lightning logs it at the index of that batch, 0 too).
    assert [s for s, _ in strict] == [0, 0]
    # 8 prompts × 1 seed of 0/1 scores: each strict mean is a multiple of 1/8. A sample that meets
    # every condition scores 1 partial too, so the partial mean is never below the strict one.
    assert all(8 * v == round(8 * v) for _, v in strict)
    assert len(partial) == 2 and all(p >= s for p, (_, s) in zip(partial, strict, strict=True))
    # The printed line rounds to 3 decimals: within 5e-4 of the logged values.
    assert float(line.group(1)) == pytest.approx(strict[0][1], abs=5e-4)
    assert float(line.group(2)) == pytest.approx(strict[-1][1], abs=5e-4)
    assert any(r.get("critic/rewards/shapes/strict/mean") for r in rows)
    # The module's validation (the base values at step 0 come from HeldOutReport, without counts).
    (tuned,) = [r for r in rows if r.get("val-aux/shapes/strict/unscored_count")]
    _check_validation(cli, tuned)
    assert (metrics.parent / "base_vs_tuned.png").is_file()
    # The split by prompt family (HeldOutReport's group_by: "tag"): each family's mean over its own
    # samples, so the families weighted by their sample counts give back the overall accuracy.
    tags = [r["tag"] for r in cli.datamodule.val_records]
    keys = {t: f"val-aux/shapes/strict/{t}/mean@1" for t in tags}
    last = [r for r in rows if all(r.get(k) for k in keys.values())][-1]  # the tuned model's
    weighted = sum(tags.count(t) * float(last[k]) for t, k in keys.items()) / len(tags)
    assert weighted == pytest.approx(strict[-1][1], abs=1e-6)
    assert re.search(r"by tag \(the base model -> after 1 rollout\): ", out), out[-2000:]


def _short_run(config: str, tmp_path: Path, **trainer: object) -> list[str]:
    """The shipped config (its callbacks, validation on), as short as the assertions allow: rollouts of
    one small group set, validations of 8 held-out prompts in one batch (8: their strict and partial
    means differ)."""
    return [
        "fit",
        "--config",
        str(REPO / "configs" / config),
        *(f"--trainer.{key}={value}" for key, value in trainer.items()),
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--data.init_args.train={REPO / 'lit_flowgrpo/toy/assets/train.jsonl'}",
        f"--data.init_args.val={REPO / 'lit_flowgrpo/toy/assets/val.jsonl'}",
        "--data.init_args.prompts_per_step=2",
        "--data.init_args.group_size=4",
        "--data.init_args.max_val_prompts=8",
        "--data.init_args.val_seeds=1",
        "--data.init_args.val_batch_size=8",
        # The configs' micro-batch (32) must divide the rollout batch: without this, one rollout
        # would need 32 samples, 4x the 8 used here.
        "--model.init_args.update.micro_batch_size=8",
    ]


class _HourPerRead:
    """``time`` for Lightning's Timer: each read is an hour after the one before."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 3600.0
        return self.now


@pytest.mark.slow
def test_the_main_jobs_time_bound_ends_training_then_evaluates(tmp_path, capsys):
    # The main job's max_time (Lightning's Timer, on a clock where every read is an hour later): the
    # first rollout ends past it, so training stops there, before max_steps' 3 and before any
    # evaluation val_check_interval asks for; Lightning validates where it stops a run early, and the
    # report, the progress bar and the picture say 1 rollout.
    from lightning.pytorch.callbacks import timer

    args = _short_run("quickstart.yaml", tmp_path, max_steps=3, val_check_interval=3, max_time="00:00:01:00")
    with mock.patch.object(timer, "time", _HourPerRead()):
        cli = FlowGRPOCLI(args=args)
    out = capsys.readouterr().out
    assert cli.trainer.global_step == 1
    assert re.search(r"held-out strict accuracy: \d\.\d{3} -> \d\.\d{3} \(.*after 1 rollout\)", out), out[
        -2000:
    ]
    bar = cli.trainer.progress_bar_callback
    assert bar.total_rollouts == 1 and bar.time_capped
    assert "1 rollouts at" in out and "(as many as fit in max_time)" in out
    assert "1/1 rollouts" in str(bar.train_progress_bar)
    (metrics,) = tmp_path.glob("*/version_0/metrics.csv")
    assert (metrics.parent / "base_vs_tuned.png").is_file()
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


def _check_validation(cli: FlowGRPOCLI, row: dict[str, str]) -> None:
    """The module's validation keys and values: the tuned model's samples regenerated (the same
    deterministic ODE and seeds), scored by the verifier, and averaged in numpy."""
    module = cli.model
    verifier = module.reward.rewards["shapes"].verifier
    scores, unscored = [], 0
    module.eval()  # as Lightning runs validation
    with torch.no_grad(), module.performance.sampling_weights(module.policy.transformer):
        for batch in cli.datamodule.val_dataloader():
            images = module.sampler.evaluate(module.policy, list(batch.prompts), batch.seeds)
            scores.append(np.stack(verifier.score_batch(to_numpy_hwc(images), list(batch.metadata))))
            unscored += int((~torch.isfinite(images)).flatten(1).any(dim=1).sum())  # the reward's NaN
    strict, partial = np.concatenate(scores, axis=1)  # (8,) each, float64
    # The logged means are fp32 sums of 8 values in [0, 1] (one rounding each, 2^-24 relative) then a
    # division: within 16 · 2^-24 < 1e-6 of the float64 mean.
    assert float(row["val-core/shapes/strict/mean@1"]) == pytest.approx(np.mean(strict), rel=1e-6, abs=1e-7)
    assert float(row["val-aux/shapes/partial/mean@1"]) == pytest.approx(np.mean(partial), rel=1e-6, abs=1e-7)
    assert float(row["val-aux/shapes/strict/unscored_count"]) == unscored
    assert float(row["val-aux/shapes/partial/unscored_count"]) == unscored
    assert "val-core/shapes/partial/mean@1" not in row and "val-aux/shapes/strict/mean@1" not in row
