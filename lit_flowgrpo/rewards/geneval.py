"""GenEval reward: a client for a GenEval scoring server (Mask2Former detection as a separate service).

GenEval (Ghosh et al., 2023) checks object presence, count, colour and position with a detector;
Flow-GRPO serves it over HTTP (flow_grpo/rewards.py ``geneval_score``, the server being
yifan123/reward-server's ``app_geneval.py``) because its mmdet stack cannot share an environment with
the trainer. One POST to the server's root per chunk of ``batch_size`` images.

``protocol="pickle"`` speaks that published server as shipped (what the GenEval recipes use)::

    request:  pickle.dumps({"images": [JPEG bytes, ...], "meta_datas": [{...}, ...], "only_strict": bool})
    response: pickle.dumps({"strict_rewards": [0/1, ...], "scores": [float, ...], "rewards": [0/1, ...],
                            "group_strict_rewards": {...}, "group_rewards": {...}})

Each ``meta_datas`` entry is the prompt's GenEval record (``tag``, ``include``, optionally ``exclude``)
with its ``prompt``, which the server reads. It opens JPEG only. Of the reply, ``strict_rewards`` (1
when every requirement of the prompt holds) is the ``strict`` component and ``scores`` (the fraction
of requirements that hold: partial credit) the ``partial`` one; ``rewards`` (GenEval's original,
non-strict accuracy, all 0 under ``only_strict``) and the per-tag ``group_*`` are not used.
Unpickling a reply runs whatever code the reply names, so a malicious or compromised server, or
anyone who can answer in its place on the network, runs code in the trainer: it also needs
``allow_pickle=True``, for a server you run yourself, reached over a network you trust.

``protocol="json"`` (the default) is the same exchange with nothing executable in it, for a server
with a small adapter in front of its scoring function (``json.loads`` of the request, base64-decoded
images, ``json.dumps`` of the same reply dict)::

    request:  {"images": [base64 JPEG|PNG, ...], "image_format": "jpeg"|"png",
               "meta_datas": [{"prompt": ..., "tag": ..., "include": [...], "exclude": [...]}, ...],
               "only_strict": true|false}
    response: {"strict_rewards": [float|null, ...], "scores": [float|null, ...]}   (other keys ignored)

``null`` marks an image the server could not score: it becomes NaN here and the sample is dropped,
never scored 0.
"""

from __future__ import annotations

import json
import math
import pickle
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from lit_flowgrpo.rewards.images import ImageFormat, encode, to_base64, to_pil
from lit_flowgrpo.rewards.registry import register_reward
from lit_flowgrpo.rewards.remote import RemoteEndpoint, decode_json

_FLAG = "--model.init_args.reward.init_args.config.geneval"


def _floats(values: Any, n: int, key: str) -> list[float]:
    if not isinstance(values, list) or len(values) != n:
        got = len(values) if isinstance(values, list) else type(values).__name__
        raise ValueError(f"'{key}' must be a list of {n} numbers, got {got}")
    return [math.nan if v is None else float(v) for v in values]


def _unpickle(raw: bytes) -> Any:
    # Only reached with protocol=pickle and allow_pickle=True (checked in the constructor).
    try:
        return pickle.loads(raw)
    except Exception as err:
        raise ValueError(f"malformed pickle response ({type(err).__name__}: {err})") from err


