"""Group rewards in one process: the rank and win-rate math against hand-worked groups, what the reward
queue hands them, a pairwise VLM judge against a real chat server on 127.0.0.1, and their failures."""

from __future__ import annotations

import base64
import io
import json
import math
import threading
from http.server import BaseHTTPRequestHandler

import numpy as np
import pytest
import torch
from PIL import Image

from lit_flowgrpo.distributed import DataParallel
from lit_flowgrpo.rewards import MultiReward, register_reward
from lit_flowgrpo.rewards.group import PairwiseWinRate, RankReward, group_ranks, score_groups, win_rates
from lit_flowgrpo.rewards.overlap import THREAD_NAME, RewardQueue

IDS = torch.tensor([0, 1, 0, 1, 1, 0, 0, 1])


@register_reward("red_for_group_tests")
class Red:
    """The mean of the red channel; NaN for an image whose green channel is full (it cannot score it)."""

    calls: list[tuple[str, int]] = []  # noqa: RUF012 (where each call ran, and its size)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        Red.calls.append((threading.current_thread().name, len(prompts)))
        red = images[:, 0].mean(dim=(1, 2))
        return torch.where(images[:, 1].mean(dim=(1, 2)) > 0.9, torch.nan, red)


def _batch(n: int = 8) -> torch.Tensor:
    # Red levels far apart (steps of 0.1) so that uint8 rounding never reorders two samples.
    red = torch.tensor([0.3, 0.8, 0.5, 0.2, 0.9, 0.1, 0.5, 0.4])[:n]
    images = torch.full((n, 3, 8, 8), 0.5)
    images[:, 0] = red.view(n, 1, 1)
    return images


def test_ranks_and_win_rates_of_hand_worked_groups() -> None:
    scores = torch.tensor([0.3, 0.8, 0.5, 0.2, 0.9, 0.1, 0.5, torch.nan])
    # group 0: 0.3, 0.5, 0.1, 0.5 -> ranks 1, 2.5, 0, 2.5 of 4; group 1: 0.8, 0.2, 0.9 scored (one NaN) of 3
    want = torch.tensor([1 / 4, 1 / 3, 2.5 / 4, 0.0, 2 / 3, 0.0, 2.5 / 4, math.nan])
    torch.testing.assert_close(group_ranks(scores, IDS), want, equal_nan=True)
    # one pair without a verdict is left out of both samples' counts; the pair in the other order
    # judged 0.0 for its first (sample 1 first, 0 second): 1 - 0 = 1 for sample 0, averaged with 0.5
    pairs = [(0, 1), (0, 2), (1, 2)]
    shares = torch.tensor([0.5, math.nan, 1.0])
    torch.testing.assert_close(win_rates(shares, pairs, 3), torch.tensor([0.5, 0.75, 0.0]))
    flipped = torch.tensor([0.0, math.nan, math.nan])
    torch.testing.assert_close(win_rates(shares, pairs, 3, flipped), torch.tensor([0.75, 0.625, 0.0]))
    assert math.isnan(float(win_rates(torch.tensor([math.nan]), [(0, 1)], 2)[0]))


def _reward() -> MultiReward:
    return MultiReward(
        {"pairwise_win_rate": 1.0, "group_rank": 0.5, "red_for_group_tests": 0.0},
        config={
            "pairwise_win_rate": {"judge": "reward", "judge_config": {"reward": "red_for_group_tests"}},
            "group_rank": {"reward": "red_for_group_tests"},
        },
    )


def test_the_queue_scores_whole_groups_once_the_rollout_is_done() -> None:
    images, prompts = _batch(), [f"p{i}" for i in range(8)]
    images[7, 1] = 1.0  # the base reward cannot score sample 7
    reward = _reward()
    Red.calls = []
    with RewardQueue(reward, prompts, [{}] * 8, IDS) as queue:
        assert queue.overlapped == ["red_for_group_tests"]  # the group rewards wait for the whole batch
        assert queue.prepared == ["group_rank"]  # but the rank's base scores come chunk by chunk
        queue.submit(slice(0, 4), images[:4])
        queue.submit(slice(4, 8), images[4:])
        out = queue.result(images)
    beside = [n for thread, n in Red.calls if thread.startswith(THREAD_NAME)]
    assert beside == [4, 4, 4, 4]  # each chunk: the weight-0 reward and group_rank's base score
    red = torch.tensor([0.3, 0.8, 0.5, 0.2, 0.9, 0.1, 0.5, math.nan])
    # group 0 (samples 0, 2, 5, 6: red 0.3, 0.5, 0.1, 0.5) wins 1, 2.5, 0, 2.5 of 3 comparisons; group 1
    # (1, 3, 4, 7: 0.8, 0.2, 0.9, unscored) 1, 0, 2 of the 2 with a verdict, and sample 7 none
    wins = torch.tensor([1 / 3, 1 / 2, 2.5 / 3, 0.0, 1.0, 0.0, 2.5 / 3, math.nan])
    torch.testing.assert_close(out.components["pairwise_win_rate"], wins, equal_nan=True)
    torch.testing.assert_close(out.components["group_rank"], group_ranks(red, IDS), equal_nan=True)
    torch.testing.assert_close(out.total, wins + 0.5 * group_ranks(red, IDS), equal_nan=True)
    assert out.failures == {"pairwise_win_rate": 1, "group_rank": 1, "red_for_group_tests": 1}
    # Without groups (validation, a plain call) a group reward has no value: NaN, counted unscored.
    plain = reward(images, prompts, [{}] * 8)
    assert (
        torch.isnan(plain.components["group_rank"]).all() and plain.unscored_count["pairwise_win_rate"] == 8
    )


