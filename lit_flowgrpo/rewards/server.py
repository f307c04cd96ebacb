"""``lit-flowgrpo serve-reward``: any registered reward behind an HTTP endpoint, for the ``served`` client.

A judge of several billion parameters, or a detector whose stack cannot share the trainer's
environment, runs best in a process of its own, on its own GPU or machine, as verl-omni's async reward
workers and flow_grpo's reward servers do. This serves any reward of the registry
(:mod:`lit_flowgrpo.rewards.registry`) over JSON, on aiohttp's web server (an asyncio server with a
request size limit of its own; aiohttp is the ``serve`` extra)::

    lit-flowgrpo serve-reward --config reward_server/shapes   # a shipped config, or a YAML file

The protocol (JSON both ways, nothing executable: no pickle)::

    POST /score   {"images": [base64 PNG|JPEG, ...], "image_format": "png"|"jpeg",
                   "prompts": [str, ...], "metadata": [{...}, ...]}                   (one entry a sample)
      200         {"components": {"<component>": [float|null, ...], ...}}   ("score" for a one-valued reward)
      400         {"error": "..."}  the request is malformed (not JSON, a missing key, lengths that
                                     differ, an image that does not decode, or whose pixels would
                                     take more than DECODED_PER_BYTE x max_request_mb once decoded)
      408         the request's body did not arrive within ``read_timeout_s``
      413         the request is larger than ``max_request_mb``
      500         the reward raised on this request's samples (its message)
      503         the server's batcher stopped on an error (a bug): every request, until restarted
    GET /health   {"status": "ok", "reward": ..., "requests": n, "samples": n, "batches": n, ...}

``null`` is a sample the reward could not score (NaN): the client drops it, never scores it 0.

**Batching across clients.** Requests go into one queue; a batcher takes the first, then every
request that arrives within ``max_wait_s`` of it, until ``max_batch_size`` samples, and scores them in
one call of the reward (on one worker thread, so the event loop keeps reading other requests and a slow
client delays nobody: a request joins the queue only once its body has arrived). Images of another
size wait for the next batch; a request larger than ``max_batch_size`` is scored alone. When the
batched call raises, each of its requests is scored alone, so one bad request fails only itself. A
served reward is a per-sample function (the contract in :mod:`lit_flowgrpo.rewards.base`), so batching
changes no value.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import importlib
import io
import json
import math
import signal
import sys
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor

from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.rewards.base import checked_output, scores_groups
from lit_flowgrpo.rewards.registry import build_reward, qualname

__all__ = ["ServerSettings", "main", "parse", "parse_request", "running", "serve"]

#: The component name of a reward that returns one Tensor.
SCORE = "score"
#: A request's images may decode to at most this many bytes (uint8 RGB) per byte of ``max_request_mb``:
#: a PNG a few pixels wide can declare 10⁹ of them, and the body limit alone would not stop it from
#: filling the server's memory. Generated images compress 2-10x (PNG, JPEG at quality 95); 16 leaves room.
DECODED_PER_BYTE = 16
#: Where the shipped server configs live (``--config NAME`` finds ``NAME.yaml`` there).
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "reward_server"


@dataclass
class ServerSettings:
    """What ``lit-flowgrpo serve-reward`` serves and how.

    Args:
        reward: the registered reward to serve, by name.
        reward_config: its constructor's arguments.
        plugins: modules to import first, which register their rewards (``lit_flowgrpo.toy`` for the
            shapes world's).
        host: the address to listen on; ``127.0.0.1`` serves this machine only.
        port: the port; 0 picks a free one (printed at start).
        max_batch_size: samples scored in one call of the reward, at most (a larger request alone).
        max_wait_s: how long the first request of a batch waits for others to join it.
        max_request_mb: the largest request body accepted, in MiB (413 above it).
        read_timeout_s: how long a request's body may take to arrive (408 after it).
        device: where the images go before the reward sees them (``cpu``, ``cuda``, ``cuda:1``); a
            reward on a GPU chooses its own device through its ``config``.
    """

    reward: str = "jpeg_compressibility"
    reward_config: dict[str, Any] = field(default_factory=dict)
    plugins: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 18086
    max_batch_size: int = 64
    max_wait_s: float = 0.05
    max_request_mb: float = 64.0
    read_timeout_s: float = 60.0
    device: str = "cpu"

    def problems(self) -> list[str]:
        p = []
        if self.max_batch_size < 1:
            p.append(f"--max_batch_size ({self.max_batch_size}) must be at least 1")
        if self.max_wait_s < 0:
            p.append(f"--max_wait_s ({self.max_wait_s}) must be 0 or more")
        if not self.max_request_mb > 0:
            p.append(f"--max_request_mb ({self.max_request_mb}) must be positive")
        if not self.read_timeout_s > 0:
            p.append(f"--read_timeout_s ({self.read_timeout_s}) must be positive")
        if not 0 <= self.port < 65536:
            p.append(f"--port ({self.port}) must be a port number (0 picks a free one)")
        return p


# --------------------------------------------------------------------------------------------------
# The wire format
# --------------------------------------------------------------------------------------------------


@dataclass
class Request:
    """One decoded request: its samples as a batch."""

    images: Tensor  # (B, 3, H, W) fp32 in [0, 1]
    prompts: list[str]
    metadata: list[dict]

    def __len__(self) -> int:
        return len(self.prompts)


def parse_request(raw: bytes, max_decoded_bytes: int | None = None) -> Request:
    """A request body, decoded; ``ValueError`` naming what is wrong with it (the server answers 400).

    ``max_decoded_bytes`` bounds the images' decoded size (uint8 RGB, all of them), read from their
    headers before any pixel is decoded; ``None`` leaves only PIL's own bound on one image.

    >>> parse_request(b'{"images": []}')
    Traceback (most recent call last):
    ...
    ValueError: the request lacks 'prompts' (it has ['images']); send {"images": [...], "prompts": [...], "metadata": [...]}
    """
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"the request is not JSON: {err}") from err
    if not isinstance(body, dict):
        raise ValueError(f"the request must be a JSON object, not a {type(body).__name__}")
    for key in ("images", "prompts"):
        if key not in body:
            raise ValueError(
                f"the request lacks {key!r} (it has {sorted(body)}); send "
                '{"images": [...], "prompts": [...], "metadata": [...]}'
            )
    images, prompts = body["images"], body["prompts"]
    metadata = body.get("metadata", [{}] * len(prompts) if isinstance(prompts, list) else None)
    if not isinstance(images, list) or not images:
        raise ValueError("'images' must be a non-empty list of base64-encoded PNG or JPEG images")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError("'prompts' must be a list of strings, one a sample")
    if not isinstance(metadata, list) or not all(isinstance(m, dict) for m in metadata):
        raise ValueError("'metadata' must be a list of objects, one a sample")
    if not len(images) == len(prompts) == len(metadata):
        raise ValueError(
            f"{len(images)} images, {len(prompts)} prompts and {len(metadata)} metadata records: one each a sample"
        )
    if body.get("image_format", "png") not in ("png", "jpeg"):
        raise ValueError(f"'image_format' ({body.get('image_format')!r}) must be 'png' or 'jpeg'")
    arrays, decoded = [], 0
    for i, encoded in enumerate(images):
        try:
            with Image.open(io.BytesIO(base64.b64decode(encoded, validate=True))) as image:
                decoded += 3 * image.width * image.height  # from the header: nothing decoded yet
                if max_decoded_bytes is not None and decoded > max_decoded_bytes:
                    raise ValueError(
                        f"the images would take more than {max_decoded_bytes / 2**20:.3g} MiB once decoded "
                        f"(image {i} is {image.width} x {image.height}): send smaller images or fewer a request"
                    )
                arrays.append(np.asarray(image.convert("RGB")))
        except (
            TypeError,
            binascii.Error,
            UnidentifiedImageError,
            OSError,
            Image.DecompressionBombError,
        ) as err:
            raise ValueError(f"image {i} is not a base64-encoded PNG or JPEG ({err})") from err
    if len({a.shape for a in arrays}) > 1:
        raise ValueError(
            f"the images of one request must share one size; got {sorted({a.shape for a in arrays})}"
        )
    pixels = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)  # (B, 3, H, W) uint8
    return Request(pixels.float() / 255, prompts, metadata)


def _reply(components: dict[str | None, Tensor], rows: slice) -> dict[str, Any]:
    """The 200 body for the samples ``rows`` of a scored batch; NaN goes as ``null``."""
    return {
        "components": {
            SCORE if key is None else key: [v if math.isfinite(v) else None for v in value[rows].tolist()]
            for key, value in components.items()
        }
    }


# --------------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------------


@dataclass
class _Pending:
    request: Request
    future: asyncio.Future

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.request.images.shape[1:])


class RewardServer:
    """A reward behind aiohttp, its requests batched across clients (the module doc).

    Args:
        reward: the reward (any per-sample callable of the reward contract).
        name: how messages and ``/health`` name it.
        settings: the server's settings.
    """

    def __init__(self, reward: Any, name: str, settings: ServerSettings) -> None:
        if scores_groups(reward):
            raise SettingsError(
                f"--reward {name!r} scores whole groups, which a request does not carry: serve its per-sample "
                "reward (a group reward's judge or base) and compute the group's reward in the trainer"
            )
        self.reward, self.name, self.settings = reward, name, settings
        self.stats = {"requests": 0, "samples": 0, "batches": 0, "largest_batch": 0, "rejected": 0}
        # One worker thread: the reward is called from one thread at a time, as the trainer does.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-server")
        self._queue: asyncio.Queue[_Pending] | None = None
        #: Every request's future from its arrival in the queue until it is answered.
        self._waiting: set[asyncio.Future] = set()
        #: Why the batcher stopped, when it stopped other than at shutdown (a bug): requests get a 503.
        self.broken: str | None = None

    def app(self) -> Any:
        from aiohttp import web

        app = web.Application(client_max_size=int(self.settings.max_request_mb * 2**20))
        app.router.add_get("/health", self.health)
        app.router.add_post("/score", self.score)
        app.on_startup.append(self._start_batcher)
        app.on_cleanup.append(self._stop_batcher)
        return app

    async def _start_batcher(self, app: Any) -> None:
        self._queue = asyncio.Queue()
        self._batcher = asyncio.get_running_loop().create_task(self._batches())
        self._batcher.add_done_callback(self._batcher_stopped)

    def _batcher_stopped(self, task: asyncio.Task) -> None:
        """A batcher that raised would leave every queued request waiting for ever: fail them instead,
        and every later one at once (503), with the error, until the server is restarted."""
        if task.cancelled():
            return
        err = task.exception()
        self.broken = f"the server's batcher stopped on {type(err).__name__}: {err}; restart the server"
        for future in self._waiting:
            if not future.done():
                future.set_exception(RuntimeError(self.broken))

    async def _stop_batcher(self, app: Any) -> None:
        self._batcher.cancel()
        # cancelled here, or stopped earlier on an error that _batcher_stopped has reported already
        await asyncio.gather(self._batcher, return_exceptions=True)
        self._worker.shutdown(wait=False, cancel_futures=True)

    async def health(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response(
            {
                "status": "ok" if self.broken is None else "broken",
                "error": self.broken,
                "reward": self.name,
                "max_batch_size": self.settings.max_batch_size,
                "queued": self._queue.qsize() if self._queue is not None else 0,
                **self.stats,
            }
        )

    async def score(self, request: Any) -> Any:
        from aiohttp import web

        try:
            raw = await asyncio.wait_for(request.read(), self.settings.read_timeout_s)
        except asyncio.TimeoutError:
            self.stats["rejected"] += 1
            return _error(
                web, 408, f"the request's body did not arrive within {self.settings.read_timeout_s} s"
            )
        except web.HTTPRequestEntityTooLarge:
            self.stats["rejected"] += 1
            return _error(
                web,
                413,
                f"the request is larger than the server's limit of {self.settings.max_request_mb} MiB: send fewer "
                "images a request (the client's batch_size), or raise the server's --max_request_mb",
            )
        try:  # decoding images takes a while: on another thread, so the loop keeps reading others
            limit = int(DECODED_PER_BYTE * self.settings.max_request_mb * 2**20)
            parsed = await asyncio.get_running_loop().run_in_executor(None, parse_request, raw, limit)
        except ValueError as err:
            self.stats["rejected"] += 1
            return _error(web, 400, str(err))
        if self.broken is not None:
            return _error(web, 503, self.broken)
        pending = _Pending(parsed, asyncio.get_running_loop().create_future())
        self._waiting.add(pending.future)
        await self._queue.put(pending)
        try:
            body = await pending.future
        except Exception as err:
            if self.broken is not None:
                return _error(web, 503, self.broken)
            return _error(web, 500, f"reward {self.name!r} raised {type(err).__name__}: {err}")
        finally:
            self._waiting.discard(pending.future)
        self.stats["requests"] += 1
        self.stats["samples"] += len(parsed)
        return web.json_response(body)

    async def _batches(self) -> None:
        """Forever: take a batch of requests from the queue and score it on the worker thread."""
        loop = asyncio.get_running_loop()
        waiting: deque[_Pending] = deque()  # taken from the queue, left for a later batch
        while True:
            first = waiting.popleft() if waiting else await self._queue.get()
            batch, later = [first], []
            size = len(first.request)
            deadline = loop.time() + self.settings.max_wait_s
            while size < self.settings.max_batch_size:
                remaining = deadline - loop.time()
                try:
                    if waiting:
                        item = waiting.popleft()
                    elif remaining <= 0:  # what has arrived meanwhile still joins
                        item = self._queue.get_nowait()
                    else:
                        item = await asyncio.wait_for(self._queue.get(), remaining)
                except (asyncio.TimeoutError, asyncio.QueueEmpty):
                    break
                if item.shape != first.shape:
                    later.append(item)  # another image size: a batch of its own
                elif size + len(item.request) > self.settings.max_batch_size:
                    later.append(item)
                    break
                else:
                    batch.append(item)
                    size += len(item.request)
            waiting.extendleft(reversed(later))
            live = [p for p in batch if not p.future.done()]  # a client that left cancelled its future
            if not live:
                continue
            outcomes = await loop.run_in_executor(self._worker, self._score, [p.request for p in live])
            for pending, outcome in zip(live, outcomes, strict=True):
                if pending.future.done():
                    continue
                if isinstance(outcome, BaseException):
                    pending.future.set_exception(outcome)
                else:
                    pending.future.set_result(outcome)

    def _score(self, requests: list[Request]) -> list[dict[str, Any] | BaseException]:
        """Score the requests in one call; if it raises, each alone (on the worker thread)."""
        try:
            return self._call(requests)
        except Exception as err:
            if len(requests) == 1:
                return [err]
        out: list[dict[str, Any] | BaseException] = []
        for request in requests:
            try:
                out += self._call([request])
            except Exception as err:
                out.append(err)
        return out

    def _call(self, requests: list[Request]) -> list[dict[str, Any]]:
        images = torch.cat([r.images for r in requests]).to(self.settings.device)
        prompts = [p for r in requests for p in r.prompts]
        metadata = [m for r in requests for m in r.metadata]
        with torch.no_grad():
            value = self.reward(images, prompts, metadata)
        components = checked_output(value, len(prompts), f"reward {self.name!r} ({qualname(self.reward)})")
        self.stats["batches"] += 1
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(prompts))
        out, start = [], 0
        for request in requests:
            out.append(_reply(components, slice(start, start + len(request))))
            start += len(request)
        return out


def _error(web: Any, status: int, message: str) -> Any:
    return web.json_response({"error": message}, status=status)


# --------------------------------------------------------------------------------------------------
# Running it
# --------------------------------------------------------------------------------------------------


def build(settings: ServerSettings) -> RewardServer:
    """The server of ``settings``: its plugins imported, its reward built (weights read here)."""
    problems = settings.problems()
    if problems:
        raise SettingsError("invalid serve-reward settings:\n  " + "\n  ".join(problems))
    for module in settings.plugins:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise SettingsError(f"--plugins names {module!r}, which does not import: {err}") from err
    try:
        reward = build_reward(settings.reward, **settings.reward_config)
    except ValueError as err:
        raise SettingsError(f"--reward {settings.reward!r}: {err}") from err
    return RewardServer(reward, settings.reward, settings)


def serve(settings: ServerSettings) -> None:
    """Serve until interrupted (SIGINT/SIGTERM), printing the address once listening."""
    web = _aiohttp_web()
    server = build(settings)

    async def run() -> None:
        runner = web.AppRunner(server.app(), access_log=None)
        await runner.setup()
        await _listen(web, runner, settings)
        port = runner.addresses[0][1]
        print(f"serving reward {settings.reward!r} on http://{settings.host}:{port}", flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    asyncio.run(run())


@contextlib.contextmanager
def running(settings: ServerSettings) -> Iterator[tuple[str, RewardServer]]:
    """The server of ``settings`` on a thread of its own for the block (tests, notebooks): yields its
    base URL (``port: 0`` picks a free port) and the server."""
    web = _aiohttp_web()
    server = build(settings)
    loop = asyncio.new_event_loop()
    ready: dict[str, Any] = {}
    started = threading.Event()

    async def start() -> None:
        runner = web.AppRunner(server.app(), access_log=None)
        await runner.setup()
        await _listen(web, runner, settings)
        ready.update(runner=runner, port=runner.addresses[0][1])

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(start())
        except BaseException as err:
            ready["error"] = err
        started.set()
        if "error" not in ready:
            loop.run_forever()

    thread = threading.Thread(target=run, name="reward-server-loop", daemon=True)
    thread.start()
    started.wait()
    if "error" in ready:
        thread.join()
        loop.close()
        raise ready["error"]
    try:
        yield f"http://{settings.host}:{ready['port']}", server
    finally:
        asyncio.run_coroutine_threadsafe(ready["runner"].cleanup(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


async def _listen(web: Any, runner: Any, settings: ServerSettings) -> None:
    """Start listening on ``settings``' address; one that cannot be bound is a settings error."""
    try:
        await web.TCPSite(runner, settings.host, settings.port).start()
    except OSError as err:
        await runner.cleanup()
        raise SettingsError(
            f"--host {settings.host} --port {settings.port} cannot be listened on ({err.strerror or err}): "
            "another server holds the port, or the address is not this machine's; pick another --port "
            "(0 picks a free one)"
        ) from err


def _aiohttp_web() -> Any:
    try:
        from aiohttp import web
    except ImportError as err:
        raise SettingsError("serve-reward needs aiohttp: pip install 'lit-flowgrpo[serve]'") from err
    return web


def _config_path(value: str) -> str:
    """``--config``'s file: a path, or the name of a shipped server config."""
    if Path(value).is_file():
        return value
    shipped = CONFIG_DIR / f"{value.removeprefix('reward_server/').removesuffix('.yaml')}.yaml"
    if shipped.is_file():
        return str(shipped)
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise SettingsError(f"--config {value!r} is neither a file nor a shipped server config ({names})")


def parse(argv: Sequence[str]) -> ServerSettings:
    """The settings of a ``serve-reward`` command line (``--config FILE|NAME`` and flags, later ones win)."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    words = list(argv)
    for i, word in enumerate(words[:-1]):
        if word == "--config":
            words[i + 1] = _config_path(words[i + 1])
    parser = ArgumentParser(
        prog="lit-flowgrpo serve-reward", description="Serve a registered reward over HTTP (JSON)."
    )
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML file, or a shipped config's name")
    parser.add_class_arguments(ServerSettings)
    cfg = parser.parse_args(words)
    return ServerSettings(**{f.name: cfg[f.name] for f in dataclasses.fields(ServerSettings)})


def main(argv: Sequence[str] | None = None) -> None:
    """``lit-flowgrpo serve-reward [--config FILE|NAME] [--reward NAME] [--port N] ...``."""
    serve(parse(sys.argv[1:] if argv is None else argv))
