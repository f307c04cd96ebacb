"""Sample images or videos with their prompts and rewards, and a table of validation samples, to any logger."""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor
from typing_extensions import override

from lit_flowgrpo.callbacks._lightning import rollout_step
from lit_flowgrpo.callbacks._module import as_mapping
from lit_flowgrpo.callbacks.grids import captioned_grid
from lit_flowgrpo.callbacks.videos import (
    captioned_video,
    downscale,
    frames_of,
    gif_bytes,
    tensorboard_gif_summary,
    video_grid,
)
from lit_flowgrpo.step_output import StepOutput, ValidationOutput

__all__ = ["SampleImageLogger"]


class SampleImageLogger(Callback):
    """Logs a grid of generated samples with their prompts and rewards, every N steps and at validation.

    Training: the ``images``, ``prompts`` and ``rewards`` (B,) the training step returns, every
    ``every_n_steps`` rollout steps, under ``train/samples``. Validation: the first ``max_images`` of
    what ``validation_step`` returns (``rewards`` is a dict of named components), under
    ``val/samples``, and (``log_table``) a table of the same samples, one row each: image, prompt and
    every reward component, under ``val/samples_table`` (as TRL's and veRL's generation tables).
    Samples with conditioning images (an edit's source, a video's first frame) are shown after them,
    source | result, in each grid and table (:func:`beside_sources`). Rank 0 only; sanity checking is
    skipped. Images may stay on the module's device: only those logged are copied to the host, on the
    steps they are logged.

    Videos: when the step returns ``images`` of shape (B, F, 3, H, W), the same samples are logged as
    animated GIFs (Pillow: no video library needed; :mod:`lit_flowgrpo.callbacks.videos`) at ``fps``,
    each brought down to at most ``video_max_side`` px: W&B gets one ``wandb.Video`` per sample with its
    caption (``WandbLogger.log_video``, and a video column in the table); TensorBoard one GIF of the
    samples tiled as a grid (what ``add_video`` writes) plus the captions; any other logger
    ``images/<key>_step<step>.gif``, the captioned grid of every frame, and the ``.json`` of captions.

    Where images go, per logger: W&B (``WandbLogger.log_image``: one ``wandb.Image`` per sample with its
    caption, works offline; the table through ``WandbLogger.log_table``); TensorBoard (``add_images``
    plus the captions, and the table as markdown, through ``add_text``); any other logger, or none,
    gets ``images/<key>_step<step>.png`` (a grid, each sample enlarged to about 128 px with its prompt and
    rewards drawn under it) and a ``.json`` of the captions in its ``log_dir``
    (else the trainer's ``default_root_dir``), and the table as ``images/val_samples_table_step<step>.json``.

    Args:
        every_n_steps: log training samples at every this many rollout steps (0: never).
        max_images: the most samples per grid (and rows per table).
        log_validation: log validation samples.
        log_table: also log the validation samples as a table (reuses the grid's samples: no extra
            host copy).
        fps: the frame rate videos are shown at (Wan 2.1 generates 16 frames per second).
        video_max_side: videos are area-downscaled so that their longer side is at most this many
            pixels before encoding (GIFs of full-resolution frames run to hundreds of MB); ``None``
            keeps their size.
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        max_images: int = 8,
        log_validation: bool = True,
        log_table: bool = True,
        fps: float = 16.0,
        video_max_side: int | None = 256,
    ) -> None:
        super().__init__()
        if every_n_steps < 0:
            raise ValueError(f"every_n_steps ({every_n_steps}) must be >= 0 (0 turns training samples off)")
        if max_images < 1:
            raise ValueError(f"max_images ({max_images}) must be at least 1")
        if not fps > 0:
            raise ValueError(f"fps ({fps}) must be positive")
        if video_max_side is not None and video_max_side < 8:
            raise ValueError(f"video_max_side ({video_max_side}) must be at least 8 pixels, or None")
        self.fps = fps
        self.video_max_side = video_max_side
        self.every_n_steps = every_n_steps
        self.max_images = max_images
        self.log_validation = log_validation
        self.log_table = log_table
        self._val = _Samples()

    # -- hooks ------------------------------------------------------------------------------------

    @override
    @rank_zero_only
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        out = cast(StepOutput, as_mapping(outputs))  # any key may be missing: read with .get
        step = rollout_step(trainer)
        if not self.every_n_steps or step % self.every_n_steps or out.get("images") is None:
            return
        samples = _Samples()
        rewards = out.get("rewards")
        images = beside_sources(out["images"], out.get("sources"))
        samples.add(
            images, out.get("prompts"), {} if rewards is None else {"reward": rewards}, self.max_images
        )
        self._log_pixels(trainer, "train/samples", samples.stacked(), samples.captions(), step)

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._val = _Samples()

    @override
    @rank_zero_only
    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        out = cast(ValidationOutput, as_mapping(outputs))
        room = self.max_images - len(self._val)
        if not self.log_validation or trainer.sanity_checking or room <= 0 or out.get("images") is None:
            return
        images = beside_sources(out["images"], out.get("sources"))
        self._val.add(images, out.get("prompts"), as_mapping(out.get("rewards")), room)

    @override
    @rank_zero_only
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        samples, self._val = self._val, _Samples()
        if not len(samples):
            return
        step = rollout_step(trainer)
        self._log_pixels(trainer, "val/samples", samples.stacked(), samples.captions(), step)
        if self.log_table:
            self._log_table(
                trainer, "val/samples_table", samples.stacked(), samples.prompts, samples.rewards, step
            )

    # -- writing ----------------------------------------------------------------------------------

    def log_images(
        self, trainer: Trainer, key: str, images: Tensor, captions: Sequence[str], step: int
    ) -> None:
        """Write (B, 3, H, W) images in [0, 1] with one caption each to every logger of ``trainer``."""
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be (B, 3, H, W) in [0, 1]; got shape {tuple(images.shape)}")
        self._log_pixels(trainer, key, _to_uint8(images), captions, step)

    def log_videos(
        self, trainer: Trainer, key: str, videos: Tensor, captions: Sequence[str], step: int
    ) -> None:
        """Write (B, F, 3, H, W) videos in [0, 1] with one caption each to every logger of ``trainer``."""
        if videos.ndim != 5 or videos.shape[2] != 3:
            raise ValueError(f"videos must be (B, F, 3, H, W) in [0, 1]; got shape {tuple(videos.shape)}")
        self._log_pixels(trainer, key, _to_uint8(videos), captions, step)

    def _log_pixels(
        self, trainer: Trainer, key: str, pixels: Tensor, captions: Sequence[str], step: int
    ) -> None:
        """(B, 3, H, W) images or (B, F, 3, H, W) videos, uint8 on the host, to every logger."""
        if len(captions) != len(pixels):
            raise ValueError(f"{len(captions)} captions for {len(pixels)} images: give one caption per image")
        if pixels.ndim == 5:
            self._log_video_pixels(trainer, key, pixels, captions, step)
            return
        if not trainer.loggers:
            _write_png(trainer.default_root_dir, key, pixels, captions, step)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                hwc = [img.permute(1, 2, 0).numpy() for img in pixels]
                logger.log_image(key=key, images=hwc, step=step, caption=list(captions))
            elif isinstance(logger, TensorBoardLogger):
                logger.experiment.add_images(key, pixels, global_step=step, dataformats="NCHW")
                text = "\n\n".join(f"{i}: {c}" for i, c in enumerate(captions))
                logger.experiment.add_text(f"{key}/captions", text, global_step=step)
            else:
                _write_png(_log_dir(trainer, logger), key, pixels, captions, step)

    def _log_video_pixels(
        self, trainer: Trainer, key: str, pixels: Tensor, captions: Sequence[str], step: int
    ) -> None:
        pixels = downscale(pixels, self.video_max_side)  # (B, F, 3, h, w) uint8, host
        if not trainer.loggers:
            _write_gif(trainer.default_root_dir, key, pixels, captions, step, self.fps)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                gifs = [io.BytesIO(gif_bytes(frames_of(video), self.fps)) for video in pixels]
                logger.log_video(
                    key=key, videos=gifs, step=step, caption=list(captions), format=["gif"] * len(gifs)
                )
            elif isinstance(logger, TensorBoardLogger):
                grid = video_grid(pixels)  # (F, 3, H', W')
                gif = gif_bytes(frames_of(grid), self.fps)
                summary = tensorboard_gif_summary(key, gif, height=grid.shape[2], width=grid.shape[3])
                # the summary add_video writes, through the writer's public file_writer: add_video
                # itself encodes with moviepy, which this project does not depend on
                logger.experiment.file_writer.add_summary(summary, step)
                text = "\n\n".join(f"{i}: {c}" for i, c in enumerate(captions))
                logger.experiment.add_text(f"{key}/captions", text, global_step=step)
            else:
                _write_gif(_log_dir(trainer, logger), key, pixels, captions, step, self.fps)

    def log_samples_table(
        self,
        trainer: Trainer,
        key: str,
        images: Tensor,
        prompts: Sequence[str],
        rewards: Mapping[str, Sequence[float]],
        step: int,
    ) -> None:
        """Write one row per sample (image, prompt, each reward component) to every logger of ``trainer``.

        Args:
            images: (B, 3, H, W) images or (B, F, 3, H, W) videos, in [0, 1].
            prompts: B prompts.
            rewards: ``{component: B values}``; NaN where a sample was not scored.
        """
        if len(prompts) != len(images) or any(len(v) != len(images) for v in rewards.values()):
            raise ValueError(
                f"a table of {len(images)} images needs {len(images)} prompts and {len(images)} values per "
                f"reward component; got {len(prompts)} prompts and { ({k: len(v) for k, v in rewards.items()}) }"
            )
        self._log_table(trainer, key, _to_uint8(images), prompts, rewards, step)

    def _log_table(
        self,
        trainer: Trainer,
        key: str,
        pixels: Tensor,
        prompts: Sequence[str],
        rewards: Mapping[str, Sequence[float]],
        step: int,
    ) -> None:
        """:meth:`log_samples_table` of images or videos already uint8 on the host."""
        columns = ["prompt", *rewards]
        rows = [[prompts[i], *(float(v[i]) for v in rewards.values())] for i in range(len(pixels))]
        if pixels.ndim == 5:
            pixels = downscale(pixels, self.video_max_side)
        if not trainer.loggers:
            _write_table(trainer.default_root_dir, key, columns, rows, step)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                import wandb

                media = (
                    [wandb.Video(io.BytesIO(gif_bytes(frames_of(v), self.fps)), format="gif") for v in pixels]
                    if pixels.ndim == 5
                    else [wandb.Image(img.permute(1, 2, 0).numpy()) for img in pixels]
                )
                data = [[m, *row] for m, row in zip(media, rows, strict=True)]
                column = "video" if pixels.ndim == 5 else "image"
                logger.log_table(key=key, columns=[column, *columns], data=data, step=step)
            elif isinstance(logger, TensorBoardLogger):
                # the samples are the same-step `val/samples` (one per row, in order); TensorBoard's text
                # plugin renders markdown tables
                logger.experiment.add_text(key, _markdown_table(["#", *columns], rows), global_step=step)
            else:
                _write_table(_log_dir(trainer, logger), key, columns, rows, step)


class _Samples:
    """Samples gathered for one grid, on the host: only those that will be logged are copied."""

    def __init__(self) -> None:
        self.images: list[Tensor] = []  # (3, H, W) or (F, 3, H, W) uint8, host
        self.prompts: list[str] = []
        self.rewards: dict[str, list[float]] = {}

    def __len__(self) -> int:
        return len(self.images)

    def add(
        self, images: Tensor, prompts: Sequence[str] | None, rewards: Mapping[str, Tensor], limit: int
    ) -> None:
        n = min(limit, len(images))
        self.images.extend(_to_uint8(images[:n]))  # rounded where the images are: a quarter of the copy
        self.prompts.extend(list(prompts)[:n] if prompts is not None else [""] * n)
        for name, values in rewards.items():
            self.rewards.setdefault(name, []).extend(
                torch.as_tensor(values[:n]).detach().float().cpu().tolist()
            )

    def stacked(self) -> Tensor:
        return torch.stack(self.images)

    def captions(self) -> list[str]:
        return [_caption(p, {k: v[i] for k, v in self.rewards.items()}) for i, p in enumerate(self.prompts)]


def _caption(prompt: str, rewards: Mapping[str, float]) -> str:
    """The prompt, then each reward; a sample that could not be scored says so.

    >>> _caption("a red cube", {"reward": 0.51234, "ocr": float("nan")})
    'a red cube | reward=0.5123 | ocr=nan (failed)'
    """
    parts = [f"{k}={v:.4g}" if math.isfinite(v) else f"{k}=nan (failed)" for k, v in rewards.items()]
    return " | ".join([prompt, *parts])


def beside_sources(images: Tensor, sources: Sequence[Sequence[Tensor]] | None) -> Tensor:
    """Images of conditioned samples shown after their sources: (B, 3, H, (n + 1)·W), each of a sample's n
    conditioning images resized to (H, W) (area interpolation) left of it. Text-only samples (``sources``
    ``None``) and videos come back as they are."""
    if not sources or images.ndim != 4 or not any(len(s) for s in sources):
        return images
    height, width = images.shape[-2:]
    rows = []
    for image, own in zip(images, sources, strict=True):
        shown = [
            torch.nn.functional.interpolate(s[None].to(image), size=(height, width), mode="area")[0]
            for s in own
        ]
        rows.append(torch.cat([*shown, image], dim=-1))
    widest = max(r.shape[-1] for r in rows)  # a record with fewer sources is padded on the left, black
    return torch.stack([torch.nn.functional.pad(r, (widest - r.shape[-1], 0)) for r in rows])


def _to_uint8(images: Tensor) -> Tensor:
    """Floats in [0, 1], any shape -> uint8 on the host, rounded."""
    return (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()


def _log_dir(trainer: Trainer, logger: Any) -> str:
    return getattr(logger, "log_dir", None) or trainer.default_root_dir


def _stem(root: str, key: str, step: int) -> str:
    folder = os.path.join(root, "images")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{key.replace('/', '_')}_step{step:07d}")


def _write_png(root: str, key: str, pixels: Tensor, captions: Sequence[str], step: int) -> None:
    stem = _stem(root, key, step)
    captioned_grid(pixels, captions).save(stem + ".png")
    with open(stem + ".json", "w") as f:
        json.dump({"step": step, "captions": list(captions)}, f, indent=1)


def _write_gif(root: str, key: str, pixels: Tensor, captions: Sequence[str], step: int, fps: float) -> None:
    stem = _stem(root, key, step)
    with open(stem + ".gif", "wb") as f:
        f.write(gif_bytes(captioned_video(pixels, captions), fps))
    with open(stem + ".json", "w") as f:
        json.dump({"step": step, "fps": fps, "captions": list(captions)}, f, indent=1)


def _write_table(root: str, key: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
    # NaN (an unscored sample) is written as JSON null, which every JSON reader accepts
    data = [[None if isinstance(v, float) and not math.isfinite(v) else v for v in row] for row in rows]
    with open(_stem(root, key, step) + ".json", "w") as f:
        json.dump({"step": step, "columns": columns, "data": data}, f, indent=1)


def _markdown_table(columns: list[str], rows: list[list[Any]]) -> str:
    """A markdown table, row index first; ``|`` in a prompt is escaped.

    >>> print(_markdown_table(["#", "prompt", "geneval"], [["a | b", 0.5], ["c", float("nan")]]))
    | # | prompt | geneval |
    |---|---|---|
    | 0 | a \\| b | 0.5 |
    | 1 | c | nan |
    """

    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join([str(i), *(cell(v) for v in row)]) + " |" for i, row in enumerate(rows)]
    return "\n".join(lines)
