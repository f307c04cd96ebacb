"""Signs of over-optimisation in the samples: diversity within each group and drift from the base model.

:class:`OverOptimizationMonitor` feeds the images the steps return (:mod:`lit_flowgrpo.step_output`)
and the batches' ids to the metrics of :mod:`lit_flowgrpo.diversity`:

- ``rollout/diversity``, every rollout: the mean pairwise distance between the samples of each prompt
  group (``batch.group_ids``), averaged over groups, all ranks;
- ``val-aux/diversity``, every validation: the same over the seeds of each validation prompt (with
  ``--data.init_args.val_seeds`` of 2 or more; validation's fixed seeds make it comparable between validations);
- ``val-aux/drift``, every validation after the base model's: the mean distance of each validation
  sample from the base model's sample of the same prompt and seed (``batch.sample_ids``).

Videos (``(B, F, 3, H, W)``, a :class:`~lit_flowgrpo.policies.wan.WanPolicy` run or the toy video
world) go through the same features frame by frame, and each video's frame features are joined in
frame order: two clips of the same frames in another order differ, so the distances see the motion.

The base model's validation is the one that runs before any optimizer step (the sanity check of
``--trainer.num_sanity_val_steps=-1``). Its features are gathered from every rank and kept on the CPU
(3·16·16 fp32 numbers a sample by default: 3 MB for the quickstart's 1000) and in the callback's
checkpoint state, so a resumed run keeps measuring against the same base. Lightning drops what is
logged during the sanity check, so the base values (drift 0 by definition) are written at step 0,
as :class:`~lit_flowgrpo.toy.report.HeldOutReport` writes the base accuracy.

Training keys go straight to the loggers at the rollout step, as ``RLThroughputMonitor``'s do (its
module docstring says why); validation keys through ``pl_module.log``, beside the module's own.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torchmetrics.utilities.distributed import gather_all_tensors
from typing_extensions import override

from lit_flowgrpo.callbacks._lightning import rollout_step, should_log
from lit_flowgrpo.callbacks._module import as_mapping, image_size
from lit_flowgrpo.distributed import DataParallel
from lit_flowgrpo.diversity import Distance, GroupDiversity, ReferenceDrift, pooled_pixels


class OverOptimizationMonitor(Callback):
    """Log the within-group diversity of rollouts and validations and the validation's drift from the base.

    Args:
        features: ``images (B, 3, H, W) in [0, 1] -> (B, D)`` features to compare (a CLIP or DINO
            image embedding, say); ``None``: :func:`~lit_flowgrpo.diversity.pooled_pixels` at
            ``pool_size``, which needs no model. A video's features are its frames', joined.
        pool_size: side of the pooled grid of the default features (``None``: every pixel).
        distance: ``"mse"`` (mean squared difference per feature) or ``"cosine"`` (1 − cos; the
            usual choice for embeddings).
        rollout: log ``rollout/diversity`` on every rollout.
        validation: log ``val-aux/diversity`` and ``val-aux/drift`` on every validation.
    """

    def __init__(
        self,
        features: Callable[[Tensor], Tensor] | None = None,
        pool_size: int | None = 16,
        distance: Distance = "mse",
        rollout: bool = True,
        validation: bool = True,
    ) -> None:
        if pool_size is not None and pool_size < 1:
            raise ValueError(f"pool_size ({pool_size}) must be at least 1, or null to keep every pixel")
        if distance not in ("mse", "cosine"):
            raise ValueError(f"distance {distance!r} must be 'mse' or 'cosine'")
        self.features = features
        self.pool_size = pool_size
        self.distance = distance
        self.rollout = rollout
        self.validation = validation
        self._train: GroupDiversity | None = None
        self._val: GroupDiversity | None = None
        self._drift = ReferenceDrift(distance)
        self._recording: list[tuple[Tensor, Tensor]] | None = None
        self._dtype = torch.float32
        self._warned = False

    def _features(self, images: Tensor) -> Tensor:
        """(B, D) features of (B, 3, H, W) images, or (B, F·D) of (B, F, 3, H, W) videos."""
        if images.ndim == 5:
            return self._features(images.flatten(0, 1)).reshape(images.shape[0], -1)
        if self.features is None:
            return pooled_pixels(images, self.pool_size)
        return self.features(images)

    def _metrics(
        self, pl_module: LightningModule, features: Tensor | None = None, validation: bool | None = None
    ) -> None:
        """Build the metrics once the feature length is known: from the sampler's sizes (a blank
        probe through the extractor) or else from the first batch's ``features``, which are
        validation's where ``validation`` says so (``None``: build both). Every rank builds them
        alike, so their states gather. Rollout and validation clips may differ in length
        (``eval_frames``), and a video's feature length with them."""
        sampler = getattr(pl_module, "sampler", None)
        for val in (False, True) if validation is None else (validation,):
            if (self._val if val else self._train) is not None:
                continue
            found = features
            if found is None:
                size = image_size(pl_module)
                if size is None:
                    continue
                if val and getattr(sampler, "eval_size", None) is not None:
                    size = tuple(sampler.eval_size)
                frames = getattr(sampler, "eval_frame_count", None) if val else None
                frames = getattr(sampler, "frames", 1) if frames is None else frames
                frames = frames if isinstance(frames, int) and frames >= 1 else 1
                probe = (1, frames, 3, *size) if frames > 1 else (1, 3, *size)
                with torch.no_grad():
                    found = self._features(torch.zeros(probe, device=pl_module.device))
            self._dtype = found.dtype  # what an empty rank sends in the base's gather
            prefix = "val-aux/" if val else "rollout/"
            metric = GroupDiversity(int(found.shape[1]), self.distance, prefix=prefix).to(pl_module.device)
            if val:
                self._val = metric
            else:
                self._train = metric
        self._drift = self._drift.to(pl_module.device)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._metrics(pl_module)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._metrics(pl_module)

    # -- rollouts ---------------------------------------------------------------------------------

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        images = as_mapping(outputs).get("images")
        group_ids = getattr(batch, "group_ids", None)
        if not self.rollout or images is None or group_ids is None:
            return
        with torch.no_grad():
            features = self._features(images)
        self._metrics(pl_module, features, validation=False)
        assert self._train is not None
        self._train.update(features, group_ids)
        value = float(_compute(self._train)["diversity"])  # a collective: every rank gets here
        self._train.reset()
        step = rollout_step(trainer)
        if trainer.is_global_zero and should_log(trainer, step) and not math.isnan(value):
            for logger in trainer.loggers:
                logger.log_metrics({"rollout/diversity": value}, step=step)

    # -- validation -------------------------------------------------------------------------------

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._val is not None:
            self._val.reset()
        self._drift.reset()
        # The base model's validation: no optimizer step yet, and no base kept from an earlier one.
        base = not self._drift.has_reference and trainer.global_step == 0
        self._recording = [] if self.validation and base else None

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
        images = as_mapping(outputs).get("images")
        if not self.validation or images is None:
            return
        with torch.no_grad():
            features = self._features(images)
        self._metrics(pl_module, features, validation=True)
        assert self._val is not None
        group_ids, sample_ids = getattr(batch, "group_ids", None), getattr(batch, "sample_ids", None)
        if group_ids is not None:
            self._val.update(features, group_ids)
        if sample_ids is None:
            return
        if self._recording is not None:
            self._recording.append((sample_ids.detach().to(features.device), features.detach()))
        elif self._drift.has_reference:
            self._drift.update(sample_ids, features)

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.validation or self._val is None:
            return
        values = {"val-aux/diversity": float(_compute(self._val)["diversity"])}
        if self._recording is not None:
            self._keep_base(trainer, pl_module)
            values["val-aux/drift"] = 0.0  # the base model against itself
        elif self._drift.has_reference:
            drift = _compute(self._drift)
            values["val-aux/drift"] = float(drift["drift"])
            if drift["unpaired_count"] > 0 and not self._warned:
                self._warned = True
                rank_zero_warn(
                    f"{int(drift['unpaired_count'])} validation samples have no base-model sample to "
                    "compare with: val-aux/drift averages the others. The base validation ran on fewer "
                    "samples (--trainer.num_sanity_val_steps=-1 runs them all) or the validation set changed"
                )
        elif not self._warned:
            self._warned = True
            rank_zero_warn(
                "val-aux/drift is not logged: the base model was not validated before training "
                "(--trainer.num_sanity_val_steps=-1 does it)"
            )
        values = {k: v for k, v in values.items() if not math.isnan(v)}  # NaN: no pair (one seed)
        if trainer.sanity_checking:
            if trainer.is_global_zero:  # Lightning drops what is logged during the sanity check
                for logger in trainer.loggers:
                    logger.log_metrics(values, step=0)
        else:
            for key, value in values.items():
                pl_module.log(key, value, on_step=False, on_epoch=True)

    def _keep_base(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Gather the base validation's (ids, features) from every rank and keep them all on the CPU."""
        parts = self._recording or []
        self._recording = None
        device = pl_module.device
        ids = torch.cat([i for i, _ in parts]) if parts else torch.zeros(0, dtype=torch.long, device=device)
        assert self._val is not None
        if parts:
            features = torch.cat([f for _, f in parts])
        else:
            features = torch.zeros(0, self._val.num_features, dtype=self._dtype, device=device)
        dp = DataParallel.of(trainer)
        if dp.size > 1:  # over data-parallel peers: a sequence-parallel group holds one copy
            ids = torch.cat(gather_all_tensors(ids.to(device).long(), group=dp.group))
            features = torch.cat(gather_all_tensors(features.to(device), group=dp.group))
        self._drift.set_reference(ids.cpu(), features.cpu())

    # -- checkpoint -------------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        if not self._drift.has_reference:
            return {}
        return {"base_ids": self._drift.reference_ids, "base_features": self._drift.reference_features}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "base_ids" in state_dict:
            self._drift.set_reference(state_dict["base_ids"], state_dict["base_features"])


def _compute(metric: Any) -> dict[str, Tensor]:
    # A rank that saw no sample still joins the gather: its empty states are the right shape.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*compute.*before.*update.*")
        return metric.compute()
