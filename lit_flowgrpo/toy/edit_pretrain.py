"""Pretraining of the toy editing model with flow matching on editing pairs, as Lightning parts.

``lit-flowgrpo fit --config configs/toy_edit_pretrain.yaml`` trains a :class:`EditPretrainModule` on
:class:`EditPairsDataModule` and, at the end, writes the checkpoint that
:class:`~lit_flowgrpo.toy.edit_policy.ToyEditPolicy` loads. The objective, the prompt dropout, the EMA
and the export are the image toy's (:class:`~lit_flowgrpo.toy.pretrain.ToyPretrainModule`); the
network also sees the source image, and the regression target is the edited scene.

Each pair is drawn fresh (:func:`lit_flowgrpo.toy.edit_world.sample_edit_record`): a source scene, an
instruction, the target computed from both, both rendered. The shipped held-out sources come from a
seed of their own, so they are never among these.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset

from lit_flowgrpo.toy import edit_world, world
from lit_flowgrpo.toy.edit_model import (
    EDIT_PRETRAIN_COMMAND,
    build_edit_models,
    load_edit_checkpoint,
    predict_edit_velocity,
    save_edit_checkpoint,
)
from lit_flowgrpo.toy.model import ToyModelConfig
from lit_flowgrpo.toy.pretrain import RenderedDataModule, ToyPretrainModule, stream_rng


def _pixels(image: np.ndarray) -> Tensor:
    """(3, H, W) fp32 in [-1, 1] from an (H, W, 3) uint8 render."""
    return torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).float() / 127.5 - 1.0


class EditPairsDataset(IterableDataset):
    """An endless stream of freshly drawn editing pairs: ``source`` and ``pixels`` (the target), each
    (3, 32, 32) in [-1, 1], and the instruction as ``prompt``.

    Args:
        seed: base seed of the stream (per rank and data-loader worker, as the image toy's).
        rank: this process's rank.
        kind_weights: relative weight of each edit kind (:data:`edit_world.KIND_WEIGHTS` when ``None``).
    """

    def __init__(self, seed: int = 0, rank: int = 0, kind_weights: Mapping[str, float] | None = None) -> None:
        self.seed, self.rank = seed, rank
        weights = dict(kind_weights or edit_world.KIND_WEIGHTS)
        self.kinds = [k for k in edit_world.EDIT_KINDS if weights.get(k, 0) > 0]
        self.p = np.array([weights[k] for k in self.kinds], dtype=np.float64)
        self.p /= self.p.sum()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        rng = stream_rng(self.seed, self.rank)
        while True:
            source = edit_world.sample_source(rng)
            kind = self.kinds[int(rng.choice(len(self.kinds), p=self.p))]
            try:
                edit = edit_world.sample_edit(source, rng, kind)
            except ValueError:  # a move with no room: draw another source
                continue
            target = edit_world.apply_edit(source, edit)
            yield {
                "pixels": _pixels(world.render(target)),
                "source": _pixels(world.render(source)),
                "prompt": edit_world.instruction(edit, source),
            }


class EditPairsDataModule(RenderedDataModule):
    """Rendered (source, instruction, target) triples of the editing world, made on the fly.

    Args:
        batch_size: pairs per step and rank.
        num_workers: data-loader worker processes rendering pairs (0 renders in the main process).
        seed: seed of the pair stream.
        kind_weights: relative weight per edit kind (``recolor``, ``remove``, ``move``); ``None``:
            the world's own (:data:`~lit_flowgrpo.toy.edit_world.KIND_WEIGHTS`).
    """

    def __init__(
        self,
        batch_size: int = 256,
        num_workers: int = 0,
        seed: int = 0,
        kind_weights: dict[str, float] | None = None,
    ) -> None:
        super().__init__(batch_size, num_workers, seed)
        if kind_weights is not None:
            unknown = sorted(set(kind_weights) - set(edit_world.EDIT_KINDS))
            if (
                unknown
                or any(w < 0 for w in kind_weights.values())
                or not any(w > 0 for w in kind_weights.values())
            ):
                raise ValueError(
                    f"--data.init_args.kind_weights ({kind_weights}) must give non-negative weights to edit "
                    f"kinds {list(edit_world.EDIT_KINDS)}, at least one positive"
                    + (f"; unknown: {unknown}" if unknown else "")
                )
        self.kind_weights = kind_weights

    def train_dataloader(self) -> DataLoader:
        rank = self.trainer.global_rank if self.trainer is not None else 0
        return self._loader(EditPairsDataset(self.seed, rank, self.kind_weights))


class EditPretrainModule(ToyPretrainModule):
    """Flow-matching pretraining of the toy editing U-Net and its text encoder.

    Args:
        architecture: the networks' sizes (ignored when ``init_from`` is given).
        init_from: start from this toy editing checkpoint instead of random weights.
        optimizer: the optimizer (AdamW by default).
        warmup_steps: linear learning-rate warm-up; the rate is constant afterwards.
        cfg_dropout: fraction of instructions replaced by the empty one (the source is kept), for
            classifier-free guidance on the instruction.
        sigma_sampling: ``logit_normal`` (SD3's default) or ``uniform`` σ during training.
        logit_mean: mean of the logit-normal.
        logit_std: standard deviation of the logit-normal.
        ema_decay: decay of an exponential moving average of the weights, exported instead of the
            raw weights; ``None`` exports the raw weights.
        export_path: where ``on_train_end`` writes the checkpoint ``ToyEditPolicy`` loads; ``None``
            writes nothing.
        export_every_n_steps: also write ``<export_path stem>_step<N>.safetensors`` every N steps.
        export_dtype: storage dtype of the exported weights (loading casts them back).
    """

    def __init__(
        self,
        architecture: ToyModelConfig | None = None,
        init_from: str | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        warmup_steps: int = 500,
        cfg_dropout: float = 0.1,
        sigma_sampling: Literal["logit_normal", "uniform"] = "logit_normal",
        logit_mean: float = 0.0,
        logit_std: float = 1.0,
        ema_decay: float | None = 0.999,
        export_path: str | None = None,
        export_every_n_steps: int | None = None,
        export_dtype: Literal["float32", "float16", "bfloat16"] = "float16",
    ) -> None:
        super().__init__(
            architecture=architecture,
            init_from=init_from,
            optimizer=optimizer,
            warmup_steps=warmup_steps,
            cfg_dropout=cfg_dropout,
            sigma_sampling=sigma_sampling,
            logit_mean=logit_mean,
            logit_std=logit_std,
            ema_decay=ema_decay,
            export_path=export_path,
            export_every_n_steps=export_every_n_steps,
            export_dtype=export_dtype,
        )
        self._source: Tensor | None = None

    def _build_networks(self, architecture: Any, init_from: str | None) -> tuple[nn.Module, nn.Module]:
        if init_from is not None:
            unet, text_encoder, _ = load_edit_checkpoint(init_from)
            return unet, text_encoder
        return build_edit_models(architecture or ToyModelConfig())

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        # The parent's step encodes the prompts and regresses the velocity; the source rides along in
        # the conditioning it builds (_encode), so the objective stays written once.
        self._source = batch["source"]
        try:
            return super().training_step(batch, batch_idx)
        finally:
            self._source = None

    def _encode(self, net: nn.ModuleDict, prompts: list[str]) -> dict[str, Tensor]:
        embeds = super()._encode(net, prompts)
        if self._source is None:
            raise RuntimeError("EditPretrainModule encodes prompts only inside training_step (with a source)")
        return embeds | {"source": self._source}

    def _velocity(self, unet: nn.Module, noisy: Tensor, sigma: Tensor, embeds: dict[str, Tensor]) -> Tensor:
        return predict_edit_velocity(unet, noisy, sigma, embeds)

    def _save(self, path: str, net: nn.ModuleDict, dtype: torch.dtype, info: dict[str, str]) -> None:
        save_edit_checkpoint(
            path,
            net["unet"],
            net["text_encoder"],
            dtype=dtype,
            info=info | {"made_by": EDIT_PRETRAIN_COMMAND},
        )
