"""Shared fixtures: tiny SD3, FLUX.1, Qwen-Image, FLUX.2 klein and Z-Image-Turbo pipeline folders (each
built once per session) and small prompt files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# One intra-op thread. The models here are tiny, so a second thread gains little on a quiet machine,
# while on a busy one every parallel region waits for a descheduled partner thread: on a loaded
# 2-core machine the shortened quickstart took 215-355 s with 2 threads and 23-29 s with 1.
# Processes the tests start (DDP ranks, CLI runs) inherit the variable.
torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data" / "flow_grpo"


@pytest.fixture(scope="session")
def tiny_sd3_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from lit_flowgrpo.tiny.sd3 import build_tiny_sd3

    return build_tiny_sd3(str(tmp_path_factory.mktemp("tiny") / "sd3"))


@pytest.fixture(scope="session")
def tiny_flux_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from lit_flowgrpo.tiny.flux import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("tiny_flux"))


@pytest.fixture(scope="session")
def tiny_qwenimage_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from lit_flowgrpo.tiny.qwenimage import build_tiny_qwenimage

    return build_tiny_qwenimage(tmp_path_factory.mktemp("tiny_qwenimage"))


@pytest.fixture(scope="session")
def tiny_flux2_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from lit_flowgrpo.tiny.flux2 import build_tiny_flux2

    return build_tiny_flux2(tmp_path_factory.mktemp("tiny_flux2"))


@pytest.fixture(scope="session")
def tiny_zimage_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from lit_flowgrpo.tiny.zimage import build_tiny_zimage

    return build_tiny_zimage(tmp_path_factory.mktemp("tiny_zimage"))


@pytest.fixture()
def prompt_file(tmp_path: Path) -> str:
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(f"prompt number {i}" for i in range(8)) + "\n")
    return str(path)
