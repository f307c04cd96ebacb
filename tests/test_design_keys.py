"""A `lit-flowgrpo fit` run of the tiny config logs every key DESIGN.md lists."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import yaml

from lit_flowgrpo.cli import FlowGRPOCLI

REPO = Path(__file__).resolve().parents[1]

# DESIGN.md's list, with each pattern expanded for the tiny run (reward `jpeg_compressibility`,
# 3 trained steps). `perf/max_memory_allocated_gb` is CUDA-only and is checked by the callback's tests.
EXPECTED = [
    *(
        f"critic/rewards/{s}"
        for s in ("mean", "std", "max", "min", "zero_std_ratio", "std_mean", "group_size")
    ),
    *(f"critic/advantages/{s}" for s in ("mean", "std", "max", "min")),
    "critic/rewards/jpeg_compressibility/mean",
    *(f"actor/{s}" for s in ("loss", "pg_loss", "kl_loss", "kl_coef", "grad_norm", "lr", "entropy")),
    *(f"actor/{s}" for s in ("pg_clipfrac", "pg_clipfrac_higher", "pg_clipfrac_lower")),
    *(f"actor/{s}" for s in ("clip_ratio", "clip_ratio_low", "clip_ratio_high")),
    *(f"actor/{s}" for s in ("ratio_mean", "ratio_std", "ratio_max", "ratio_min")),
    *(f"actor/{s}" for s in ("approx_kl", "ppo_kl", "policy_confidence", "mean_new_logp", "mean_old_logp")),
    "actor/logp_diff_mean",
    "actor/kl_max",
    # verl-omni's FlowDPPOLoss names, logged for every ratio objective (DiagnosticsSettings.step_kl)
    "actor/kl_new_old_mean",
    "actor/kl_new_old_max",
    *(f"actor_by_step/ratio_mean/step_{j}" for j in range(3)),
    *(f"timing_s/{s}" for s in ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "step")),
    *(f"timing_per_image_ms/{s}" for s in ("gen", "reward", "update_actor", "step")),
    *(
        f"perf/{s}"
        for s in ("throughput", "time_per_step", "total_num_images", "mfu/actor_infer", "mfu/actor")
    ),
    "val-aux/jpeg_compressibility/mean@1",
    "val-aux/jpeg_compressibility/unscored_count",
    *(f"global_load/{s}" for s in ("min", "max", "mean", "minmax_diff")),
]


def _run_tiny(tiny_sd3_path: str, tmp_path: Path, *overrides: str) -> list[dict[str, str]]:
    config = yaml.safe_load((REPO / "configs" / "tiny_sd3.yaml").read_text())
    (monitor,) = [
        c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("RLThroughputMonitor")
    ]
    # CPUs have no peak-FLOPs entry: give one so the MFU keys are computed.
    monitor["init_args"] = {"available_flops": 1e11}
    path = tmp_path / "tiny_sd3.yaml"
    path.write_text(yaml.safe_dump(config))
    FlowGRPOCLI(
        args=[
            "fit",
            "--config",
            str(path),
            f"--model.init_args.policy.init_args.pretrained={tiny_sd3_path}",
            f"--data.init_args.train={REPO / 'configs' / 'data' / 'tiny_prompts.txt'}",
            f"--data.init_args.val={REPO / 'configs' / 'data' / 'tiny_prompts.txt'}",
            "--trainer.logger=CSVLogger",
            f"--trainer.logger.save_dir={tmp_path}",
            f"--trainer.default_root_dir={tmp_path}",
            *overrides,
        ]
    )
    (metrics,) = tmp_path.glob("lightning_logs/version_*/metrics.csv")
    with open(metrics) as f:
        return list(csv.DictReader(f))


def test_tiny_run_logs_every_design_key(tiny_sd3_path, tmp_path):
    rows = _run_tiny(tiny_sd3_path, tmp_path)
    seen = {k for row in rows for k, v in row.items() if v != ""}
    missing = [k for k in EXPECTED if k not in seen]
    assert not missing, f"not logged: {missing}"


def test_diagnostics_options_from_the_command_line(tiny_sd3_path, tmp_path):
    rows = _run_tiny(
        tiny_sd3_path,
        tmp_path,
        "--model.init_args.diagnostics.top_k_kl=2",
        "--model.init_args.diagnostics.clip_gate=none",
        "--model.init_args.diagnostics.by_step=false",
        "--trainer.max_steps=2",
    )
    steps = [{k: float(v) for k, v in r.items() if v != ""} for r in rows if r.get("actor/loss")]
    assert steps
    for row in steps:
        # The highest-KL record is the maximum the metric reports; records come sorted by KL.
        assert row["actor/top_kl/0/kl"] == row["actor/kl_max"]
        assert row["actor/top_kl/0/kl"] >= row["actor/top_kl/1/kl"]
        # Ungated (CISPO-style) clipping counts every ratio outside the range: the same tokens as
        # pg_clipfrac, on either side.
        assert row["actor/clip_ratio_high"] == row["actor/pg_clipfrac_higher"]
        assert row["actor/clip_ratio_low"] == row["actor/pg_clipfrac_lower"]
        assert not any(k.startswith("actor_by_step/") for k in row)


def test_trajectory_level_clip_statistics_from_the_command_line(tiny_sd3_path, tmp_path):
    rows = _run_tiny(
        tiny_sd3_path,
        tmp_path,
        "--model.init_args.diagnostics.clip_level=trajectory",
        "--model.init_args.diagnostics.clip_gate=none",
        "--trainer.max_steps=2",
        # A large step, so the rollout's second optimizer step sees ratios outside the 1e-4 clip.
        "--model.init_args.optimizer.init_args.lr=0.01",
    )
    steps = [{k: float(v) for k, v in r.items() if v != ""} for r in rows if r.get("actor/loss")]
    assert steps
    images = 2 * 4  # prompts_per_step x group_size: one geometric-mean ratio per image
    trained = {k for row in steps for k in row if k.startswith("actor_by_step/ratio_mean/")}
    assert len(trained) > 1  # several steps per image, so a per-image count differs from a per-step one
    for row in steps:
        for key in ("actor/clip_ratio", "actor/clip_ratio_low", "actor/clip_ratio_high"):
            # A fraction of the rollout's 8 images, not of its 8 x steps (image, step) pairs.
            assert row[key] * images == round(row[key] * images), (key, row[key])
        assert row["actor/clip_ratio"] == row["actor/clip_ratio_low"] + row["actor/clip_ratio_high"]
        # The per-(image, step) fraction stays what it is: a multiple of 1 / (8 images x steps).
        pairs = images * len(trained)
        assert row["actor/pg_clipfrac"] * pairs == pytest.approx(
            round(row["actor/pg_clipfrac"] * pairs), abs=1e-4
        )
    assert any(row["actor/clip_ratio"] > 0 for row in steps)  # the check above had something to count
