"""``served``: a reward scored by ``lit-flowgrpo serve-reward`` (:mod:`lit_flowgrpo.rewards.server`).

The client of that server's JSON protocol, on the remote rewards' one transport
(:class:`~lit_flowgrpo.rewards.remote.RemoteEndpoint`: a timeout per attempt, retries with backoff on
timeouts, refused connections and 5xx, none on another 4xx, bounded concurrency, and a stop after
``max_consecutive_failures`` failed batches in a row). One POST to ``{url}/score`` per chunk of
``batch_size`` images, the chunks concurrently. A chunk that fails after its retries (the server
down, killed, or refusing the request) makes its samples NaN in every component: they are dropped
from the advantages and counted (``reward/failure_rate``), never scored 0; a ``null`` in a reply is
one sample the served reward could not score.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.rewards.images import ImageFormat, encode, to_base64, to_pil
from lit_flowgrpo.rewards.registry import register_reward
from lit_flowgrpo.rewards.remote import RemoteEndpoint, decode_json

__all__ = ["ServedReward"]

_FLAG = "--model.init_args.reward.init_args.config.served"


@register_reward("served")
class ServedReward:
    """A reward scored by a ``lit-flowgrpo serve-reward`` server.

    Args:
        url: the server's base URL (``serve-reward`` listens on ``http://127.0.0.1:18086`` by default).
        components: the components the served reward returns, in the reply's names (``score`` for a
            reward that returns one Tensor); each is a component of this reward, ``served/<name>``.
        primary: the component a bare ``served`` weight applies to (``None``: the first).
        core_components: those of ``components`` that measure accuracy (logged under ``val-core/``).
        batch_size: images per request; chunks go out concurrently.
        image_format: encoding of the images on the wire (``png`` is lossless).
        timeout_s: limit of one request attempt, seconds.
        max_retries: further attempts after a failed one.
        backoff_s: sleep before the first retry (doubles each time).
        max_concurrency: requests in flight at once.
        max_consecutive_failures: failed batches in a row before the run stops.
    """

    def __init__(
        self,
        url: str = "http://127.0.0.1:18086",
        components: Sequence[str] = ("score",),
        primary: str | None = None,
        core_components: Sequence[str] = (),
        batch_size: int = 16,
        image_format: ImageFormat = "png",
        timeout_s: float = 120.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        max_concurrency: int = 4,
        max_consecutive_failures: int = 3,
    ) -> None:
        components = list(components)
        problems = []
        if not components or not all(isinstance(c, str) and c for c in components):
            problems.append(f"{_FLAG}.components ({components!r}) must name at least one component")
        if primary is not None and primary not in components:
            problems.append(f"{_FLAG}.primary ({primary!r}) must be one of components {components}")
        if not set(core_components) <= set(components):
            problems.append(f"{_FLAG}.core_components ({list(core_components)}) must be among {components}")
        if batch_size < 1:
            problems.append(f"{_FLAG}.batch_size ({batch_size}) must be at least 1")
        if image_format not in ("png", "jpeg"):
            problems.append(f"{_FLAG}.image_format ({image_format!r}) must be 'png' or 'jpeg'")
        if problems:
            raise SettingsError("; ".join(problems))
        self.components = components
        self.primary = primary or components[0]
        self.core_components = tuple(core_components)
        self.batch_size = batch_size
        self.image_format = image_format
        self.endpoint = RemoteEndpoint(
            url,
            flag=_FLAG,
            timeout_s=timeout_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
            max_concurrency=max_concurrency,
            max_consecutive_failures=max_consecutive_failures,
        )

    def check(self) -> None:
        """Raise a ``SettingsError`` naming ``--model.init_args.reward.init_args.config.served.url`` if
        the server is down."""
        self.endpoint.check("health")

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, Tensor]:
        if len(prompts) != images.shape[0]:
            raise ValueError(f"served: {images.shape[0]} images but {len(prompts)} prompts")
        metadata = list(metadata) if metadata else [{}] * len(prompts)
        pil = to_pil(images)
        chunks = [
            (
                pil[i : i + self.batch_size],
                prompts[i : i + self.batch_size],
                metadata[i : i + self.batch_size],
            )
            for i in range(0, len(pil), self.batch_size)
        ]
        results = self.endpoint.map(self._score_chunk, chunks)
        out: dict[str, list[float]] = {c: [] for c in self.components}
        for (chunk, _, _), result in zip(chunks, results, strict=True):
            for c in self.components:  # a failed chunk: its samples are dropped, never scored 0
                out[c] += [math.nan] * len(chunk) if result is None else result[c]
        return {c: torch.tensor(values, dtype=torch.float32) for c, values in out.items()}

    def _score_chunk(self, chunk: tuple[list, list[str], list[dict]]) -> dict[str, list[float]]:
        images, prompts, metadata = chunk
        payload = {
            "images": [to_base64(encode(image, self.image_format)) for image in images],
            "image_format": self.image_format,
            "prompts": prompts,
            "metadata": metadata,
        }
        try:
            body = json.dumps(payload).encode("utf-8")
        except TypeError as err:
            raise ValueError(f"served: metadata must be JSON-serialisable ({err})") from err
        return self.endpoint.request(
            "score", body, "application/json", lambda raw: self._parse(decode_json(raw), len(images))
        )

    def _parse(self, reply: Any, n: int) -> dict[str, list[float]]:
        found = reply.get("components") if isinstance(reply, dict) else None
        if not isinstance(found, dict):
            raise ValueError(f"the reply has no 'components' object: {str(reply)[:120]}")
        missing = [c for c in self.components if c not in found]
        if missing:
            raise ValueError(
                f"the served reward returned components {sorted(found)}, not {missing}: set {_FLAG}.components"
            )
        out = {}
        for c in self.components:
            values = found[c]
            if not isinstance(values, list) or len(values) != n:
                raise ValueError(f"component {c!r} must be a list of {n} numbers or nulls")
            out[c] = [math.nan if v is None else float(v) for v in values]
        return out