def test_a_group_reward_that_raises_names_itself() -> None:
    class Broken:
        scores_groups = True

        def __call__(self, images, prompts, metadata, group_ids):
            raise RuntimeError("judge exploded")

    with pytest.raises(RuntimeError, match="judge exploded") as info:
        score_groups("broken", Broken(), _batch(), ["p"] * 8, [{}] * 8, IDS, DataParallel())
    assert any("reward 'broken'" in n for n in getattr(info.value, "__notes__", []))

    class BrokenBase(Broken):
        def prepare(self, images, prompts, metadata):
            raise RuntimeError("base exploded")

    # Beside the sampler its prepare fails quietly; the group step raises it (on every rank alike).
    with RewardQueue(MultiReward({"b": 1.0}, rewards={"b": BrokenBase()}), ["p"] * 8, [{}] * 8, IDS) as queue:
        queue.submit(slice(0, 8), _batch())
        with pytest.raises(RuntimeError, match="base exploded") as info:
            queue.result(_batch())
    assert any("while preparing its inputs" in n for n in getattr(info.value, "__notes__", []))


@register_reward("main_thread_for_group_tests")
class MainThreadOnly(Red):
    """Red, but it must run on the training loop's thread, and it finds every third record bad."""

    thread_safe = False

    def problems(self, records: list[dict]) -> list[str]:
        return [f"record {i} is bad" for i in range(0, len(records), 3)]


def test_rank_reward_keeps_its_bases_thread_and_record_checks() -> None:
    rank = RankReward(reward="main_thread_for_group_tests")
    assert rank.thread_safe is False and RankReward(reward="red_for_group_tests").thread_safe is True
    reward = MultiReward(
        {"group_rank": 1.0}, config={"group_rank": {"reward": "main_thread_for_group_tests"}}
    )
    assert reward.problems([{}] * 4) == [
        "reward 'group_rank': record 0 is bad",
        "reward 'group_rank': record 3 is bad",
    ]
    # The queue leaves its prepare out of the worker: the base runs once, on this thread, with the batch.
    Red.calls = []
    with RewardQueue(reward, ["p"] * 8, [{}] * 8, group_ids=IDS) as queue:
        assert queue.prepared == []
        queue.submit(slice(0, 8), _batch())
        out = queue.result(_batch())
    assert Red.calls == [(threading.current_thread().name, 8)]
    torch.testing.assert_close(
        out.components["group_rank"], group_ranks(Red()(_batch(), [""] * 8, [{}] * 8), IDS)
    )


def test_rank_reward_refuses_a_component_its_base_lacks() -> None:
    rank = RankReward(reward="red_for_group_tests", component="blue")
    with pytest.raises(ValueError, match=r"group_rank\.component"):
        rank.prepare(_batch(), ["p"] * 8, [{}] * 8)
    with pytest.raises(ValueError, match="must be one of"):
        PairwiseWinRate(judge="oracle")


class PairHandler(BaseHTTPRequestHandler):
    """A pairwise judge: the redder image wins; a prompt with 'tie' gets a tie, one with 'mute' no answer."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        content = request["messages"][0]["content"]
        urls = [c["image_url"]["url"] for c in content if c["type"] == "image_url"]
        text = next(c["text"] for c in content if c["type"] == "text")
        pixels = [Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))) for u in urls]
        red = [np.asarray(image, dtype=np.float64)[..., 0].mean() for image in pixels]
        if "[mute]" in text:
            answer = "I cannot say."
        elif "[tie]" in text:
            answer = "<think>...</think><answer>Both are equal.</answer>"
        else:
            answer = f"<think>...</think><answer>Image {1 if red[0] > red[1] else 2} is better</answer>"
        body = json.dumps({"choices": [{"message": {"content": answer}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_vlm_pairwise_judge_against_a_chat_server(http_server) -> None:
    url = http_server(PairHandler)
    config = {
        "base_url": f"{url}/v1",
        "resize": None,
        "image_format": "png",
        "max_retries": 0,
        "timeout_s": 10.0,
    }
    reward = PairwiseWinRate(judge="vlm", judge_config=config, both_orders=True)
    reward.check()
    images = _batch(6)
    ids = torch.tensor([0, 0, 0, 1, 1, 2])
    prompts = ["red", "red", "red", "tie", "tie", "alone"]
    out = reward(images, prompts, [{}] * 6, ids)
    # group 0 by redness 0.3, 0.8, 0.5: wins 0, 2, 1 of 2; group 1 ties; a group of one has no comparison
    torch.testing.assert_close(out, torch.tensor([0.0, 1.0, 0.5, 0.5, 0.5, math.nan]), equal_nan=True)
    muted = reward(images[:2], ["mute", "mute"], [{}] * 2, torch.tensor([0, 0]))
    assert torch.isnan(muted).all()  # no answer is no verdict, never a tie
