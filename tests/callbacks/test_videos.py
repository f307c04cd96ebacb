"""SampleImageLogger given videos: GIFs to TensorBoard, W&B (calls and a real offline run) and disk,
with the captions; the GIF encoding itself."""

from __future__ import annotations

import glob
import io
import json
import os
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from callback_helpers import StandIn, loader, trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from PIL import Image, ImageSequence
from torch import Tensor

from lit_flowgrpo.callbacks import SampleImageLogger
from lit_flowgrpo.callbacks.videos import downscale, gif_bytes, video_grid

F, H, W = 4, 6, 5


def few_colour_videos(b: int, seed: int = 0) -> Tensor:
    """(b, F, 3, H, W) in [0, 1] with 4 levels a channel: 64 colours, so a GIF's palette holds them exactly."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4, (b, F, 3, H, W), generator=g) / 3


def to_u8(videos: Tensor) -> np.ndarray:
    """Independent of the callback: float [0, 1] -> uint8 by rounding, (..., H, W, 3)."""
    return np.rint(videos.movedim(-3, -1).numpy() * 255).astype(np.uint8)


def gif_frames(data: bytes) -> tuple[list[np.ndarray], int]:
    image = Image.open(io.BytesIO(data))
    return [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(image)], image.info["duration"]


def video_outputs(n: int, b: int = 3) -> list[dict[str, Any]]:
    return [
        {
            "images": few_colour_videos(b, seed=i),
            "prompts": [f"a red circle moving up {i}-{j}" for j in range(b)],
            "rewards": torch.tensor([0.5, float("nan"), 0.25])[:b] + i,
        }
        for i in range(n)
    ]


def fit_videos(tmp_path: Any, logger: Any, n: int = 1, **kwargs: Any) -> list[dict[str, Any]]:
    """``n`` rollouts of videos, each logged, and one validation batch of the first (2 of 3 logged)."""
    outputs = video_outputs(n)
    model = StandIn(outputs)
    model.validation_step = lambda batch, batch_idx: {  # type: ignore[method-assign]
        "images": outputs[0]["images"],
        "prompts": ["p0", "p1", "p2"],
        "rewards": {"shapes_video": torch.tensor([1.0, 0.0, 0.5])},
    }
    trainer(
        tmp_path,
        [SampleImageLogger(every_n_steps=1, max_images=2, fps=10, **kwargs)],
        logger=logger,
        limit_train_batches=n,
        limit_val_batches=1,
    ).fit(model, loader(n), loader(1))
    return outputs


def test_gif_bytes_round_trip_and_frame_delay() -> None:
    videos = few_colour_videos(1)[0]
    pixels = torch.from_numpy(to_u8(videos)).permute(0, 3, 1, 2)  # (F, 3, H, W) uint8
    frames = [Image.fromarray(f) for f in to_u8(videos)]
    decoded, delay = gif_frames(gif_bytes(frames, fps=16))
    assert delay == 60  # 100/16 = 6.25 cs, stored as 6 cs
    np.testing.assert_array_equal(np.stack(decoded), to_u8(videos))
    grid = video_grid(pixels[None].expand(2, -1, -1, -1, -1), pad=1)  # two copies side by side
    assert grid.shape == (F, 3, H, 2 * W + 1)
    with pytest.raises(ValueError, match=r"fps \(0\) must be positive"):
        gif_bytes(frames, fps=0)


def test_downscale_keeps_the_aspect_and_averages_areas() -> None:
    pixels = torch.arange(2 * 4 * 8, dtype=torch.float64).reshape(1, 2, 1, 4, 8).expand(1, 2, 3, 4, 8)
    small = downscale(pixels.to(torch.uint8), max_side=4)
    assert small.shape == (1, 2, 3, 2, 4)
    ref = pixels.reshape(1, 2, 3, 2, 2, 4, 2).mean(dim=(4, 6))  # 2x2 block means, float64
    np.testing.assert_array_equal(
        small.numpy(), np.rint(ref.numpy()).astype(np.uint8)
    )  # halves to even, as torch
    assert downscale(pixels.to(torch.uint8), None).shape == (1, 2, 3, 4, 8)


def test_videos_to_tensorboard(tmp_path: Any) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(str(tmp_path), name="tb")
    outputs = fit_videos(tmp_path, logger, n=2)
    logger.experiment.flush()
    acc = EventAccumulator(logger.log_dir, size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    events = acc.Images("train/samples")
    assert [e.step for e in events] == [0, 1]
    for event, out in zip(events, outputs, strict=True):
        frames, delay = gif_frames(event.encoded_image_string)
        assert delay == 100 and (event.height, event.width) == (H, 2 * W + 2)  # 10 fps; 2 videos, 2 px apart
        expected = to_u8(out["images"][:2])  # (2, F, H, W, 3)
        assert len(frames) == F
        for t, frame in enumerate(frames):
            np.testing.assert_array_equal(frame[:, :W], expected[0, t])
            np.testing.assert_array_equal(frame[:, W + 2 :], expected[1, t])
    text = acc.Tensors("train/samples/captions/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "a red circle moving up 0-0 | reward=0.5" in text and "0-1 | reward=nan (failed)" in text
    (table,) = acc.Tensors("val/samples_table/text_summary")
    assert table.tensor_proto.string_val[0].decode().startswith("| # | prompt | shapes_video |")


def test_videos_to_wandb_logger_calls(tmp_path: Any) -> None:
    wandb = pytest.importorskip("wandb")
    logger = mock.Mock(spec=WandbLogger)
    outputs = fit_videos(tmp_path, logger)
    expected = to_u8(outputs[0]["images"][:2])
    train, val = logger.log_video.call_args_list
    assert {k: v for k, v in train.kwargs.items() if k != "videos"} == {
        "key": "train/samples",
        "step": 0,
        "caption": [
            "a red circle moving up 0-0 | reward=0.5",
            "a red circle moving up 0-1 | reward=nan (failed)",
        ],
        "format": ["gif", "gif"],
    }
    assert val.kwargs["key"] == "val/samples" and val.kwargs["caption"] == [
        "p0 | shapes_video=1",
        "p1 | shapes_video=0",
    ]
    for call in (train, val):
        for got, want in zip(call.kwargs["videos"], expected, strict=True):
            frames, delay = gif_frames(got.getvalue())
            assert delay == 100
            np.testing.assert_array_equal(np.stack(frames), want)
    logger.log_image.assert_not_called()
    (table,) = logger.log_table.call_args_list
    assert table.kwargs["columns"] == ["video", "prompt", "shapes_video"]
    assert [row[1:] for row in table.kwargs["data"]] == [["p0", 1.0], ["p1", 0.0]]
    assert all(isinstance(row[0], wandb.Video) for row in table.kwargs["data"])


def test_videos_to_wandb_offline(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real offline W&B run: the video files it keeps are our GIFs; the captions read back."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="lit-flowgrpo-test")
    try:
        outputs = fit_videos(tmp_path, logger, log_table=False)
        summary = logger.experiment.summary
        train = dict(summary["train/samples"])
    finally:
        wandb.finish()
    assert train["captions"] == [
        "a red circle moving up 0-0 | reward=0.5",
        "a red circle moving up 0-1 | reward=nan (failed)",
    ]
    (run_dir,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    gifs = sorted(glob.glob(os.path.join(run_dir, "files", "media", "videos", "train", "samples_*.gif")))
    assert len(gifs) == 2
    expected = to_u8(outputs[0]["images"][:2])
    written = set()
    for path in gifs:
        with open(path, "rb") as f:
            written.add(np.stack(gif_frames(f.read())[0]).tobytes())
    assert written == {expected[0].tobytes(), expected[1].tobytes()}


def test_videos_to_gif_on_disk_with_captions(tmp_path: Any) -> None:
    logger = CSVLogger(str(tmp_path), name="csv")
    outputs = fit_videos(tmp_path, logger)
    stem = os.path.join(logger.log_dir, "images", "train_samples_step0000000")
    with open(stem + ".gif", "rb") as f:
        frames, delay = gif_frames(f.read())
    expected = to_u8(outputs[0]["images"][:2])
    # as the image grid: each 6 x 5 px sample enlarged 21x, 2 columns of cells 8 px apart, the caption
    # (prompt, then the reward) drawn under each sample, in every frame
    scale, pad = 21, 8
    assert len(frames) == F and delay == 100
    for t, frame in enumerate(frames):
        for i in range(2):
            x0 = pad + i * (W * scale + pad)
            tile = frame[pad : pad + H * scale, x0 : x0 + W * scale]
            np.testing.assert_array_equal(tile, expected[i, t].repeat(scale, axis=0).repeat(scale, axis=1))
            caption = frame[pad + H * scale :, x0 : x0 + W * scale]
            assert (caption.min(axis=2) > 150).sum() > 50  # light text on the dark background
    with open(stem + ".json") as f:
        assert json.load(f) == {
            "step": 0,
            "fps": 10,
            "captions": [
                "a red circle moving up 0-0 | reward=0.5",
                "a red circle moving up 0-1 | reward=nan (failed)",
            ],
        }
    written = sorted(os.listdir(os.path.join(logger.log_dir, "images")))
    assert "val_samples_step0000000.gif" in written and "val_samples_table_step0000000.json" in written


def test_large_videos_are_brought_down_before_encoding(tmp_path: Any) -> None:
    t = trainer(tmp_path, [])
    SampleImageLogger(video_max_side=16).log_videos(t, "k", torch.rand(1, 2, 3, 40, 64), ["a"], 0)
    with open(os.path.join(tmp_path, "images", "k_step0000000.gif"), "rb") as f:
        frames, _ = gif_frames(f.read())
    # 40 x 64 -> 10 x 16, then enlarged 8x (the largest whole factor within 128 px) in the captioned grid
    assert len(frames) == 2 and frames[0].shape[1] == 8 + 16 * 8 + 8


def test_video_logger_rejects_bad_input(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=r"fps \(0\) must be positive"):
        SampleImageLogger(fps=0)
    with pytest.raises(ValueError, match=r"video_max_side \(4\)"):
        SampleImageLogger(video_max_side=4)
    t = trainer(tmp_path, [])
    with pytest.raises(ValueError, match=r"videos must be \(B, F, 3, H, W\)"):
        SampleImageLogger().log_videos(t, "k", torch.zeros(2, 3, 4, 4), ["a", "b"], 0)
    with pytest.raises(ValueError, match="one caption per image"):
        SampleImageLogger().log_videos(t, "k", torch.zeros(2, 3, 3, 4, 4), ["a"], 0)
