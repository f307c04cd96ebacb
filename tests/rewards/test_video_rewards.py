"""Video rewards: PerFrame against per-frame float64 references, the temporal-consistency formula in
float64, the modality declarations, and the errors for the wrong input."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torch import Tensor

from lit_flowgrpo.rewards import (
    MultiReward,
    PerFrame,
    TemporalConsistencyReward,
    as_reward,
    build_reward,
    modality_problems,
    reward_modalities,
)
from lit_flowgrpo.rewards.images import frame_indices


def _videos(b: int = 3, f: int = 4, h: int = 8, w: int = 6, seed: int = 0) -> Tensor:
    return torch.rand(b, f, 3, h, w, generator=torch.Generator().manual_seed(seed))


class Brightness:
    """Mean pixel of each image; records what it was called with."""

    primary = "bright"
    core_components = ("bright",)
    required_metadata = ("tag",)
    thread_safe = False

    def __init__(self, nan_frames: frozenset[int] = frozenset()) -> None:
        self.calls: list[tuple[int, list[str], list[dict]]] = []
        self.nan_frames = nan_frames  # frame positions (over the whole flattened batch) scored NaN in "dark"

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, Tensor]:
        assert images.ndim == 4
        offset = sum(n for n, _, _ in self.calls)
        self.calls.append((images.shape[0], list(prompts), list(metadata)))
        bright = images.double().mean(dim=(1, 2, 3))
        dark = 1 - bright
        for i in range(images.shape[0]):
            if offset + i in self.nan_frames:
                dark[i] = float("nan")
        return {"bright": bright, "dark": dark}


def _frame_means(videos: Tensor) -> np.ndarray:
    return videos.double().numpy().mean(axis=(2, 3, 4))  # (B, F) float64


def test_per_frame_mean_and_min_match_float64_references() -> None:
    videos = _videos()
    means = _frame_means(videos)
    for reduce, ref in (("mean", means.mean(axis=1)), ("min", means.min(axis=1))):
        out = PerFrame(Brightness(), reduce=reduce)(videos, ["a", "b", "c"], [{"tag": i} for i in range(3)])
        assert set(out) == {"bright", "dark"}
        np.testing.assert_allclose(out["bright"].numpy(), ref, rtol=0, atol=1e-6)
        dark_ref = (1 - means).mean(axis=1) if reduce == "mean" else (1 - means).min(axis=1)
        np.testing.assert_allclose(out["dark"].numpy(), dark_ref, rtol=0, atol=1e-6)


def test_frames_are_one_image_batch_with_their_video_prompt_and_metadata() -> None:
    inner = Brightness()
    meta = [{"tag": "x"}, {"tag": "y"}]
    PerFrame(inner)(_videos(b=2, f=3), ["p0", "p1"], meta)
    ((n, prompts, metadata),) = inner.calls
    assert n == 6 and prompts == ["p0"] * 3 + ["p1"] * 3 and metadata == [meta[0]] * 3 + [meta[1]] * 3


def test_a_nan_frame_makes_its_video_component_nan_only() -> None:
    videos = _videos(b=3, f=4)
    out = PerFrame(Brightness(nan_frames=frozenset({5})), reduce="min")(videos, ["a"] * 3, [])
    # frame 5 of the flattened batch is video 1's frame 1: that video's "dark" is NaN, nothing else
    assert torch.isnan(out["dark"]).tolist() == [False, True, False]
    assert torch.isfinite(out["bright"]).all()
    out = PerFrame(Brightness(nan_frames=frozenset({5})), reduce="mean")(videos, ["a"] * 3, [])
    assert torch.isnan(out["dark"]).tolist() == [False, True, False]


def test_a_tensor_valued_reward_stays_a_tensor_and_chunks_change_nothing() -> None:
    calls: list[int] = []

    def bright(images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        calls.append(images.shape[0])
        return images.mean(dim=(1, 2, 3))

    videos = _videos(b=3, f=5)
    whole = PerFrame(bright)(videos, ["a"] * 3, [])
    chunked = PerFrame(bright, frames_per_call=4)(videos, ["a"] * 3, [])
    assert isinstance(whole, Tensor) and whole.shape == (3,)
    assert calls == [15, 4, 4, 4, 3]
    torch.testing.assert_close(whole, chunked, rtol=0, atol=0)
    np.testing.assert_allclose(whole.numpy(), _frame_means(videos).mean(axis=1), rtol=0, atol=1e-6)


def test_max_frames_scores_evenly_spaced_frames() -> None:
    assert frame_indices(81, 5) == [0, 20, 40, 60, 80]
    assert frame_indices(10, 4) == [0, 3, 6, 9]
    assert frame_indices(10, 1) == [0] and frame_indices(3, None) == [0, 1, 2]
    videos = _videos(b=2, f=10)
    out = PerFrame(lambda x, p, m: x.mean(dim=(1, 2, 3)), max_frames=4)(videos, ["a", "b"], [])
    ref = _frame_means(videos)[:, [0, 3, 6, 9]].mean(axis=1)
    np.testing.assert_allclose(out.numpy(), ref, rtol=0, atol=1e-6)


def test_the_wrapper_keeps_the_wrapped_declarations() -> None:
    inner = Brightness()
    wrapped = PerFrame(inner)
    assert (wrapped.primary, wrapped.core_components, wrapped.required_metadata) == (
        "bright",
        ("bright",),
        ("tag",),
    )
    assert wrapped.thread_safe is False and wrapped.name == "Brightness"
    assert reward_modalities(wrapped) == frozenset({"video"}) and reward_modalities(inner) == frozenset(
        {"image"}
    )
    built = build_reward("per_frame", reward="jpeg_compressibility", reduce="min")
    assert built.name == "jpeg_compressibility" and built.__qualname__ == "PerFrame(jpeg_compressibility)"
    assert built.thread_safe is True and built.problems([{"prompt": "x"}]) == []


def test_per_frame_in_a_weighted_sum_from_yaml_settings() -> None:
    videos = _videos(b=2, f=3)
    reward = MultiReward(
        {"per_frame": 1.0, "temporal_consistency": 0.5},
        config={"per_frame": {"reward": "jpeg_compressibility", "reduce": "min"}},
    )
    assert reward.modalities == frozenset({"video"})
    out = reward(videos, ["a", "b"], [])
    direct = build_reward("jpeg_compressibility")(videos.flatten(0, 1), ["a"] * 6, []).view(2, 3).amin(dim=1)
    torch.testing.assert_close(out.components["per_frame"], direct.float())
    assert out.valid.all()


def test_thread_unsafe_wrapped_reward_runs_on_the_calling_thread() -> None:
    seen: list[str] = []

    class Unsafe:
        thread_safe = False

        def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
            seen.append(threading.current_thread().name)
            return images.mean(dim=(1, 2, 3))

    reward = MultiReward(
        {"per_frame": 1.0, "temporal_consistency": 1.0},
        rewards={"per_frame": PerFrame(Unsafe())},
        max_workers=4,
    )
    reward(_videos(b=2, f=2), ["a", "b"], [])
    assert seen == [threading.current_thread().name]


# ------------------------------------------------------------------ modalities


def test_image_rewards_given_videos_fail_naming_per_frame() -> None:
    reward = MultiReward({"jpeg_compressibility": 1.0})
    assert reward.modalities == frozenset({"image"})
    with pytest.raises(ValueError, match=r"'jpeg_compressibility'.*lit_flowgrpo\.rewards\.video\.PerFrame"):
        reward(_videos(), ["a"] * 3, [])
    with pytest.raises(ValueError, match=r"'temporal_consistency'.*scores \['video'\] only, not images"):
        MultiReward({"temporal_consistency": 1.0})(torch.rand(2, 3, 8, 8), ["a", "b"], [])
    plain = as_reward(lambda x, p, m: x.mean(dim=(1, 2, 3)))
    assert plain.modalities == frozenset({"image"})
    (problem,) = modality_problems({"mine": lambda x, p, m: x}, "video")
    assert "reward 'mine'" in problem and "PerFrame" in problem


def test_bad_modalities_declaration() -> None:
    class Bad:
        modalities = "video"  # a string would read as letters

    with pytest.raises(TypeError, match=r"Bad\.modalities is 'video'.*frozenset"):
        reward_modalities(Bad())
    with pytest.raises(ValueError, match="modality 'audio'"):
        modality_problems({}, "audio")


def test_per_frame_rejects_bad_settings_and_input() -> None:
    with pytest.raises(
        ValueError, match=r"config\.per_frame\.reduce \('median'\) must be one of \['mean', 'min'\]"
    ):
        PerFrame(Brightness(), reduce="median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"per_frame\.max_frames \(0\)"):
        PerFrame(Brightness(), max_frames=0)
    with pytest.raises(ValueError, match=r"per_frame\.frames_per_call \(0\)"):
        PerFrame(Brightness(), frames_per_call=0)
    with pytest.raises(ValueError, match=r"per_frame\.config is given for a reward that is already built"):
        PerFrame(Brightness(), config={"x": 1})
    with pytest.raises(ValueError, match=r"per_frame\.reward \('nope'\) is not a registered reward"):
        PerFrame("nope")
    with pytest.raises(
        ValueError, match=r"per_frame\.reward \(temporal_consistency\) scores \['video'\], not images"
    ):
        PerFrame("temporal_consistency")
    with pytest.raises(
        ValueError, match=r"PerFrame\(Brightness\) take videos as a \(B, F, 3, H, W\).*batch of images"
    ):
        PerFrame(Brightness())(torch.rand(2, 3, 8, 8), ["a", "b"], [])
    with pytest.raises(ValueError, match=r"2 videos, 1 prompts"):
        PerFrame(Brightness())(_videos(b=2), ["a"], [])


# ------------------------------------------------------------------ temporal consistency


def _temporal_reference(videos: Tensor, size: int | None) -> np.ndarray:
    """1 - mean over consecutive pairs of mean |x_{t+1} - x_t|, float64; area-average by blocks."""
    x = videos.double().numpy()
    if size is not None:
        b, f, c, h, w = x.shape
        x = x.reshape(b, f, c, size, h // size, size, w // size).mean(axis=(4, 6))
    change = np.abs(np.diff(x, axis=1)).mean(axis=(2, 3, 4))
    return 1 - change.mean(axis=1)


@pytest.mark.parametrize("size", [None, 4])
def test_temporal_consistency_matches_float64_reference(size: int | None) -> None:
    videos = _videos(b=3, f=5, h=8, w=8)
    out = TemporalConsistencyReward(size=size)(videos, ["a"] * 3, [])
    assert out.dtype == torch.float32 and out.shape == (3,)
    np.testing.assert_allclose(out.numpy(), _temporal_reference(videos, size), rtol=0, atol=1e-6)


def test_temporal_consistency_extremes_and_nan() -> None:
    static = _videos(b=1, f=1).expand(1, 4, 3, 8, 6).clone()
    flicker = torch.zeros(1, 4, 3, 8, 6)
    flicker[:, 1::2] = 1.0  # black, white, black, white: every pixel changes by 1 each frame
    broken = _videos(b=1, f=4)
    broken[0, 2, 0, 0, 0] = float("nan")
    out = TemporalConsistencyReward()(torch.cat([static, flicker, broken]), ["a"] * 3, [])
    assert out[0] == 1.0 and out[1] == 0.0 and torch.isnan(out[2])


def test_temporal_consistency_rejects_images_one_frame_and_bad_size() -> None:
    reward = TemporalConsistencyReward()
    with pytest.raises(
        ValueError,
        match=r"config\.temporal_consistency\) take videos as a \(B, F, 3, H, W\).*got \(2, 3, 8, 8\)",
    ):
        reward(torch.rand(2, 3, 8, 8), ["a", "b"], [])
    with pytest.raises(ValueError, match=r"temporal_consistency.*videos of 1 frame: generate at least 2"):
        reward(_videos(f=1), ["a"] * 3, [])
    with pytest.raises(ValueError, match=r"config\.temporal_consistency\.size \(0\)"):
        TemporalConsistencyReward(size=0)
