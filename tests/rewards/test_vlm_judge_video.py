"""The VLM judge given videos, against a real OpenAI-compatible chat server on 127.0.0.1.

The server decodes every frame it is sent (image parts, or vLLM's ``data:video/jpeg`` list of JPEG
frames) and answers ``Final Score: s`` with s = 1 + 4·mean/255 over all of their pixels; the test
computes s/5 from the tensors on its own.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import ClassVar

import numpy as np
import pytest
import torch
from PIL import Image

from lit_flowgrpo.rewards import MultiReward, reward_modalities
from lit_flowgrpo.rewards.vlm_judge import VLMJudgeReward

PROMPTS = ["a red circle moving up", "FAIL a blue square moving down"]
ATOL = 0.5e-6 / 5 + 2.0**-24  # the server prints 6 decimals; each side rounds once to float32


def _decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.float64)


class VideoChatHandler(BaseHTTPRequestHandler):
    """/ok answers every request; /partial answers 500 when the question holds 'FAIL'."""

    seen: ClassVar[list[dict]] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        VideoChatHandler.seen.append(request)
        content = request["messages"][0]["content"]
        frames = []
        for part in content:
            if part["type"] == "image_url":
                frames.append(_decode(part["image_url"]["url"].split(",", 1)[1]))
            elif part["type"] == "video_url":
                head, data = part["video_url"]["url"].split(",", 1)
                assert head == "data:video/jpeg;base64"
                frames += [_decode(b64) for b64 in data.split(",")]
        text = next(c["text"] for c in content if c["type"] == "text")
        if self.path.startswith("/partial") and "FAIL" in text:
            status, body = 500, b'{"error": "boom"}'
        else:
            answer = f"Final Score: {1 + 4 * np.mean(frames) / 255:.6f}"
            status = 200
            body = json.dumps({"choices": [{"message": {"role": "assistant", "content": answer}}]}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def server(http_server) -> Iterator[str]:
    VideoChatHandler.seen = []
    yield http_server(VideoChatHandler)


def _judge(server: str, route: str = "ok", **kwargs: object) -> VLMJudgeReward:
    settings = {
        "resize": None,
        "timeout_s": 5.0,
        "max_retries": 0,
        "backoff_s": 0.0,
        "model": "judge",
        **kwargs,
    }
    return VLMJudgeReward(base_url=f"{server}/{route}/v1", **settings)


def _expected(frames: torch.Tensor) -> torch.Tensor:
    """(B, n, 3, H, W) in [0, 1] -> (B,) (1 + 4·mean/255)/5 of the uint8 pixels, float64 then fp32."""
    pixels = (frames * 255).round().clamp(0, 255).to(torch.float64)
    return ((1 + 4 * pixels.mean(dim=(1, 2, 3, 4)) / 255) / 5).float()


def _videos() -> torch.Tensor:
    return torch.rand(2, 7, 3, 12, 10, generator=torch.Generator().manual_seed(0))


def test_video_as_image_parts_with_frame_rate(server: str) -> None:
    videos = _videos()
    judge = _judge(
        server, max_frames=4, fps=16.0, video_template="{num_frames} frames at {fps:g} fps: {prompt}"
    )
    assert reward_modalities(judge) == frozenset({"image", "video"})
    scores = judge(videos, PROMPTS, [])
    # frames 0, 2, 4, 6 of 7 are sent: they span the same 6/16 s, so 3 intervals at 8 fps
    torch.testing.assert_close(scores, _expected(videos[:, [0, 2, 4, 6]]), atol=ATOL, rtol=0)
    by_text = {r["messages"][0]["content"][-1]["text"]: r for r in VideoChatHandler.seen}
    assert sorted(by_text) == sorted(f"4 frames at 8 fps: {p}" for p in PROMPTS)
    for request in by_text.values():
        content = request["messages"][0]["content"]
        assert [c["type"] for c in content] == ["image_url"] * 4 + ["text"]
        assert all(c["image_url"]["url"].startswith("data:image/png;base64,") for c in content[:4])


def test_video_as_vllm_video_url_of_jpeg_frames(server: str) -> None:
    # flat colours per frame: JPEG keeps them to within a level or two
    colours = torch.rand(2, 5, 3, 1, 1, generator=torch.Generator().manual_seed(1))
    videos = colours.expand(2, 5, 3, 16, 16).contiguous()
    judge = _judge(
        server, video_format="video_url", max_frames=None, extra_body={"mm_processor_kwargs": {"fps": 16}}
    )
    scores = judge(videos, PROMPTS, [])
    torch.testing.assert_close(scores, _expected(videos), atol=4 * 2 / 255 / 5, rtol=0)
    for request in VideoChatHandler.seen:
        (video, text) = request["messages"][0]["content"]
        assert video["type"] == "video_url" and video["video_url"]["url"].count(",") == 5  # 5 frames
        assert "5 frames in order at 16 frames per second" in text["text"]
        assert request["mm_processor_kwargs"] == {"fps": 16} and request["model"] == "judge"


def test_a_failed_video_is_nan_and_the_others_score(server: str) -> None:
    videos = _videos()
    scores = _judge(server, "partial", max_frames=2)(videos, PROMPTS, [])
    assert torch.isnan(scores[1])
    torch.testing.assert_close(scores[:1], _expected(videos[:1, [0, 6]]), atol=ATOL, rtol=0)


def test_videos_through_the_weighted_sum(server: str) -> None:
    videos = _videos()
    reward = MultiReward({"vlm_judge": 1.0}, rewards={"vlm_judge": _judge(server, max_frames=3)})
    assert reward.modalities == frozenset({"image", "video"})
    out = reward(videos, PROMPTS, [{}, {}])
    torch.testing.assert_close(out.total, _expected(videos[:, [0, 3, 6]]), atol=ATOL, rtol=0)


def test_video_settings_and_input_are_checked(server: str) -> None:
    with pytest.raises(ValueError, match=r"vlm_judge\.fps \(0\.0\) must be positive"):
        VLMJudgeReward(fps=0.0)
    with pytest.raises(ValueError, match=r"vlm_judge\.video_format \('mp4'\)"):
        VLMJudgeReward(video_format="mp4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"vlm_judge\.video_template must contain \{prompt\}"):
        VLMJudgeReward(video_template="Rate this video")
    with pytest.raises(ValueError, match=r"vlm_judge\.max_frames \(0\)"):
        VLMJudgeReward(max_frames=0)
    with pytest.raises(ValueError, match=r"vlm_judge\.extra_body sets \['messages'\]"):
        VLMJudgeReward(extra_body={"messages": []})
    with pytest.raises(
        ValueError, match=r"vlm_judge' \(--model.*vlm_judge\) take videos as a \(B, F, 3, H, W\)"
    ):
        _judge(server)(torch.rand(2, 7, 4, 8, 8), PROMPTS, [])
