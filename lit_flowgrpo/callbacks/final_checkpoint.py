"""A run never ends without a checkpoint of its last rollout: at the end of fit, and on SIGTERM."""

from __future__ import annotations

import signal

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lit_flowgrpo.callbacks._lightning import save_now, saved_at_current_step

__all__ = ["FinalCheckpoint"]

#: Exit status of a run stopped by SIGTERM: 128 + signal number, the shell's convention for a
#: process ended by a signal, which schedulers read as "did not finish".
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM


class FinalCheckpoint(Callback):
    """Has every ``ModelCheckpoint`` of the trainer save the last state when fit ends between its save points.

    ``ModelCheckpoint`` saves at its own points (every N steps, after validation, at epoch end). A
    run that stops between them, at ``max_steps`` say, keeps nothing of the rollouts since the last
    point; with validation every 2 rollouts, ``max_steps`` of one rollout writes no checkpoint at all.
    At the end of fit (the last training epoch's end), each ``ModelCheckpoint`` that has not saved
    at the current step saves once more, through its own machinery: its ``dirpath`` and file name,
    its top-k ranking when its monitored metric is logged, and ``last.ckpt`` when ``save_last`` (so
    ``--ckpt_path last`` resumes from it). A state that neither keeps is written under the
    callback's file name outside top-k.

    SIGTERM (a scheduler's preemption, ``scancel``, ``kill``): Lightning notes the signal and stops at
    the next batch boundary by raising ``SIGTERMException``, a ``SystemExit`` with no code, so the
    process exits 0 and the scheduler reads a finished run. With ``on_sigterm`` this callback saves
    the state there, as at the end of fit, and gives the exception exit status 143 (128 + SIGTERM).
    Other exceptions save nothing: a crash in the middle of an update leaves weights that match no
    step.

    Uses the trainer's ``ModelCheckpoint`` callbacks (Lightning adds one unless
    ``enable_checkpointing=False``). Every rank takes part (saving is collective).

    Args:
        on_sigterm: save when SIGTERM stops the run, and exit with status 143.
    """

    def __init__(self, on_sigterm: bool = True) -> None:
        super().__init__()
        self.on_sigterm = on_sigterm

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and not _model_checkpoints(trainer):
            raise ValueError(
                "FinalCheckpoint saves through the trainer's ModelCheckpoint, and it has none: drop "
                "--trainer.enable_checkpointing=false, or add a lightning.pytorch.callbacks.ModelCheckpoint"
            )

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # the hook where Lightning's own checkpoints are saved (the epoch counted as processed, not
        # yet completed), so the file is named and resumed like theirs
        if _fit_stops_after_this_epoch(trainer):
            self._save(trainer, "end of fit")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._save(trainer, "end of fit")  # a stop the epoch-end test did not foresee

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if not (self.on_sigterm and isinstance(exception, SIGTERMException)):
            return
        # SystemExit's code is what the interpreter exits with; Lightning re-raises this very
        # exception. Set first, so that a stop during sanity checking (nothing to save) or a failed
        # save still exits non-zero.
        exception.code = SIGTERM_EXIT_CODE
        self._save(trainer, "SIGTERM")

    def _save(self, trainer: Trainer, why: str) -> None:
        if trainer.sanity_checking or trainer.fast_dev_run:
            return
        for checkpoint in _model_checkpoints(trainer):
            if not saved_at_current_step(checkpoint, trainer):
                save_now(checkpoint, trainer)
                rank_zero_info(f"{why}: saved step {trainer.global_step} in {checkpoint.dirpath}")


def _fit_stops_after_this_epoch(trainer: Trainer) -> bool:
    # FitLoop.done's stop conditions from the Trainer's public attributes (`done` itself logs each
    # time it is read); read in on_train_epoch_end, where current_epoch is the epoch ending
    max_steps, max_epochs = trainer.max_steps, trainer.max_epochs
    return (
        trainer.should_stop
        or 0 <= max_steps <= trainer.global_step
        or (max_epochs is not None and 0 <= max_epochs <= trainer.current_epoch + 1)
    )


def _model_checkpoints(trainer: Trainer) -> list[ModelCheckpoint]:
    return [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
