"""The Lightning internals the callbacks read (all in ``callbacks/_lightning.py``) still exist and mean
what the callbacks assume. A Lightning upgrade that renames or changes one fails here, by name."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from callback_helpers import RecordingLogger, StandIn, constant_loader, trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor

from lit_flowgrpo.callbacks import _lightning


def test_the_private_names_exist() -> None:
    for name in _lightning.CHECKPOINT_METHODS:
        assert callable(getattr(ModelCheckpoint, name, None)), f"ModelCheckpoint.{name} is gone"
    checkpoint = ModelCheckpoint()
    for name in _lightning.CHECKPOINT_ATTRIBUTES:
        assert hasattr(checkpoint, name), f"ModelCheckpoint().{name} is gone"


class RecordsSteps(StandIn):
    def __init__(self) -> None:
        super().__init__(opt_steps=2)
        self.seen: list[tuple[int, int]] = []  # (rollout step, global step) at each batch end

    def training_step(self, batch: Tensor, batch_idx: int) -> Any:
        super().training_step(batch, batch_idx)
        self.log("rollout_metric", float(batch_idx))
        return None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append((_lightning.rollout_step(self.trainer), self.trainer.global_step))


def test_rollout_step_is_the_step_of_logged_metrics(tmp_path: Path) -> None:
    logger = RecordingLogger()
    model = RecordsSteps()
    t = trainer(tmp_path, [], logger=logger, limit_train_batches=3)
    t.fit(model, constant_loader(3))
    # counts rollouts (training batches), not optimizer steps, and is the step self.log stamps
    assert model.seen == [(0, 2), (1, 4), (2, 6)]
    assert [s for s, m in logger.calls if "rollout_metric" in m] == [0, 1, 2]
    assert _lightning.rollout_step(t) == 3


def test_save_now_writes_through_the_model_checkpoint(tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_epochs=0)  # never saves by itself
    t = trainer(tmp_path, [checkpoint], enable_checkpointing=True, limit_train_batches=2)
    t.fit(StandIn(opt_steps=2), constant_loader(2))
    assert not (tmp_path / "ckpt").exists()
    assert not _lightning.saved_at_current_step(checkpoint, t)

    _lightning.save_now(checkpoint, t)
    assert _lightning.saved_at_current_step(checkpoint, t)
    # its own file name and top-k bookkeeping (after fit, epoch 0 counts as completed)
    assert os.listdir(tmp_path / "ckpt") == ["epoch=1-step=4.ckpt"]
    assert checkpoint.best_model_path == str(tmp_path / "ckpt" / "epoch=1-step=4.ckpt")
