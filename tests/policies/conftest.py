"""Tiny pipelines built once per test session, saved to a temp folder and loaded back by path."""

from __future__ import annotations

import pytest

from lit_flowgrpo.tiny.flux import build_tiny_flux
from lit_flowgrpo.tiny.qwenimage import build_tiny_qwenimage
from lit_flowgrpo.tiny.wan import build_tiny_wan


@pytest.fixture(scope="session")
def tiny_flux_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_flux(tmp_path_factory.mktemp("tiny_flux"))


@pytest.fixture(scope="session")
def tiny_qwenimage_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_qwenimage(tmp_path_factory.mktemp("tiny_qwenimage"))


@pytest.fixture(scope="session")
def tiny_flux2_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from lit_flowgrpo.tiny.flux2 import build_tiny_flux2

    return build_tiny_flux2(tmp_path_factory.mktemp("tiny_flux2_klein"))


@pytest.fixture(scope="session")
def tiny_zimage_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from lit_flowgrpo.tiny.zimage import build_tiny_zimage

    return build_tiny_zimage(tmp_path_factory.mktemp("tiny_zimage_turbo"))


@pytest.fixture(scope="session")
def tiny_wan_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Tiny Wan 2.1, Wan 2.2 A14B (two experts) and TI2V-style (expanded timesteps) pipelines."""
    return {v: build_tiny_wan(tmp_path_factory.mktemp(f"tiny_wan_{v}"), v) for v in ("2.1", "a14b", "ti2v")}
