"""FinalCheckpoint: the last rollout is saved at the end of fit and on SIGTERM, and resumes exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from callback_helpers import StandIn, constant_loader, trainer
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_flowgrpo.callbacks import FinalCheckpoint
from lit_flowgrpo.callbacks.final_checkpoint import SIGTERM_EXIT_CODE

HERE = Path(__file__).resolve().parent


def fit(
    root: Path, max_steps: int, *, final: bool, ckpt_path: str | None = None, **checkpoint: Any
) -> tuple[StandIn, Trainer]:
    """2 optimizer steps per rollout, validation every 2 rollouts (the shipped configs' layout)."""
    torch.manual_seed(0)
    model = StandIn(opt_steps=2)
    callbacks: list[Any] = [ModelCheckpoint(dirpath=str(root / "ckpt"), **checkpoint)]
    if final:
        callbacks.append(FinalCheckpoint())
    t = trainer(
        root,
        callbacks,
        enable_checkpointing=True,
        max_steps=max_steps,
        max_epochs=-1,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        limit_val_batches=1,
    )
    t.fit(model, constant_loader(100), constant_loader(1), ckpt_path=ckpt_path)
    return model, t


def checkpoints(root: Path) -> dict[str, int]:
    """{file name: global step} of every checkpoint written."""
    folder = root / "ckpt"
    names = sorted(os.listdir(folder)) if folder.exists() else []
    return {n: torch.load(folder / n, weights_only=False)["global_step"] for n in names}


def trainable(state: dict[str, torch.Tensor], model: StandIn) -> torch.Tensor:
    return torch.cat([state[n].flatten() for n, p in model.named_parameters() if p.requires_grad])


@pytest.mark.parametrize(
    ("save_last", "max_steps", "without", "with_final"),
    [
        # Lightning's default ModelCheckpoint (the tiny config's). One rollout, before the first
        # validation: nothing is written.
        (None, 2, {}, {"epoch=0-step=2.ckpt": 2}),
        # Three rollouts: the last save point is the validation after rollout 2 (step 4).
        (None, 6, {"epoch=0-step=4.ckpt": 4}, {"epoch=0-step=6.ckpt": 6}),
        # The recipes' save_last=True: Lightning 2.6 writes `last` at the end only when nothing else
        # was saved in the run, so after a save point `last` stays behind.
        (True, 2, {"last.ckpt": 2}, {"epoch=0-step=2.ckpt": 2, "last.ckpt": 2}),
        (True, 6, {"epoch=0-step=4.ckpt": 4, "last.ckpt": 4}, {"epoch=0-step=6.ckpt": 6, "last.ckpt": 6}),
    ],
)
def test_the_end_of_fit_is_saved(
    tmp_path: Path,
    save_last: bool | None,
    max_steps: int,
    without: dict[str, int],
    with_final: dict[str, int],
) -> None:
    fit(tmp_path / "lightning", max_steps, final=False, save_last=save_last)
    assert checkpoints(tmp_path / "lightning") == without

    model, _ = fit(tmp_path / "final", max_steps, final=True, save_last=save_last)
    assert checkpoints(tmp_path / "final") == with_final
    (newest,) = [n for n in with_final if n != "last.ckpt"]
    saved = torch.load(tmp_path / "final" / "ckpt" / newest, weights_only=False)
    assert torch.equal(trainable(saved["state_dict"], model), model.history[-1])


def test_resume_from_the_final_checkpoint_is_exact(tmp_path: Path) -> None:
    straight, _ = fit(tmp_path / "straight", 10, final=True, save_last=True)
    fit(tmp_path / "resumed", 6, final=True, save_last=True)
    resumed, t = fit(
        tmp_path / "resumed",
        10,
        final=True,
        save_last=True,
        ckpt_path=str(tmp_path / "resumed" / "ckpt" / "last.ckpt"),
    )
    assert t.global_step == 10 and len(resumed.history) == 4  # two rollouts after the restored six steps
    assert torch.equal(resumed.history[-1], straight.history[-1])


def test_a_state_that_top_k_would_not_keep_is_still_written(tmp_path: Path) -> None:
    # ranks by a metric the module never logs, no `last`: ModelCheckpoint alone keeps nothing
    fit(tmp_path / "lightning", 2, final=False, monitor="val-core/never/mean@1", save_last=False)
    assert checkpoints(tmp_path / "lightning") == {}
    fit(tmp_path / "final", 2, final=True, monitor="val-core/never/mean@1", save_last=False)
    assert checkpoints(tmp_path / "final") == {"epoch=0-step=2.ckpt": 2}


def test_uses_lightnings_default_checkpoint_and_needs_one(tmp_path: Path) -> None:
    t = trainer(tmp_path, [FinalCheckpoint()], enable_checkpointing=True, max_steps=2, max_epochs=-1)
    t.fit(StandIn(opt_steps=2), constant_loader(100))
    assert os.listdir(tmp_path / "checkpoints") == ["epoch=0-step=2.ckpt"]

    t = trainer(tmp_path, [FinalCheckpoint()], enable_checkpointing=False, max_steps=2)
    with pytest.raises(ValueError, match="enable_checkpointing"):
        t.fit(StandIn(opt_steps=2), constant_loader(100))


def test_sigterm_saves_and_exits_non_zero(tmp_path: Path) -> None:
    """A real process, stopped by SIGTERM in its third rollout: it saves that rollout and exits 143."""
    child = subprocess.Popen(
        [sys.executable, str(HERE / "sigterm_child.py"), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    marker = tmp_path / "in_rollout_3"
    try:
        while not marker.exists():  # the child writes it from inside rollout 3
            if child.poll() is not None:
                pytest.fail(
                    f"the child ended before rollout 3 (exit {child.returncode}):\n{child.stdout.read()}"
                )
            time.sleep(0.05)
        child.send_signal(signal.SIGTERM)
        output, _ = child.communicate(timeout=600)  # a guard against a hang, not a measurement
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == SIGTERM_EXIT_CODE == 143, output
    assert checkpoints(tmp_path) == {"epoch=0-step=6.ckpt": 6, "last.ckpt": 6}

    # it holds the third rollout's weights, and Lightning resumes from it to the uninterrupted result
    torch.manual_seed(0)
    reference = StandIn(opt_steps=2)
    trainer(tmp_path / "reference", [], max_steps=10, max_epochs=-1).fit(reference, constant_loader(100))
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert torch.equal(trainable(last["state_dict"], reference), reference.history[5])
    resumed = StandIn(opt_steps=2)
    trainer(tmp_path / "resumed", [], max_steps=10, max_epochs=-1).fit(
        resumed, constant_loader(100), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt")
    )
    assert len(resumed.history) == 4 and torch.equal(resumed.history[-1], reference.history[-1])
