"""Pretraining of the toy video model with flow matching, as Lightning parts.

``lit-flowgrpo fit --config configs/toy_video_pretrain.yaml`` trains a :class:`ToyVideoPretrainModule`
on :class:`ToyVideoDataModule` (freshly rendered clips of the video world's TRAIN prompts) and, at the
end, writes the checkpoint that :class:`~lit_flowgrpo.toy.video_policy.ToyVideoPolicy` loads. The
objective, the prompt dropout for classifier-free guidance, the EMA and the export are the image
toy's (:class:`~lit_flowgrpo.toy.pretrain.ToyPretrainModule`); only the networks and the data differ.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset

from lit_flowgrpo.toy import video_world
from lit_flowgrpo.toy.pretrain import RenderedDataModule, ToyPretrainModule, stream_rng
from lit_flowgrpo.toy.video_model import (
    VIDEO_PRETRAIN_COMMAND,
    ToyVideoModelConfig,
    build_video_models,
    load_video_checkpoint,
    predict_video_velocity,
    save_video_checkpoint,
)


class ToyVideoDataset(IterableDataset):
    """An endless stream of freshly drawn clips (F, 3, size, size) in [-1, 1] for the given records.

    Every item picks a record uniformly, draws a new trajectory (:func:`video_world.sample_trajectory`)
    and renders it, so the model never sees the same clip twice. Streams differ per data-loader worker
    and per rank, and are reproducible from ``seed``.
    """

    def __init__(
        self, records: Sequence[Mapping[str, Any]], frames: int, size: int, seed: int = 0, rank: int = 0
    ) -> None:
        if not records:
            raise ValueError("the toy video pretraining needs at least one prompt record")
        self.records, self.frames, self.size, self.seed, self.rank = list(records), frames, size, seed, rank

    def __iter__(self) -> Iterator[dict[str, Any]]:
        rng = stream_rng(self.seed, self.rank)
        while True:
            record = self.records[int(rng.integers(len(self.records)))]
            clip = video_world.render_video(
                video_world.sample_trajectory(record, rng, self.frames), self.size
            )
            pixels = torch.from_numpy(np.ascontiguousarray(clip)).permute(0, 3, 1, 2).float() / 127.5 - 1.0
            yield {"pixels": pixels, "prompt": record["prompt"]}  # pixels (F, 3, H, W)


class ToyVideoDataModule(RenderedDataModule):
    """Rendered (clip, prompt) pairs of the video world's TRAIN prompts, made on the fly.

    Only the train list (:func:`video_world.video_split`) is used, so the held-out compositions stay
    unseen. The clips' frame count and size are the model's (its architecture or the checkpoint it
    starts from): one owner, so data and network cannot disagree.

    Args:
        batch_size: clips per step and rank.
        num_workers: data-loader worker processes rendering clips (0 renders in the main process).
        seed: seed of the clip stream.
    """

    def __init__(self, batch_size: int = 32, num_workers: int = 0, seed: int = 0) -> None:
        super().__init__(batch_size, num_workers, seed)
        self.records = video_world.video_split()[0]

    def train_dataloader(self) -> DataLoader:
        module = self.trainer.lightning_module
        if not isinstance(module, ToyVideoPretrainModule):
            raise ValueError(
                f"ToyVideoDataModule feeds ToyVideoPretrainModule, not {type(module).__name__}: set --model "
                "to lit_flowgrpo.toy.video_pretrain.ToyVideoPretrainModule"
            )
        config = module.net["unet"].config
        dataset = ToyVideoDataset(
            self.records,
            int(config.frames),
            int(config.sample_size),
            self.seed,
            rank=self.trainer.global_rank,
        )
        return self._loader(dataset)


class ToyVideoPretrainModule(ToyPretrainModule):
    """Flow-matching pretraining of the toy video network and its text encoder.

    Args:
        architecture: the networks' sizes and the clips' frames and size (ignored when ``init_from``
            is given).
        init_from: start from this toy video checkpoint instead of random weights.
        optimizer: the optimizer (AdamW by default).
        warmup_steps: linear learning-rate warm-up; the rate is constant afterwards.
        cfg_dropout: fraction of prompts replaced by the empty prompt.
        sigma_sampling: ``logit_normal`` (SD3's default) or ``uniform`` σ during training.
        logit_mean: mean of the logit-normal.
        logit_std: standard deviation of the logit-normal.
        ema_decay: decay of an exponential moving average of the weights, exported instead of the
            raw weights; ``None`` exports the raw weights.
        export_path: where ``on_train_end`` writes the checkpoint ``ToyVideoPolicy`` loads; ``None``
            writes nothing.
        export_every_n_steps: also write ``<export_path stem>_step<N>.safetensors`` every N steps.
        export_dtype: storage dtype of the exported weights (loading casts them back).
    """

    def __init__(
        self,
        architecture: ToyVideoModelConfig | None = None,
        init_from: str | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        warmup_steps: int = 100,
        cfg_dropout: float = 0.1,
        sigma_sampling: Literal["logit_normal", "uniform"] = "logit_normal",
        logit_mean: float = 0.0,
        logit_std: float = 1.0,
        ema_decay: float | None = 0.99,
        export_path: str | None = None,
        export_every_n_steps: int | None = None,
        export_dtype: Literal["float32", "float16", "bfloat16"] = "float16",
    ) -> None:
        super().__init__(
            architecture=architecture,  # type: ignore[arg-type]
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

    def _build_networks(self, architecture: Any, init_from: str | None) -> tuple[nn.Module, nn.Module]:
        if init_from is not None:
            net, text_encoder, _ = load_video_checkpoint(init_from)
            return net, text_encoder
        return build_video_models(architecture or ToyVideoModelConfig())

    def _velocity(self, unet: nn.Module, noisy: Tensor, sigma: Tensor, embeds: dict[str, Tensor]) -> Tensor:
        return predict_video_velocity(unet, noisy, sigma, embeds)

    def _save(self, path: str, net: nn.ModuleDict, dtype: torch.dtype, info: dict[str, str]) -> None:
        save_video_checkpoint(
            path,
            net["unet"],
            net["text_encoder"],
            dtype=dtype,
            info=info | {"made_by": VIDEO_PRETRAIN_COMMAND},
        )
