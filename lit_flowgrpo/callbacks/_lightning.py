"""The only place the callbacks touch Lightning's private attributes.

Lightning has no public API for two things the callbacks need, so each is read here, once, and
``tests/callbacks/test_lightning_private.py`` fails if a Lightning release renames any of them:

- the rollout-step counter, the x-axis Lightning stamps on every metric the module logs through
  ``self.log`` (under manual optimization ``trainer.global_step`` counts ``optimizer.step()`` calls,
  several per rollout step); Lightning's own ``LearningRateMonitor`` reads the same counter;
- "save a checkpoint now, as this ModelCheckpoint would at one of its save points", which
  ``ModelCheckpoint`` does inside its hooks through protected methods only;
- "is this step one that logs", the logger connector's private ``should_update_logs``, restated
  from the trainer's public settings.
"""

from __future__ import annotations

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

#: The private names read here, for the test that guards them.
TRAINER_COUNTER = "_batches_that_stepped"  # on trainer.fit_loop.epoch_loop
CHECKPOINT_METHODS = (
    "_monitor_candidates",
    "_save_topk_checkpoint",
    "_save_last_checkpoint",
    "_save_checkpoint",
)
CHECKPOINT_ATTRIBUTES = ("_last_global_step_saved",)


def rollout_step(trainer: Trainer) -> int:
    """Training batches (rollout steps) completed so far: the step of metrics logged through ``self.log``.

    Inside ``on_train_batch_end`` it is the current batch's index over the whole run (Lightning
    increments it after the batch-end hooks), and it survives resume.
    """
    return int(getattr(trainer.fit_loop.epoch_loop, TRAINER_COUNTER))


def should_log(trainer: Trainer, step: int) -> bool:
    """Whether on-step metrics of rollout step ``step`` are logged: Lightning's own rule (the logger
    connector's ``should_update_logs``), every ``log_every_n_steps`` steps and at the last one."""
    every = trainer.log_every_n_steps
    return every > 0 and ((step + 1) % every == 0 or trainer.should_stop)


def saved_at_current_step(checkpoint: ModelCheckpoint, trainer: Trainer) -> bool:
    """Whether ``checkpoint`` has already written a file at ``trainer.global_step``."""
    return checkpoint._last_global_step_saved == trainer.global_step


def save_now(checkpoint: ModelCheckpoint, trainer: Trainer) -> None:
    """Save the current state through ``checkpoint``: its file naming, top-k bookkeeping and ``last``.

    What ``ModelCheckpoint`` does at one of its save points: rank by the monitored metric when it is
    logged, then refresh ``last`` (if ``save_last``). When neither wrote the state (top-k judged it
    not good enough, or the monitored metric is missing, and ``save_last`` is off), it is written
    under the callback's file name outside top-k, as ``ModelCheckpoint(save_on_exception=True)``
    does, so the state is never lost. Every rank must call it (saving is collective).
    """
    candidates = checkpoint._monitor_candidates(trainer)
    if checkpoint.monitor is None or checkpoint.monitor in candidates:
        checkpoint._save_topk_checkpoint(trainer, candidates)
    checkpoint._save_last_checkpoint(trainer, candidates)
    if not saved_at_current_step(checkpoint, trainer):
        checkpoint._save_checkpoint(trainer, checkpoint.format_checkpoint_name(candidates))
