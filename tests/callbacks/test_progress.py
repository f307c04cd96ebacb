"""RolloutProgressBar: the count and total in rollouts, the reward and the validation score beside it,
what each evaluation is, and time (s/rollout, s/sample, the run's ETA with its evaluations) on a patched clock."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
from callback_helpers import StandIn, constant_loader, trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, TQDMProgressBar
from torch import Tensor
from torch.utils.data import DataLoader

from lit_flowgrpo.callbacks import FinalCheckpoint, RolloutProgressBar, progress

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


# -- time: what each evaluation is, s/rollout and s/sample, the run's ETA with evaluations ------------


class FakeClock:
    """``time.perf_counter`` for the progress module: the stand-in advances it as its work would."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


class EvalSet(torch.utils.data.IterableDataset):
    """3 batches of 4 samples, declaring its size as the prompt data's validation set does."""

    num_samples, batch_size = 12, 4

    def __iter__(self) -> Any:
        return iter(torch.zeros(3, 4, dtype=torch.long))


class Timed(Rollouts):
    """A rollout takes 50 s, an evaluated sample 1 s (on the fake clock); records both bars."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__([1] * 10, steps_per_rollout=1, val_scores={})
        self.clock = clock
        self.train_bar: list[tuple[int, str, str, float | None]] = []  # (n, eta, pace, seconds left)
        self.eval_bar: list[tuple[str, int, int | None, str, str]] = []  # (title, n, total, eta, pace)

    def training_step(self, batch: Tensor, batch_idx: int) -> Any:
        self.clock.now += 50.0
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Tensor, batch_idx: int) -> Any:
        self.clock.now += 1.0 * len(batch)
        return None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        progress = self.trainer.progress_bar_callback
        bar = progress.train_progress_bar
        self.train_bar.append((bar.n, bar.eta, bar.pace, progress.seconds_left))

    def on_validation_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        bar = self.trainer.progress_bar_callback.val_progress_bar
        self.eval_bar.append((bar.desc.removesuffix(": "), bar.n, bar.total, bar.eta, bar.pace))


class EvaluatesAfterTraining(Callback):
    """Declares, as the quickstart's HeldOutReport does, one more evaluation after the last rollout."""

    evaluate_after_training = True


def test_evaluations_say_what_they_are_and_the_eta_counts_them(tmp_path: Path, capsys) -> None:
    clock = FakeClock()
    model, bar = Timed(clock), RolloutProgressBar()
    t = trainer(
        tmp_path,
        [bar, EvaluatesAfterTraining()],
        enable_progress_bar=True,
        max_steps=5,
        max_epochs=-1,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=-1,  # the base model's evaluation, before any rollout
    )
    with mock.patch.object(progress, "time", clock):
        t.fit(model, constant_loader(100), DataLoader(EvalSet(), batch_size=None))

    # each evaluation names itself and counts samples against its total, at its own pace
    base = "evaluating the base model: 12 samples"
    assert model.eval_bar[:3] == [
        (base, 4, 12, "00:08", "1 s/sample"),
        (base, 8, 12, "00:04", "1 s/sample"),
        (base, 12, 12, "00:00", "1 s/sample"),
    ]
    titles = [title for title, *_ in model.eval_bar[::3]]
    assert titles == [
        base,
        "evaluating after 2 rollouts: 12 samples",
        "evaluating after 4 rollouts: 12 samples",
    ]

    # the run's ETA: rollouts left x 50 s + evaluations left x 12 samples x 1 s; evaluations are due
    # after rollouts 2 and 4 (val_check_interval) and after the last one, 5 (declared by a callback)
    assert model.train_bar == [
        (1, "03:56", "50 s/rollout", 4 * 50 + 3 * 12),
        (2, "03:06", "50 s/rollout", 3 * 50 + 3 * 12),  # the evaluation after rollout 2 is still to come
        (3, "02:04", "50 s/rollout", 2 * 50 + 2 * 12),
        (4, "01:14", "50 s/rollout", 1 * 50 + 2 * 12),
        (5, "00:12", "50 s/rollout", 0 + 1 * 12),
    ]
    assert bar.train_progress_bar.eta == "00:12"  # after the evaluation at rollout 4 and before the last
    shown = str(bar.train_progress_bar)
    assert "5/5 rollouts" in shown and "50 s/rollout" in shown and "it/s" not in shown

    # the first line after the first rollout: the whole run on this machine
    out = capsys.readouterr().out
    expected = (
        "this run on this machine: about 5 min in all (5 rollouts at 50 s/rollout + 4 evaluations of 12 "
        "samples at 1 s/sample), from the first rollout and the evaluations so far; the bar's ETA corrects "
        "it as it goes"
    )
    assert expected in out
    assert bar.estimate_s == 50 + 12 + 4 * 50 + 3 * 12


