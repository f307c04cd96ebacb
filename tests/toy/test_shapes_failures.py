"""benchmarks/shapes_failures.py: rendered scenes are classed by the condition they miss, and a
relation's chance rate is that of unrelated placements."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from lit_flowgrpo.toy import world
from lit_flowgrpo.toy.pretrain import swap_bound_colors
from lit_flowgrpo.toy.verifier import ShapeVerifier

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "shapes_failures.py"


def _module():
    spec = importlib.util.spec_from_file_location("shapes_failures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_scene_is_classed_by_what_it_gets_wrong() -> None:
    classify, verifier, rng = _module().classify, ShapeVerifier(), np.random.default_rng(0)
    binding = world.make_record("color_attr", [("circle", 1, "red"), ("square", 1, "yellow")])
    scene = world.sample_scene(binding, rng)
    assert classify(world.render(scene), binding, verifier) == [
        "samples", "strict", "shapes_right", "colours_right"
    ]  # fmt: skip
    swapped = swap_bound_colors(binding, scene)
    assert classify(world.render(swapped), binding, verifier) == [
        "samples",
        "shapes_right",
        "colours_swapped",
    ]
    other = [obj | {"color": "green"} if obj["shape"] == "circle" else obj for obj in scene]
    assert classify(world.render(other), binding, verifier) == ["samples", "shapes_right", "colours_other"]
    assert classify(world.render(scene[:1]), binding, verifier) == ["samples"]  # the square missing

    position = world.make_record("position", [("circle", 1, "red"), ("square", 1, "yellow")], "left of")
    held = world.sample_scene(position, rng)
    assert classify(world.render(held), position, verifier) == [
        "samples", "strict", "shapes_right", "colours_right", "relation_right"
    ]  # fmt: skip
    # Mirrored, the circle is to the right of the square: every other condition still holds.
    assert classify(world.render(held)[:, ::-1].copy(), position, verifier) == [
        "samples", "shapes_right", "colours_right"
    ]  # fmt: skip


def test_relation_chance_is_a_rate_per_relation() -> None:
    chance = _module().relation_chance(40, ShapeVerifier())
    assert set(chance) == {"left of", "right of", "above", "below", "all"}
    assert all(0.0 <= v <= 1.0 for v in chance.values())
    # The relations exclude one another (each needs a full gap along its own axis and little offset
    # across it), so unrelated placements meet the asked one well under half the time.
    assert chance["all"] < 0.5
