"""GenEval client against a real GenEval-protocol server on 127.0.0.1 with fixed scoring.

The server decodes each image and scores it from its pixels and metadata: ``strict`` = 1 when the
tag is ``single_object``, ``partial`` = mean pixel value / 255 (exact, PNG on the wire). The test
computes the same numbers from the tensors on its own. Its root route answers as the published
server (yifan123/reward-server ``app_geneval.py``) does: pickle in and out, JPEG only, each record's
``prompt`` read, partial credit under ``scores`` and GenEval's non-strict accuracy under ``rewards``.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import pickle
import threading
import traceback
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from lit_flowgrpo.rewards import MultiReward, RemoteRewardError, build_reward
from lit_flowgrpo.rewards.geneval import GenEvalReward

META = [
    {"tag": "single_object", "include": [{"class": "cat", "count": 1}]},
    {"tag": "counting", "include": [{"class": "dog", "count": 2}], "exclude": [{"class": "dog", "count": 3}]},
    {"tag": "single_object", "include": [{"class": "bench", "count": 1}]},
    {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]},
]


REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["a photo of a cat", "a photo of two dogs", "a photo of a bench", "a photo of a red car"]


def _score(image_bytes: bytes, meta: dict, formats: list[str] | None = None) -> tuple[float, float]:
    pixels = np.asarray(Image.open(io.BytesIO(image_bytes), formats=formats).convert("RGB"), dtype=np.float64)
    return float(meta["tag"] == "single_object"), float(pixels.mean() / 255)


def _published_reply(body: bytes) -> dict:
    """The published server's handling of one request: what it reads, and the reply it builds."""
    data = pickle.loads(body)
    only_strict = data["only_strict"]
    scores = []
    for image, meta in zip(data["images"], data["meta_datas"], strict=True):
        _ = meta["prompt"]  # the server reads it for its report: without it, a KeyError and an HTTP 500
        scores.append(_score(image, meta, formats=["jpeg"]))
    strict = [s for s, _ in scores]
    return {
        "scores": [p for _, p in scores],  # partial credit
        "rewards": [0.0 if only_strict else s for s in strict],  # GenEval's non-strict 0/1 accuracy
        "strict_rewards": strict,
        "group_rewards": {"single_object": strict},
        "group_strict_rewards": {"single_object": strict},
    }


# /slow answers only once the test releases it, or after this long: far beyond any client timeout
# used here, so a client that waited for the answer would be seen (as a reply) however loaded the
# machine is.
SLOW_REPLY_AFTER_S = 30.0
TIMEOUT_S = 0.2


class GenEvalHandler(BaseHTTPRequestHandler):
    """Routes pick a behaviour: /ok, /slow, /error, /badjson, /nulls, /chunkfail, /flaky, /pickle."""

    requests = 0
    replies = 0
    lock = threading.Lock()
    release = threading.Event()

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(405)
        self.end_headers()

    def _reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        with GenEvalHandler.lock:
            GenEvalHandler.replies += 1
        # The client timed out and left (the point of /slow): writing to its socket may fail.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with GenEvalHandler.lock:
            GenEvalHandler.requests += 1
            count = GenEvalHandler.requests
        route = self.path.strip("/")
        if route == "":  # the published server
            try:
                return self._reply(200, pickle.dumps(_published_reply(body)), "application/octet-stream")
            except Exception:
                return self._reply(500, traceback.format_exc().encode(), "text/plain")
        data = json.loads(body)
        images = [base64.b64decode(s) for s in data["images"]]
        metas = data["meta_datas"]
        if route == "slow":
            GenEvalHandler.release.wait(SLOW_REPLY_AFTER_S)
        if route == "error" or (route == "flaky" and count == 1):
            return self._reply(500, b"internal error")
        if route == "badjson":
            return self._reply(200, b'{"strict_rewards": [1.0,')
        if route == "chunkfail" and any(m["tag"] == "counting" for m in metas):
            return self._reply(500, b"detector crashed")
        scores = [_score(img, meta) for img, meta in zip(images, metas, strict=True)]
        strict = [s for s, _ in scores]
        partial = [p for _, p in scores]
        if route == "nulls":
            strict = [None if m["tag"] == "colors" else s for s, m in zip(strict, metas, strict=True)]
            partial = [None if m["tag"] == "colors" else p for p, m in zip(partial, metas, strict=True)]
        self._reply(200, json.dumps({"strict_rewards": strict, "scores": partial}).encode())


# The server and this test compute the same float64 mean of the same integer pixels (exact sums,
# correctly rounded divisions; at most an ulp of float64 apart), and each side rounds it once to
# float32: they differ by at most one float32 ulp below 1.
ONE_ULP = 2.0**-24