def test_before_any_evaluation_is_timed_the_eta_says_so(tmp_path: Path, capsys) -> None:
    clock = FakeClock()
    model, bar = Timed(clock), RolloutProgressBar()
    t = trainer(
        tmp_path, [bar], enable_progress_bar=True, max_steps=3, max_epochs=-1, val_check_interval=2,
        check_val_every_n_epoch=None,
    )  # fmt: skip
    with mock.patch.object(progress, "time", clock):
        t.fit(model, constant_loader(100), DataLoader(EvalSet(), batch_size=None))
    # no base evaluation: one evaluation (after rollout 2) is due and not yet timed
    assert model.train_bar[0] == (1, "01:40 + evaluations", "50 s/rollout", None)
    assert model.train_bar[2] == (3, "00:00", "50 s/rollout", 0.0)
    assert (
        "3 rollouts at 50 s/rollout + 1 evaluation of 12 samples (not measured yet)"
        in capsys.readouterr().out
    )


def test_max_time_ends_the_count_where_the_timer_stops_training(tmp_path: Path, capsys) -> None:
    # Lightning's Timer reads the same fake clock: 50 s rollouts against 175 s of max_time stop
    # training at the end of rollout 4 (200 s), well before max_steps' 10
    from lightning.pytorch.callbacks import timer

    clock = FakeClock()
    clock.monotonic = clock.perf_counter  # type: ignore[method-assign]
    model, bar = Timed(clock), RolloutProgressBar()
    t = trainer(
        tmp_path, [bar], enable_progress_bar=True, max_steps=10, max_epochs=-1, max_time={"seconds": 175},
        val_check_interval=20, check_val_every_n_epoch=None, num_sanity_val_steps=-1,
    )  # fmt: skip
    with mock.patch.object(progress, "time", clock), mock.patch.object(timer, "time", clock):
        t.fit(model, constant_loader(100), DataLoader(EvalSet(), batch_size=None))
    assert model.done == 4
    # from the first rollout on, the bar counts to 4 (ceil of 125 s left / 50 s a rollout, plus one
    # done), and the ETA counts the evaluation Lightning runs where it stops a run early
    assert model.train_bar == [
        (1, "02:42", "50 s/rollout", 3 * 50 + 12),
        (2, "01:52", "50 s/rollout", 2 * 50 + 12),
        (3, "01:02", "50 s/rollout", 1 * 50 + 12),
        (4, "00:12", "50 s/rollout", 0 + 12),
    ]
    assert bar.total_rollouts == 4 and bar.time_capped
    assert "4/4 rollouts" in str(bar.train_progress_bar)
    titles = [title for title, *_ in model.eval_bar[::3]]
    assert titles == ["evaluating the base model: 12 samples", "evaluating after 4 rollouts: 12 samples"]
    out = capsys.readouterr().out
    assert (
        "about 4 min in all (4 rollouts at 50 s/rollout (as many as fit in max_time) + 2 evaluations of 12 "
        "samples at 1 s/sample)" in out
    )
    assert bar.estimate_s == 50 + 12 + 3 * 50 + 12
