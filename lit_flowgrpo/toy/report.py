"""`HeldOutReport`: the quickstart's before/after line and picture.

Validation before training runs as Lightning's sanity check (``num_sanity_val_steps: -1``), whose
logged values Lightning discards; this callback keeps its own tally from the validation outputs, so
the base accuracy is known, logged at step 0 (every validation reward component) and printed at
the end:

    held-out strict accuracy: 0.412 -> 0.561

It also writes ``base_vs_tuned.png`` to the run's log dir: the first validation prompts, sampled
with the same seeds by the base model (top row of each pair) and the tuned one (bottom row).
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from PIL import Image, ImageDraw


class HeldOutReport(L.Callback):
    """Track a validation reward component from the first validation to the last.

    Args:
        component: the reward component in the validation outputs (``name/component``).
        label: how the printed line names it.
        num_images: how many validation samples go into the base-vs-tuned picture.
        filename: the picture's name inside the run's log dir.
    """

    def __init__(
        self,
        component: str = "shapes/strict",
        label: str = "held-out strict accuracy",
        num_images: int = 16,
        filename: str = "base_vs_tuned.png",
    ) -> None:
        self.component = component
        self.label = label
        self.num_images = num_images
        self.filename = filename
        self.history: list[tuple[int, float]] = []
        self._sums: dict[str, list[float]] = {}
        self._images: list[torch.Tensor] = []
        self._prompts: list[str] = []
        self._first: tuple[torch.Tensor, list[str]] | None = None
        self._last: tuple[torch.Tensor, list[str]] | None = None

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._sums, self._images, self._prompts = {}, [], []

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not isinstance(outputs, dict) or self.component not in outputs.get("rewards", {}):
            return
        for name, values in outputs["rewards"].items():
            finite = values.float()[torch.isfinite(values.float())]
            total = self._sums.setdefault(name, [0.0, 0.0])
            total[0] += float(finite.sum())
            total[1] += float(finite.numel())
        have = sum(len(x) for x in self._images)
        if have < self.num_images:
            take = self.num_images - have
            self._images.append(outputs["images"][:take])
            self._prompts.extend(outputs["prompts"][:take])

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.component not in self._sums:
            return
        names = sorted(self._sums)
        totals = torch.tensor([self._sums[n] for n in names], dtype=torch.float64, device=pl_module.device)
        totals = trainer.strategy.reduce(totals, reduce_op="sum")  # (components, 2): Σ, n over ranks
        means = {n: float(t[0] / t[1]) for n, t in zip(names, totals, strict=True) if t[1] > 0}
        value = means[self.component]
        step = 0 if trainer.sanity_checking else trainer.fit_loop.epoch_loop._batches_that_stepped
        if not self.history or step != self.history[-1][0]:
            self.history.append((step, value))
        images = (torch.cat(self._images) if self._images else torch.zeros(0, 3, 1, 1), list(self._prompts))
        if self._first is None:
            self._first = images
            if trainer.sanity_checking:  # Lightning drops what is logged during the sanity check
                self._log_base(trainer, means)
        self._last = images

    @rank_zero_only
    def _log_base(self, trainer: L.Trainer, means: dict[str, float]) -> None:
        reward = trainer.lightning_module.reward  # names the keys as the module's validation does
        values = {reward.validation_keys(name)[0]: value for name, value in means.items()}
        for logger in trainer.loggers:
            logger.log_metrics(values, step=0)

    @rank_zero_only
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.history:
            return
        base, final = self.history[0][1], self.history[-1][1]
        print(f"{self.label}: {base:.3f} -> {final:.3f}")
        if self._first is not None and self._last is not None and len(self._first[0]):
            folder = trainer.log_dir or trainer.default_root_dir
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, self.filename)
            base_vs_tuned_grid(self._first[0], self._last[0]).save(path)
            print(f"base (top) vs tuned (bottom) samples: {path}")

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [tuple(x) for x in state_dict.get("history", [])]


def base_vs_tuned_grid(
    base: torch.Tensor, tuned: torch.Tensor, per_row: int = 8, scale: int = 3
) -> Image.Image:
    """Pairs of rows: base samples above the tuned samples of the same prompts and seeds."""
    n = min(len(base), len(tuned))
    _, _, h, w = base.shape
    rows = (n + per_row - 1) // per_row
    pad = 2
    cell_w, cell_h = w * scale + pad, h * scale + pad
    canvas = Image.new("RGB", (per_row * cell_w + pad, rows * (2 * cell_h + 6) + pad), (40, 40, 40))
    draw = ImageDraw.Draw(canvas)
    for i in range(n):
        r, c = divmod(i, per_row)
        for k, batch in enumerate((base, tuned)):
            pixels = (batch[i].clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
            tile = Image.fromarray(pixels).resize((w * scale, h * scale), Image.NEAREST)
            canvas.paste(tile, (pad + c * cell_w, pad + r * (2 * cell_h + 6) + k * cell_h))
        draw.line(
            [(0, (r + 1) * (2 * cell_h + 6) - 2), (canvas.width, (r + 1) * (2 * cell_h + 6) - 2)],
            fill=(90, 90, 90),
        )
    return canvas
