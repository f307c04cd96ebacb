"""The quickstart's base-vs-tuned picture (each sample's frame says what the verifier decided) and its
last line (base -> tuned, or what was not evaluated)."""

from __future__ import annotations

import csv
import math
import shutil
from pathlib import Path
from typing import Any, ClassVar

import lightning as L
import pytest
import torch
from ddp_helpers import CloseProcessGroup
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lit_flowgrpo.callbacks import FinalCheckpoint
from lit_flowgrpo.toy.report import HeldOutReport, base_vs_tuned_grid

GREEN, RED = (40, 200, 70), (220, 50, 50)


def test_frames_follow_the_pass_flags_and_columns_follow_the_samples() -> None:
    n, scale, frame = 3, 4, 3
    base_passed = torch.tensor([True, False, True])
    tuned_passed = torch.tensor([False, False, True])
    grid = base_vs_tuned_grid(
        torch.zeros(n, 3, 32, 32), torch.zeros(n, 3, 32, 32), ["a red circle"] * n, base_passed, tuned_passed,
        scale=scale,
    )  # fmt: skip
    tile, cell_w, pad, label_w, text_h = 32 * scale, 32 * scale + 2 * frame + 6, 6, 44, 11
    assert grid.width == label_w + n * cell_w + pad  # three columns, not a full row of eight
    for i in range(n):
        x = label_w + pad + i * cell_w + 1  # inside the left frame edge
        for k, flags in enumerate((base_passed, tuned_passed)):
            y = pad + text_h + k * (tile + 2 * frame) + frame + tile // 2
            assert grid.getpixel((x, y)) == (GREEN if flags[i] else RED)
            assert grid.getpixel((x + frame + tile // 2, y)) == (0, 0, 0)  # the (black) sample itself


def test_without_flags_there_is_no_frame_and_no_legend() -> None:
    with_flags = base_vs_tuned_grid(
        torch.zeros(2, 3, 32, 32), torch.zeros(2, 3, 32, 32), ["a"] * 2, torch.ones(2).bool()
    )
    plain = base_vs_tuned_grid(torch.zeros(2, 3, 32, 32), torch.zeros(2, 3, 32, 32), ["a"] * 2)
    assert plain.height < with_flags.height
    assert plain.getpixel((44 + 6 + 1, 6 + 11 + 3 + 64)) == (30, 30, 30)  # background where a frame would be


# -- the last line ---------------------------------------------------------------------------------


class _Keys:
    """The module's reward as the report reads it: the logged key of a validation component (a class,
    not a lambda, so that ``ddp_spawn`` can pickle the module)."""

    def validation_keys(self, name: str) -> list[str]:
        return [f"val-core/{name}/mean@1"]


class Learner(L.LightningModule):
    """A stand-in for FlowGRPOModule: each rollout is one optimizer step, and validation scores
    ``0.1 × rollouts done`` (optimizer steps) strict accuracy on 4 samples per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.reward = _Keys()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward((self.w - 1).pow(2).sum())
        opt.step()

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> dict:
        strict = torch.full((4,), 0.1 * self.trainer.global_step)  # restored on resume
        images = torch.zeros(4, 3, 8, 8, device=self.device)  # where the module's samples are
        return {"rewards": {"shapes/strict": strict}, "images": images, "prompts": ["p"] * 4}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([self.w], lr=0.1)


def fit(
    tmp_path: Path,
    report: HeldOutReport,
    max_steps: int,
    *,
    sanity: int = -1,
    ckpt: str | None = None,
    module: L.LightningModule | None = None,
    logger: Any = False,
    accelerator: str = "cpu",
    devices: int | str = "auto",
    strategy: str = "auto",
    extra_callbacks: tuple[L.Callback, ...] = (),
) -> None:
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        max_epochs=-1,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=sanity,
        limit_val_batches=1,
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        # the last state at the end of fit too (as the quickstart's FinalCheckpoint): a resume may start
        # where no evaluation ran
        callbacks=[
            report,
            ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True),
            FinalCheckpoint(),
            *extra_callbacks,
        ],
        default_root_dir=str(tmp_path),
    )
    loader = DataLoader(torch.zeros(100), batch_size=1)
    trainer.fit(module or Learner(), loader, DataLoader(torch.zeros(1), batch_size=1), ckpt_path=ckpt)


def test_a_run_ending_between_validations_is_evaluated_once_more(tmp_path: Path, capsys) -> None:
    report = HeldOutReport()
    fit(tmp_path, report, max_steps=3)  # validations due after rollout 2 only
    out = capsys.readouterr().out
    assert report.history == [(0, 0.0), (2, pytest.approx(0.2)), (3, pytest.approx(0.3))]
    assert "held-out strict accuracy after 3 rollouts: 0.300" in out
    assert report.last_line == "held-out strict accuracy: 0.000 -> 0.300 (the base model -> after 3 rollouts)"
    assert (tmp_path / "base_vs_tuned.png").is_file()


class PairedLearner(Learner):
    """Validation outputs carry sample ids, as FlowGRPOModule's do: sample i passes after g rollouts
    when i·g is odd (none at the base model; after 3 rollouts samples 1 and 3 of 0..3)."""

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> dict:
        out = super().validation_step(batch, batch_idx)
        ids = torch.arange(4)
        out["rewards"]["shapes/strict"] = ((ids * self.trainer.global_step) % 2 == 1).float()
        out["sample_ids"] = ids.flip(0)  # any order: rows pair by id, not by position
        return out


def test_the_gain_is_a_paired_difference_with_its_standard_error(tmp_path: Path) -> None:
    report = HeldOutReport()
    fit(tmp_path, report, max_steps=3, module=PairedLearner())
    d = torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=torch.float64)  # tuned − base per sample, by hand
    se = float(d.std(unbiased=True)) / 2.0  # over sqrt(4) samples: 0.2887
    assert report.paired_gain() == (pytest.approx(0.5), pytest.approx(se), 4)
    assert report.last_line == (
        f"held-out strict accuracy: 0.000 -> 0.500 (+0.500 ± {se:.3f}, 4 paired samples; "
        "the base model -> after 3 rollouts)"
    )
    # the base model's per-sample values travel in the checkpoint: a resumed run pairs too
    shutil.copy(tmp_path / "ckpt" / "last.ckpt", tmp_path / "three.ckpt")
    resumed = HeldOutReport()
    fit(tmp_path, resumed, max_steps=4, ckpt=str(tmp_path / "three.ckpt"), module=PairedLearner())
    assert resumed.paired_gain() == (0.0, 0.0, 4)  # i·4 is even: every sample back at its base verdict
    assert resumed.last_line.endswith(
        "0.000 -> 0.000 (+0.000 ± 0.000, 4 paired samples; the base model -> after 4 rollouts)"
    )


class _Records(L.LightningDataModule):
    """The loaders of ``fit`` plus the ``val_records`` a prompt data module holds (sample id i is
    record i % 4)."""

    val_records: ClassVar[list[dict[str, str]]] = [{"tag": "a"}, {"tag": "b"}, {"tag": "a"}, {"tag": "b"}]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.zeros(100), batch_size=1)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(torch.zeros(1), batch_size=1)


def test_the_accuracy_is_split_by_the_records_field(tmp_path: Path, capsys) -> None:
    report = HeldOutReport()
    trainer = L.Trainer(
        max_steps=3,
        max_epochs=-1,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=-1,
        limit_val_batches=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[report],
        default_root_dir=str(tmp_path),
    )
    trainer.fit(PairedLearner(), datamodule=_Records())
    # PairedLearner: after g rollouts the sample at position i passes when i·g is odd, and positions
    # carry ids 3 − i: after 3 rollouts ids 2 and 0 pass, both tagged a (tags a, b, a, b by id).
    assert report.group_history == [
        (0, {"a": 0.0, "b": 0.0}),
        (2, {"a": 0.0, "b": 0.0}),
        (3, {"a": 1.0, "b": 0.0}),
    ]
    assert (
        "by tag (the base model -> after 3 rollouts): a 0.00 -> 1.00, b 0.00 -> 0.00"
        in capsys.readouterr().out
    )
    assert trainer.callback_metrics["val-aux/shapes/strict/a/mean@1"] == pytest.approx(1.0)
    assert HeldOutReport(group_by=None)._group_means(trainer, torch.zeros(4)) == {}
    # the split travels with the rest of the report's state
    resumed = HeldOutReport()
    resumed.load_state_dict(report.state_dict())
    assert resumed.group_history == report.group_history


def test_a_run_ending_on_a_validation_is_evaluated_once(tmp_path: Path) -> None:
    report = HeldOutReport()
    fit(tmp_path, report, max_steps=4)
    assert [n for n, _ in report.history] == [0, 2, 4]
    assert report.last_line.endswith("0.000 -> 0.400 (the base model -> after 4 rollouts)")


def test_the_last_line_says_what_was_not_evaluated(tmp_path: Path) -> None:
    off = HeldOutReport(evaluate_after_training=False)
    fit(tmp_path / "off", off, max_steps=3)
    assert off.last_line == (
        "held-out strict accuracy of the base model: 0.000; the tuned model (after 3 rollouts) was not "
        "evaluated: HeldOutReport's evaluate_after_training is off; the last evaluation, after 2 rollouts: 0.200"
    )
    assert not (tmp_path / "off" / "base_vs_tuned.png").exists()  # no tuned samples to show

    no_base = HeldOutReport()
    fit(tmp_path / "no_base", no_base, max_steps=3, sanity=0)
    assert no_base.last_line == (
        "held-out strict accuracy of the base model: not evaluated (no validation before training; "
        "--trainer.num_sanity_val_steps=-1 runs one); after 3 rollouts: 0.300"
    )
    for line in (off.last_line, no_base.last_line):
        assert " -> " not in line


def test_a_resumed_run_keeps_the_base_value_from_the_checkpoint(tmp_path: Path) -> None:
    fit(tmp_path, HeldOutReport(), max_steps=2)
    two = tmp_path / "two.ckpt"
    shutil.copy(tmp_path / "ckpt" / "last.ckpt", two)

    resumed = HeldOutReport()
    fit(tmp_path, resumed, max_steps=3, ckpt=str(two))
    assert resumed.base == (0.0, 4)
    assert resumed.last_line.endswith(": 0.000 -> 0.300 (the base model -> after 3 rollouts)")

    # a resume with nothing left to do: the checkpoint's model was evaluated after its 2 rollouts
    idle = HeldOutReport()
    fit(tmp_path, idle, max_steps=2, ckpt=str(two))
    assert idle.last_line.endswith(": 0.000 -> 0.200 (the base model -> after 2 rollouts)")

    # ... and one whose checkpoint's model was not evaluated: said, rather than "0.000 -> 0.000"
    fit(tmp_path / "off", HeldOutReport(evaluate_after_training=False), max_steps=3)
    idle = HeldOutReport(evaluate_after_training=False)
    fit(tmp_path / "off", idle, max_steps=3, ckpt=str(tmp_path / "off" / "ckpt" / "last.ckpt"))
    assert idle.last_line == (
        "held-out strict accuracy of the base model: 0.000; no rollout ran in this session: the checkpoint "
        "already had 3 rollouts (raise --trainer.max_steps to train on), and the model was not evaluated "
        "after them; the last evaluation, after 2 rollouts: 0.200"
    )

    # a checkpoint without the base value (written before it was kept)
    old = torch.load(two, weights_only=False)
    (key,) = [k for k in old["callbacks"] if "HeldOutReport" in k]
    old["callbacks"][key] = {"history": [(0, 0.0), (1, 0.2)], "rollouts": 2}
    torch.save(old, tmp_path / "old.ckpt")
    unknown = HeldOutReport()
    fit(tmp_path, unknown, max_steps=3, ckpt=str(tmp_path / "old.ckpt"))
    assert unknown.last_line == (
        "held-out strict accuracy of the base model: not known (the checkpoint this run resumed from "
        "holds none); after 3 rollouts: 0.300"
    )


# -- a proxy beside the tracked component ------------------------------------------------------------


class ProxyLearner(Learner):
    """Validation also scores a proxy, 0.5 + 0.2 × rollouts on 3 of the 4 samples (one unscored), so
    the gap to strict (0.1 × rollouts) is 0.5 + 0.1 × rollouts over the 3 samples both scored."""

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> dict:
        out = super().validation_step(batch, batch_idx)
        proxy = torch.full((4,), 0.5 + 0.2 * self.trainer.global_step)
        proxy[3] = math.nan
        out["rewards"]["shapes_color"] = proxy
        return out


def test_a_proxy_is_reported_and_its_gap_logged(tmp_path: Path, capsys) -> None:
    report = HeldOutReport(proxy="shapes_color")
    assert report.gap_key == "val-aux/shapes_color_gap/mean@1"
    logger = CSVLogger(str(tmp_path), name="run")
    fit(tmp_path, report, max_steps=3, module=ProxyLearner(), logger=logger)
    out = capsys.readouterr().out

    want = [(0, 0.5, 0.5), (2, 0.9, 0.7), (3, 1.1, 0.8)]  # (rollouts, proxy mean, gap)
    assert [n for n, _, _ in report.proxy_history] == [n for n, _, _ in want]
    # The stand-in's scores are fp32 (one rounding each, 2^-24 relative), averaged in fp64.
    for got, (_, proxy, gap) in zip(report.proxy_history, want, strict=True):
        assert got[1:] == (pytest.approx(proxy, rel=1e-7), pytest.approx(gap, rel=1e-7))
    assert "held-out strict accuracy of the base model: 0.000; shapes_color: 0.500 (gap +0.500)" in out
    assert "held-out strict accuracy after 3 rollouts: 0.300; shapes_color: 1.100 (gap +0.800)" in out
    assert report.last_line == "held-out strict accuracy: 0.000 -> 0.300 (the base model -> after 3 rollouts)"
    assert (
        "shapes_color: 0.500 -> 1.100, its gap to held-out strict accuracy: +0.500 -> +0.800 "
        "(the base model -> after 3 rollouts)" in out
    )

    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get(report.gap_key)]
    # The base's at step 0, the others through Lightning's fp32 result collection: one more rounding.
    assert [float(r[report.gap_key]) for r in rows] == [
        0.5, pytest.approx(0.7, rel=2e-7), pytest.approx(0.8, rel=2e-7)
    ]  # fmt: skip


def test_a_proxy_must_differ_from_the_tracked_component() -> None:
    with pytest.raises(ValueError, match="must differ"):
        HeldOutReport(proxy="shapes/strict")


def test_the_picture_is_drawn_under_two_process_ddp(tmp_path: Path, capfd, monkeypatch) -> None:
    """Rank 0 draws the picture and says the last line; the folder is asked for on every rank, since
    Lightning's ``trainer.log_dir`` is a collective. Asked on rank 0 alone (it was), rank 0's broadcast
    found the other rank gone: the run failed at its end (gloo) or drew nothing (two GPUs)."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    fit(
        tmp_path, HeldOutReport(), max_steps=2, module=PairedLearner(), devices=2, strategy="ddp_spawn",
        extra_callbacks=(CloseProcessGroup(),),
    )  # fmt: skip
    assert (tmp_path / "base_vs_tuned.png").is_file()
    out = capfd.readouterr().out
    # i·2 is even: every sample back at its base verdict (4 samples, each validated on both ranks)
    assert out.count("held-out strict accuracy: 0.000 -> 0.000 (+0.000 ± 0.000, 4 paired samples;") == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_picture_is_drawn_from_samples_on_a_gpu(tmp_path: Path) -> None:
    # One GPU whatever the host has: the subject is samples on a CUDA device, not the number of
    # processes (two processes: the test above). With devices left to Lightning, a host with two GPUs
    # starts DDP by running this pytest session again as rank 1.
    report = HeldOutReport()
    fit(tmp_path, report, max_steps=2, module=PairedLearner(), accelerator="cuda", devices=1)
    assert report.paired_gain() is not None
    assert (tmp_path / "base_vs_tuned.png").is_file()  # failed before: CUDA samples cannot become numpy
