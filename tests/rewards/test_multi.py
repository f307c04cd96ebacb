"""JPEG rewards against PIL directly, and MultiReward's weighting, zero weights, NaN propagation,
failure counts and logged keys."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image
from torch import Tensor

from lit_flowgrpo.rewards import MultiReward, available_rewards, build_reward


def _jpeg_kb(images: Tensor) -> list[float]:
    sizes = []
    for array in (images * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy():
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(array)).save(buffer, "JPEG", quality=95)
        sizes.append(len(buffer.getvalue()) / 1000)
    return sizes


def test_jpeg_sizes(images: Tensor) -> None:
    flat = torch.full((1, 3, 40, 48), 0.5)
    batch = torch.cat([images, flat])
    incompressible = build_reward("jpeg_incompressibility")(batch, ["p"] * 5, [{}] * 5)
    compressible = build_reward("jpeg_compressibility")(batch, ["p"] * 5, [{}] * 5)
    torch.testing.assert_close(incompressible, torch.tensor(_jpeg_kb(batch)))
    torch.testing.assert_close(compressible, -incompressible)
    assert incompressible[:4].min() > 2 * incompressible[4]  # noise costs more bytes than a flat grey


class Components:
    """A dict-valued reward with a failed sample (NaN) in one component."""

    primary = "a"

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, Tensor]:
        return {"a": torch.tensor([1.0, 2.0, 3.0, 4.0]), "b": torch.tensor([0.5, math.nan, 0.5, 0.5])}


def test_weights_zero_weight_and_nan(images: Tensor) -> None:
    multi = MultiReward(
        {"jpeg_incompressibility": 0.0, "toy": 2.0, "toy/b": 1.0}, rewards={"toy": Components()}
    )
    out = multi(images, ["p"] * 4, [{}] * 4)
    jpeg = torch.tensor(_jpeg_kb(images))
    torch.testing.assert_close(out.components["jpeg_incompressibility"], jpeg)  # weight 0: computed
    expected = torch.tensor([2.5, math.nan, 6.5, 8.5])  # 2·a + 1·b; NaN in b drops sample 1
    torch.testing.assert_close(out.total, expected, equal_nan=True)
    assert out.failures == {"jpeg_incompressibility": 0, "toy": 1}
    logs = out.log_dict()
    assert logs["critic/rewards/jpeg_incompressibility/mean"] == pytest.approx(float(jpeg.mean()))
    assert logs["critic/rewards/toy/a/mean"] == pytest.approx(2.5)
    assert logs["critic/rewards/toy/b/mean"] == pytest.approx(0.5)  # NaN skipped
    assert logs["reward/failure_rate"] == 0.25 and logs["reward/failure_rate/toy"] == 0.25
    assert logs["reward/latency_s"] == max(out.latency_s.values())


def test_registry_and_unknown_name() -> None:
    assert {"pickscore", "clip_score", "aesthetic", "ocr", "geneval", "vlm_judge"} <= set(available_rewards())
    assert {"jpeg_compressibility", "jpeg_incompressibility"} <= set(available_rewards())
    with pytest.raises(
        ValueError,
        match=r"--model\.init_args\.reward\.init_args\.weights names unregistered rewards \['pick_score'\]",
    ):
        MultiReward({"pick_score": 1.0})
