"""SampleImageLogger: grids and captions to TensorBoard, W&B and PNG; the validation table."""

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
from PIL import Image
from torch import Tensor

from lit_flowgrpo.callbacks import SampleImageLogger
from lit_flowgrpo.callbacks.grids import captioned_grid


def sample_outputs(n_batches: int, b: int = 3) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    return [
        {
            "images": torch.rand(b, 3, 6, 5, generator=g),
            "prompts": [f"a red cube {i}-{j}" for j in range(b)],
            "rewards": torch.tensor([0.5, float("nan"), 0.25])[:b] + i,
        }
        for i in range(n_batches)
    ]


def to_u8(images: Tensor) -> np.ndarray:
    """Independent of the callback: float [0, 1] -> uint8 by rounding, HWC."""
    return np.rint(images.permute(0, 2, 3, 1).numpy() * 255).astype(np.uint8)


def test_images_to_tensorboard(tmp_path: Any) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    outputs = sample_outputs(3)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer(
        tmp_path, [SampleImageLogger(every_n_steps=2, max_images=2)], logger=logger, limit_train_batches=3
    ).fit(StandIn(outputs), loader(3))
    logger.experiment.flush()
    acc = EventAccumulator(logger.log_dir, size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    events = acc.Images("train/samples")
    assert [e.step for e in events] == [0, 2]  # every 2 rollout steps
    for event, out in zip(events, outputs[::2], strict=True):
        grid = np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))
        expected = to_u8(out["images"][:2])
        assert grid.shape == (6, 10, 3)  # TensorBoard lays the 2 samples side by side
        np.testing.assert_array_equal(grid[:, :5], expected[0])
        np.testing.assert_array_equal(grid[:, 5:], expected[1])
    text = acc.Tensors("train/samples/captions/text_summary")
    first = text[0].tensor_proto.string_val[0].decode()
    assert "a red cube 0-0 | reward=0.5" in first and "a red cube 0-1 | reward=nan (failed)" in first


VAL_OUTPUT_PROMPTS = ["p0", "p1", "p2"]


def val_output(images: Tensor) -> dict[str, Any]:
    return {
        "images": images,
        "prompts": VAL_OUTPUT_PROMPTS,
        "rewards": {"geneval": torch.tensor([1.0, 0.0, 0.5]), "ocr": torch.tensor([0.25, float("nan"), 1.0])},
    }


