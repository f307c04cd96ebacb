"""The editing report: the per-kind evaluation on a tiny model, and the hacking view's curves read from a
run's metrics.csv."""

from __future__ import annotations

import csv

import torch

from lit_flowgrpo.toy.edit_model import build_edit_models, save_edit_checkpoint
from lit_flowgrpo.toy.edit_policy import ToyEditPolicy
from lit_flowgrpo.toy.edit_report import curves_picture, evaluate_edits, held_out_records, read_curves
from lit_flowgrpo.toy.model import ToyModelConfig


def test_the_curves_are_the_logged_training_means(tmp_path):
    path = tmp_path / "metrics.csv"
    keys = [f"critic/rewards/shapes_edit/{k}/mean" for k in ("edit", "preserve", "strict")]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, ["step", *keys, "val-core/shapes_edit/strict/mean@1"])
        writer.writeheader()
        writer.writerow({"step": 0, "val-core/shapes_edit/strict/mean@1": 0.7})  # a validation row: skipped
        for step in range(3):
            writer.writerow({"step": step, **{k: 0.1 * (step + i) for i, k in enumerate(keys)}})
    curves = read_curves(str(path))
    assert curves["edit"] == [(0, 0.0), (1, 0.1), (2, 0.2)]
    assert curves["strict"] == [(0, 0.2), (1, 0.30000000000000004), (2, 0.4)]
    image = curves_picture([str(path), str(path)], ["a", "b"])
    assert image.width > 2 * 360 and image.height > 220


def test_the_evaluation_splits_by_edit_kind(tmp_path):
    torch.manual_seed(0)
    config = ToyModelConfig(
        block_out_channels=(8, 16),
        attention_heads=2,
        norm_num_groups=4,
        text_dim=16,
        text_layers=1,
        text_heads=2,
    )
    path = tmp_path / "tiny.safetensors"
    save_edit_checkpoint(str(path), *build_edit_models(config), dtype=torch.float32)
    policy = ToyEditPolicy(pretrained=str(path))
    policy.load()
    records = held_out_records()[:6]
    result = evaluate_edits(policy, records, [0], num_steps=2, batch_size=6)
    assert result["n"] == 6 and set(result["by_kind"]) == {r["tag"] for r in records}
    for scores in (result, *result["by_kind"].values()):
        assert 0 <= scores["strict"] <= min(scores["edit"], scores["preserve"]) <= 1
