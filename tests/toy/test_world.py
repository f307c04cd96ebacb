"""The toy world: vocabulary, GenEval-style records, scenes, the renderer and the shipped prompt lists."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from lit_flowgrpo.toy import make_prompts, world

GENEVAL_METADATA = (
    Path(__file__).resolve().parents[2].parent
    / "shared"
    / "data"
    / "flow_grpo"
    / ("geneval_test_metadata.jsonl")
)
SMALL_FAMILIES = {"single_object", "two_object"}  # too few distinct prompts to hold any out


# ------------------------------------------------------------------ vocabulary


def test_tokenize_lowercases_and_splits_on_punctuation() -> None:
    assert world.tokenize("Two RED circles, above a Square.") == [
        "two",
        "red",
        "circles",
        "above",
        "a",
        "square",
    ]


def test_tokenize_lists_every_unknown_word_once() -> None:
    with pytest.raises(ValueError) as info:
        world.tokenize("a purple circle and a purple hexagon")
    message = str(info.value)
    assert "['purple', 'hexagon']" in message
    assert "'a purple circle and a purple hexagon'" in message
    assert "known words:" in message and "'triangle'" in message


def test_vocab_is_exactly_the_words_prompts_use() -> None:
    used = set()
    for family in world.FAMILIES:
        for record in world.family_records(family, unseen=None):
            used |= set(world.tokenize(record["prompt"]))  # raises if a prompt leaves the vocabulary
    assert used == set(world.VOCAB)


def test_palette_is_well_separated() -> None:
    rgb = np.array(list(world.COLORS.values()), dtype=float)
    assert len(rgb) >= 4
    gaps = np.linalg.norm(rgb[:, None] - rgb[None], axis=-1)[np.triu_indices(len(rgb), 1)]
    assert gaps.min() > 150  # of a 441 maximum: far apart in RGB


# ------------------------------------------------------------------ records


def test_position_record_follows_geneval_conventions() -> None:
    record = world.make_record("position", [("circle", 1, "red"), ("square", 1, "yellow")], "left of")
    assert record == {
        "tag": "position",
        "include": [
            {"class": "square", "count": 1, "color": "yellow"},
            {"class": "circle", "count": 1, "color": "red", "position": ["left of", 0]},
        ],
        "exclude": [
            {"class": "square", "count": 2},
            {"class": "circle", "count": 2},
            {"class": "triangle", "count": 1},
        ],
        "prompt": "a red circle to the left of a yellow square",
    }
    assert list(record) == ["tag", "include", "exclude", "prompt"]  # GenEval's key order


def test_counting_record() -> None:
    record = world.make_record("counting", [("triangle", 3, "green")])
    assert record["prompt"] == "three green triangles"
    assert record["include"] == [{"class": "triangle", "count": 3, "color": "green"}]
    assert record["exclude"] == [
        {"class": "triangle", "count": 4},
        {"class": "circle", "count": 1},
        {"class": "square", "count": 1},
    ]


@pytest.mark.skipif(not GENEVAL_METADATA.is_file(), reason="GenEval metadata not available")
def test_records_use_geneval_field_conventions() -> None:
    geneval = [json.loads(line) for line in GENEVAL_METADATA.read_text().splitlines() if line.strip()]
    ours = [r for f in world.FAMILIES for r in world.family_records(f, unseen=None)]
    assert {r["tag"] for r in geneval} == set(world.FAMILIES)
    assert {k for r in ours for k in r} <= {k for r in geneval for k in r}
    assert {k for r in ours for e in r["include"] for k in e} <= {
        k for r in geneval for e in r["include"] for k in e
    }
    geneval_relations = {e["position"][0] for r in geneval for e in r["include"] if "position" in e}
    assert set(world.RELATIONS) == geneval_relations
    for r in ours + geneval:
        for i, entry in enumerate(r["include"]):
            if "position" in entry:  # on the second object, pointing at the first
                assert i == 1 and entry["position"][1] == 0


def test_make_record_rejects_outside_words() -> None:
    with pytest.raises(
        ValueError, match=r"colour 'purple'.*shape 'hexagon'|shape 'hexagon'.*colour 'purple'"
    ):
        world.make_record("color_attr", [("circle", 1, "purple"), ("hexagon", 1, "red")])
    with pytest.raises(ValueError, match="tag 'shapes'"):
        world.make_record("shapes", [("circle", 1, None)])


def test_family_sizes() -> None:
    # 3 shapes, 4 colours, counts {2, 3}, 4 relations; two-object prompts name two different shapes
    # (6 ordered pairs), color_attr two different colours (12 ordered pairs), position any (16).
    sizes = {f: len(world.family_records(f, unseen=None)) for f in world.FAMILIES}
    assert sizes == {
        "single_object": 3,
        "colors": 12,
        "counting": 24,
        "two_object": 6,
        "color_attr": 72,
        "position": 384,
    }
    # Two unseen bindings out of 12: colors 2, counting 2×2, color_attr and position by inclusion–exclusion.
    unseen = {f: len(world.family_records(f, unseen=True)) for f in world.FAMILIES}
    assert unseen["colors"] == 2 and unseen["counting"] == 4
    assert unseen["single_object"] == unseen["two_object"] == 0
    # color_attr: shapes (a, b) ordered and distinct, colours distinct. An unseen binding on the first
    # object: 2 choices × 2 second shapes × 3 second colours = 12, same on the second = 12, both: the
    # two bindings have different shapes and colours, 2 orders → 2. 12 + 12 − 2 = 22.
    assert unseen["color_attr"] == 22
    # position: colours free (4 × 4) and 4 relations: (2·2·4 + 2·2·4 − 2) · 4 = 30 · 4 = 120.
    assert unseen["position"] == 120


def test_sample_record_respects_unseen_and_weights() -> None:
    rng = np.random.default_rng(0)
    draws = [world.sample_record(rng) for _ in range(4000)]
    assert not any(world.is_unseen(r) for r in draws)
    freq = Counter(r["tag"] for r in draws)
    for family, weight in world.FAMILY_WEIGHTS.items():
        # binomial standard deviation at n=4000 is below 0.007; allow 4 of them
        assert abs(freq[family] / len(draws) - weight) < 0.028, family
    counts = Counter(r["include"][0]["count"] for r in draws if r["tag"] == "counting")
    assert abs(counts[3] / sum(counts.values()) - world.COUNT_WEIGHTS[3]) < 0.06
    assert all(world.is_unseen(world.sample_record(rng, "position", unseen=True)) for _ in range(50))
    with pytest.raises(ValueError, match="no unseen compositions"):
        world.sample_record(rng, "single_object", unseen=True)


# ------------------------------------------------------------------ scenes


def _box(obj: dict) -> tuple[float, float, float, float]:
    (x, y), s = obj["center"], obj["size"]
    return x - s / 2, y - s / 2, x + s / 2, y + s / 2


def _geneval_relations(a: tuple[float, ...], b: tuple[float, ...], threshold: float = 0.1) -> set[str]:
    # GenEval's relative_position (evaluation/evaluate_images.py), from boxes (x0, y0, x1, y1).
    ca, cb = (
        np.array([(a[0] + a[2]) / 2, (a[1] + a[3]) / 2]),
        np.array([(b[0] + b[2]) / 2, (b[1] + b[3]) / 2]),
    )
    dims = np.array([a[2] - a[0] + b[2] - b[0], a[3] - a[1] + b[3] - b[1]])
    offset = ca - cb
    revised = np.maximum(np.abs(offset) - threshold * dims, 0) * np.sign(offset)
    dx, dy = revised / np.linalg.norm(offset)
    return {
        n
        for n, ok in [
            ("left of", dx < -0.5),
            ("right of", dx > 0.5),
            ("above", dy < -0.5),
            ("below", dy > 0.5),
        ]
        if ok
    }


@pytest.mark.parametrize("family", world.FAMILIES)
def test_scenes_satisfy_their_records(family: str) -> None:
    rng = np.random.default_rng(1)
    for _ in range(150):
        record = world.sample_record(rng, family)
        scene = world.sample_scene(record, rng)
        expected = [(e["class"], e.get("color")) for e in record["include"] for _ in range(e["count"])]
        assert [o["shape"] for o in scene] == [s for s, _ in expected]
        assert all(c is None or o["color"] == c for o, (_, c) in zip(scene, expected, strict=True))
        boxes = [_box(o) for o in scene]
        assert all(world.MIN_SIZE <= o["size"] <= world.MAX_SIZE for o in scene)
        assert all(b[0] >= 1 and b[1] >= 1 and b[2] <= 31 and b[3] <= 31 for b in boxes)
        for i in range(len(boxes)):
            for j in range(i):
                a, b = boxes[i], boxes[j]
                gap = max(b[0] - a[2], a[0] - b[2], b[1] - a[3], a[1] - b[3])
                assert gap >= world.GAP - 1e-9
        if family == "position":
            relation = record["include"][1]["position"][0]
            # Holds under GenEval's rule even with twice its margin (0.2 for 0.1): boxes a gap apart
            # along the axis and a cross offset of at most half give a normalised revised offset
            # above (1 - 2·0.2) / √1.25 > 0.5.
            assert relation in _geneval_relations(boxes[1], boxes[0], threshold=0.2)


def test_scene_sampling_is_deterministic() -> None:
    record = world.make_record("counting", [("square", 3, "blue")])
    a = world.sample_scene(record, np.random.default_rng(7))
    b = world.sample_scene(record, np.random.default_rng(7))
    assert a == b


# ------------------------------------------------------------------ rendering


def test_render_square_is_pixel_exact() -> None:
    # A 10-pixel square on integer coordinates covers whole pixels: colour inside, black outside.
    image = world.render([{"shape": "square", "color": "green", "center": [10.0, 20.0], "size": 10.0}])
    assert image.shape == (32, 32, 3) and image.dtype == np.uint8
    expected = np.zeros((32, 32, 3), dtype=np.uint8)
    expected[15:25, 5:15] = world.COLORS["green"]
    np.testing.assert_array_equal(image, expected)


@pytest.mark.parametrize(
    ("shape", "area"), [("circle", math.pi * 5.5**2), ("square", 11.0**2), ("triangle", 11.0**2 / 2)]
)
def test_render_areas_match_geometry(shape: str, area: float) -> None:
    color = world.COLORS["red"]
    image = world.render([{"shape": shape, "color": "red", "center": [15.3, 16.1], "size": 11.0}])
    covered = image[..., 0].astype(float).sum() / color[0]  # anti-aliased coverage in pixels
    assert covered == pytest.approx(area, rel=0.03)  # 4×4 sub-samples: about ±2% on slanted edges
    # The same scene at 64×64 covers four times the pixels.
    big = world.render([{"shape": shape, "color": "red", "center": [15.3, 16.1], "size": 11.0}], size=64)
    assert big[..., 0].astype(float).sum() / color[0] == pytest.approx(4 * area, rel=0.03)


def test_triangle_points_up() -> None:
    image = world.render([{"shape": "triangle", "color": "blue", "center": [16.0, 16.0], "size": 12.0}])
    widths = (image.max(axis=-1) > 0).sum(axis=1)[10:22]
    assert widths[0] <= 2 and widths[-1] == 12 and np.all(np.diff(widths) >= 0)


def test_render_rejects_outside_colours() -> None:
    with pytest.raises(ValueError, match="'purple' is not in the toy palette"):
        world.render([{"shape": "circle", "color": "purple", "center": [16, 16], "size": 10}])


# ------------------------------------------------------------------ prompt lists


def _lines(path: str | Path) -> list[str]:
    return Path(path).read_text(encoding="utf-8").splitlines()


def test_prompt_lists_regenerate_identically(tmp_path: Path) -> None:
    paths = make_prompts.write_prompt_lists(str(tmp_path))
    for split in ("train", "val"):
        assert Path(paths[split]).read_bytes() == Path(world.prompt_file(split)).read_bytes(), split


def test_prompt_lists_are_stratified_by_family() -> None:
    for split, size in (("train", make_prompts.TRAIN_SIZE), ("val", make_prompts.VAL_SIZE)):
        records = world.load_prompts(split)
        assert len(records) == size
        freq = Counter(r["tag"] for r in records)
        for family, weight in world.FAMILY_WEIGHTS.items():
            assert abs(freq[family] - weight * size) <= 1, (split, family)
    # Every prefix keeps the mix (--data.init_args.max_val_prompts takes one).
    val = world.load_prompts("val")
    for n in (60, 100, 180):
        freq = Counter(r["tag"] for r in val[:n])
        for family, weight in world.FAMILY_WEIGHTS.items():
            assert abs(freq[family] - weight * n) <= 1.5, (n, family)
    assert len(val) * 4 >= 1000  # four seeds per prompt reach 1000 evaluation samples


def test_val_prompts_are_held_out_and_some_unseen() -> None:
    train, val = world.load_prompts("train"), world.load_prompts("val")
    for family in world.FAMILIES:
        t = {r["prompt"] for r in train if r["tag"] == family}
        v = {r["prompt"] for r in val if r["tag"] == family}
        if family in SMALL_FAMILIES:
            assert t == v == {r["prompt"] for r in world.family_records(family)}
        else:
            assert t.isdisjoint(v) and len(v) >= 3, family
    # Unseen bindings: never in training, never drawn by sample_record's default; about a third of
    # the validation records of families with colours.
    assert not any(world.is_unseen(r) for r in train)
    for family in ("colors", "counting", "color_attr", "position"):
        fam = [r for r in val if r["tag"] == family]
        share = sum(world.is_unseen(r) for r in fam) / len(fam)
        assert abs(share - 1 / 3) < 0.05, family
    trained = {b for r in train for b in world.bindings(r)}
    for color, shape in world.UNSEEN_BINDINGS:  # each word is still trained, in other bindings
        assert any(c == color for c, _ in trained) and any(s == shape for _, s in trained)
    # Every training-side prompt appears in the training list: the seen prompts minus the 30% held
    # out per stratum (colors 10 → 7; counting 2 × (10 → 7); color_attr 50 → 35; position 4 × (66 → 46)).
    sizes = {f: len({r["prompt"] for r in train if r["tag"] == f}) for f in world.FAMILIES}
    assert sizes == {
        "single_object": 3,
        "two_object": 6,
        "colors": 7,
        "counting": 14,
        "color_attr": 35,
        "position": 184,
    }
    universe = {r["prompt"]: r for f in world.FAMILIES for r in world.family_records(f, unseen=None)}
    assert all(universe[r["prompt"]] == r for r in train + val)


def test_counting_three_is_rare_in_lists() -> None:
    train = world.load_prompts("train")
    counts = Counter(r["include"][0]["count"] for r in train if r["tag"] == "counting")
    assert counts[3] / sum(counts.values()) == pytest.approx(world.COUNT_WEIGHTS[3], abs=0.01)


def test_prompt_file_rejects_unknown_split() -> None:
    with pytest.raises(ValueError, match="'test' must be 'train' or 'val'"):
        world.prompt_file("test")  # type: ignore[arg-type]