def fit_train_and_val(tmp_path: Any, logger: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """One rollout (its samples logged) and one validation batch (2 of its 3 samples logged)."""
    outputs = sample_outputs(1)
    model = StandIn(outputs)
    model.validation_step = lambda batch, batch_idx: val_output(outputs[0]["images"])  # type: ignore[method-assign]
    trainer(
        tmp_path,
        [SampleImageLogger(every_n_steps=1, max_images=2, **kwargs)],
        logger=logger,
        limit_train_batches=1,
        limit_val_batches=1,
    ).fit(model, loader(1), loader(1))
    return outputs


def test_images_and_table_to_wandb_logger_calls(tmp_path: Any) -> None:
    """The exact calls on WandbLogger's public API (as Lightning's own callback tests check loggers)."""
    wandb = pytest.importorskip("wandb")
    logger = mock.Mock(spec=WandbLogger)
    outputs = fit_train_and_val(tmp_path, logger)
    expected = to_u8(outputs[0]["images"][:2])

    train, val = logger.log_image.call_args_list
    assert train.args == () and val.args == ()
    assert {k: v for k, v in train.kwargs.items() if k != "images"} == {
        "key": "train/samples",
        "step": 0,
        "caption": ["a red cube 0-0 | reward=0.5", "a red cube 0-1 | reward=nan (failed)"],
    }
    # validation runs after the first rollout, before Lightning counts it: the step its metrics carry
    assert {k: v for k, v in val.kwargs.items() if k != "images"} == {
        "key": "val/samples",
        "step": 0,
        "caption": ["p0 | geneval=1 | ocr=0.25", "p1 | geneval=0 | ocr=nan (failed)"],
    }
    for call in (train, val):
        images = call.kwargs["images"]
        assert len(images) == 2
        for got, want in zip(images, expected, strict=True):
            assert got.dtype == np.uint8
            np.testing.assert_array_equal(got, want)

    (table,) = logger.log_table.call_args_list
    assert {k: v for k, v in table.kwargs.items() if k != "data"} == {
        "key": "val/samples_table",
        "columns": ["image", "prompt", "geneval", "ocr"],
        "step": 0,
    }
    rows = table.kwargs["data"]
    assert [row[1:2] + row[2:3] for row in rows] == [["p0", 1.0], ["p1", 0.0]]
    assert rows[0][3] == 0.25 and np.isnan(rows[1][3])
    for row, want in zip(rows, expected, strict=True):
        assert isinstance(row[0], wandb.Image)
        np.testing.assert_array_equal(np.asarray(row[0].image.convert("RGB")), want)


def test_table_is_optional(tmp_path: Any) -> None:
    logger = mock.Mock(spec=WandbLogger)
    fit_train_and_val(tmp_path, logger, log_table=False)
    assert logger.log_image.call_count == 2
    logger.log_table.assert_not_called()


def test_images_to_wandb_offline(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real offline W&B run: the media files hold our pixels; the captions read back through run.summary."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="lit-flowgrpo-test")
    try:
        outputs = fit_train_and_val(tmp_path, logger)
        # run.summary asks the run's own process for the last logged value of each key (a blocking
        # request that is answered after the log records before it), not a file written in the background
        summary = logger.experiment.summary
        train, val = dict(summary["train/samples"]), dict(summary["val/samples"])
        table = dict(summary["val/samples_table"])
    finally:
        wandb.finish()
    assert train["captions"] == ["a red cube 0-0 | reward=0.5", "a red cube 0-1 | reward=nan (failed)"]
    assert val["captions"] == ["p0 | geneval=1 | ocr=0.25", "p1 | geneval=0 | ocr=nan (failed)"]
    assert (train["count"], val["count"], table["_type"], table["nrows"], table["ncols"]) == (
        2,
        2,
        "table-file",
        2,
        4,
    )
    (run_dir,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    media = os.path.join(run_dir, "files", "media", "images")
    train_pngs = sorted(glob.glob(os.path.join(media, "train", "samples_*.png")))
    val_pngs = sorted(glob.glob(os.path.join(media, "val", "samples_*.png")))
    assert len(train_pngs) == 2 and len(val_pngs) == 2
    expected = to_u8(outputs[0]["images"][:2])
    for pngs in (train_pngs, val_pngs):
        written = {np.asarray(Image.open(p).convert("RGB")).tobytes() for p in pngs}
        assert written == {expected[0].tobytes(), expected[1].tobytes()}


def test_table_to_tensorboard_and_json(tmp_path: Any) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = TensorBoardLogger(str(tmp_path), name="tb")
    fit_train_and_val(tmp_path, tb)
    tb.experiment.flush()
    acc = EventAccumulator(tb.log_dir, size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors("val/samples_table/text_summary")
    assert event.step == 0
    assert event.tensor_proto.string_val[0].decode() == (
        "| # | prompt | geneval | ocr |\n|---|---|---|---|\n| 0 | p0 | 1 | 0.25 |\n| 1 | p1 | 0 | nan |"
    )

    csv = CSVLogger(str(tmp_path), name="csv")
    fit_train_and_val(tmp_path, csv)
    with open(os.path.join(csv.log_dir, "images", "val_samples_table_step0000000.json")) as f:
        assert json.load(f) == {
            "step": 0,
            "columns": ["prompt", "geneval", "ocr"],
            "data": [["p0", 1.0, 0.25], ["p1", 0.0, None]],
        }


def test_images_are_copied_to_the_host_only_when_logged(tmp_path: Any) -> None:
    """Images on the meta device cannot be copied anywhere: the steps and samples not logged hold them."""
    outputs = sample_outputs(4)
    for i in (1, 3):  # every_n_steps=2 logs rollouts 0 and 2 only
        outputs[i]["images"] = torch.empty(3, 3, 6, 5, device="meta")
    model = StandIn(outputs)
    val_batches = [val_output(outputs[0]["images"]), val_output(torch.empty(3, 3, 6, 5, device="meta"))]
    model.validation_step = lambda batch, batch_idx: val_batches[batch_idx]  # type: ignore[method-assign]
    csv = CSVLogger(str(tmp_path), name="csv")
    trainer(
        tmp_path,
        [SampleImageLogger(every_n_steps=2, max_images=3)],  # the first validation batch fills the grid
        logger=csv,
        limit_train_batches=4,
        limit_val_batches=2,
        val_check_interval=4,
    ).fit(model, loader(4), loader(2))
    written = sorted(os.listdir(os.path.join(csv.log_dir, "images")))
    assert written == [
        "train_samples_step0000000.json",
        "train_samples_step0000000.png",
        "train_samples_step0000002.json",
        "train_samples_step0000002.png",
        "val_samples_step0000003.json",
        "val_samples_step0000003.png",
        "val_samples_table_step0000003.json",
    ]


def test_images_to_png_without_image_logger(tmp_path: Any) -> None:
    outputs = sample_outputs(1, b=3)
    logger = CSVLogger(str(tmp_path), name="csv")
    trainer(
        tmp_path, [SampleImageLogger(every_n_steps=1, max_images=3)], logger=logger, limit_train_batches=1
    ).fit(StandIn(outputs), loader(1))
    stem = os.path.join(logger.log_dir, "images", "train_samples_step0000000")
    grid = np.asarray(Image.open(stem + ".png"))
    expected = to_u8(outputs[0]["images"])  # (3, 6, 5, 3): 6 x 5 px samples
    # each sample enlarged 21x (126 x 105 px: the largest whole factor within 128 px), nearest neighbour,
    # in 2 columns x 2 rows of cells 8 px apart, each with 2 caption lines of 16 px under it
    scale, pad, text_h = 21, 8, 2 * 16
    tile_h, tile_w = 6 * scale, 5 * scale
    cell_w, cell_h = tile_w + pad, tile_h + text_h + 2 * pad
    assert grid.shape == (2 * cell_h, pad + 2 * cell_w, 3)
    for i in range(3):
        r, c = divmod(i, 2)
        y0, x0 = pad + r * cell_h, pad + c * cell_w
        tile = grid[y0 : y0 + tile_h, x0 : x0 + tile_w]
        np.testing.assert_array_equal(tile, expected[i].repeat(scale, axis=0).repeat(scale, axis=1))
        # the caption is drawn under the sample: light text pixels on the dark background
        caption = grid[y0 + tile_h : y0 + tile_h + text_h + pad, x0 : x0 + tile_w]
        assert (caption.min(axis=2) > 150).sum() > 50
    assert grid[pad + cell_h :, pad + cell_w :].max() == 30  # the empty fourth cell: background only
    with open(stem + ".json") as f:
        captions = json.load(f)["captions"]
    assert captions == [
        "a red cube 0-0 | reward=0.5",
        "a red cube 0-1 | reward=nan (failed)",
        "a red cube 0-2 | reward=0.25",
    ]


def test_image_logger_rejects_bad_input(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="every_n_steps"):
        SampleImageLogger(every_n_steps=-1)
    with pytest.raises(ValueError, match="max_images"):
        SampleImageLogger(max_images=0)
    t = trainer(tmp_path, [])
    with pytest.raises(ValueError, match="one caption per image"):
        SampleImageLogger().log_images(t, "k", torch.zeros(2, 3, 4, 4), ["only one"], 0)
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        SampleImageLogger().log_images(t, "k", torch.zeros(2, 4, 4), ["a", "b"], 0)


def test_shapes_world_samples_are_drawn_at_128_px_with_their_captions() -> None:
    # the quickstart's training grid: 16 samples of 32 x 32 px (once a 134 x 134 px picture)
    pixels = torch.zeros(16, 3, 32, 32, dtype=torch.uint8)
    grid = np.asarray(captioned_grid(pixels, ["a red circle above a blue square | reward=0.75"] * 16))
    assert grid.shape[1] == 8 + 4 * (128 + 8)  # 4 columns of 128 px samples
    caption = grid[8 + 128 : 8 + 128 + 3 * 16, 8 : 8 + 128]  # under the first sample: 2 prompt lines + reward
    assert (caption.min(axis=2) > 150).sum() > 100
