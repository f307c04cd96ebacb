"""benchmarks/video_bases.py: the direction classes of a track, and one seed of the shipped base."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "video_bases.py"


def _module():
    spec = importlib.util.spec_from_file_location("video_bases", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_track_is_classed_by_its_larger_displacement() -> None:
    went = _module().went
    assert went([[4.0, 8.0], None, [12.0, 9.0]]) == "right"  # untracked frames are skipped
    assert went([[12.0, 8.0], [4.0, 6.0]]) == "left"
    assert went([[8.0, 12.0], [9.0, 3.0]]) == "up"  # rows count down
    assert went([[8.0, 3.0], [8.0, 12.0]]) == "down"
    assert went([[8.0, 8.0], [9.0, 9.0]]) == "still"
    assert went([[8.0, 8.0], None, None]) == "untracked"


# slow: 16 clips of the shipped base through the sampler and the verifier, about 15 s
@pytest.mark.slow
def test_the_shipped_base_scored_for_direction(tmp_path: Path) -> None:
    out = tmp_path / "bases.json"
    base = SCRIPT.parents[1] / "lit_flowgrpo" / "toy" / "assets" / "toy_video_base.safetensors"
    subprocess.run(
        [sys.executable, str(SCRIPT), str(base), "--seeds", "1", "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (result,) = json.loads(out.read_text()).values()
    val = result["val"]
    assert val["clips"] == 16
    # 16 held-out prompts, 4 per direction; every clip classed once
    assert {want: sum(got.values()) for want, got in val["confusion"].items()} == dict.fromkeys(
        ("down", "left", "right", "up"), 4
    )
    on_diagonal = sum(got.get(want, 0) for want, got in val["confusion"].items())
    assert val["direction"] == on_diagonal / 16
    # a strict pass moves along the named direction by a quarter side, straight: it went that way
    assert 0.0 <= val["strict"] <= val["direction"] <= 1.0
