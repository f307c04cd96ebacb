"""Reward hacking on the shapes world: the ``shapes_color`` proxy on rendered scenes against hand-counted
pixels and a float64 re-derivation (a blob of the colour beats a correct scene on the proxy, while the
gold verifier says the opposite), and ``configs/hacking_proxy.yaml`` run through the real CLI."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from lit_flowgrpo.cli import FlowGRPOCLI
from lit_flowgrpo.rewards import MultiReward, build_reward
from lit_flowgrpo.rewards.images import to_numpy_hwc
from lit_flowgrpo.toy import ColorCoverageReward, world

REPO = Path(__file__).resolve().parents[2]
RED_SQUARE = world.make_record("colors", [("square", 1, "red")])


def _images(*scenes: list[dict]) -> torch.Tensor:
    pixels = np.stack([world.render(scene) for scene in scenes])  # (B, 32, 32, 3) uint8
    return torch.from_numpy(pixels).permute(0, 3, 1, 2).double() / 255  # exact: to_uint8 gives them back


def _square(size: float, color: str = "red", center: tuple[float, float] = (16.0, 16.0)) -> dict:
    return {"shape": "square", "color": color, "center": list(center), "size": size}


def test_a_blob_of_the_colour_beats_a_correct_scene_and_the_verifier_says_the_opposite() -> None:
    # Squares centred on a pixel corner with an even side cover whole pixels only: a side-s square is
    # s² pixels of pure red, every other pixel black. So the proxy is s²/1024 / 0.5, by hand.
    correct, blob, flood = _square(10), _square(20), _square(26)
    images = _images([correct], [blob], [flood])
    records = [RED_SQUARE] * 3
    proxy = ColorCoverageReward()(images.float(), [RED_SQUARE["prompt"]] * 3, records)
    assert proxy.tolist() == [100 / 1024 / 0.5, 400 / 1024 / 0.5, 1.0]  # 676/1024 > 0.5: capped at 1
    assert proxy.dtype == torch.float32
    gold = build_reward("shapes")(images.float(), [RED_SQUARE["prompt"]] * 3, records)
    # The blob covers 39% of the image, above the verifier's largest object (35%): not a square.
    assert gold["strict"].tolist() == [1.0, 0.0, 0.0]


def _float64_coverage(pixels: np.ndarray, record: dict) -> float:
    """The verifier's segmentation rule re-derived in float64: brightest channel ≥ 0.35, nearest palette
    hue in chromaticity (RGB over its largest channel) within 0.45."""
    x = pixels.reshape(-1, 3).astype(np.float64) / 255
    peak = x.max(axis=1)
    chroma = x / np.maximum(peak, 1e-12)[:, None]
    palette = np.array([world.COLORS[c] for c in world.COLORS], dtype=np.float64) / 255
    hues = palette / palette.max(axis=1, keepdims=True)
    dist = np.sqrt(((chroma[:, None, :] - hues[None]) ** 2).sum(axis=2))  # (N, 4)
    nearest = dist.argmin(axis=1)
    colour = np.where((peak >= 0.35) & (dist.min(axis=1) <= 0.45), nearest, -1)
    named = [e["color"] for e in record["include"] if "color" in e] or list(world.COLORS)
    wanted = [list(world.COLORS).index(c) for c in named]
    return float(np.isin(colour, wanted).mean())


def test_proxy_matches_a_float64_rederivation_on_rendered_scenes() -> None:
    rng = np.random.default_rng(0)
    records = [world.sample_record(rng, family) for family in world.FAMILIES for _ in range(4)]
    scenes = [world.sample_scene(r, rng) for r in records]
    images = _images(*scenes).float()
    reward = ColorCoverageReward()
    got = reward(images, [r["prompt"] for r in records], records)
    pixels = to_numpy_hwc(images)
    want = [min(_float64_coverage(p, r) / 0.5, 1.0) for p, r in zip(pixels, records, strict=True)]
    # Coverage is a count of pixels over 1024, exact in both; fp32 output: one rounding.
    assert got.tolist() == pytest.approx(want, rel=2**-24, abs=0.0)
    assert all(0 < w < 1 for w in want)  # correct scenes: scored, none reaches the cap


def test_wrong_colour_scores_nothing_and_a_prompt_without_colour_counts_every_colour() -> None:
    blue, yellow = _square(10, "blue", (8.0, 8.0)), _square(8, "yellow", (24.0, 24.0))
    two = world.make_record("two_object", [("square", 1, None), ("circle", 1, None)])
    images = _images([blue], [blue, yellow]).float()
    got = ColorCoverageReward(saturation=1.0)(images, ["", ""], [RED_SQUARE, two])
    assert got.tolist() == [0.0, (100 + 64) / 1024]


def test_unscorable_images_are_nan_and_bad_settings_are_named() -> None:
    images = _images([_square(10)], [_square(12)]).float()
    images[1, 0, 3, 3] = math.nan
    got = ColorCoverageReward()(images, ["", ""], [RED_SQUARE] * 2)
    assert got[0] == pytest.approx(100 / 1024 / 0.5) and math.isnan(got[1])
    with pytest.raises(ValueError, match=r"shapes_color.saturation \(0\) must be in \(0, 1\]"):
        ColorCoverageReward(saturation=0)
    with pytest.raises(ValueError, match="one record per image"):
        ColorCoverageReward()(images, ["", ""], [RED_SQUARE])
    problems = build_reward("shapes_color").problems([{**RED_SQUARE, "prompt": "a red dragon"}])
    assert problems and "dragon" in problems[0]


def test_validation_splits_gold_and_proxy() -> None:
    reward = MultiReward({"shapes_color": 1.0, "shapes/strict": 0.0})
    assert reward.validation_keys("shapes/strict")[0] == "val-core/shapes/strict/mean@1"
    assert reward.validation_keys("shapes_color")[0] == "val-aux/shapes_color/mean@1"
    assert reward.validation_keys("shapes/partial")[0] == "val-aux/shapes/partial/mean@1"
    out = reward(_images([_square(10)], [_square(20)]).float(), ["", ""], [RED_SQUARE] * 2)
    # Trained on the proxy alone: the blob gets the higher total, strict weighs nothing.
    assert out.total.tolist() == out.components["shapes_color"].tolist()
    assert out.total[1] > out.total[0] and out.components["shapes/strict"].tolist() == [1.0, 0.0]


@pytest.mark.slow
def test_hacking_proxy_config_logs_gold_proxy_gap_diversity_and_drift(tmp_path: Path, capsys) -> None:
    # Two rollouts of one small group set, validated before, after each: 4 held-out prompts x 2 seeds.
    cli = FlowGRPOCLI(
        args=[
            "fit",
            "--config",
            str(REPO / "configs" / "hacking_proxy.yaml"),
            "--trainer.max_steps=2",
            "--trainer.val_check_interval=1",
            f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            f"--data.init_args.train={REPO / 'lit_flowgrpo/toy/assets/train.jsonl'}",
            f"--data.init_args.val={REPO / 'lit_flowgrpo/toy/assets/val.jsonl'}",
            "--data.init_args.prompts_per_step=2",
            "--data.init_args.group_size=4",
            "--data.init_args.max_val_prompts=4",
            "--data.init_args.val_seeds=2",
            "--data.init_args.val_batch_size=8",
            "--model.init_args.update.micro_batch_size=8",
        ]
    )
    out = capsys.readouterr().out
    assert "held-out strict accuracy of the base model: " in out and "; shapes_color: " in out
    assert "its gap to held-out strict accuracy: " in out
    (metrics,) = tmp_path.glob("*/version_0/metrics.csv")
    with open(metrics) as f:
        rows = list(csv.DictReader(f))

    def logged(key: str) -> list[float]:
        return [float(r[key]) for r in rows if r.get(key)]

    gold, proxy = logged("val-core/shapes/strict/mean@1"), logged("val-aux/shapes_color/mean@1")
    gap = logged("val-aux/shapes_color_gap/mean@1")
    assert len(gold) == len(proxy) == len(gap) == 3  # the base, after rollout 1, after rollout 2
    # Every sample scored by both (unscored_count 0): the mean gap is the gap of the means. The
    # means are fp32 sums of 8 values in [0, 1], each within 8·2^-24 of the exact mean.
    assert logged("val-aux/shapes_color/unscored_count") == [0.0, 0.0]
    for g, p, d in zip(gold, proxy, gap, strict=True):
        assert d == pytest.approx(p - g, abs=1e-6)
    assert len(logged("rollout/diversity")) == 2 and all(v > 0 for v in logged("rollout/diversity"))
    assert len(logged("val-aux/diversity")) == 3
    drift = logged("val-aux/drift")
    assert len(drift) == 3 and drift[0] == 0.0 and all(v >= 0 for v in drift)
    assert logged("critic/rewards/shapes_color/mean") and logged("critic/rewards/shapes/strict/mean")

    # The drift after the last rollout, recomputed: the tuned model's samples regenerated (the same
    # deterministic ODE and seeds) against the base features the callback kept.
    (monitor,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "OverOptimizationMonitor"]
    base_ids, base = monitor._drift.reference_ids, monitor._drift.reference_features.double()
    assert base_ids.tolist() == list(range(8))
    module = cli.model
    module.eval()
    distances = []
    with torch.no_grad(), module.performance.sampling_weights(module.policy.transformer):
        for batch in cli.datamodule.val_dataloader():
            images = module.sampler.evaluate(module.policy, list(batch.prompts), batch.seeds)
            features = torch.nn.functional.adaptive_avg_pool2d(images.float(), 16).flatten(1).double()
            distances += ((features - base[batch.sample_ids]) ** 2).mean(dim=1).tolist()
    # Logged through Lightning's fp32 result collection: one rounding.
    assert drift[-1] == pytest.approx(float(np.mean(distances)), rel=1e-6)