@register_reward("geneval")
class GenEvalReward:
    """Strict and partial GenEval scores from a remote server.

    Components: ``strict`` (all requirements met: 0/1) and ``partial`` (fraction met). ``primary``
    chooses which a bare ``geneval`` weight applies to; the other can be weighted as
    ``geneval/partial`` or watched with weight 0. ``strict`` is the core component (the benchmark's
    accuracy, logged under ``val-core/``), whichever is primary.

    Args:
        url: the server's URL (the published server listens on ``http://127.0.0.1:18085``).
        path: the route requests are posted to.
        primary: the component a bare ``geneval`` weight applies to.
        only_strict: asks the server to skip GenEval's original, non-strict check (faster), which
            this reward does not use; strict and partial scores come either way.
        batch_size: images per request; chunks go out concurrently.
        image_format: encoding of the images on the wire; ``jpeg`` (PIL's default quality) is what
            the published client sends and the only one the published server opens.
        protocol: ``json`` (the format above) or ``pickle`` (the published server as shipped;
            needs ``allow_pickle``).
        allow_pickle: explicit consent to unpickle the server's replies; only with ``pickle``.
        timeout_s: limit of one request attempt, seconds.
        max_retries: further attempts after a failed one.
        backoff_s: sleep before the first retry (doubles each time).
        max_concurrency: requests in flight at once.
        max_consecutive_failures: failed batches in a row before the run stops.
    """

    core_components: tuple[str | None, ...] = ("strict",)  # GenEval's score, whichever is primary
    required_metadata: tuple[str, ...] = ("tag", "include")

    def __init__(
        self,
        url: str = "http://127.0.0.1:18085",
        path: str = "",
        primary: Literal["strict", "partial"] = "strict",
        only_strict: bool = False,
        batch_size: int = 64,
        image_format: ImageFormat = "jpeg",
        protocol: Literal["json", "pickle"] = "json",
        allow_pickle: bool = False,
        timeout_s: float = 120.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        max_concurrency: int = 4,
        max_consecutive_failures: int = 3,
    ) -> None:
        problems = []
        if primary not in ("strict", "partial"):
            problems.append(f"{_FLAG}.primary ({primary!r}) must be 'strict' or 'partial'")
        if batch_size < 1:
            problems.append(f"{_FLAG}.batch_size ({batch_size}) must be at least 1")
        if image_format not in ("jpeg", "png"):
            problems.append(f"{_FLAG}.image_format ({image_format!r}) must be 'jpeg' or 'png'")
        if protocol not in ("json", "pickle"):
            problems.append(f"{_FLAG}.protocol ({protocol!r}) must be 'json' or 'pickle'")
        if protocol == "pickle" and not allow_pickle:
            problems.append(
                f"{_FLAG}.protocol=pickle unpickles bytes from the network, which can run arbitrary code: "
                f"set {_FLAG}.allow_pickle=true only for a server you run and trust, or use protocol=json"
            )
        if protocol == "pickle" and image_format != "jpeg":
            problems.append(
                f"{_FLAG}.image_format ({image_format!r}) must be 'jpeg' with protocol=pickle: the published "
                "server opens JPEG only"
            )
        if problems:
            raise ValueError("; ".join(problems))
        self.primary = primary
        self.path = path
        self.only_strict = only_strict
        self.batch_size = batch_size
        self.image_format = image_format
        self.protocol = protocol
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
        """Raise a ``ValueError`` naming ``--model.init_args.reward.init_args.config.geneval.url`` if the server is down."""
        self.endpoint.check(self.path)

    def check_metadata(self, metadata: Sequence[dict]) -> None:
        """Raise a ``ValueError`` naming the missing keys unless every sample has GenEval's fields."""
        for i, meta in enumerate(metadata):
            missing = [k for k in self.required_metadata if not isinstance(meta, dict) or k not in meta]
            if missing:
                raise ValueError(
                    f"reward 'geneval' needs metadata {list(self.required_metadata)} for every prompt; sample "
                    f"{i} lacks {missing}. Use a GenEval prompt file (one JSON object per line with 'prompt', "
                    "'tag', 'include' and optionally 'exclude') as --data's metadata source"
                )

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, Tensor]:
        if len(metadata) != images.shape[0] or len(prompts) != images.shape[0]:
            raise ValueError(
                f"geneval: {images.shape[0]} images but {len(prompts)} prompts and {len(metadata)} metadata entries"
            )
        self.check_metadata(metadata)
        pil = to_pil(images)
        # The server reads each record's prompt (flow_grpo sends whole prompt-file records); the data
        # module keeps it apart from the metadata, so it goes back in here.
        records = [{**meta, "prompt": prompt} for meta, prompt in zip(metadata, prompts, strict=True)]
        chunks = [
            (pil[i : i + self.batch_size], records[i : i + self.batch_size])
            for i in range(0, len(pil), self.batch_size)
        ]
        results = self.endpoint.map(self._score_chunk, chunks)
        strict: list[float] = []
        partial: list[float] = []
        for (chunk_images, _), result in zip(chunks, results, strict=True):
            if result is None:  # the chunk failed: its samples are dropped, not scored 0
                strict += [math.nan] * len(chunk_images)
                partial += [math.nan] * len(chunk_images)
            else:
                strict += result[0]
                partial += result[1]
        return {"strict": torch.tensor(strict), "partial": torch.tensor(partial)}

    def _score_chunk(self, chunk: tuple[list, list[dict]]) -> tuple[list[float], list[float]]:
        images, metadata = chunk
        encoded = [encode(image, self.image_format) for image in images]
        if self.protocol == "pickle":
            # The published server's request: raw JPEG bytes and the metadata list, pickled.
            body = pickle.dumps({"images": encoded, "meta_datas": metadata, "only_strict": self.only_strict})
            return self.endpoint.request(
                self.path,
                body,
                "application/octet-stream",
                lambda raw: self._parse(_unpickle(raw), len(images)),
            )
        else:
            payload = {
                "images": [to_base64(data) for data in encoded],
                "image_format": self.image_format,
                "meta_datas": metadata,
                "only_strict": self.only_strict,
            }
            try:
                body = json.dumps(payload).encode("utf-8")
            except TypeError as err:
                raise ValueError(f"geneval: metadata must be JSON-serialisable ({err})") from err
        return self.endpoint.request(
            self.path, body, "application/json", lambda raw: self._parse(decode_json(raw), len(images))
        )

    @staticmethod
    def _parse(reply: Any, n: int) -> tuple[list[float], list[float]]:
        if not isinstance(reply, dict):
            raise ValueError(f"the GenEval reply must be an object, got {type(reply).__name__}")
        missing = [k for k in ("strict_rewards", "scores") if k not in reply]
        if missing:
            raise ValueError(
                f"the GenEval reply lacks {missing}; it has {sorted(reply)} (partial credit is 'scores': "
                "the published server's 'rewards' is GenEval's non-strict 0/1 accuracy)"
            )
        return _floats(reply["strict_rewards"], n, "strict_rewards"), _floats(reply["scores"], n, "scores")
