"""A progress bar that counts rollouts to the end of the run, with the reward and the validation score."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

from lit_flowgrpo.callbacks._lightning import rollout_step
from lit_flowgrpo.callbacks._module import optimizer_steps_per_rollout

__all__ = ["RolloutProgressBar"]

# How the validation means are named (MultiReward.validation_keys).
_CORE, _AUX, _MEAN = "val-core/", "val-aux/", "/mean@1"


class RolloutProgressBar(TQDMProgressBar):
    """Lightning's TQDM bar, counting rollout batches against the rollouts the run will take.

    Lightning's bar counts training batches (rollouts) against ``max_steps``, which counts optimizer
    steps: with 2 optimizer steps per rollout a run of ``max_steps=4`` ends with the bar at ``2/4``.
    This bar's total is the rollouts the run takes, r + ⌈(max_steps − global_step) / s⌉, with r the
    rollouts done and s the module's optimizer steps per rollout
    (``optimizer_steps_per_rollout × num_inner_epochs``, read from ``pl_module.update`` or the module).
    It is recomputed after each rollout, so a rollout that takes fewer steps (a batch with nothing to
    learn from) moves it. The count starts at the rollouts already done (a resumed run starts part
    full) and the ETA is tqdm's: the rollouts left at this run's mean rate, validation time included.
    Without ``max_steps`` or a module that says how many steps a rollout takes, it is Lightning's bar.

    Beside the count: ``reward`` (``reward_key``, the last rollout's mean reward) and the last
    validation score(s), each ``val-core/<name>/mean@1`` shown as ``val/<name>`` (the
    ``val-aux/<name>/mean@1`` scores instead when the reward has no core component).

    Args:
        refresh_rate: redraw every this many rollouts (Lightning's ``TQDMProgressBar``).
        process_position: the bar's line, for several trainers at once (Lightning's).
        leave: keep each epoch's finished bar on screen (Lightning's).
        reward_key: the logged metric shown as ``reward``.
        val_key: the validation metric shown; None shows every ``val-core/<name>/mean@1`` logged,
            or every ``val-aux/<name>/mean@1`` when there is none.
    """

    def __init__(
        self,
        refresh_rate: int = 1,
        process_position: int = 0,
        leave: bool = False,
        reward_key: str = "critic/rewards/mean",
        val_key: str | None = None,
    ) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)
        self.reward_key = reward_key
        self.val_key = val_key
        self._rollouts = 0
        self._steps_per_rollout: int | None = None
        self.total_rollouts: int | None = None
        """The rollouts the run takes, as the bar shows it; None while the bar is Lightning's own."""

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        # a run resumed from a checkpoint saved at an epoch's end continues without a new epoch start
        self._start_count(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)  # resets the bar
        self._start_count(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._steps_per_rollout is None:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        self._rollouts += 1
        bar = self.train_progress_bar
        bar.total = self.total_rollouts = self._total(trainer)
        n = self._rollouts
        if self.is_enabled and not bar.disable and (n % self.refresh_rate == 0 or n == bar.total):
            bar.n = n
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # redraws

    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        return {**items, **self._scores(trainer.callback_metrics)}

    def _start_count(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._steps_per_rollout = optimizer_steps_per_rollout(pl_module) if trainer.max_steps > 0 else None
        if self._steps_per_rollout is None:
            self.total_rollouts = None
            return
        self._rollouts = rollout_step(trainer)
        bar = self.train_progress_bar
        bar.total = self.total_rollouts = self._total(trainer)
        # tqdm's rate is (n − initial) / elapsed: the rollouts of this session, not the resumed ones
        bar.initial = bar.n = self._rollouts
        bar.refresh()

    def _total(self, trainer: Trainer) -> int:
        assert self._steps_per_rollout is not None
        steps_left = max(trainer.max_steps - trainer.global_step, 0)
        return self._rollouts + math.ceil(steps_left / self._steps_per_rollout)

    def _scores(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        scores = {}
        if self.reward_key in metrics:
            scores["reward"] = float(metrics[self.reward_key])
        if self.val_key is None:
            means = [k for k in metrics if k.endswith(_MEAN)]
            val_keys = [k for k in means if k.startswith(_CORE)] or [k for k in means if k.startswith(_AUX)]
        else:
            val_keys = [self.val_key] if self.val_key in metrics else []
        for key in val_keys:
            name = key.removeprefix(_CORE).removeprefix(_AUX).removesuffix(_MEAN)
            scores[f"val/{name}"] = float(metrics[key])
        return scores
