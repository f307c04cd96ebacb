"""The editing verifier and the ``shapes_edit`` reward: exact on clean renders of the target, 0 on
noise, and each component on hand-made outputs (the edit undone, done with the scene redrawn, an extra
object)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lit_flowgrpo.rewards import build_reward
from lit_flowgrpo.toy import edit_world, world
from lit_flowgrpo.toy.edit_verifier import EditVerifier

VERIFIER = EditVerifier()


def _obj(shape: str, color: str, x: float, y: float, size: float = 10.0) -> dict:
    return {"shape": shape, "color": color, "center": [x, y], "size": size}


SOURCE = [_obj("circle", "red", 8.0, 8.0), _obj("square", "blue", 24.0, 24.0)]


def _check(scene: list[dict], edit: dict) -> dict:
    return VERIFIER.verify(world.render(scene), edit_world.make_edit_record(SOURCE, edit))


def test_clean_renders_of_the_target_pass_and_of_the_source_fail_the_edit_only():
    rng = np.random.default_rng(0)
    records = [edit_world.sample_edit_record(rng) for _ in range(1000)]
    targets = np.stack([world.render(r["target"]) for r in records])
    sources = np.stack([world.render(r["source"]) for r in records])
    done = VERIFIER.score_batch(targets, records)
    # Measured: 0.9995 on 2000 (one circle of ~11 px read as a square by the shapes world's
    # classifier); the shipped lists keep only sources read exactly.
    assert done["strict"].mean() >= 0.995
    assert np.array_equal(done["strict"], done["edit"] * done["preserve"])
    undone = VERIFIER.score_batch(sources, records)
    assert undone["edit"].sum() == 0 and undone["strict"].sum() == 0
    assert undone["preserve"].mean() >= 0.995


@pytest.mark.parametrize("split", ["val", "train"])
def test_the_shipped_records_verify_exactly_on_their_renders(split):
    records = edit_world.load_edit_records(split)
    scores = VERIFIER.score_batch(np.stack([world.render(r["target"]) for r in records]), records)
    assert scores["strict"].min() == 1.0


def test_noise_and_black_images_score_no_strict_edit():
    rng = np.random.default_rng(1)
    records = [edit_world.sample_edit_record(rng) for _ in range(300)]
    noise = rng.integers(0, 256, size=(300, 32, 32, 3)).astype(np.uint8)
    assert VERIFIER.score_batch(noise, records)["strict"].sum() == 0
    black = np.zeros((300, 32, 32, 3), dtype=np.uint8)
    scores = VERIFIER.score_batch(black, records)
    assert scores["strict"].sum() == 0 and scores["preserve"].sum() == 0
    # An empty canvas does remove the object: edit alone is gameable (the hacking view's point).
    removes = np.array([r["tag"] == "remove" for r in records])
    assert scores["edit"][removes].min() == 1 and scores["edit"][~removes].max() == 0


def test_each_component_on_hand_made_outputs():
    recolour = {"kind": "recolor", "index": 0, "color": "green"}
    right = _check([_obj("circle", "green", 8, 8), SOURCE[1]], recolour)
    assert (right["edit"], right["preserve"], right["strict"], right["partial"]) == (True, True, True, 1.0)
    wrong_colour = _check([_obj("circle", "yellow", 8, 8), SOURCE[1]], recolour)
    assert (wrong_colour["edit"], wrong_colour["preserve"]) == (False, True)
    assert wrong_colour["partial"] == 0.5
    # The edit done, the rest redrawn elsewhere: edit passes, preserve fails.
    redrawn = _check([_obj("circle", "green", 8, 8), _obj("square", "blue", 22, 10)], recolour)
    assert (redrawn["edit"], redrawn["preserve"], redrawn["strict"]) == (True, False, False)
    # The rest kept, one object more: preserve fails, counted as extra.
    extra = _check([_obj("circle", "green", 8, 8), SOURCE[1], _obj("triangle", "red", 24, 8)], recolour)
    assert (extra["edit"], extra["preserve"], extra["extra_objects"]) == (True, False, 1)
    # Two circles where one was asked for: the edit is not done (the old one left beside the new).
    both = _check([_obj("circle", "green", 8, 8), _obj("circle", "red", 24, 8), SOURCE[1]], recolour)
    assert not both["edit"] and both["preserve"]


def test_move_is_judged_on_the_new_place():
    move = {"kind": "move", "index": 0, "direction": "right"}
    moved = _check([_obj("circle", "red", 16, 8), SOURCE[1]], move)
    assert moved["strict"]
    stayed = _check(SOURCE, move)
    assert (stayed["edit"], stayed["preserve"]) == (False, True)
    short = _check([_obj("circle", "red", 12, 8), SOURCE[1]], move)  # half way: 4 px off the target
    assert not short["edit"]


def test_the_reward_scores_a_batch_and_refuses_records_it_cannot_read():
    reward = build_reward("shapes_edit")
    records = [edit_world.make_edit_record(SOURCE, {"kind": "remove", "index": 1})] * 2
    images = torch.from_numpy(np.stack([world.render(records[0]["target"]), world.render(SOURCE)]))
    images = images.permute(0, 3, 1, 2).float() / 255
    out = reward(images, [r["prompt"] for r in records], records)
    assert out["strict"].tolist() == [1.0, 0.0] and out["preserve"].tolist() == [1.0, 1.0]
    images[1, 0, 0, 0] = float("nan")
    assert torch.isnan(reward(images, ["a", "b"], records)["strict"][1])
    problems = reward.problems([{"prompt": "a red circle", "tag": "colors"}, records[0]])
    assert len(problems) == 2 and "prompt record 0" in problems[0] and "lacks" in problems[0]
    assert "vocabulary" in problems[1]
