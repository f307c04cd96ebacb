"""OCR reward: does the image show the text the prompt asks for?

The target is the text between the first pair of double quotes in the prompt (straight ``"`` or
curly ``“ ”``); the recognised text is what the OCR engine reads in the image. Both are compared
with spaces removed and case folded (flow_grpo/ocr.py ``OcrScorer``)::

    score = 1                                   if target is a substring of the recognised text
    score = 1 − min(Levenshtein(rec, target), len(target)) / len(target)     otherwise

A prompt without quoted text (or with empty quotes) has no target: its score is 0 **by
definition** and a warning names how many prompts were affected. An engine that raises on an
image is a failure: that sample is NaN (dropped), never 0.

The engine is pluggable: any callable ``engine(image: PIL.Image | np.ndarray) -> str``. The default,
``"rapidocr"``, is RapidOCR (the ``rapidocr`` package: PaddleOCR's PP-OCR models on ONNX Runtime;
the ``ocr`` extra: ``pip install lit-flowgrpo[ocr]``), whose wheel ships its weights, so nothing is
downloaded at run time. Flow-GRPO used PaddleOCR itself; RapidOCR runs the same model family
without Paddle.
"""

from __future__ import annotations

import importlib
import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torchmetrics.functional.text import edit_distance

from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.rewards.images import to_pil
from lit_flowgrpo.rewards.registry import register_reward

_FLAG = "--model.init_args.reward.init_args.config.ocr"
_QUOTED = re.compile(r'"([^"]*)"|“([^”]*)”')

OcrEngine = Callable[[Any], str]
"""``engine(image: PIL.Image | np.ndarray (H, W, 3) uint8 RGB) -> recognised text``."""


def quoted_text(prompt: str) -> str | None:
    """The text between the first pair of double quotes, or ``None`` when the prompt has none."""
    match = _QUOTED.search(prompt)
    if match is None:
        return None
    return match.group(1) if match.group(1) is not None else match.group(2)


def normalize_text(text: str) -> str:
    """Spaces removed, case folded: the comparison form of flow_grpo's OCR reward."""
    return "".join(text.split()).casefold()


def levenshtein(a: str, b: str) -> int:
    """Character edit distance (insertions, deletions, substitutions of one character each)."""
    return int(edit_distance([a], [b], reduction="none")[0])


def ocr_score(recognised: str, target: str) -> float:
    """flow_grpo's OCR score of ``recognised`` text against ``target`` (both raw; normalised here)."""
    rec, tgt = normalize_text(recognised), normalize_text(target)
    if not tgt:
        return 0.0
    if tgt in rec:
        return 1.0
    return 1.0 - min(levenshtein(rec, tgt), len(tgt)) / len(tgt)


class RapidOCREngine:
    """RapidOCR (the ``rapidocr`` package, on ONNX Runtime) as an :data:`OcrEngine`: the recognised
    lines joined without separator.

    Args:
        min_confidence: lines recognised with a lower confidence are ignored (flow_grpo keeps any
            line with confidence > 0).
    """

    def __init__(self, min_confidence: float = 0.0) -> None:
        try:
            from rapidocr import RapidOCR
        except ImportError as err:
            raise ImportError(
                f"{_FLAG}.engine='rapidocr' needs the OCR extra: pip install 'lit-flowgrpo[ocr]' "
                "(rapidocr and onnxruntime), or pass another engine"
            ) from err
        self.min_confidence = min_confidence
        self._ocr = RapidOCR()

    def __call__(self, image: Image.Image | np.ndarray) -> str:
        rgb = np.asarray(image.convert("RGB") if isinstance(image, Image.Image) else image)
        # RapidOCR reads an array as OpenCV's BGR (every 3.x release takes arrays; not all take PIL).
        result = self._ocr(np.ascontiguousarray(rgb[..., ::-1]))
        texts, scores = getattr(result, "txts", None), getattr(result, "scores", None)
        if not texts:  # nothing detected: the output carries no lines
            return ""
        return "".join(t for t, c in zip(texts, scores, strict=True) if float(c) > self.min_confidence)


def _resolve_engine(engine: str | OcrEngine) -> OcrEngine:
    if callable(engine):
        return engine
    if engine == "rapidocr":
        return RapidOCREngine()
    if isinstance(engine, str) and ":" in engine:
        module, _, attr = engine.partition(":")
        factory = getattr(importlib.import_module(module), attr)
        return factory()
    raise SettingsError(
        f"{_FLAG}.engine ({engine!r}) must be 'rapidocr', 'package.module:factory' (a callable that "
        "returns an engine), or an engine callable"
    )


@register_reward("ocr")
class OCRReward:
    """Text-rendering accuracy of the quoted text in each prompt (Flow-GRPO's OCR task).

    One value per image, the core (accuracy) component: logged as ``val-core/ocr/mean@1``.

    Args:
        engine: ``"rapidocr"`` (default; the ``ocr`` extra), ``"package.module:factory"``, or any
            callable ``engine(image) -> str``. Built on first use.
    """

    core_components: tuple[str | None, ...] = (None,)  # the reward's one value is the accuracy

    def __init__(self, engine: str | OcrEngine = "rapidocr") -> None:
        if not callable(engine) and not isinstance(engine, str):
            raise ValueError(f"{_FLAG}.engine must be a name or a callable, got {type(engine).__name__}")
        self._engine_spec = engine
        self._engine: OcrEngine | None = None

    @property
    def engine(self) -> OcrEngine:
        if self._engine is None:
            self._engine = _resolve_engine(self._engine_spec)
        return self._engine

    def check(self) -> None:
        """Build the engine now, so a missing OCR package fails before the first rollout."""
        try:
            _ = self.engine
        except ImportError as err:  # a missing package is a setting to fix, said in one message
            message = str(err) if _FLAG in str(err) else f"{_FLAG}.engine ({self._engine_spec!r}): {err}"
            raise SettingsError(message) from err

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        if len(prompts) != images.shape[0]:
            raise ValueError(f"ocr: {images.shape[0]} images but {len(prompts)} prompts")
        targets = [quoted_text(p) for p in prompts]
        untargeted = [p for p, t in zip(prompts, targets, strict=True) if not t]
        if untargeted:
            warnings.warn(
                f"ocr reward: {len(untargeted)} of {len(prompts)} prompts have no text between double quotes "
                f"(e.g. {untargeted[0]!r}); they score 0 by definition. Quote the text to render, e.g. "
                'a sign that says "OPEN"',
                UserWarning,
                stacklevel=2,
            )
        engine = self.engine if any(targets) else None  # built outside the try: a missing package must raise
        scores = []
        for image, target in zip(to_pil(images), targets, strict=True):
            if not target:
                scores.append(0.0)
                continue
            try:
                recognised = engine(image)
            except Exception as err:  # an engine failure drops the sample instead of scoring it 0
                warnings.warn(
                    f"ocr engine failed on an image ({type(err).__name__}: {err}); sample dropped",
                    stacklevel=2,
                )
                scores.append(math.nan)
                continue
            scores.append(ocr_score(recognised, target))
        return torch.tensor(scores, dtype=torch.float32)
