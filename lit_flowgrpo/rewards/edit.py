"""``edit_judge``: a vision-language judge of an edit, shown the source image(s), the result and the instruction.

One ``POST {base_url}/chat/completions`` per sample on the remote rewards' one transport
(:class:`~lit_flowgrpo.rewards.remote.RemoteEndpoint`: a timeout per attempt, retries with backoff,
bounded concurrency, a stop after ``max_consecutive_failures`` failed batches in a row). The one user
message holds, in this order, every source image of the sample's record (in the record's order), the
result, then the question. The reply is read for one number per component, the *last* match of each
component's regex (the question asks for them at the end, after the reasoning); each is divided by
``score_max``. A reply that lacks a component, or gives one outside ``[0, score_max]``, is a failed
attempt (retried); a sample that fails every attempt is NaN in every component: dropped and counted,
never scored 0.

**The scales** follow VIEScore's editing protocol (Ku et al., ACL 2024; TIGER-AI-Lab/VIEScore,
``viescore/__init__.py``, task ``"tie"``): a 0–10 score of the editing's success and a 0–10 score of
over-editing (10: a minimal yet effective edit of the source) make its semantic consistency
SC = min(success, over-editing); naturalness and artifacts, 0–10 each, make its perceptual quality PQ =
min of the two; the overall score is O = √(SC · PQ). Here one request asks for three numbers, the
question written anew: ``instruction`` (the edit is done), ``preservation`` (nothing else changed) and
``quality`` (natural, free of artifacts: VIEScore's two PQ numbers asked as one), and

    overall = √(min(instruction, preservation) · quality)        (all divided by score_max: in [0, 1])

VIEScore asks PQ in a second request that shows the result alone; Flow-Factory's
``ConsistentEditingRewardModel`` (``rewards/consistent_editing.py``) asks two yes/no questions
(instruction following, consistency outside the edit) and takes the geometric mean of their "yes"
probabilities. Both need two requests a sample; one request halves the judge's load, and the
components are logged apart, so a run may weight them as it likes (``edit_judge/instruction``,
``edit_judge/preservation``, ``edit_judge/quality`` in ``weights``).

EditReward (TIGER-AI-Lab/EditReward) is a reward model with a trained score head, not a chat judge: it
answers no chat completion. Register it as a reward of your own that declares ``uses_sources``, in the
training process: the ``served`` client and ``lit-flowgrpo serve-reward`` carry no sources yet.

**Images on the wire**: each image (source or result) at its own aspect ratio, scaled down so that its
longer side is at most ``max_side`` (Flow-GRPO's judges are sent 512 × 512; a square would distort a
source of another shape), PNG by default. Each distinct source tensor is encoded once per call: the K
samples of a group share their record's sources.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.rewards.images import ImageFormat, check_images, data_url, to_pil
from lit_flowgrpo.rewards.registry import register_reward
from lit_flowgrpo.rewards.remote import (
    RemoteEndpoint,
    bearer_headers,
    chat_body,
    chat_reply,
    chat_settings_problems,
)

__all__ = [
    "DEFAULT_COMPONENTS",
    "DEFAULT_EDIT_TEMPLATE",
    "EditJudgeReward",
    "checked_sources",
    "fit_within",
    "template_metadata",
    "to_pil_one",
]

_FLAG = "--model.init_args.reward.init_args.config.edit_judge"

#: The components whose VIEScore combination is ``overall``.
_VIESCORE = ("instruction", "preservation", "quality")

DEFAULT_EDIT_TEMPLATE = (
    "The last image is the result of editing the image(s) before it, the source, by this instruction: "
    "[{prompt}]\n"
    "Judge the result on three scales from 0 to 10.\n"
    "Instruction: is the edit done? 0 if the result ignores the instruction, 10 if it carries it out "
    "completely and exactly. The result may look the same as the source when the edit failed.\n"
    "Preservation: is everything else kept? 0 if the result is a different picture, 10 if nothing but "
    "what the instruction asks for changed: the same layout, objects, identities, colours, background "
    "and style.\n"
    "Quality: does the result look right? 0 if it is badly distorted, blurred or broken, 10 if it looks "
    "natural (lighting, shadows, proportions) and has no artifacts, seams or deformed parts.\n"
    "Reason briefly, then end with exactly three lines:\n"
    "Instruction score: <0-10>\n"
    "Preservation score: <0-10>\n"
    "Quality score: <0-10>"
)

_NUMBER = r"\s*\**\s*([0-9]+(?:\.[0-9]+)?)"
DEFAULT_COMPONENTS = {
    "instruction": r"Instruction score:" + _NUMBER,
    "preservation": r"Preservation score:" + _NUMBER,
    "quality": r"Quality score:" + _NUMBER,
}
"""Component name -> the regex whose first group is its number in the reply (the last match counts)."""


def to_pil_one(image: Tensor) -> Image.Image:
    """One (3, H, W) image in [0, 1] as an RGB PIL image (``round(x·255)``, as every image reward)."""
    return to_pil(image.unsqueeze(0))[0]


def fit_within(image: Image.Image, side: int | None) -> Image.Image:
    """``image`` scaled down (aspect kept, PIL's default filter) so that its longer side is at most
    ``side``; as it is when it already fits or ``side`` is ``None``."""
    width, height = image.size
    if side is None or max(width, height) <= side:
        return image
    scale = side / max(width, height)
    return image.resize((max(1, round(width * scale)), max(1, round(height * scale))))


def checked_sources(sources: Sequence[Sequence[Tensor]] | None, batch: int, label: str) -> list[list[Tensor]]:
    """Each sample's source images, checked: one non-empty list per sample of (3, H, W) tensors.

    Raises:
        ValueError: naming ``label`` (the reward) and what is wrong; a reward that needs sources is
            refused at setup on text-only data, so this is a caller's error, not a sample to drop.
    """
    if sources is None:
        raise ValueError(
            f"{label} needs each sample's source images (sources=...): it scores an edit against its source; "
            'give the records "condition_images", or drop the reward'
        )
    given = [list(s) for s in sources]
    if len(given) != batch:
        raise ValueError(f"{label}: {batch} images but {len(given)} samples' sources: one list per sample")
    for i, images in enumerate(given):
        if not images:
            raise ValueError(
                f'{label}: sample {i} has no source image: its record carries no "condition_images"'
            )
        for image in images:
            if not isinstance(image, Tensor) or image.ndim != 3 or image.shape[0] != 3:
                shape = tuple(image.shape) if isinstance(image, Tensor) else type(image).__name__
                raise ValueError(
                    f"{label}: sample {i}'s sources must be (3, H, W) tensors in [0, 1]; got {shape}"
                )
    return given


def template_metadata(template: str) -> tuple[str, ...]:
    """The metadata keys a question template reads (``{metadata[key]}``), in order, once each."""
    keys: list[str] = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field and field.startswith("metadata["):
            key = field[len("metadata[") :].split("]", 1)[0]
            if key not in keys:
                keys.append(key)
    return tuple(keys)


@register_reward("edit_judge")
class EditJudgeReward:
    """Judge each edit by a vision-language model behind an OpenAI-compatible chat API, shown the source(s),
    the result and the instruction in one request.

    Components: one per entry of ``components`` (default ``instruction``, ``preservation``, ``quality``,
    each divided by ``score_max``), and, when those three are judged, ``overall`` = √(min(instruction,
    preservation) · quality) (VIEScore's O = √(SC · PQ)), the primary component; otherwise the first
    component is the primary.

    Args:
        base_url: the server's API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the served model name sent in each request.
        template: the question, after the images; ``{prompt}`` is the edit instruction (the sample's
            prompt), ``{num_sources}`` the number of source images shown before the result, and
            ``{metadata[key]}`` a metadata field (required of every record).
        components: ``{name: regex}``: the components read from the reply, each the first group of the
            last match of its regex. The default reads ``Instruction score:``, ``Preservation score:``
            and ``Quality score:``.
        score_max: each number is divided by this (10 maps VIEScore's 0–10 scales to [0, 1]); a number
            above it, or below 0, is a failed attempt.
        image_format: encoding of the images in their data URLs.
        max_side: scale each image (sources and result) down, aspect kept, so that its longer side is at
            most this many pixels; ``None`` sends them at their own size.
        max_tokens: completion budget of one reply.
        temperature: sampling temperature of the judge (0 makes it deterministic).
        api_key: sent as ``Authorization: Bearer``; ``None`` sends no key (local servers).
        timeout_s: limit of one request attempt, seconds.
        max_retries: further attempts after a failed one (no reply, an error status, a reply without
            every component).
        backoff_s: sleep before the first retry (doubles each time).
        max_concurrency: requests in flight at once.
        max_consecutive_failures: failed batches (no sample scored) in a row before the run stops.
        extra_body: more fields for every request's JSON body (not ``model`` or ``messages``).
    """

    uses_sources = True
    needs_sources = True

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000/v1",
        model: str = "Qwen2.5-VL-7B-Instruct",
        template: str = DEFAULT_EDIT_TEMPLATE,
        components: dict[str, str] | None = None,
        score_max: float = 10.0,
        image_format: ImageFormat = "png",
        max_side: int | None = 512,
        max_tokens: int = 512,
        temperature: float = 0.0,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        max_concurrency: int = 16,
        max_consecutive_failures: int = 3,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        components = dict(DEFAULT_COMPONENTS if components is None else components)
        problems = []
        patterns: dict[str, re.Pattern[str]] = {}
        if not components:
            problems.append(f"{_FLAG}.components is empty: name at least one component and its regex")
        for name, pattern in components.items():
            if not isinstance(name, str) or not name or "/" in name or name == "overall":
                problems.append(
                    f"{_FLAG}.components names {name!r}: a component name is a non-empty string without '/', "
                    "and not 'overall' (computed from instruction, preservation and quality)"
                )
                continue
            try:
                patterns[name] = re.compile(pattern)
            except (re.error, TypeError) as err:
                problems.append(f"{_FLAG}.components.{name} ({pattern!r}) is not a valid regex: {err}")
                continue
            if patterns[name].groups < 1:
                problems.append(f"{_FLAG}.components.{name} ({pattern!r}) needs a group around the number")
        if "{prompt}" not in template:
            problems.append(f"{_FLAG}.template must contain {{prompt}}, where the edit instruction goes")
        else:
            try:
                template.format(
                    prompt="", num_sources=1, metadata={k: "" for k in template_metadata(template)}
                )
            except (KeyError, IndexError, ValueError, AttributeError) as err:
                problems.append(
                    f"{_FLAG}.template names a field other than {{prompt}}, {{num_sources}} and "
                    f"{{metadata[key]}}, or has a stray brace ({type(err).__name__}: {err}); write a literal "
                    "brace as {{ or }}"
                )
        problems += chat_settings_problems(_FLAG, score_max, image_format, extra_body)
        if max_side is not None and max_side < 1:
            problems.append(f"{_FLAG}.max_side ({max_side}) must be positive or null")
        if problems:
            raise SettingsError("; ".join(problems))
        self.patterns = patterns
        self.overall = all(name in patterns for name in _VIESCORE)
        self.primary = "overall" if self.overall else next(iter(patterns))
        self.required_metadata = template_metadata(template)
        self.model = model
        self.template = template
        self.score_max = float(score_max)
        self.image_format = image_format
        self.max_side = max_side
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.extra_body = dict(extra_body or {})
        self.endpoint = RemoteEndpoint(
            base_url,
            flag=_FLAG,
            timeout_s=timeout_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
            max_concurrency=max_concurrency,
            max_consecutive_failures=max_consecutive_failures,
            headers=bearer_headers(api_key),
            url_key="base_url",
        )

    @property
    def component_names(self) -> list[str]:
        """The components this judge returns, in order (``overall`` last when computed)."""
        return [*self.patterns, *(["overall"] if self.overall else [])]

    def check(self) -> None:
        """Raise a ``SettingsError`` naming ``--model.init_args.reward.init_args.config.edit_judge.base_url``
        if the server is down."""
        self.endpoint.check("models")

    def __call__(
        self,
        images: Tensor,
        prompts: list[str],
        metadata: list[dict],
        sources: Sequence[Sequence[Tensor]] | None = None,
    ) -> dict[str, Tensor]:
        """``{component: (B,) fp32}`` for (B, 3, H, W) results; NaN in every component where the judge failed."""
        check_images(images)
        batch = images.shape[0]
        if len(prompts) != batch:
            raise ValueError(f"edit_judge: {batch} images but {len(prompts)} prompts")
        given = checked_sources(sources, batch, f"reward 'edit_judge' ({_FLAG})")
        metadata = list(metadata) if metadata else [{}] * batch
        # A config error (a template field that a record lacks) raises here, not as a dropped sample.
        questions = [
            self.template.format(prompt=p, num_sources=len(s), metadata=m)
            for p, s, m in zip(prompts, given, metadata, strict=True)
        ]
        urls: dict[int, str] = {}  # id(source tensor) -> its data URL: a group's K samples share them

        def url(image: Tensor) -> str:
            if id(image) not in urls:
                urls[id(image)] = self._url(image)
            return urls[id(image)]

        items = [
            ([url(s) for s in srcs], self._url(result), question)
            for srcs, result, question in zip(given, images, questions, strict=True)
        ]
        replies = self.endpoint.map(self._score_one, items)
        out = {name: torch.full((batch,), math.nan) for name in self.component_names}
        for i, reply in enumerate(replies):
            if reply is None:  # failed: NaN in every component, never a number
                continue
            for name, value in reply.items():
                out[name][i] = value
        return out

    def _url(self, image: Tensor) -> str:
        return data_url(fit_within(to_pil_one(image), self.max_side), self.image_format)

    def _score_one(self, item: tuple[list[str], str, str]) -> dict[str, float]:
        sources, result, question = item
        content = [
            *({"type": "image_url", "image_url": {"url": u}} for u in sources),
            {"type": "image_url", "image_url": {"url": result}},
            {"type": "text", "text": question},
        ]
        body = chat_body(self.model, content, self.max_tokens, self.temperature, self.extra_body)
        return self.endpoint.request("chat/completions", body, "application/json", self._parse)

    def _parse(self, raw: bytes) -> dict[str, float]:
        """The reply's components, each divided by ``score_max``, and ``overall``; a ``ValueError`` (a failed
        attempt, retried) when one is missing or out of range."""
        return self.parse_reply(chat_reply(raw))

    def parse_reply(self, text: Any) -> dict[str, float]:
        """The components of one reply's text (see :meth:`_parse`)."""
        text = text or ""
        found: dict[str, float] = {}
        for name, pattern in self.patterns.items():
            matches = [m.group(1) for m in pattern.finditer(text)]
            if not matches:
                raise ValueError(
                    f"no {name} score matching {pattern.pattern!r} in the reply {str(text)[-160:]!r}"
                )
            try:
                value = float(matches[-1])
            except ValueError as err:
                raise ValueError(f"the {name} score {matches[-1]!r} is not a number") from err
            if not 0 <= value <= self.score_max:
                raise ValueError(f"the {name} score {value} is outside [0, {self.score_max:g}]")
            found[name] = value / self.score_max
        if self.overall:
            # VIEScore's O = sqrt(SC * PQ), SC = min(edit success, over-editing) (viescore/__init__.py)
            semantic = min(found["instruction"], found["preservation"])
            found["overall"] = math.sqrt(semantic * found["quality"])
        return found
