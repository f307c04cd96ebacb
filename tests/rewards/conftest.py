"""Tiny CLIP checkpoints built in code, and real HTTP servers on 127.0.0.1, for the reward tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch


def _tiny_clip(path: Path) -> Path:
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    # A byte-level vocabulary without merges: every character is a token, as CLIP's BPE degenerates to.
    chars = sorted(ByteLevel.alphabet())
    tokens = [*chars, *(c + "</w>" for c in chars), "<|startoftext|>", "<|endoftext|>"]
    tokenizer = CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[])
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(path)
    common = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    config = CLIPConfig(
        text_config={
            **common,
            "vocab_size": len(tokenizer),
            "max_position_embeddings": 77,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={**common, "image_size": 32, "patch_size": 8},
        projection_dim=16,
    )
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a tiny CLIP model and its processor, as ``save_pretrained`` writes them."""
    return _tiny_clip(tmp_path_factory.mktemp("tiny_clip"))


@pytest.fixture(scope="session")
def aesthetic_mlp_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lit_flowgrpo.rewards.aesthetic import AestheticMLP

    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("aesthetic") / "mlp.pth"
    torch.save(AestheticMLP(16).state_dict(), path)
    return path


@pytest.fixture
def images() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.rand(4, 3, 40, 48, generator=generator)


@pytest.fixture
def http_server() -> Iterator[Callable[[type[BaseHTTPRequestHandler]], str]]:
    """Start real HTTP servers on 127.0.0.1 (a free port each); yields ``start(handler_class) -> base URL``."""
    servers: list[ThreadingHTTPServer] = []

    def start(handler: type[BaseHTTPRequestHandler]) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def closed_port_url() -> str:
    """A URL on 127.0.0.1 where nothing listens."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def wait_for() -> Callable[..., bool]:
    """``wait_for(condition, limit_s=30)``: poll until ``condition()`` holds, False if it never did.

    For state another thread will reach (a server's handler lagging the client that gave up): a
    bound on waiting, never an assertion on how fast anything ran.
    """

    def wait(condition: Callable[[], bool], limit_s: float = 30.0) -> bool:
        # A bounded number of polls, not a clock: the bound only keeps a broken test from hanging.
        for _ in range(int(limit_s / 0.01)):
            if condition():
                return True
            time.sleep(0.01)
        return condition()

    return wait
