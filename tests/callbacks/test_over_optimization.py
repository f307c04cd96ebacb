"""OverOptimizationMonitor in a real Trainer with a stand-in module: the logged diversity and drift are
the float64 brute force over the very images the steps returned, the base is the validation before any
optimizer step, and a resumed run measures against the same base."""

from __future__ import annotations

import csv
import itertools
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
import torch.distributed as dist
from ddp_helpers import CloseProcessGroup
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, IterableDataset

from lit_flowgrpo.callbacks import OverOptimizationMonitor
from lit_flowgrpo.diversity import pooled_pixels

GROUPS, GROUP_SIZE, VAL_PROMPTS, VAL_SEEDS = 3, 4, 3, 2


def _pattern(ids: torch.Tensor, salt: int) -> torch.Tensor:
    """A fixed (B, 3, 8, 8) image per id, in [0, 1]."""
    gens = [torch.Generator().manual_seed(1000 * salt + int(i)) for i in ids]
    return torch.stack([torch.rand(3, 8, 8, generator=g) for g in gens])


class Batches(IterableDataset):
    """Rollout batches (group_ids, sample_ids as PromptBatch has them), or the validation set; with
    several ranks, each takes every other sample, as GroupSampler and the validation set split them
    (so groups span ranks)."""

    def __init__(self, validation: bool) -> None:
        self.validation = validation

    def __iter__(self):
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        if self.validation:  # prompt k, seed s is sample k + VAL_PROMPTS·s; batches of 4
            ids = torch.arange(VAL_PROMPTS * VAL_SEEDS)[rank::world]
            for part in torch.split(ids, 4):
                yield SimpleNamespace(group_ids=part % VAL_PROMPTS, sample_ids=part)
        else:
            for step in itertools.count():
                ids = torch.arange(GROUPS * GROUP_SIZE)[rank::world]
                yield SimpleNamespace(group_ids=ids // GROUP_SIZE, sample_ids=ids, step=step)


def _identity(batch):
    return batch


class Learner(L.LightningModule):
    """Images that move away from a fixed pattern as the weight ``w`` moves from 0 (one optimizer
    step per rollout); every image it returns is kept for the brute force."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.sampler = SimpleNamespace(height=8, width=8)
        self.rollouts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.validations: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []

    def _images(self, ids: torch.Tensor, salt: int) -> torch.Tensor:
        w = float(self.w.detach())
        return ((1 - w) * _pattern(ids, salt) + w * _pattern(ids, salt + 7)).clamp(0, 1)

    def training_step(self, batch, batch_idx: int) -> dict:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward((self.w - 1).pow(2))
        opt.step()
        images = self._images(batch.sample_ids + 100 * batch.step, salt=1)
        self.rollouts.append((images, batch.group_ids))
        return {"images": images}

    def on_validation_epoch_start(self) -> None:
        self.validations.append([])

    def validation_step(self, batch, batch_idx: int) -> dict:
        images = self._images(batch.sample_ids, salt=2)
        self.validations[-1].append((images, batch.group_ids, batch.sample_ids))
        return {"images": images}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([self.w], lr=0.1)


class VideoLearner(Learner):
    """The same, returning 3-frame clips (B, 3, 3, 8, 8): each frame its own pattern."""

    FRAMES = 3

    def __init__(self) -> None:
        super().__init__()
        self.sampler = SimpleNamespace(height=8, width=8, frames=self.FRAMES)

    def _images(self, ids: torch.Tensor, salt: int) -> torch.Tensor:
        return torch.stack(
            [super(VideoLearner, self)._images(ids, salt + 20 * f) for f in range(self.FRAMES)], 1
        )


class LongValidationLearner(VideoLearner):
    """3-frame rollouts, 5-frame validation clips (the sampler's ``eval_frames``)."""

    EVAL_FRAMES = 5

    def __init__(self) -> None:
        super().__init__()
        self.sampler = SimpleNamespace(
            height=8, width=8, frames=self.FRAMES, eval_size=(8, 8), eval_frame_count=self.EVAL_FRAMES
        )

    def validation_step(self, batch, batch_idx: int) -> dict:
        frames = [Learner._images(self, batch.sample_ids, 2 + 20 * f) for f in range(self.EVAL_FRAMES)]
        images = torch.stack(frames, 1)
        self.validations[-1].append((images, batch.group_ids, batch.sample_ids))
        return {"images": images}


def fit(
    root: Path,
    monitor: OverOptimizationMonitor,
    max_steps: int,
    *,
    sanity: int = -1,
    ckpt: str | None = None,
    devices: int = 1,
    module_class: type[Learner] = Learner,
):
    module = module_class()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp_spawn" if devices > 1 else "auto",
        max_steps=max_steps,
        max_epochs=-1,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=sanity,
        log_every_n_steps=1,
        logger=CSVLogger(str(root), name="run"),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor, ModelCheckpoint(dirpath=str(root / "ckpt"), save_last=True), CloseProcessGroup()],
        default_root_dir=str(root),
    )
    trainer.fit(
        module,
        DataLoader(Batches(False), batch_size=None, collate_fn=_identity),
        DataLoader(Batches(True), batch_size=None, collate_fn=_identity),
        ckpt_path=ckpt,
    )
    (metrics,) = (root / "run").glob("version_*/metrics.csv")  # written by rank 0, spawned or not
    with open(metrics) as f:
        rows = list(csv.DictReader(f))
    return module, rows


