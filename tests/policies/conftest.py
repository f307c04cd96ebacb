"""Tiny Wan pipelines built once per test session, saved to a temp folder and loaded back by path (the
image families' tiny pipelines are tests/conftest.py's)."""

from __future__ import annotations

import pytest

from lit_flowgrpo.tiny.wan import build_tiny_wan


@pytest.fixture(scope="session")
def tiny_wan_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Tiny Wan 2.1, Wan 2.2 A14B (two experts) and TI2V-style (expanded timesteps) pipelines."""
    return {v: build_tiny_wan(tmp_path_factory.mktemp(f"tiny_wan_{v}"), v) for v in ("2.1", "a14b", "ti2v")}
