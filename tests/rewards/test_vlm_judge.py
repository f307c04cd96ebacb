"""VLM judge against a real OpenAI-compatible chat server on 127.0.0.1 with fixed scoring.

The server decodes the data-URL image and answers ``Final Score: s`` with s = 1 + 4·mean/255 of
the PNG pixels it received; the test computes s/5 from the tensors on its own.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import ClassVar

import numpy as np
import pytest
import torch
from PIL import Image

from lit_flowgrpo.rewards import RemoteRewardError
from lit_flowgrpo.rewards.vlm_judge import VLMJudgeReward

PROMPTS = ["a red cube", "two cats", "FAIL here", "a blue sky"]


# /slow answers only once the test releases it, or after this long: far beyond the client's timeout,
# so a client that waited for the answer would be seen (as a reply) however loaded the machine is.
# /pairs holds each request until a second one is in flight with it, for as long at most.
HOLD_S = 30.0
TIMEOUT_S = 0.2


class ChatHandler(BaseHTTPRequestHandler):
    """Route prefix picks a behaviour: /ok, /pairs, /slow, /error, /badjson, /noscore, /partial
    (500 on 'FAIL')."""

    in_flight = 0
    max_in_flight = 0
    replies = 0
    lock = threading.Lock()
    release = threading.Event()
    pairs = threading.Barrier(2, timeout=HOLD_S)
    seen: ClassVar[list[dict]] = []

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, status: int, body: bytes) -> None:
        # Out of flight before the answer goes out: the client may send its next request as soon as
        # it has read this one, possibly before this thread runs again.
        self._leave()
        with ChatHandler.lock:
            ChatHandler.replies += 1
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client timed out and left
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path.endswith("/v1/models"):
            return self._reply(200, b'{"object": "list", "data": [{"id": "judge"}]}')
        self._reply(404, b"{}")

    def do_POST(self) -> None:
        route = self.path.split("/")[1]
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with ChatHandler.lock:
            ChatHandler.in_flight += 1
            ChatHandler.max_in_flight = max(ChatHandler.max_in_flight, ChatHandler.in_flight)
            ChatHandler.seen.append(request)
        self._in_flight = True
        try:
            self._answer(route, request)
        finally:
            self._leave()

    def _leave(self) -> None:
        if getattr(self, "_in_flight", False):
            self._in_flight = False
            with ChatHandler.lock:
                ChatHandler.in_flight -= 1

    def _answer(self, route: str, request: dict) -> None:
        content = request["messages"][0]["content"]
        url = next(c["image_url"]["url"] for c in content if c["type"] == "image_url")
        text = next(c["text"] for c in content if c["type"] == "text")
        pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))), dtype=np.float64)
        if route == "slow":
            ChatHandler.release.wait(HOLD_S)
        if route == "pairs":
            ChatHandler.pairs.wait()  # BrokenBarrierError (no reply) if no second request comes
            # Stay in flight a little longer: a client over its bound would have a third request
            # counted meanwhile. (A loaded machine can only hide such a bug, never fail the test.)
            time.sleep(0.1)
        if route == "error" or (route == "partial" and "FAIL" in text):
            return self._reply(500, b'{"error": "boom"}')
        if route == "badjson":
            return self._reply(200, b'{"choices": [{"message": ')
        answer = (
            "I cannot tell."
            if route == "noscore"
            else f"Reasoning...\nFinal Score: {1 + 4 * pixels.mean() / 255:.6f}"
        )
        self._reply(
            200, json.dumps({"choices": [{"message": {"role": "assistant", "content": answer}}]}).encode()
        )


# The server prints s = 1 + 4·mean/255 with 6 decimals (off by at most 0.5e-6), the reward divides
# it by 5; the float64 means agree to an ulp, and each side rounds once to float32 (one ulp below 1).
ATOL = 0.5e-6 / 5 + 2.0**-24


def _expected(images: torch.Tensor) -> torch.Tensor:
    pixels = (images * 255).round().clamp(0, 255).to(torch.float64)
    return ((1 + 4 * pixels.mean(dim=(1, 2, 3)) / 255) / 5).float()


@pytest.fixture
def server(http_server) -> Iterator[str]:
    ChatHandler.in_flight = ChatHandler.max_in_flight = ChatHandler.replies = 0
    ChatHandler.seen = []
    ChatHandler.release.clear()
    ChatHandler.pairs.reset()
    yield http_server(ChatHandler)
    ChatHandler.release.set()  # let held /slow handlers finish before the server shuts down


def _judge(server: str, route: str, **kwargs: object) -> VLMJudgeReward:
    settings = {
        "resize": None,
        "timeout_s": 5.0,
        "max_retries": 0,
        "backoff_s": 0.0,
        "model": "judge",
        **kwargs,
    }
    return VLMJudgeReward(base_url=f"{server}/{route}/v1", **settings)


def test_success_and_request_format(server: str, images: torch.Tensor) -> None:
    judge = _judge(server, "pairs", template="Rate: {prompt} ({metadata[tag]})", max_concurrency=2)
    scores = judge(images, PROMPTS, [{"tag": f"t{i}"} for i in range(4)])
    torch.testing.assert_close(scores, _expected(images), atol=ATOL, rtol=0)
    # /pairs answers a request only once another is in flight with it: every request was answered,
    # so two ran at once; never three (bounded).
    assert ChatHandler.max_in_flight == 2 and judge.endpoint.last_stats.failures == 0
    texts = sorted(
        c["text"] for r in ChatHandler.seen for c in r["messages"][0]["content"] if c["type"] == "text"
    )
    assert texts == sorted(f"Rate: {p} (t{i})" for i, p in enumerate(PROMPTS))
    assert all(r["model"] == "judge" and r["temperature"] == 0.0 for r in ChatHandler.seen)


def test_timeout(server: str, images: torch.Tensor, wait_for) -> None:
    judge = _judge(server, "slow", timeout_s=TIMEOUT_S, max_concurrency=4)
    scores = judge(images, PROMPTS, [])
    # The client came back while the server still held every request: it gave up on its own.
    assert ChatHandler.replies == 0
    assert torch.isnan(scores).all()
    assert judge.endpoint.last_stats.failures == 4 and "timed out" in judge.endpoint.last_stats.last_error
    # One attempt each (max_retries=0); the server's handler threads may lag the client.
    assert wait_for(lambda: len(ChatHandler.seen) >= 4) and len(ChatHandler.seen) == 4


def test_500_malformed_json_and_missing_score(server: str, images: torch.Tensor) -> None:
    for route, error in [
        ("error", "HTTP 500"),
        ("badjson", "malformed JSON"),
        ("noscore", "no score matching"),
    ]:
        judge = _judge(server, route, max_retries=1, max_concurrency=4)
        scores = judge(images, PROMPTS, [])
        assert torch.isnan(scores).all(), route
        assert error in judge.endpoint.last_stats.last_error, route
    assert len(ChatHandler.seen) == 3 * 4 * 2  # every request retried once


def test_partial_batch_failure(server: str, images: torch.Tensor) -> None:
    judge = _judge(server, "partial", max_consecutive_failures=1)
    scores = judge(images, PROMPTS, [])
    expected = _expected(images)
    assert torch.isnan(scores[2])
    torch.testing.assert_close(scores[[0, 1, 3]], expected[[0, 1, 3]], atol=ATOL, rtol=0)
    assert judge.endpoint.last_stats.failures == 1  # one failed sample does not stop the run


def test_consecutive_failures_stop(server: str, images: torch.Tensor) -> None:
    judge = _judge(server, "error", max_consecutive_failures=1, max_concurrency=4)
    with pytest.raises(RemoteRewardError, match=r"/error/v1 failed 1 consecutive.*HTTP 500"):
        judge(images, PROMPTS, [])


def test_check_and_bad_input(server: str, closed_port_url: str) -> None:
    _judge(server, "ok").check()
    with pytest.raises(ValueError, match=r"vlm_judge\.base_url .* unreachable"):
        VLMJudgeReward(base_url=f"{closed_port_url}/v1", timeout_s=1.0).check()
    with pytest.raises(ValueError, match=r"score_pattern .* needs a group"):
        VLMJudgeReward(score_pattern=r"Score: \d+")
    with pytest.raises(ValueError, match=r"template must contain \{prompt\}"):
        VLMJudgeReward(template="Rate this image")
    with pytest.raises(ValueError, match=r"max_concurrency \(0\)"):
        VLMJudgeReward(max_concurrency=0)
