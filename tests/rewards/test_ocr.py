"""OCR reward: the score formula against hand-worked values, quote handling, and the real RapidOCR
engine reading text rendered with PIL (the ``[dev]`` extra installs it, as ``[ocr]`` does; skipped without it)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from lit_flowgrpo.rewards import build_reward
from lit_flowgrpo.rewards.ocr import levenshtein, ocr_score, quoted_text


@pytest.mark.parametrize(
    ("a", "b", "distance"),
    [("kitten", "sitting", 3), ("", "abc", 3), ("abc", "", 3), ("flaw", "lawn", 2), ("same", "same", 0)],
)
def test_levenshtein(a: str, b: str, distance: int) -> None:
    assert levenshtein(a, b) == distance == levenshtein(b, a)


@pytest.mark.parametrize(
    ("recognised", "target", "score"),
    [
        ("OPEN", "open", 1.0),  # case folded
        ("Grand Opening today", "opening", 1.0),  # substring
        ("O P E N", "open", 1.0),  # spaces stripped
        ("OPFN", "open", 0.75),  # one substitution in four letters
        ("HELO", "hello", 0.8),  # one deletion in five
        ("", "hello", 0.0),
        ("zzzzzzzzzzzzzzz", "cat", 0.0),  # distance 15 capped at len 3
    ],
)
def test_ocr_score(recognised: str, target: str, score: float) -> None:
    assert ocr_score(recognised, target) == pytest.approx(score)


def test_quoted_text() -> None:
    assert quoted_text('a sign that says "Hello World" on a wall') == "Hello World"
    assert quoted_text("a neon sign “Café” at night") == "Café"
    assert quoted_text("no quotes here") is None


class FixedEngine:
    """Stands in for an engine's weights: returns fixed readings in order."""

    def __init__(self, readings: list[object]) -> None:
        self.readings = list(readings)

    def __call__(self, image: Image.Image) -> str:
        assert isinstance(image, Image.Image) and image.size == (16, 8)
        reading = self.readings.pop(0)
        if isinstance(reading, Exception):
            raise reading
        return str(reading)


def test_reward_quotes_warning_and_engine_failure() -> None:
    images = torch.rand(4, 3, 8, 16)
    prompts = ['a sign "OPEN"', "a plain street", 'a mug with "coffee"', 'a card "hello"']
    engine = FixedEngine(["open 24h", RuntimeError("engine crashed"), "HELO"])
    reward = build_reward("ocr", engine=engine)
    with (
        pytest.warns(UserWarning, match=r"1 of 4 prompts have no text between double quotes"),
        pytest.warns(UserWarning, match=r"ocr engine failed .*engine crashed"),
    ):
        scores = reward(images, prompts, [{}] * 4)
    assert scores[0] == 1.0 and scores[1] == 0.0 and scores[3] == pytest.approx(0.8)
    assert math.isnan(scores[2])  # an engine failure drops the sample, never scores it 0
    assert engine.readings == []


def test_bad_engine_name() -> None:
    with pytest.raises(ValueError, match=r"ocr\.engine \('tesseract'\) must be"):
        build_reward("ocr", engine="tesseract").check()


def _render(text: str) -> torch.Tensor:
    image = Image.new("RGB", (256, 96), "white")
    font = ImageFont.load_default(size=40)
    ImageDraw.Draw(image).text((10, 25), text, fill="black", font=font)
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255


@pytest.mark.slow
def test_rapidocr_reads_rendered_text() -> None:
    pytest.importorskip("rapidocr")
    images = torch.stack([_render("HELLO 42"), _render("WORLD"), torch.ones(3, 96, 256)])
    prompts = ['a sign that says "hello 42"', 'a poster saying "world peace"', 'a blank page with "text"']
    scores = build_reward("ocr")(images, prompts, [{}] * 3)
    # "world" against "worldpeace": distance 5 of 10 → 0.5; a blank image reads "" → 0.
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.5, 0.0]))
