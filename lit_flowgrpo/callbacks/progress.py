"""A progress bar that counts rollouts to the end of the run, with the reward and the validation score,
and says what each evaluation is and how long the whole run (evaluations included) has left."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Timer, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from typing_extensions import override

from lit_flowgrpo.callbacks._lightning import rollout_step
from lit_flowgrpo.callbacks._module import optimizer_steps_per_rollout

__all__ = ["RolloutProgressBar"]

# How the validation means are named (MultiReward.validation_keys).
_CORE, _AUX, _MEAN = "val-core/", "val-aux/", "/mean@1"

# Lightning's bar format with our own ETA and pace in place of tqdm's: tqdm's rate is items per second
# over everything since the bar started (0.01it/s says nothing), and its ETA knows nothing of the
# evaluations still to come.
_TRAIN_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} rollouts [{elapsed}<{eta}, {pace}{postfix}]"
_EVAL_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} samples [{elapsed}<{eta}, {pace}]"


class RolloutProgressBar(TQDMProgressBar):
    """Lightning's TQDM bar, counting rollout batches against the rollouts the run will take.

    Lightning's bar counts training batches (rollouts) against ``max_steps``, which counts optimizer
    steps: with 2 optimizer steps per rollout a run of ``max_steps=4`` ends with the bar at ``2/4``.
    This bar's total is the rollouts the run takes, r + ⌈(max_steps − global_step) / s⌉, with r the
    rollouts done and s the module's optimizer steps per rollout
    (``optimizer_steps_per_rollout × num_inner_epochs``, read from ``pl_module.update`` or the module).
    It is recomputed after each rollout, so a rollout that takes fewer steps (a batch with nothing to
    learn from) moves it. The count starts at the rollouts already done (a resumed run starts part
    full). Without ``max_steps`` or a module that says how many steps a rollout takes, the count is
    Lightning's. With ``max_time`` as well, the total is the smaller of that and the rollouts that fit
    in the time left: Lightning's ``Timer`` stops training at the first rollout's end past it (its
    clock runs through the evaluations inside training, so their share is spread over the rollouts).

    Time, from this session's measurements: the pace is seconds per rollout (rollout and update,
    evaluations not counted) and the ETA is the run's remaining time, evaluations included:
    rollouts left × s/rollout + evaluations left × samples per evaluation × s/sample, where the
    evaluations left follow ``val_check_interval`` (with ``check_val_every_n_epoch: null``) up to the
    last rollout, plus one after training when a callback says it evaluates then
    (``evaluate_after_training``, e.g. the quickstart's ``HeldOutReport``). After the first rollout
    one line says how long the whole run will take on this machine; the ETA corrects it as it goes.

    Each evaluation says what it is (``evaluating the base model: 1000 samples``, ``evaluating after
    20 rollouts: 1000 samples``) and counts samples against its total, with its own pace (s/sample)
    and ETA. The total comes from the validation set's ``num_samples`` (the prompt data's validation
    set declares it; Lightning's own count is unknown for a dataset without a length), capped by
    Lightning's batch limits.

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
        say_estimate: print the whole run's estimated time after the first rollout.
    """

    def __init__(
        self,
        refresh_rate: int = 1,
        process_position: int = 0,
        leave: bool = False,
        reward_key: str = "critic/rewards/mean",
        val_key: str | None = None,
        say_estimate: bool = True,
    ) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)
        self.reward_key = reward_key
        self.val_key = val_key
        self.say_estimate = say_estimate
        self._rollouts = 0
        self._steps_per_rollout: int | None = None
        self.total_rollouts: int | None = None
        """The rollouts the run takes, as the bar shows it; None while the bar is Lightning's own."""
        self.time_capped = False
        """Whether ``max_time`` ends training before ``max_steps`` does, at this session's pace."""
        self.estimate_s: float | None = None
        """The whole run's estimated seconds (this session), said after its first rollout."""
        self._clock = _Clock()

    # -- bars -------------------------------------------------------------------------------------

    @override
    def init_train_tqdm(self) -> Tqdm:
        return _bar(
            self, leave=True, smoothing=0, bar_format=_TRAIN_FORMAT, desc="training", pace="? s/rollout"
        )

    @override
    def init_sanity_tqdm(self) -> Tqdm:
        return _bar(self, leave=False, bar_format=_EVAL_FORMAT, desc="evaluating", pace="? s/sample")

    @override
    def init_validation_tqdm(self) -> Tqdm:
        has_main_bar = self.trainer.state.fn != "validate"  # as Lightning's
        return _bar(
            self, leave=not has_main_bar, line=has_main_bar, bar_format=_EVAL_FORMAT, desc="evaluating",
            pace="? s/sample",
        )  # fmt: skip

    # -- training ---------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._clock.start_session(rollout_step(trainer))
        # a run resumed from a checkpoint saved at an epoch's end continues without a new epoch start
        self._start_count(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)  # resets the bar
        self.train_progress_bar.set_description("training")
        self._start_count(trainer, pl_module)

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._clock.rollout_started()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._clock.rollout_ended()
        self._rollouts += 1  # also names the evaluations when the count is Lightning's
        if self._steps_per_rollout is None:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        bar = self.train_progress_bar
        bar.total = self.total_rollouts = self._total(trainer)
        self._time_left(trainer)
        n = self._rollouts
        if self._clock.session_rollouts == 1 and self.say_estimate and self.is_enabled and not bar.disable:
            self.print(self._estimate_line(trainer))
        if self.is_enabled and not bar.disable and (n % self.refresh_rate == 0 or n == bar.total):
            bar.n = n
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # redraws

    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        return {**items, **self._scores(trainer.callback_metrics)}

    # -- evaluation -------------------------------------------------------------------------------

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_start(trainer, pl_module)
        self._clock.eval_started()
        if self._val_progress_bar is not None:  # title and total from the start, not at the first batch
            bar = self.val_progress_bar
            bar.total = _eval_size(trainer, 0)
            bar.set_description(self._eval_title(trainer, bar.total))

    @override
    def on_validation_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not self.has_dataloader_changed(dataloader_idx):
            return
        bar = self.val_progress_bar
        bar.reset()
        bar.total = _eval_size(trainer, dataloader_idx)
        bar.initial = 0
        bar.set_description(self._eval_title(trainer, bar.total))

    @override
    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        done = self._clock.eval_batch_ended(_batch_len(batch))
        bar = self.val_progress_bar
        pace = self._clock.s_per_sample()
        bar.pace = _pace(pace, "sample")
        bar.eta = _clock(pace * (bar.total - done)) if pace is not None and bar.total else "?"
        if (
            self.is_enabled
            and not bar.disable
            and ((batch_idx + 1) % self.refresh_rate == 0 or done == bar.total)
        ):
            bar.n = done
            bar.refresh()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._clock.eval_ended(self._rollouts)
        if self._steps_per_rollout is not None and self._train_progress_bar is not None:
            self._time_left(trainer)
        super().on_validation_end(trainer, pl_module)  # redraws the training bar with the new score

    def _eval_title(self, trainer: Trainer, total: int | None) -> str:
        size = f": {total} samples" if total else ""
        if trainer.state.fn != "fit":
            return f"evaluating{size}"
        if self._rollouts == 0:
            return f"evaluating the base model{size}"
        return f"evaluating after {self._rollouts} rollout{'s' if self._rollouts != 1 else ''}{size}"

    # -- counting and time ------------------------------------------------------------------------

    def _start_count(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._rollouts = rollout_step(trainer)
        self._steps_per_rollout = optimizer_steps_per_rollout(pl_module) if trainer.max_steps > 0 else None
        if self._steps_per_rollout is None:
            self.total_rollouts = None
            return
        bar = self.train_progress_bar
        bar.total = self.total_rollouts = self._total(trainer)
        bar.initial = bar.n = self._rollouts
        self._time_left(trainer)
        bar.refresh()

    def _total(self, trainer: Trainer) -> int:
        assert self._steps_per_rollout is not None
        steps_left = max(trainer.max_steps - trainer.global_step, 0)
        by_steps = self._rollouts + math.ceil(steps_left / self._steps_per_rollout)
        by_time = self._rollouts_in_time(trainer)
        self.time_capped = by_time is not None and by_time < by_steps
        return min(by_steps, by_time) if by_time is not None else by_steps

    def _rollouts_in_time(self, trainer: Trainer) -> int | None:
        """The rollouts done by the time ``max_time`` stops training, from this session's pace; None
        without ``max_time`` or before a rollout is timed."""
        timer = next((cb for cb in trainer.callbacks if isinstance(cb, Timer)), None)
        left = timer.time_remaining() if timer is not None else None
        per_rollout = self._clock.s_per_rollout()
        if left is None or per_rollout is None:
            return None
        every, per_sample, size = (
            _validation_every(trainer),
            self._clock.s_per_sample(),
            self._clock.eval_size,
        )
        if every is not None and per_sample is not None and size:
            per_rollout += size * per_sample / every  # the evaluations inside training, a share a rollout
        return self._rollouts + max(math.ceil(left / per_rollout), 0)

    def _time_left(self, trainer: Trainer) -> None:
        """Set the training bar's pace and ETA (and ``seconds_left``) from this session's measurements."""
        bar, clock = self.train_progress_bar, self._clock
        per_rollout, per_sample = clock.s_per_rollout(), clock.s_per_sample()
        rollouts_left = max((self.total_rollouts or 0) - self._rollouts, 0)
        evaluations = self._evaluations_left(trainer)
        size = _eval_size(trainer, 0, sanity=False) if trainer.val_dataloaders is not None else None
        size = clock.eval_size if size is None else size  # a set that does not declare its size: as measured
        self.evaluations_left, self.eval_size = evaluations, size
        unknown = per_rollout is None and rollouts_left > 0
        eval_unknown = evaluations > 0 and (size is None or (size > 0 and per_sample is None))
        left = rollouts_left * (per_rollout or 0.0) + evaluations * (size or 0) * (per_sample or 0.0)
        self.seconds_left = None if unknown or eval_unknown else left
        bar.pace = _pace(per_rollout, "rollout")
        bar.eta = "?" if unknown else _clock(left) + (" + evaluations" if eval_unknown else "")

    def _evaluations_left(self, trainer: Trainer) -> int:
        """Evaluations still to run: at each multiple of ``val_check_interval`` up to the last rollout
        (not one already run), and one after training where a callback asks for it and the last
        rollout is no such multiple."""
        if not trainer.enable_validation or self.total_rollouts is None:
            return 0
        every, last, done = _validation_every(trainer), self.total_rollouts, self._clock.validated_at
        points = {r for r in range(max(self._rollouts, 1), last + 1) if every is not None and r % every == 0}
        # Lightning validates where a run is stopped early (max_time's Timer), or a callback asks it to
        if last not in points and (
            self.time_capped
            or any(getattr(cb, "evaluate_after_training", False) is True for cb in trainer.callbacks)
        ):
            points.add(last)
        return len(points - {done})

    def _estimate_line(self, trainer: Trainer) -> str:
        clock, left = self._clock, self.seconds_left
        rollouts = self.total_rollouts or 0
        capped = " (as many as fit in max_time)" if self.time_capped else ""
        parts = [
            f"{rollouts - clock.first_rollout} rollouts at {_pace(clock.s_per_rollout(), 'rollout')}{capped}"
        ]
        evaluations = self.evaluations_left + clock.evaluations
        if evaluations:
            size = f" of {self.eval_size} samples" if self.eval_size else ""
            per_sample = clock.s_per_sample()
            at = f" at {_pace(per_sample, 'sample')}" if per_sample is not None else " (not measured yet)"
            parts.append(f"{evaluations} evaluation{'s' if evaluations != 1 else ''}{size}{at}")
        if left is None:
            return f"this run on this machine: {' + '.join(parts)}; the bar's ETA follows once an evaluation is timed"
        self.estimate_s = clock.rollout_s + clock.eval_s + left
        return (
            f"this run on this machine: about {_duration(self.estimate_s)} in all ({' + '.join(parts)}), "
            "from the first rollout and the evaluations so far; the bar's ETA corrects it as it goes"
        )

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


class _Clock:
    """This session's measured time: seconds in rollouts and in evaluations.

    Reads ``time.perf_counter`` (the tests patch this module's ``time``), on the host: the module's
    step returns after its images are on the host, so no device synchronisation is needed here.
    """

    def __init__(self) -> None:
        self.rollout_s = 0.0
        self.session_rollouts = 0
        self.first_rollout = 0  # rollouts done before this session (a resumed run)
        self.eval_s = 0.0
        self.eval_samples = 0
        self.evaluations = 0  # evaluations run in this session
        self.eval_size: int | None = None  # samples in the last evaluation
        self.validated_at: int | None = None  # the rollout count at the last evaluation's end
        self._rollout_t0: float | None = None
        self._eval_t0: float | None = None
        self._eval_done = 0

    def start_session(self, rollouts: int) -> None:
        self.first_rollout = self.validated_at = rollouts

    def rollout_started(self) -> None:
        self._rollout_t0 = time.perf_counter()

    def rollout_ended(self) -> None:
        if self._rollout_t0 is not None:
            self.rollout_s += time.perf_counter() - self._rollout_t0
            self.session_rollouts += 1
            self._rollout_t0 = None

    def eval_started(self) -> None:
        self._eval_t0, self._eval_done = time.perf_counter(), 0

    def eval_batch_ended(self, samples: int) -> int:
        self._eval_done += samples
        self._eval_now = time.perf_counter()
        return self._eval_done

    def eval_ended(self, rollouts: int) -> None:
        if self._eval_t0 is not None:
            self.eval_s += time.perf_counter() - self._eval_t0
            self.eval_samples += self._eval_done
            self.evaluations += 1
            self.eval_size = self._eval_done
            self._eval_t0 = None
        self.validated_at = rollouts

    def s_per_rollout(self) -> float | None:
        return self.rollout_s / self.session_rollouts if self.session_rollouts else None

    def s_per_sample(self) -> float | None:
        """Seconds per evaluated sample over every evaluation so far, the running one included."""
        seconds, samples = self.eval_s, self.eval_samples
        if self._eval_t0 is not None:
            seconds, samples = seconds + self._eval_now - self._eval_t0, samples + self._eval_done
        return seconds / samples if samples else None


class _Bar(Tqdm):
    """Lightning's Tqdm with two fields of our own for the bar format: ``eta`` and ``pace``."""

    def __init__(self, *args: Any, eta: str = "?", pace: str = "", **kwargs: Any) -> None:
        self.eta, self.pace = eta, pace
        super().__init__(*args, **kwargs)

    @property
    def format_dict(self) -> dict[str, Any]:
        return {**super().format_dict, "eta": self.eta, "pace": self.pace}


def _bar(owner: TQDMProgressBar, *, line: bool = False, pace: str, **kwargs: Any) -> _Bar:
    return _Bar(
        position=2 * owner.process_position + int(line),
        disable=owner.is_disabled,
        dynamic_ncols=True,
        file=sys.stdout,
        pace=pace,
        **kwargs,
    )


def _eval_size(trainer: Trainer, dataloader_idx: int, *, sanity: bool | None = None) -> int | None:
    """Samples one evaluation takes on this rank: the validation set's ``num_samples`` (declared by
    the set; Lightning cannot count a dataset without a length), capped by Lightning's batch limits."""
    loaders = trainer.val_dataloaders
    if isinstance(loaders, (list, tuple)):
        loaders = loaders[dataloader_idx] if dataloader_idx < len(loaders) else None
    dataset = getattr(loaders, "dataset", None)
    samples, batch_size = getattr(dataset, "num_samples", None), getattr(dataset, "batch_size", None)
    if not isinstance(samples, int):
        return None
    if sanity if sanity is not None else trainer.sanity_checking:
        limit: float = trainer.num_sanity_val_steps
        limit = math.inf if limit < 0 else limit
    else:
        limit = trainer.limit_val_batches
        if isinstance(limit, float):  # a fraction of the batches
            limit = math.inf if limit >= 1.0 else math.floor(limit * math.ceil(samples / (batch_size or 1)))
    if isinstance(batch_size, int) and math.isfinite(limit):
        samples = min(samples, int(limit) * batch_size)
    return samples


def _validation_every(trainer: Trainer) -> int | None:
    """The rollouts between evaluations during training (``val_check_interval`` counted over the whole
    run, ``check_val_every_n_epoch: null``); None where evaluations follow epochs instead."""
    every = trainer.val_check_batch
    periodic = trainer.check_val_every_n_epoch is None and isinstance(every, int) and every > 0
    return every if periodic else None


def _batch_len(batch: Any) -> int:
    """Samples in a validation batch: its prompts (a ``PromptBatch``), else its length, else 1."""
    prompts = getattr(batch, "prompts", None)
    if prompts is not None:
        return len(prompts)
    try:
        return len(batch)
    except TypeError:
        return 1


def _pace(seconds: float | None, unit: str) -> str:
    """
    >>> _pace(52.345, "rollout"), _pace(0.0123, "sample"), _pace(None, "rollout")
    ('52.3 s/rollout', '0.0123 s/sample', '? s/rollout')
    """
    if seconds is None:
        return f"? s/{unit}"
    return f"{seconds:.3g} s/{unit}" if seconds < 100 else f"{seconds:.0f} s/{unit}"


def _clock(seconds: float) -> str:
    """
    >>> _clock(59.6), _clock(3 * 3600 + 20 * 60)
    ('01:00', '3:20:00')
    """
    return Tqdm.format_interval(round(seconds))


def _duration(seconds: float) -> str:
    """
    >>> _duration(42), _duration(125), _duration(3 * 3600 + 19.6 * 60)
    ('42 s', '2 min', '3 h 20 min')
    """
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"
