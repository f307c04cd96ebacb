"""The editing world: instructions and the target scene computed from a source, exactly; the shipped
records and sources are what the generator makes and what their fields say."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from lit_flowgrpo.conditioning import read_rgb
from lit_flowgrpo.toy import edit_world, world
from lit_flowgrpo.toy.edit_prompts import SPLIT_SEEDS, build_split


def _obj(shape: str, color: str, x: float, y: float, size: float = 10.0) -> dict:
    return {"shape": shape, "color": color, "center": [x, y], "size": size}


SOURCE = [
    _obj("circle", "red", 8.0, 8.0),
    _obj("square", "blue", 24.0, 24.0),
    _obj("triangle", "green", 8.0, 24.0),
]


def test_recolour_changes_the_one_colour_and_nothing_else():
    edit = {"kind": "recolor", "index": 0, "color": "yellow"}
    target = edit_world.apply_edit(SOURCE, edit)
    assert target == [_obj("circle", "yellow", 8.0, 8.0), *SOURCE[1:]]
    assert SOURCE[0]["color"] == "red"  # the source is not touched
    assert edit_world.instruction(edit, SOURCE) == "make the red circle yellow"


def test_remove_drops_the_object_and_keeps_the_order_of_the_rest():
    edit = {"kind": "remove", "index": 1}
    assert edit_world.apply_edit(SOURCE, edit) == [SOURCE[0], SOURCE[2]]
    assert edit_world.instruction(edit, SOURCE) == "remove the square"


@pytest.mark.parametrize(
    ("direction", "center", "words"),
    [("right", [16.0, 8.0], "move the circle to the right"), ("down", [8.0, 16.0], None)],
)
def test_move_carries_the_object_the_move_distance(direction, center, words):
    source = SOURCE[:2]
    edit = {"kind": "move", "index": 0, "direction": direction}
    target = edit_world.apply_edit(source, edit)
    assert target[0] == _obj("circle", "red", *center) and target[1] == source[1]
    assert edit_world.MOVE_DISTANCE == 8.0
    if words:
        assert edit_world.instruction(edit, source) == words


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"kind": "move", "index": 0, "direction": "left"}, "leaves the canvas"),
        ({"kind": "move", "index": 0, "direction": "down"}, "meets another object"),  # onto the triangle
        ({"kind": "recolor", "index": 0, "color": "red"}, "other than the object's own"),
        ({"kind": "recolor", "index": 5, "color": "red"}, "does not name one"),
        ({"kind": "paint", "index": 0}, "is not one of"),
    ],
)
def test_impossible_edits_are_refused(edit, message):
    with pytest.raises(ValueError, match=message):
        edit_world.apply_edit(SOURCE, edit)


def test_possible_edits_are_the_ones_apply_accepts():
    rng = np.random.default_rng(3)
    for _ in range(50):
        source = edit_world.sample_source(rng)
        assert edit_world.MIN_OBJECTS <= len(source) <= edit_world.MAX_OBJECTS
        assert len({o["shape"] for o in source}) == len(source)  # "the square" names one object
        assert edit_world.scene_fits(source)
        edits = edit_world.possible_edits(source)
        assert len(edits["remove"]) == len(source) and len(edits["recolor"]) == 3 * len(source)
        for edit in edits["move"]:
            assert edit_world.scene_fits(edit_world.apply_edit(source, edit))


def test_instructions_use_the_editing_vocabulary_only():
    rng = np.random.default_rng(0)
    for _ in range(100):
        record = edit_world.sample_edit_record(rng)
        assert edit_world.unknown_edit_words(record["prompt"]) == []
        edit_world.check_edit_record(record)
    with pytest.raises(ValueError, match=r"outside the editing world's vocabulary: \['paint'\]"):
        edit_world.edit_words("paint the circle")


def test_a_record_whose_target_is_not_its_edit_is_refused():
    record = edit_world.make_edit_record(SOURCE, {"kind": "remove", "index": 1})
    bad = dict(record, target=SOURCE)
    with pytest.raises(ValueError, match="not its source with its edit applied"):
        edit_world.check_edit_record(bad)
    with pytest.raises(ValueError, match="lacks"):
        edit_world.check_edit_record({"prompt": "remove the square"})


def test_the_shipped_lists_are_the_generators_and_their_sources_the_renders():
    for split, sources in (("val", 125), ("train", 400)):
        shipped = edit_world.load_edit_records(split)
        assert len(shipped) == 2 * sources
        if split == "val":  # the generator reproduces the held-out list exactly (train: the same code)
            built = [r for records, _ in build_split("val", sources, SPLIT_SEEDS["val"]) for r in records]
            assert [json.dumps(r) for r in built] == [json.dumps(r) for r in shipped]
        for record in shipped[::25]:
            edit_world.check_edit_record(record)
            (image,) = record["condition_images"]
            path = f"{edit_world.edit_prompt_file(split)[: -len('.jsonl')]}/{image.split('/')[-1]}"
            pixels = (read_rgb(path) * 255).round().byte().permute(1, 2, 0).numpy()
            assert np.array_equal(pixels, world.render(record["source"]))
            assert Image.open(path).size == (32, 32)
    # Held-out sources are not training sources (nor, by their seed, pretraining's).
    train = {json.dumps(r["source"]) for r in edit_world.load_edit_records("train")}
    assert not any(json.dumps(r["source"]) in train for r in edit_world.load_edit_records("val"))
