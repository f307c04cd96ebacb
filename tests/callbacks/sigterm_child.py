"""The process the SIGTERM test stops: trains the stand-in module until SIGTERM arrives in rollout 3.

Usage: ``python sigterm_child.py OUT_DIR``. Writes ``OUT_DIR/in_rollout_3`` once the third rollout's
optimizer steps are done, then waits in that training step until Lightning has noted the signal, so
the stop always comes at the end of rollout 3, however slow the machine.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
from callback_helpers import StandIn, constant_loader, trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor

from lit_flowgrpo.callbacks import FinalCheckpoint

ROLLOUTS_BEFORE_SIGTERM = 3


class WaitsForSigterm(StandIn):
    def __init__(self, marker: Path) -> None:
        super().__init__(opt_steps=2)
        self.marker = marker

    def training_step(self, batch: Tensor, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        if batch_idx == ROLLOUTS_BEFORE_SIGTERM - 1:
            self.marker.write_text("ready for SIGTERM")
            while not self.trainer.received_sigterm:  # polls a flag; the signal handler sets it
                time.sleep(0.01)
        return out


def main(out: Path) -> None:
    torch.manual_seed(0)
    model = WaitsForSigterm(out / f"in_rollout_{ROLLOUTS_BEFORE_SIGTERM}")
    callbacks = [ModelCheckpoint(dirpath=str(out / "ckpt"), save_last=True), FinalCheckpoint()]
    trainer(out, callbacks, enable_checkpointing=True, limit_train_batches=100).fit(
        model, constant_loader(100)
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