def _distance(a: np.ndarray, b: np.ndarray, kind: str) -> float:
    if kind == "mse":
        return float(np.mean((a - b) ** 2))
    return float(1.0 - a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _diversity(features: torch.Tensor, groups: torch.Tensor, kind: str = "mse") -> float:
    """Every ordered pair of every group, float64, averaged per group then over groups."""
    x, g = features.double().numpy(), groups.numpy()
    means = []
    for k in np.unique(g):
        rows = x[g == k]
        means.append(
            np.mean(
                [_distance(rows[i], rows[j], kind) for i, j in itertools.permutations(range(len(rows)), 2)]
            )
        )
    return float(np.mean(means))


def _validation(module: Learner, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    images, groups, ids = (torch.cat(part) for part in zip(*module.validations[index], strict=True))
    return images, groups, ids


def _logged(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]


# fp32 features (pooled once, as the callback does) compared in fp64 both ways: only the order of
# fp64 summation differs, well within 1e-12 relative. The validation keys pass through Lightning's
# result collection, which holds them in fp32: one rounding, 2^-24 < 1e-7 relative.
def test_logged_values_are_the_brute_force_of_the_returned_images(tmp_path: Path) -> None:
    module, rows = fit(tmp_path, OverOptimizationMonitor(pool_size=4), max_steps=4)

    rollouts = _logged(rows, "rollout/diversity")
    assert [s for s, _ in rollouts] == [0, 1, 2, 3]
    for (_, got), (images, groups) in zip(rollouts, module.rollouts, strict=True):
        assert got == pytest.approx(_diversity(pooled_pixels(images, 4), groups), rel=1e-12)

    # Validations: the base (sanity check, logged at step 0), after rollouts 2 and 4.
    assert len(module.validations) == 3
    diversity, drift = _logged(rows, "val-aux/diversity"), _logged(rows, "val-aux/drift")
    assert [s for s, _ in drift] == [0, 1, 3] and drift[0][1] == 0.0
    base_images, _, base_ids = _validation(module, 0)
    base = dict(zip(base_ids.tolist(), pooled_pixels(base_images, 4).double().numpy(), strict=True))
    for k in range(3):
        images, groups, ids = _validation(module, k)
        features = pooled_pixels(images, 4)
        assert diversity[k][1] == pytest.approx(_diversity(features, groups), rel=1e-7)
        want = np.mean(
            [
                _distance(f, base[i], "mse")
                for i, f in zip(ids.tolist(), features.double().numpy(), strict=True)
            ]
        )
        assert drift[k][1] == pytest.approx(want, rel=1e-7, abs=0.0)
    assert drift[2][1] > drift[1][1] > 0  # the images move away from the base as w moves


def test_a_resumed_run_measures_against_the_base_in_its_checkpoint(tmp_path: Path) -> None:
    first, _ = fit(tmp_path, OverOptimizationMonitor(pool_size=None), max_steps=2)
    two = tmp_path / "two.ckpt"
    shutil.copy(tmp_path / "ckpt" / "last.ckpt", two)
    base_images, _, base_ids = _validation(first, 0)

    # No sanity check on resume: the base comes from the checkpoint alone.
    resumed, rows = fit(
        tmp_path / "again", OverOptimizationMonitor(pool_size=None), 4, sanity=0, ckpt=str(two)
    )
    images, _, ids = _validation(resumed, -1)
    assert torch.equal(ids, base_ids)
    want = np.mean(((images - base_images).double().flatten(1).numpy()) ** 2, axis=1).mean()
    assert _logged(rows, "val-aux/drift")[-1][1] == pytest.approx(want, rel=1e-7)


def test_without_a_base_validation_drift_is_not_logged_and_it_says_why(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="num_sanity_val_steps=-1"):
        _, rows = fit(tmp_path, OverOptimizationMonitor(), max_steps=2, sanity=0)
    assert not _logged(rows, "val-aux/drift")
    assert _logged(rows, "val-aux/diversity") and _logged(rows, "rollout/diversity")


def test_a_feature_hook_and_cosine(tmp_path: Path) -> None:
    def features(images: torch.Tensor) -> torch.Tensor:  # a stand-in embedding: channel means and maxima
        return torch.cat([images.mean(dim=(2, 3)), images.amax(dim=(2, 3))], dim=1)

    module, rows = fit(tmp_path, OverOptimizationMonitor(features=features, distance="cosine"), max_steps=2)
    (_, got), *_ = _logged(rows, "rollout/diversity")
    images, groups = module.rollouts[0]
    assert got == pytest.approx(_diversity(features(images), groups, "cosine"), rel=1e-9)
    assert all(math.isfinite(v) for _, v in _logged(rows, "val-aux/drift"))


def test_videos_compare_their_frames_in_order(tmp_path: Path) -> None:
    """Videos: each clip's per-frame features joined in frame order, the same brute force over them."""
    module, rows = fit(tmp_path, OverOptimizationMonitor(pool_size=4), max_steps=2, module_class=VideoLearner)

    def joined(videos: torch.Tensor) -> torch.Tensor:
        return torch.cat([pooled_pixels(videos[:, f], 4) for f in range(videos.shape[1])], dim=1)

    (_, got), *_ = _logged(rows, "rollout/diversity")
    videos, groups = module.rollouts[0]
    assert videos.shape[1:] == (3, 3, 8, 8)
    assert got == pytest.approx(_diversity(joined(videos), groups), rel=1e-12)
    drift = _logged(rows, "val-aux/drift")
    assert drift[0][1] == 0.0 and drift[-1][1] > 0
    # Frame order counts: a clip played backwards is another clip.
    monitor = OverOptimizationMonitor(pool_size=4)
    forward, backward = monitor._features(videos), monitor._features(videos.flip(1))
    assert forward.shape == (len(videos), 3 * 3 * 4 * 4) and not torch.equal(forward, backward)


def test_validation_clips_may_be_longer_than_the_rollouts(tmp_path: Path) -> None:
    """eval_frames: rollout and validation features have their own lengths, each probed at fit start."""
    module, rows = fit(
        tmp_path, OverOptimizationMonitor(pool_size=4), max_steps=2, module_class=LongValidationLearner
    )

    def joined(videos: torch.Tensor) -> torch.Tensor:
        return torch.cat([pooled_pixels(videos[:, f], 4) for f in range(videos.shape[1])], dim=1)

    (_, got), *_ = _logged(rows, "rollout/diversity")
    videos, groups = module.rollouts[0]
    assert videos.shape[1] == 3 and got == pytest.approx(_diversity(joined(videos), groups), rel=1e-12)
    images, groups, _ = _validation(module, -1)
    assert images.shape[1] == 5
    (*_, (_, last)) = _logged(rows, "val-aux/diversity")
    assert last == pytest.approx(_diversity(joined(images), groups), rel=1e-7)
    assert _logged(rows, "val-aux/drift")[-1][1] > 0


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="pool_size"):
        OverOptimizationMonitor(pool_size=0)
    with pytest.raises(ValueError, match="distance"):
        OverOptimizationMonitor(distance="l2")  # type: ignore[arg-type]


# slow: each spawned rank imports the package afresh (seconds)
@pytest.mark.slow
def test_two_ranks_log_what_one_process_logs(tmp_path: Path) -> None:
    # The same images (a function of each sample's id and the weight, equal on every rank after the
    # gradient all-reduce), split over two gloo ranks: groups, the validation set and the base
    # features gathered from both. Only fp64 summation order differs: 1e-12; validation keys pass
    # through Lightning's fp32 result collection, whose one rounding each run may fall either side of.
    _, one = fit(tmp_path / "one", OverOptimizationMonitor(pool_size=4), max_steps=4)
    _, two = fit(tmp_path / "two", OverOptimizationMonitor(pool_size=4), max_steps=4, devices=2)
    for key, rel in (("rollout/diversity", 1e-12), ("val-aux/diversity", 2e-7), ("val-aux/drift", 2e-7)):
        want, got = _logged(one, key), _logged(two, key)
        assert [s for s, _ in got] == [s for s, _ in want] and len(want) >= 3, key
        for (_, g), (_, w) in zip(got, want, strict=True):
            assert g == pytest.approx(w, rel=rel, abs=0.0), key
