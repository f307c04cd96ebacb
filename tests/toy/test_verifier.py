"""The toy verifier and the ``shapes`` reward: accuracy on renders, noise and black images, per-family
partial scores against hand-counted conditions, and components against a flood fill. (Its speed is
measured by benchmarks/verifier_speed.py, not asserted here.)"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import pytest
import torch

from lit_flowgrpo.rewards import MultiReward, build_reward
from lit_flowgrpo.toy import world
from lit_flowgrpo.toy.verifier import ShapeVerifier, _label, check_record, relative_position, verify

VERIFIER = ShapeVerifier()


def _renders(n: int, seed: int) -> tuple[list[dict], np.ndarray]:
    rng = np.random.default_rng(seed)
    records = [world.sample_record(rng, world.FAMILIES[i % len(world.FAMILIES)]) for i in range(n)]
    images = np.stack([world.render(world.sample_scene(r, rng)) for r in records])
    return records, images


def _blur(images: np.ndarray, sigma: float) -> np.ndarray:
    """Separable Gaussian blur of (B, H, W, 3) uint8 images, zero padding."""
    radius = math.ceil(3 * sigma)
    taps = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    taps /= taps.sum()
    x = images.astype(np.float64)
    for axis in (1, 2):
        padded = np.pad(x, [(radius, radius) if a == axis else (0, 0) for a in range(4)])
        n = x.shape[axis]
        x = sum(t * np.take(padded, np.arange(k, k + n), axis=axis) for k, t in enumerate(taps))
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


def _obj(shape: str, color: str, x: float, y: float, size: float = 10.0) -> dict:
    return {"shape": shape, "color": color, "center": [x, y], "size": size}


def _score(scene: list[dict], record: dict) -> tuple[bool, float]:
    result = VERIFIER.verify(world.render(scene), record)
    return result["strict"], result["partial"]


# ------------------------------------------------------------------ accuracy


def test_strict_on_ground_truth_renders() -> None:
    # 1200 renders, 200 per family. Measured: 1.000 strict overall.
    records, images = _renders(1200, seed=0)
    strict, partial = VERIFIER.score_batch(images, records)
    assert strict.mean() >= 0.97
    assert partial.mean() >= 0.98
    for family in world.FAMILIES:
        mask = np.array([r["tag"] == family for r in records])
        assert strict[mask].mean() >= 0.95, family


def test_strict_on_renders_at_64_pixels() -> None:
    # The features are scale-free and the areas scale with the image: the same scenes drawn at
    # 64×64 verify as well (measured: 1.000).
    rng = np.random.default_rng(11)
    records = [world.sample_record(rng, world.FAMILIES[i % len(world.FAMILIES)]) for i in range(240)]
    images = np.stack([world.render(world.sample_scene(r, rng), size=64) for r in records])
    strict, _ = VERIFIER.score_batch(images, records)
    assert strict.mean() >= 0.97


@pytest.mark.parametrize(("sigma", "noise", "floor"), [(0.5, 0.0, 0.97), (0.8, 8.0, 0.93)])
def test_strict_on_perturbed_renders(sigma: float, noise: float, floor: float) -> None:
    # What a small generative model draws: soft edges, colours a bit off, some pixel noise.
    # Measured (two seeds): 0.99–1.00 at σ=0.5; 0.97–0.98 at σ=0.8 with noise 8 and ±15% gains.
    rng = np.random.default_rng(1)
    records, images = _renders(600, seed=2)
    x = _blur(images, sigma).astype(np.float64)
    x *= 1 + rng.uniform(-0.15, 0.15, size=(len(x), 1, 1, 3))
    x += rng.normal(0, noise, size=x.shape)
    strict, _ = VERIFIER.score_batch(np.clip(np.rint(x), 0, 255).astype(np.uint8), records)
    assert strict.mean() >= floor


def test_noise_and_black_images_score_zero() -> None:
    rng = np.random.default_rng(3)
    records, _ = _renders(600, seed=4)
    noise = rng.integers(0, 256, size=(600, 32, 32, 3), dtype=np.uint8)
    strict, partial = VERIFIER.score_batch(noise, records)
    assert strict.max() == 0.0  # measured: 0 of 600
    assert partial.mean() < 0.03  # measured: 0.008 (specks count as extra objects)
    black = np.zeros((600, 32, 32, 3), dtype=np.uint8)
    strict, partial = VERIFIER.score_batch(black, records)
    assert strict.max() == 0.0 and partial.max() == 0.0


# ------------------------------------------------------------------ partial, family by family


def test_single_object_partial() -> None:
    record = world.make_record("single_object", [("circle", 1, None)])  # 1 condition: count
    assert _score([_obj("circle", "blue", 16, 16)], record) == (True, 1.0)
    assert _score([_obj("square", "blue", 16, 16)], record) == (False, 0.0)  # 0 met, nothing extra
    # circle right, plus one extra object: 1 met of 1 condition + 1 extra
    assert _score([_obj("circle", "red", 8, 8), _obj("square", "red", 24, 24)], record) == (False, 0.5)


def test_colors_partial() -> None:
    record = world.make_record("colors", [("circle", 1, "red")])  # count, colour
    assert _score([_obj("circle", "red", 16, 16)], record) == (True, 1.0)
    assert _score([_obj("circle", "blue", 16, 16)], record) == (False, 0.5)
    assert _score([_obj("triangle", "red", 16, 16)], record) == (False, 0.0)


def test_counting_partial() -> None:
    record = world.make_record("counting", [("triangle", 2, "green")])  # count, colour
    two = [_obj("triangle", "green", 8, 8), _obj("triangle", "green", 24, 24)]
    assert _score(two, record) == (True, 1.0)
    assert _score([two[0], _obj("triangle", "red", 24, 24)], record) == (False, 0.5)
    three = [*two, _obj("triangle", "green", 24, 8)]
    assert _score(three, record) == (False, 0.0)  # 3 ≠ 2 twice, plus one extra: 0 / 3
    assert _score(two[:1], record) == (False, 0.0)


def test_two_object_partial() -> None:
    record = world.make_record("two_object", [("circle", 1, None), ("square", 1, None)])  # 2 counts
    pair = [_obj("circle", "yellow", 8, 8), _obj("square", "green", 24, 24)]
    assert _score(pair, record) == (True, 1.0)
    assert _score(pair[:1], record) == (False, 0.5)
    assert _score([*pair, _obj("triangle", "red", 24, 8)], record) == (False, pytest.approx(2 / 3))


def test_color_attr_partial() -> None:
    record = world.make_record(
        "color_attr", [("circle", 1, "red"), ("square", 1, "blue")]
    )  # 2 × (count, colour)
    assert _score([_obj("circle", "red", 8, 8), _obj("square", "blue", 24, 24)], record) == (True, 1.0)
    swapped = [_obj("circle", "blue", 8, 8), _obj("square", "red", 24, 24)]
    assert _score(swapped, record) == (False, 0.5)


def test_position_partial() -> None:
    record = world.make_record("position", [("circle", 1, "red"), ("square", 1, "yellow")], "left of")
    # 2 × (count, colour) + position = 5 conditions
    assert _score([_obj("circle", "red", 8, 16), _obj("square", "yellow", 24, 16)], record) == (True, 1.0)
    assert _score([_obj("circle", "red", 24, 16), _obj("square", "yellow", 8, 16)], record) == (False, 0.8)
    assert _score([_obj("circle", "red", 16, 8), _obj("square", "yellow", 16, 24)], record) == (False, 0.8)
    wrong_colour = [_obj("circle", "green", 8, 16), _obj("square", "yellow", 24, 16)]
    assert _score(wrong_colour, record) == (False, 0.8)
    assert _score([_obj("square", "yellow", 24, 16)], record) == (False, 0.4)  # subject missing


def test_verify_lists_conditions_and_objects() -> None:
    record = world.make_record("position", [("triangle", 1, "blue"), ("circle", 1, "red")], "above")
    image = world.render([_obj("triangle", "blue", 16, 7), _obj("circle", "red", 16, 24)])
    result = verify(image, record)
    assert [c["name"] for c in result["conditions"]] == [
        "count:circle",
        "color:red circle",
        "count:triangle",
        "color:blue triangle",
        "position:triangle above circle",
    ]
    assert all(c["met"] for c in result["conditions"]) and result["strict"]
    assert sorted((o["shape"], o["color"]) for o in result["objects"]) == [
        ("circle", "red"),
        ("triangle", "blue"),
    ]
    assert result["extra_objects"] == 0 and result["stray_pixels"] == 0
    assert all(e["met"] for e in result["exclude"])


# ------------------------------------------------------------------ geometry and components


def test_detects_box_colour_and_shape_of_a_square() -> None:
    image = world.render([_obj("square", "green", 10, 20)])  # covers pixels x 5..14, y 15..24
    (found,) = VERIFIER.detect(image).objects
    assert (found.shape, found.color) == ("square", "green")
    assert (found.x0, found.y0, found.x1, found.y1, found.area) == (5, 15, 15, 25, 100)
    assert found.center == (10.0, 20.0)


def test_positions_use_box_centres_not_centroids() -> None:
    # A triangle's centroid sits a sixth of its height below its box centre; relations are judged
    # on box centres, so a triangle beside a circle on the same line is beside it, not above/below.
    record = world.make_record("position", [("triangle", 1, "red"), ("circle", 1, "green")], "left of")
    image = world.render([_obj("triangle", "red", 8, 16, 12), _obj("circle", "green", 24, 16, 8)])
    tri, circ = sorted(VERIFIER.detect(image).objects, key=lambda o: o.shape, reverse=True)
    # (the apex pixel is too faint to count: the box loses half a pixel at the top)
    assert tri.center == pytest.approx((8.0, 16.0), abs=0.5) and circ.center == (24.0, 16.0)
    red = np.where(image[..., 0] > image[..., 1], image[..., 0], 0).astype(float)  # the red triangle
    centroid_y = ((np.arange(32)[:, None] + 0.5) * red).sum() / red.sum()
    assert centroid_y == pytest.approx(16 + 12 / 6, abs=0.1)  # a sixth of the height below the box centre
    assert relative_position(tri, circ) == {"left of"}
    assert VERIFIER.verify(image, record)["strict"]


def test_relative_position_matches_geneval_cases() -> None:
    from lit_flowgrpo.toy.verifier import Detection

    def box(x0: int, y0: int, x1: int, y1: int) -> Detection:
        return Detection("square", "red", 1, x0, y0, x1, y1, 1.0, 0.5, 1.0, 1.0)

    a = box(0, 0, 10, 10)
    assert relative_position(box(20, 0, 30, 10), a) == {"right of"}
    assert relative_position(box(0, 20, 10, 30), a) == {"below"}
    assert relative_position(box(20, 20, 30, 30), a) == {"right of", "below"}  # 45°: both
    # Centres 3 apart, shrunk by 0.1 × (10 + 10) = 2: 1 of 3 along x, under 0.5: no relation.
    assert relative_position(box(3, 0, 13, 10), a) == set()
    assert relative_position(a, a) == set()


def _flood_fill(colors: np.ndarray) -> list[set[tuple[int, int]]]:
    """Independent reference: breadth-first flood fill, 4-neighbourhood, equal colour."""
    h, w = colors.shape
    seen = np.zeros_like(colors, dtype=bool)
    comps = []
    for r in range(h):
        for c in range(w):
            if colors[r, c] < 0 or seen[r, c]:
                continue
            comp, queue = set(), deque([(r, c)])
            seen[r, c] = True
            while queue:
                y, x = queue.popleft()
                comp.add((y, x))
                for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                    if 0 <= ny < h and 0 <= nx < w and not seen[ny, nx] and colors[ny, nx] == colors[y, x]:
                        seen[ny, nx] = True
                        queue.append((ny, nx))
            comps.append(comp)
    return comps


def test_components_match_flood_fill() -> None:
    rng = np.random.default_rng(6)
    colors = np.where(rng.random((6, 24, 20)) < 0.55, rng.integers(0, 3, size=(6, 24, 20)), -1)
    colors[0] = -1  # an empty image
    colors[1, 2:22, 3] = 1  # a long bar and a spiral-free snake through it
    labels = _label(colors)
    for b in range(len(colors)):
        ours: dict[int, set[tuple[int, int]]] = {}
        for (y, x), label in np.ndenumerate(labels[b]):
            if label >= 0:
                ours.setdefault(int(label), set()).add((y, x))
        assert sorted(map(sorted, ours.values())) == sorted(map(sorted, _flood_fill(colors[b])))


def test_touching_objects_of_different_colours_stay_apart() -> None:
    image = world.render([_obj("square", "red", 10, 16), _obj("square", "blue", 20, 16)])  # edges touch
    found = VERIFIER.detect(image).objects
    assert sorted((o.shape, o.color) for o in found) == [("square", "blue"), ("square", "red")]


# ------------------------------------------------------------------ bad input


def test_records_outside_the_world_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"include\[0\]\.class 'dog'.*include\[1\]\.color 'purple'"):
        check_record(
            {"include": [{"class": "dog", "count": 1}, {"class": "circle", "count": 1, "color": "purple"}]}
        )
    with pytest.raises(ValueError, match="non-empty 'include' list"):
        check_record({"tag": "colors"})
    with pytest.raises(ValueError, match=r"position \['near', 0\]"):
        check_record(
            {
                "include": [
                    {"class": "circle", "count": 1},
                    {"class": "square", "count": 1, "position": ["near", 0]},
                ]
            }
        )


def test_verifier_rejects_wrong_image_layout() -> None:
    with pytest.raises(ValueError, match=r"\(B, H, W, 3\) uint8"):
        VERIFIER.detect_batch(np.zeros((2, 3, 32, 32), dtype=np.uint8))


# ------------------------------------------------------------------ the reward


def _as_tensor(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0


def test_shapes_reward_matches_the_verifier() -> None:
    reward = build_reward("shapes")
    assert reward.primary == "strict" and reward.required_metadata == ("tag", "include")
    records, images = _renders(48, seed=7)
    # Spoil a third of the images so both outcomes appear: drop the first object's colour.
    images[::3] = 0
    metadata = [{k: v for k, v in r.items() if k != "prompt"} for r in records]  # as the data module passes
    out = reward(_as_tensor(images), [r["prompt"] for r in records], metadata)
    assert set(out) == {"strict", "partial"}
    expected = [VERIFIER.verify(image, r) for image, r in zip(images, records, strict=True)]
    torch.testing.assert_close(out["strict"], torch.tensor([float(e["strict"]) for e in expected]))
    torch.testing.assert_close(
        out["partial"], torch.tensor([e["partial"] for e in expected], dtype=torch.float32)
    )
    assert out["strict"].dtype == torch.float32 and out["strict"].shape == (48,)
    assert out["strict"][::3].sum() == 0 and out["strict"].sum() == 32

    total = MultiReward({"shapes": 1.0}, rewards={"shapes": reward})(_as_tensor(images), [""] * 48, metadata)
    torch.testing.assert_close(total.total, out["strict"])


def test_shapes_reward_marks_non_finite_images_nan() -> None:
    reward = build_reward("shapes")
    records, images = _renders(4, seed=8)
    x = _as_tensor(images)
    x[2, 1, 5, 5] = float("nan")
    out = reward(x, [""] * 4, records)
    assert torch.isnan(out["strict"][2]) and torch.isnan(out["partial"][2])
    assert torch.equal(out["strict"][[0, 1, 3]], torch.ones(3))


def test_shapes_reward_bad_input() -> None:
    reward = build_reward("shapes")
    records, images = _renders(2, seed=9)
    with pytest.raises(ValueError, match="2 images but 1 metadata records"):
        reward(_as_tensor(images), ["", ""], records[:1])
    with pytest.raises(ValueError, match="class 'dog'"):
        reward(
            _as_tensor(images),
            ["", ""],
            [records[0], {"tag": "x", "include": [{"class": "dog", "count": 1}]}],
        )
    with pytest.raises(ValueError, match="brightness"):
        build_reward("shapes", brightness=1.5)
