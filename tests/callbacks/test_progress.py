"""RolloutProgressBar: the count and total in rollouts, the reward and the validation score beside it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from callback_helpers import StandIn, constant_loader, trainer
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from torch import Tensor

from lit_flowgrpo.callbacks import FinalCheckpoint, RolloutProgressBar

# What the module logs for a reward of GenEval (strict core, partial aux) and OCR (core).
VAL_SCORES = {
    "val-core/geneval/strict/mean@1": 0.5,
    "val-aux/geneval/partial/mean@1": 0.75,
    "val-aux/geneval/strict/unscored_count": 0.0,  # not a score: never shown
    "val-core/ocr/mean@1": 0.125,
}


class Rollouts(StandIn):
    """Takes ``steps[i]`` optimizer steps in rollout i, logs a reward and a validation score, and
    records what the progress bar shows after each rollout."""

    def __init__(
        self,
        steps: Sequence[int],
        steps_per_rollout: int | None = 2,
        val_scores: dict[str, float] | None = None,
    ) -> None:
        super().__init__()
        self.steps = list(steps)
        self.val_scores = VAL_SCORES if val_scores is None else val_scores
        if steps_per_rollout is not None:
            self.optimizer_steps_per_rollout = steps_per_rollout
        self.done = 0
        self.shown: list[tuple[int, int | None]] = []  # (count, total) after each rollout
        self.postfix: list[str] = []

    def training_step(self, batch: Tensor, batch_idx: int) -> Any:
        self.opt_steps = self.steps[self.done]
        super().training_step(batch, batch_idx)
        self.done += 1
        self.log("critic/rewards/mean", 0.25 * self.done)
        return None

    def validation_step(self, batch: Tensor, batch_idx: int) -> Any:
        for key, value in self.val_scores.items():
            self.log(key, value)
        return None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.trainer.progress_bar_callback is None:
            return
        bar = self.trainer.progress_bar_callback.train_progress_bar
        self.shown.append((bar.n, bar.total))
        self.postfix.append(bar.postfix)


def run(
    tmp_path: Path, model: Rollouts, max_steps: int, bar: TQDMProgressBar, ckpt_path: str | None = None
) -> None:
    t = trainer(
        tmp_path,
        [bar],
        enable_progress_bar=True,
        max_steps=max_steps,
        max_epochs=-1,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        limit_val_batches=1,
    )
    t.fit(model, constant_loader(100), constant_loader(1), ckpt_path=ckpt_path)


def test_counts_rollouts_to_the_run_end(tmp_path: Path) -> None:
    # Lightning's bar counts rollouts against max_steps (optimizer steps): it ends at 4/8
    lightning = Rollouts([2, 2, 2, 2])
    run(tmp_path, lightning, 8, TQDMProgressBar())
    assert lightning.shown == [(1, 8), (2, 8), (3, 8), (4, 8)]

    ours, bar = Rollouts([2, 2, 2, 2]), RolloutProgressBar()
    run(tmp_path, ours, 8, bar)
    assert ours.shown == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert bar.total_rollouts == 4


def test_refresh_rate_counts_rollouts(tmp_path: Path) -> None:
    model = Rollouts([2, 2, 2, 2])
    run(tmp_path, model, 8, RolloutProgressBar(refresh_rate=3))
    assert model.shown == [(0, 4), (0, 4), (3, 4), (4, 4)]  # every 3rd rollout, and the last


def test_total_follows_rollouts_that_take_no_step(tmp_path: Path) -> None:
    # rollout 2 has nothing to learn from (no optimizer step): the run needs one rollout more
    model = Rollouts([2, 0, 2, 2])
    run(tmp_path, model, 6, RolloutProgressBar())
    assert model.shown == [(1, 3), (2, 4), (3, 4), (4, 4)]


@pytest.mark.parametrize(
    ("settings", "steps", "expected"),
    [
        # the module's update settings, inner epochs included: 2 x 2 steps a rollout
        (SimpleNamespace(optimizer_steps_per_rollout=2, num_inner_epochs=2), [4, 4], [(1, 2), (2, 2)]),
        # a module that does not say: Lightning's count
        (None, [2, 2, 2, 2], [(1, 8), (2, 8), (3, 8), (4, 8)]),
    ],
)
def test_steps_per_rollout_from_the_update_settings_or_lightning(
    tmp_path: Path, settings: Any, steps: list[int], expected: list[tuple[int, int]]
) -> None:
    model = Rollouts(steps, steps_per_rollout=None)
    if settings is not None:
        model.update = settings
    bar = RolloutProgressBar()
    run(tmp_path, model, 8, bar)
    assert model.shown == expected
    assert bar.total_rollouts == (None if settings is None else 2)


def test_a_resumed_run_starts_part_full(tmp_path: Path) -> None:
    torch.manual_seed(0)
    first = trainer(
        tmp_path,
        [ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True), FinalCheckpoint()],
        enable_checkpointing=True,
        max_steps=4,
        max_epochs=-1,
    )
    first.fit(Rollouts([2, 2]), constant_loader(100))
    model, bar = Rollouts([2, 2, 2, 2]), RolloutProgressBar()
    run(tmp_path, model, 8, bar, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert model.shown == [(3, 4), (4, 4)]
    assert bar.train_progress_bar.initial == 2  # the ETA's rate counts this session's rollouts only


def test_reward_and_validation_score_beside_the_count(tmp_path: Path) -> None:
    model, bar = Rollouts([2, 2, 2]), RolloutProgressBar()
    run(tmp_path, model, 6, bar)
    # validation runs after rollout 2: its scores appear from rollout 3 on
    assert model.postfix == [
        "reward=0.250",
        "reward=0.500",
        "reward=0.750, val/geneval/strict=0.500, val/ocr=0.125",
    ]
    # the core scores only: the auxiliary partial score stays off the bar
    assert bar.get_metrics(bar.trainer, model) == {
        "reward": 0.75,
        "val/geneval/strict": 0.5,
        "val/ocr": 0.125,
    }

    model, bar = (
        Rollouts([2, 2, 2]),
        RolloutProgressBar(reward_key="none", val_key="val-aux/geneval/partial/mean@1"),
    )
    run(tmp_path, model, 6, bar)
    assert model.postfix[-1] == "val/geneval/partial=0.750"

    # a reward with no core component (a preference score): its auxiliary means are shown instead
    scores = {"val-aux/pickscore/score/mean@1": 0.25, "val-aux/pickscore/unscored_count": 0.0}
    model, bar = Rollouts([2, 2, 2], val_scores=scores), RolloutProgressBar(reward_key="none")
    run(tmp_path, model, 6, bar)
    assert model.postfix[-1] == "val/pickscore/score=0.250"
