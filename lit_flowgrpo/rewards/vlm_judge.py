"""VLM-as-judge reward: any OpenAI-compatible chat endpoint (vLLM, sglang) serving a vision model.

One ``POST {base_url}/chat/completions`` per image, the image inline as a base64 ``data:`` URL,
the question from a configurable template; the score is the first group of a configurable regex
in the reply, divided by ``score_max``. This is Flow-GRPO's UnifiedReward judge
(flow_grpo/rewards.py ``unifiedreward_score_sglang``: "Final Score: x" out of 5, divided by 5),
generalised. A reply without a score is a failed sample (NaN, dropped), not a 0 as there.

Videos ``(B, F, 3, H, W)`` are judged too, one request per video, with ``video_template`` (which may
name ``{num_frames}`` and ``{fps}``, those of the frames sent) and up to ``max_frames`` evenly spaced
frames, sent one of two ways:

- ``video_format="frames"``: one ``image_url`` part per frame, in order, then the question: any server
  that takes several images in one message reads it;
- ``video_format="video_url"``: one ``video_url`` part whose URL is ``data:video/jpeg;base64,`` and the
  frames' base64 JPEGs joined by commas, the form in which vLLM's OpenAI server takes a video as
  frames (its ``VideoMediaIO.load_base64`` for the media type ``video/jpeg``), so a video model
  (Qwen2.5-VL, ...) sees one video with its temporal position encoding.

The frame rate reaches the judge in the question; ``extra_body`` adds server-specific fields to every
request (for vLLM, e.g. ``{"mm_processor_kwargs": {"fps": 16}}``).
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

import torch
from torch import Tensor

from lit_flowgrpo.rewards.images import (
    ImageFormat,
    check_videos,
    data_url,
    encode,
    frame_indices,
    to_base64,
    to_pil_resized,
)
from lit_flowgrpo.rewards.registry import register_reward
from lit_flowgrpo.rewards.remote import (
    RemoteEndpoint,
    bearer_headers,
    chat_body,
    chat_reply,
    chat_settings_problems,
)

_FLAG = "--model.init_args.reward.init_args.config.vlm_judge"

DEFAULT_TEMPLATE = (
    "You are given a text caption and an image generated from it. Judge (1) how well the image "
    "matches the caption: objects, counts, attributes and relations; and (2) the image quality: "
    "clarity, detail and aesthetics. Give a score from 1 to 5 after 'Final Score:'.\n"
    "Caption: [{prompt}]"
)
DEFAULT_VIDEO_TEMPLATE = (
    "You are given a text caption and a video generated from it, as {num_frames} frames in order at "
    "{fps:.3g} frames per second. Judge (1) how well the video matches the caption: objects, counts, "
    "attributes, relations and the motion it describes; and (2) the video quality: clarity, detail, "
    "smooth and consistent motion without flicker. Give a score from 1 to 5 after 'Final Score:'.\n"
    "Caption: [{prompt}]"
)
DEFAULT_PATTERN = r"Final Score:\s*\**\s*([0-9]+(?:\.[0-9]+)?)"


@register_reward("vlm_judge")
class VLMJudgeReward:
    """Score images or videos with a vision-language model behind an OpenAI-compatible chat API.

    Args:
        base_url: the server's API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the served model name sent in each request.
        template: the question; ``{prompt}`` is replaced by the sample's prompt (``str.format``),
            ``{metadata[key]}`` reads a metadata field.
        score_pattern: a regex whose first group is the score in the reply.
        score_max: the score is divided by this (5 maps a 1–5 scale to (0, 1]).
        image_format: encoding of the image in the data URL.
        resize: resize images (and video frames) to this square size before sending (Flow-GRPO
            sends 512); ``None`` sends them as they are.
        max_tokens: completion budget of one reply.
        temperature: sampling temperature of the judge (0 makes it deterministic).
        api_key: sent as ``Authorization: Bearer``; ``None`` sends no key (local servers).
        timeout_s: limit of one request attempt, seconds.
        max_retries: further attempts after a failed one.
        backoff_s: sleep before the first retry (doubles each time).
        max_concurrency: requests in flight at once.
        max_consecutive_failures: failed batches in a row before the run stops.
        video_template: the question for a video; ``{prompt}``, ``{metadata[key]}``, ``{num_frames}``
            and ``{fps}`` (the frames sent and their rate) are filled in.
        video_format: ``"frames"`` (one image part per frame, in ``image_format``) or ``"video_url"``
            (vLLM's ``data:video/jpeg`` list of JPEG frames); see the module doc.
        fps: the frame rate of the videos the reward is given (Wan 2.1 generates 16).
        max_frames: send at most this many frames of a video, evenly spaced with the first and the
            last (the rate the judge is told shrinks with them); ``None`` sends every frame.
        extra_body: more fields for every request's JSON body (not ``model`` or ``messages``).
    """

    modalities = frozenset({"image", "video"})

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000/v1",
        model: str = "UnifiedReward-7b-v1.5",
        template: str = DEFAULT_TEMPLATE,
        score_pattern: str = DEFAULT_PATTERN,
        score_max: float = 5.0,
        image_format: ImageFormat = "png",
        resize: int | None = 512,
        max_tokens: int = 512,
        temperature: float = 0.0,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        max_concurrency: int = 16,
        max_consecutive_failures: int = 3,
        video_template: str = DEFAULT_VIDEO_TEMPLATE,
        video_format: Literal["frames", "video_url"] = "frames",
        fps: float = 16.0,
        max_frames: int | None = 8,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        problems = []
        try:
            self.pattern = re.compile(score_pattern)
            if self.pattern.groups < 1:
                problems.append(f"{_FLAG}.score_pattern ({score_pattern!r}) needs a group around the number")
        except re.error as err:
            problems.append(f"{_FLAG}.score_pattern ({score_pattern!r}) is not a valid regex: {err}")
        if "{prompt}" not in template:
            problems.append(f"{_FLAG}.template must contain {{prompt}}, where the sample's prompt goes")
        problems += chat_settings_problems(_FLAG, score_max, image_format, extra_body)
        if resize is not None and resize < 1:
            problems.append(f"{_FLAG}.resize ({resize}) must be positive or null")
        if "{prompt}" not in video_template:
            problems.append(f"{_FLAG}.video_template must contain {{prompt}}, where the sample's prompt goes")
        if video_format not in ("frames", "video_url"):
            problems.append(f"{_FLAG}.video_format ({video_format!r}) must be 'frames' or 'video_url'")
        if not fps > 0:
            problems.append(f"{_FLAG}.fps ({fps}) must be positive")
        if max_frames is not None and max_frames < 1:
            problems.append(f"{_FLAG}.max_frames ({max_frames}) must be at least 1, or null for every frame")
        if problems:
            raise ValueError("; ".join(problems))
        self.video_template = video_template
        self.video_format = video_format
        self.fps = float(fps)
        self.max_frames = max_frames
        self.extra_body = dict(extra_body or {})
        self.model = model
        self.template = template
        self.score_max = float(score_max)
        self.image_format = image_format
        self.resize = resize
        self.max_tokens = max_tokens
        self.temperature = temperature
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

    def check(self) -> None:
        """Raise a ``ValueError`` naming ``--model.init_args.reward.init_args.config.vlm_judge.base_url`` if the server is down."""
        self.endpoint.check("models")

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        """(B,) fp32 for (B, 3, H, W) images or (B, F, 3, H, W) videos; NaN where the judge failed."""
        kind = "videos" if images.ndim == 5 else "images"
        if len(prompts) != images.shape[0]:
            raise ValueError(f"vlm_judge: {images.shape[0]} {kind} but {len(prompts)} prompts")
        metadata = list(metadata) if metadata else [{}] * len(prompts)
        media = self._video_parts(images) if kind == "videos" else self._image_parts(images)
        items = list(zip(media, prompts, metadata, strict=True))
        scores = self.endpoint.map(self._score_one, items)
        return torch.tensor([math.nan if s is None else s for s in scores], dtype=torch.float32)

    def _image_parts(self, images: Tensor) -> list[tuple[list[dict], dict[str, Any]]]:
        """Per image: its message parts, and what the template may name beyond the prompt."""
        return [
            ([{"type": "image_url", "image_url": {"url": data_url(image, self.image_format)}}], {})
            for image in to_pil_resized(images, self.resize)
        ]

    def _video_parts(self, videos: Tensor) -> list[tuple[list[dict], dict[str, Any]]]:
        """Per video: the parts that carry its frames, and ``num_frames`` and ``fps`` for the template."""
        check_videos(videos, f"reward 'vlm_judge' ({_FLAG})")
        frames = videos.shape[1]
        index = frame_indices(frames, self.max_frames)
        # n of F frames evenly spaced span the same (F-1)/fps seconds: (n-1)/that frames per second
        fps = self.fps * (len(index) - 1) / (frames - 1) if len(index) > 1 else self.fps
        out = []
        for video in videos:
            pil = to_pil_resized(video[index], self.resize)
            if self.video_format == "video_url":
                joined = ",".join(to_base64(encode(frame, "jpeg")) for frame in pil)
                parts = [{"type": "video_url", "video_url": {"url": f"data:video/jpeg;base64,{joined}"}}]
            else:
                parts = [
                    {"type": "image_url", "image_url": {"url": data_url(frame, self.image_format)}}
                    for frame in pil
                ]
            out.append((parts, {"num_frames": len(index), "fps": fps}))
        return out

    def _score_one(self, item: tuple[tuple[list[dict], dict[str, Any]], str, dict]) -> float:
        (parts, fields), prompt, meta = item
        template = self.video_template if "fps" in fields else self.template
        question = template.format(prompt=prompt, metadata=meta, **fields)
        content = [*parts, {"type": "text", "text": question}]
        body = chat_body(self.model, content, self.max_tokens, self.temperature, self.extra_body)
        return self.endpoint.request("chat/completions", body, "application/json", self._parse)

    def _parse(self, raw: bytes) -> float:
        text = chat_reply(raw)
        match = self.pattern.search(text or "")
        if match is None:
            raise ValueError(f"no score matching {self.pattern.pattern!r} in the reply {str(text)[:120]!r}")
        return float(match.group(1)) / self.score_max
