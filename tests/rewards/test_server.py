"""The reward server on 127.0.0.1 (on a thread of this process) against real clients: the ``served``
reward, requests of two clients batched into one call, malformed and oversized requests, a client that
never finishes its body, and a request the reward raises on beside a good one."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import torch

from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.rewards import MultiReward, build_reward, register_reward
from lit_flowgrpo.rewards.images import to_uint8
from lit_flowgrpo.rewards.served import ServedReward
from lit_flowgrpo.rewards.server import ServerSettings, build, parse, running


@register_reward("recorder_for_server_tests")
class Recorder:
    """Per sample: the mean pixel and the prompt's length; raises on a prompt that says 'boom'; records
    the size of every call."""

    calls: list[int] = []  # noqa: RUF012 (one list for the class: the server builds its own instance)

    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict]
    ) -> dict[str, torch.Tensor]:
        Recorder.calls.append(len(prompts))
        if any("boom" in p for p in prompts):
            raise RuntimeError("boom in the batch")
        bright = images.mean(dim=(1, 2, 3))
        return {
            "bright": bright,
            "length": torch.tensor(
                [float(len(p) + m.get("extra", 0)) for p, m in zip(prompts, metadata, strict=True)]
            ),
        }


@pytest.fixture
def served() -> Iterator[str]:
    Recorder.calls = []
    settings = ServerSettings(reward="recorder_for_server_tests", port=0, max_batch_size=4, max_wait_s=30.0)
    with running(settings) as (url, _):
        yield url


def _client(url: str, **kwargs: object) -> ServedReward:
    settings = {"url": url, "components": ["bright", "length"], "max_retries": 0, "timeout_s": 60.0, **kwargs}
    return ServedReward(**settings)


def _health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/health", timeout=30) as response:
        return json.loads(response.read())


def _post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(f"{url}/score", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def _images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def test_two_clients_are_scored_in_one_batch_with_the_local_values(served: str) -> None:
    images = [_images(2, 0), _images(2, 1)]
    prompts = [["a", "bb"], ["ccc", "dddd"]]
    out: list[dict] = [{}, {}]

    def score(i: int) -> None:
        out[i] = _client(served)(images[i], prompts[i], [{"extra": 10}, {}])

    # max_batch_size 4 and a 30 s wait: the batch is scored once both clients' 2 samples have arrived
    threads = [threading.Thread(target=score, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Recorder.calls == [4]
    health = _health(served)
    assert (health["status"], health["batches"], health["largest_batch"], health["requests"]) == (
        "ok",
        1,
        4,
        2,
    )
    for i in range(2):
        # PNG carries the images rounded to 8 bits exactly; the means agree to fp32 rounding of 192 values
        want = (to_uint8(images[i]).float() / 255).mean(dim=(1, 2, 3))
        torch.testing.assert_close(out[i]["bright"], want, rtol=0, atol=192 * 2.0**-24)
        assert out[i]["length"].tolist() == [len(prompts[i][0]) + 10, len(prompts[i][1])]


def test_malformed_and_oversized_requests_get_a_clear_4xx(served: str) -> None:
    cases = {
        b"{not json": "not JSON",
        b'{"prompts": ["a"]}': "lacks 'images'",
        b'{"images": ["aGk="], "prompts": ["a", "b"]}': "one each a sample",
        b'{"images": ["%%%"], "prompts": ["a"]}': "image 0 is not a base64-encoded PNG or JPEG",
        b"[1, 2]": "must be a JSON object",
    }
    for body, message in cases.items():
        status, reply = _post(served, body)
        assert status == 400 and message in reply["error"], (body, status, reply)
    assert Recorder.calls == []  # none reached the reward
    # The client does not retry a 4xx: its samples are NaN, counted, and the batch fails at once.
    client = {
        "url": f"{served}/nowhere",
        "components": ["bright", "length"],
        "primary": "bright",
        "max_retries": 5,
    }
    reward = MultiReward({"served": 1.0}, config={"served": client})  # POST /nowhere/score: 404
    out = reward(_images(2), ["a", "b"], [{}, {}])
    assert torch.isnan(out.total).all() and out.failures == {"served": 2}
    assert "HTTP 404" in reward.rewards["served"].endpoint.last_stats.last_error


def test_a_request_over_the_size_limit_is_refused_with_413() -> None:
    settings = ServerSettings(reward="recorder_for_server_tests", port=0, max_request_mb=0.001)  # 1 KiB
    with running(settings) as (url, _):
        status, reply = _post(url, json.dumps({"images": ["A" * 4096], "prompts": ["a"]}).encode())
        assert status == 413 and "max_request_mb" in reply["error"]


def test_an_image_that_decodes_too_large_is_refused_before_decoding() -> None:
    """A small body can declare many pixels (a constant PNG compresses about 1000x): the server reads the
    size from the header and refuses the request before decoding it."""
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (512, 512)).save(buffer, format="PNG")  # 512² x 3 bytes = 768 KiB decoded
    body = json.dumps({"images": [base64.b64encode(buffer.getvalue()).decode()], "prompts": ["a"]})
    assert len(body) < 10 * 2**10
    Recorder.calls = []
    # 10 KiB a request: 16 x 10 KiB = 160 KiB decoded at most
    settings = ServerSettings(reward="recorder_for_server_tests", port=0, max_request_mb=10 / 2**10)
    with running(settings) as (url, _):
        status, reply = _post(url, body.encode())
    assert status == 400 and "MiB once decoded (image 0 is 512 x 512)" in reply["error"], reply
    assert Recorder.calls == []


def test_a_slow_client_delays_nobody_and_is_timed_out() -> None:
    Recorder.calls = []
    settings = ServerSettings(reward="recorder_for_server_tests", port=0, max_wait_s=0.0, read_timeout_s=0.5)
    with running(settings) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=60) as slow:
            # Headers and half the promised body, then nothing: the request never reaches the queue.
            slow.sendall(
                b'POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"ima'
            )
            # Another client meanwhile. Its body arrives whole at once, but a starved CPU could still let
            # 0.5 s pass before the server reads it: a retry on that 408 keeps the test about the slow one.
            scored = _client(url, max_retries=3, backoff_s=0.0)(_images(3), ["a", "b", "c"], [{}] * 3)
            assert torch.isfinite(scored["bright"]).all() and Recorder.calls == [3]
            answer = slow.recv(4096).decode()  # the server gives up on the body after read_timeout_s
        assert answer.startswith("HTTP/1.1 408"), answer[:80]


def test_a_batcher_that_stops_fails_the_waiting_requests_and_later_ones() -> None:
    """A bug that stops the batcher (here: the scoring step returns no reply for the batch) answers the
    request it held with 503 and the error, not a hang; later requests get 503 at once, /health says so."""
    Recorder.calls = []
    settings = ServerSettings(reward="recorder_for_server_tests", port=0, max_wait_s=0.0)
    with running(settings) as (url, server):
        server._score = lambda requests: []  # zip(strict=True) in the batcher raises
        body = json.dumps({"images": [_png(0.2)], "prompts": ["a"], "metadata": [{}]}).encode()
        for _ in range(2):
            status, reply = _post(url, body)
            assert status == 503 and "batcher stopped on ValueError" in reply["error"], (status, reply)
        health = _health(url)
        assert health["status"] == "broken" and "restart the server" in health["error"]
    assert Recorder.calls == []


def test_a_request_the_reward_raises_on_fails_alone(served: str) -> None:
    out: dict[str, object] = {}

    def bad() -> None:
        body = {"images": [_png(0.2)], "prompts": ["boom"], "metadata": [{}]}
        out["bad"] = _post(served, json.dumps(body).encode())

    def good() -> None:
        out["good"] = _client(served)(_images(3), ["a", "b", "c"], [{}] * 3)

    threads = [threading.Thread(target=f) for f in (bad, good)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    status, reply = out["bad"]
    assert status == 500 and "boom in the batch" in reply["error"]
    assert torch.isfinite(out["good"]["bright"]).all()
    # the batch of both raised; then each was scored alone, in the order they arrived
    assert Recorder.calls[0] == 4 and sorted(Recorder.calls[1:]) == [1, 3]


def _png(level: float) -> str:
    from lit_flowgrpo.rewards.images import encode, to_base64, to_pil

    return to_base64(encode(to_pil(torch.full((1, 3, 8, 8), level))[0], "png"))


def test_settings_and_group_rewards_are_refused_before_serving() -> None:
    with pytest.raises(SettingsError, match="max_batch_size"):
        build(ServerSettings(max_batch_size=0))
    with pytest.raises(SettingsError, match="scores whole groups"):
        build(ServerSettings(reward="group_rank", reward_config={"reward": "jpeg_compressibility"}))
    with pytest.raises(SettingsError, match="does not import"):
        build(ServerSettings(plugins=["no_such_module_here"]))
    assert callable(build_reward("served"))


def test_a_port_in_use_is_a_settings_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = ServerSettings(reward="recorder_for_server_tests", port=port)
        with pytest.raises(SettingsError, match=rf"--port {port} cannot be listened on"), running(settings):
            pass


def test_the_command_line_reads_a_shipped_config_and_flags_over_it() -> None:
    settings = parse(["--config", "reward_server/shapes", "--port", "0", "--max_batch_size", "8"])
    assert (settings.reward, settings.plugins, settings.port, settings.max_batch_size) == (
        "shapes",
        ["lit_flowgrpo.toy"],
        0,
        8,
    )
    with pytest.raises(SettingsError, match="neither a file nor a shipped server config"):
        parse(["--config", "no_such_server"])