def _expected(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pixels = (images * 255).round().clamp(0, 255).to(torch.float64)
    partial = (pixels.mean(dim=(1, 2, 3)) / 255).float()
    strict = torch.tensor([float(m["tag"] == "single_object") for m in META])
    return strict, partial


def _expected_jpeg(images: torch.Tensor) -> torch.Tensor:
    """Partial scores of the images as JPEG at PIL's default quality (what the published client sends)."""
    pixels = (images * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    out = []
    for array in pixels:
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG")
        out.append(_score(buffer.getvalue(), {"tag": ""})[1])
    return torch.tensor(out, dtype=torch.float32)


def _reward(url: str, route: str, **kwargs: object) -> GenEvalReward:
    settings = {"image_format": "png", "timeout_s": 5.0, "max_retries": 0, "backoff_s": 0.0, **kwargs}
    return GenEvalReward(url=url, path=route, **settings)


@pytest.fixture
def server(http_server) -> Iterator[str]:
    GenEvalHandler.requests = GenEvalHandler.replies = 0
    GenEvalHandler.release.clear()
    yield http_server(GenEvalHandler)
    GenEvalHandler.release.set()  # let a held /slow handler finish before the server shuts down


def test_success_strict_and_partial(server: str, images: torch.Tensor) -> None:
    reward = _reward(server, "ok", batch_size=3)
    out = reward(images, ["p"] * 4, META)
    strict, partial = _expected(images)
    torch.testing.assert_close(out["strict"], strict)
    torch.testing.assert_close(out["partial"], partial, atol=ONE_ULP, rtol=0)
    assert GenEvalHandler.requests == 2  # 4 images in chunks of 3
    assert reward.endpoint.last_stats.failures == 0


def test_pickle_protocol_needs_explicit_consent_and_jpeg(server: str) -> None:
    with pytest.raises(ValueError, match="allow_pickle"):
        GenEvalReward(url=server, protocol="pickle")
    with pytest.raises(ValueError, match=r"image_format \('png'\) must be 'jpeg' with protocol=pickle"):
        GenEvalReward(url=server, protocol="pickle", allow_pickle=True, image_format="png")


@pytest.mark.parametrize("only_strict", [True, False])
def test_pickle_protocol_against_the_published_server(
    server: str, images: torch.Tensor, only_strict: bool
) -> None:
    """Strict from ``strict_rewards``, partial from ``scores`` (not ``rewards``, which under
    ``only_strict`` is all 0); the server gets each record's prompt, as flow_grpo sends it."""
    reward = _reward(
        server, "", protocol="pickle", allow_pickle=True, image_format="jpeg", only_strict=only_strict
    )
    out = reward(images, PROMPTS, META)
    torch.testing.assert_close(out["strict"], _expected(images)[0])
    torch.testing.assert_close(out["partial"], _expected_jpeg(images), atol=ONE_ULP, rtol=0)
    assert reward.endpoint.last_stats.failures == 0


@pytest.mark.parametrize("recipe", ["sd35m_geneval_flowgrpo.yaml", "sd35m_geneval_grpoguard.yaml"])
def test_geneval_recipes_speak_the_published_server(server: str, images: torch.Tensor, recipe: str) -> None:
    reward_args = yaml.safe_load((REPO / "configs" / recipe).read_text())["model"]["init_args"]["reward"][
        "init_args"
    ]
    settings = reward_args["config"]["geneval"]
    assert settings["protocol"] == "pickle" and settings["allow_pickle"] is True
    multi = MultiReward(
        reward_args["weights"], config={"geneval": {**settings, "url": server, "max_retries": 0}}
    )
    multi.check()
    out = multi(images, PROMPTS, META)
    assert out.failures == {"geneval": 0}
    torch.testing.assert_close(out.components["geneval/strict"], _expected(images)[0])


def test_timeout_gives_nan_not_zero(server: str, images: torch.Tensor, wait_for) -> None:
    reward = _reward(server, "slow", timeout_s=TIMEOUT_S, max_retries=1)
    out = reward(images, ["p"] * 4, META)
    # The client came back while the server still held every request: it gave up on its own.
    assert GenEvalHandler.replies == 0
    assert torch.isnan(out["strict"]).all() and torch.isnan(out["partial"]).all()
    assert "timed out" in reward.endpoint.last_stats.last_error
    assert "after 2 attempt(s)" in reward.endpoint.last_stats.last_error  # and retried once
    assert reward.endpoint.last_stats.failures == 1
    # The server saw both attempts of the one chunk (its handler threads may lag the client).
    assert wait_for(lambda: GenEvalHandler.requests >= 2) and GenEvalHandler.requests == 2


def test_http_500_is_retried_then_succeeds(server: str, images: torch.Tensor) -> None:
    reward = _reward(server, "flaky", max_retries=2)
    out = reward(images, ["p"] * 4, META)
    torch.testing.assert_close(out["strict"], _expected(images)[0])
    assert GenEvalHandler.requests == 2


def test_malformed_json_is_a_failure(server: str, images: torch.Tensor) -> None:
    reward = _reward(server, "badjson", max_retries=1)
    out = reward(images, ["p"] * 4, META)
    assert torch.isnan(out["strict"]).all()
    assert "malformed JSON" in reward.endpoint.last_stats.last_error
    assert GenEvalHandler.requests == 2  # retried once


def test_partial_batch_failure(server: str, images: torch.Tensor) -> None:
    strict, partial = _expected(images)
    # Per-image nulls: only the 'colors' sample (index 3) is dropped.
    out = _reward(server, "nulls")(images, ["p"] * 4, META)
    assert torch.isnan(out["strict"][3]) and torch.isnan(out["partial"][3])
    torch.testing.assert_close(out["partial"][:3], partial[:3], atol=ONE_ULP, rtol=0)
    # A failed chunk: chunk [0, 1] holds the 'counting' sample and fails with 500; chunk [2, 3] is scored.
    reward = _reward(server, "chunkfail", batch_size=2)
    out = reward(images, ["p"] * 4, META)
    assert torch.isnan(out["strict"][:2]).all()
    torch.testing.assert_close(out["strict"][2:], strict[2:])
    assert reward.endpoint.last_stats.failures == 1 and "HTTP 500" in reward.endpoint.last_stats.last_error
    assert reward.endpoint.consecutive_failures == 0  # a batch with any success is not a failed batch


def test_consecutive_failed_batches_stop_the_run(server: str, images: torch.Tensor) -> None:
    reward = _reward(server, "error", max_consecutive_failures=2)
    out = reward(images, ["p"] * 4, META)
    assert torch.isnan(out["strict"]).all()
    with pytest.raises(RemoteRewardError, match=r"127\.0\.0\.1.*2 consecutive batches.*HTTP 500"):
        reward(images, ["p"] * 4, META)


def test_through_multireward_counts_failures(server: str, images: torch.Tensor) -> None:
    multi = MultiReward(
        {"geneval": 1.0, "geneval/partial": 0.0},
        config={"geneval": {"url": server, "path": "nulls", "image_format": "png", "max_retries": 0}},
    )
    multi.check()
    out = multi(images, ["p"] * 4, META)
    assert out.failures == {"geneval": 1}
    assert out.valid.tolist() == [True, True, True, False]
    logs = out.log_dict()
    assert logs["reward/failure_rate"] == 0.25
    strict, partial = _expected(images)
    assert logs["critic/rewards/geneval/strict/mean"] == pytest.approx(float(strict[:3].mean()))
    # Three values, each within ONE_ULP of ours, averaged in fp32 on both sides: each side's sum rounds
    # twice (below 4: within 2^-23 = 2 ulps each) and divides once (half an ulp): in ulps below 1,
    # (3 + 2·2·2)/3 + 2·½ < 5.
    assert logs["critic/rewards/geneval/partial/mean"] == pytest.approx(
        float(partial[:3].mean()), abs=5 * ONE_ULP
    )
    assert logs["reward/latency_s"] > 0


def test_bad_input(server: str, closed_port_url: str, images: torch.Tensor) -> None:
    with pytest.raises(
        ValueError, match=r"--model\.init_args\.reward\.init_args\.config\.geneval\.url .* unreachable"
    ):
        GenEvalReward(url=closed_port_url, timeout_s=1.0).check()
    GenEvalReward(url=server).check()  # a POST-only server answering 405 is reachable
    with pytest.raises(ValueError, match=r"geneval\.url .* must be an http"):
        GenEvalReward(url="127.0.0.1:18085")
    bad_meta = [{"tag": "single_object"}, *META[1:]]
    with pytest.raises(ValueError, match=r"sample 0 lacks \['include'\]"):
        _reward(server, "ok")(images, ["p"] * 4, bad_meta)
    multi = MultiReward({"geneval": 1.0}, config={"geneval": {"url": server}})
    with pytest.raises(
        ValueError, match=r"'geneval' \(--model\.init_args\.reward\.init_args\.weights\) needs metadata"
    ):
        multi.check_metadata([{"tag": "colors"}])
    assert build_reward("geneval", url=server).required_metadata == ("tag", "include")
