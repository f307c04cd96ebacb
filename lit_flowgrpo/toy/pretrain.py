"""Pretraining of the toy base model with flow matching, as Lightning parts.

``lit-flowgrpo fit --config configs/toy_pretrain.yaml`` trains a :class:`ToyPretrainModule` on
:class:`ToyShapesDataModule` and, at the end, writes the checkpoint that ``ToyPolicy`` loads.

The objective is rectified flow / flow matching as SD3 trains it (Esser et al. 2024, eq. 1–3 with
the "rf" parametrisation): x_σ = (1 − σ)·x0 + σ·ε and the network regresses the velocity ε − x0,
with σ drawn from a logit-normal (their §3.1, "lognorm(0, 1)") or uniformly. A fraction of the
prompts is replaced by the empty prompt so the same network also learns the unconditional velocity
that classifier-free guidance needs (Ho & Salimans 2022, §3.2; 10% as in their experiments).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lit_flowgrpo.toy import world
from lit_flowgrpo.toy.model import (
    PRETRAIN_COMMAND,
    ToyModelConfig,
    build_models,
    load_checkpoint,
    predict_velocity,
    save_checkpoint,
)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ToyShapesDataset(IterableDataset):
    """An endless stream of freshly rendered scenes for the given records.

    Every item picks a record (weighted by family if asked), draws a new scene that satisfies it
    and renders it, so the model never sees the same image twice. Streams differ per data-loader
    worker and per rank, and are reproducible from ``seed``.

    Args:
        records: the prompt records to draw from (the world's train list).
        seed: base seed of the stream.
        family_weights: relative weight of each family (``tag``); records of a family absent from
            the mapping are never drawn. ``None`` draws records uniformly.
        rank: this process's rank (set by the data module), so ranks see different scenes.
        flip_prob: probability that a scene is mirrored left to right with its caption unchanged.
        swap_colors_prob: probability that the colours a caption binds to two objects are drawn the
            other way round (the caption unchanged).
        relation_noise_prob: probability that the objects of a caption naming a relation are placed
            as if none were named (the caption unchanged).
        count_noise_prob: probability that a counting caption's objects are drawn in another number,
            one of the world's other counts (the caption unchanged).
    """

    def __init__(
        self,
        records: Sequence[Mapping[str, Any]],
        seed: int = 0,
        family_weights: Mapping[str, float] | None = None,
        rank: int = 0,
        flip_prob: float = 0.0,
        swap_colors_prob: float = 0.0,
        relation_noise_prob: float = 0.0,
        count_noise_prob: float = 0.0,
    ) -> None:
        self.records = list(records)
        self.seed = seed
        self.rank = rank
        self.probs = _record_probs(self.records, family_weights)
        self.flip_prob = flip_prob
        self.swap_colors_prob = swap_colors_prob
        self.relation_noise_prob = relation_noise_prob
        self.count_noise_prob = count_noise_prob

    def __iter__(self) -> Iterator[dict[str, Any]]:
        rng = stream_rng(self.seed, self.rank)
        while True:
            record = self.records[rng.choice(len(self.records), p=self.probs)]
            drawn = record
            # The relation and count draws only where their probability is set and the record has
            # what they change; the swap and flip draws wherever theirs is set. A clean stream stays
            # what it was.
            if self.relation_noise_prob and has_relation(record) and rng.random() < self.relation_noise_prob:
                drawn = without_relation(drawn)
            if self.count_noise_prob and is_counting(record) and rng.random() < self.count_noise_prob:
                drawn = with_other_count(drawn, rng)
            scene = world.sample_scene(drawn, rng)
            if self.swap_colors_prob and rng.random() < self.swap_colors_prob:
                scene = swap_bound_colors(drawn, scene)
            image = world.render(scene)  # (H, W, 3) uint8
            if self.flip_prob and rng.random() < self.flip_prob:
                image = image[:, ::-1]
            pixels = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).float() / 127.5 - 1.0
            yield {"pixels": pixels, "prompt": record["prompt"]}


def swap_bound_colors(record: Mapping[str, Any], scene: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The scene with the colours of the record's two coloured entries exchanged.

    ``scene`` lists the objects in the record's ``include`` order, ``count`` per entry (as
    :func:`world.sample_scene` draws them). Records with fewer than two coloured entries come back
    unchanged: there is no binding to get wrong.
    """
    coloured = [i for i, entry in enumerate(record["include"]) if "color" in entry]
    if len(coloured) < 2:
        return scene
    a, b = coloured[:2]
    swap = {record["include"][a]["color"]: record["include"][b]["color"]}
    swap[record["include"][b]["color"]] = record["include"][a]["color"]
    entry_of = [i for i, entry in enumerate(record["include"]) for _ in range(int(entry["count"]))]
    return [
        obj | {"color": swap[obj["color"]]} if entry_of[k] in (a, b) else obj for k, obj in enumerate(scene)
    ]


def has_relation(record: Mapping[str, Any]) -> bool:
    """Whether the record asks for a relation between its objects (the ``position`` family)."""
    return any("position" in entry for entry in record.get("include") or ())


def is_counting(record: Mapping[str, Any]) -> bool:
    """Whether the record is a counting one: the ``counting`` family, one object entry."""
    return record.get("tag") == "counting" and len(record.get("include") or ()) == 1


def without_relation(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record with its relation dropped: the same objects, placed as two unrelated ones are."""
    include = [{k: v for k, v in entry.items() if k != "position"} for entry in record["include"]]
    return {**record, "include": include}


def with_other_count(record: Mapping[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """A counting record's single entry drawn in another of the world's counts, uniformly."""
    if not is_counting(record):
        raise ValueError(
            f"record {record.get('prompt', record)!r} is not a counting record with one object entry: "
            "count noise applies only to those"
        )
    (entry,) = record["include"]
    others = [n for n in world.NUMBER_WORDS if n != int(entry["count"])]
    return {**record, "include": [{**entry, "count": others[int(rng.integers(len(others)))]}]}


def stream_rng(seed: int, rank: int) -> np.random.Generator:
    """The random generator of one rendered stream: its own for every seed, rank and data-loader worker."""
    info = get_worker_info()
    worker = 0 if info is None else info.id
    return np.random.default_rng([seed, rank, worker])


def _record_probs(
    records: Sequence[Mapping[str, Any]], family_weights: Mapping[str, float] | None
) -> np.ndarray:
    if not records:
        raise ValueError("the toy pretraining needs at least one prompt record")
    if family_weights is None:
        return np.full(len(records), 1.0 / len(records))
    families = [r["tag"] for r in records]
    unknown = sorted(set(family_weights) - set(families))
    negative = sorted(f for f, w in family_weights.items() if w < 0)
    if unknown or negative or not any(family_weights.get(f, 0) > 0 for f in families):
        raise ValueError(
            f"--data.init_args.family_weights ({dict(family_weights)}) must give non-negative weights to "
            f"families of the train list {sorted(set(families))}, at least one positive"
            + (f"; unknown: {unknown}" if unknown else "")
        )
    counts = {f: families.count(f) for f in set(families)}
    # Each family gets its weight's share of the draws, split evenly among its records.
    probs = np.array([family_weights.get(f, 0.0) / counts[f] for f in families])
    return probs / probs.sum()


class RenderedDataModule(pl.LightningDataModule):
    """What the toy data modules share: a stream of freshly rendered samples, batched.

    Args:
        batch_size: samples per step and rank.
        num_workers: data-loader worker processes rendering samples (0 renders in the main process).
        seed: seed of the stream.
    """

    def __init__(self, batch_size: int, num_workers: int, seed: int) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"--data.init_args.batch_size ({batch_size}) must be at least 1")
        if num_workers < 0:
            raise ValueError(f"--data.init_args.num_workers ({num_workers}) must be 0 or more")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed

    def _loader(self, dataset: IterableDataset) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )


class ToyShapesDataModule(RenderedDataModule):
    """Rendered (image, prompt) pairs of the toy world's TRAIN prompts, made on the fly.

    Only the train list is used, so the held-out list's unseen compositions stay unseen.

    Args:
        batch_size: images per step and rank.
        num_workers: data-loader worker processes rendering scenes (0 renders in the main process).
        seed: seed of the scene stream.
        family_weights: relative weight per family (``tag``) of the train list; ``None`` draws
            prompts uniformly.
        flip_prob: mirror this fraction of the scenes left to right, captions unchanged (the
            random flip augmentation of diffusers' text-to-image training scripts). "Left of" and
            "right of" then hold only ``1 - flip_prob`` of the time in what the model sees.
        swap_colors_prob: draw this fraction of the scenes whose caption binds colours to two
            objects with those colours exchanged, captions unchanged (a caption that names the right
            colours and shapes but binds them wrongly).
        relation_noise_prob: place the objects of this fraction of the scenes whose caption names a
            relation as if it named none, captions unchanged (a caption that states a relation the
            picture does not show).
        count_noise_prob: draw this fraction of the counting scenes with another of the world's
            counts, captions unchanged (a miscounted caption).

    The noise settings make the pretraining data lossy the ways web captions are (the shipped
    config says which it uses and why); all are off by default.
    """

    def __init__(
        self,
        batch_size: int = 64,
        num_workers: int = 0,
        seed: int = 0,
        family_weights: dict[str, float] | None = None,
        flip_prob: float = 0.0,
        swap_colors_prob: float = 0.0,
        relation_noise_prob: float = 0.0,
        count_noise_prob: float = 0.0,
    ) -> None:
        super().__init__(batch_size, num_workers, seed)
        noise = {
            "flip_prob": flip_prob,
            "swap_colors_prob": swap_colors_prob,
            "relation_noise_prob": relation_noise_prob,
            "count_noise_prob": count_noise_prob,
        }
        for name, value in noise.items():
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"--data.init_args.{name} ({value}) must be a probability in [0, 1]")
        self.family_weights = family_weights
        self.noise = noise
        self.records = world.load_prompts("train")
        _record_probs(self.records, family_weights)  # fail at construction, before any model is built

    def train_dataloader(self) -> DataLoader:
        rank = self.trainer.global_rank if self.trainer is not None else 0
        dataset = ToyShapesDataset(
            self.records,
            self.seed,
            self.family_weights,
            rank=rank,
            **self.noise,
        )
        return self._loader(dataset)


class ToyPretrainModule(pl.LightningModule):
    """Flow-matching pretraining of the toy U-Net and text encoder, with prompt dropout for CFG.

    Args:
        architecture: the networks' sizes (ignored when ``init_from`` is given).
        init_from: start from this toy checkpoint instead of random weights.
        optimizer: the optimizer (AdamW by default).
        warmup_steps: linear learning-rate warm-up; the rate is constant afterwards, so the weights
            after N steps equal those of a run with ``--trainer.max_steps=N``.
        cfg_dropout: fraction of prompts replaced by the empty prompt.
        sigma_sampling: ``logit_normal`` (SD3's default) or ``uniform`` σ during training.
        logit_mean: mean of the logit-normal.
        logit_std: standard deviation of the logit-normal.
        ema_decay: decay of an exponential moving average of the weights, exported instead of the
            raw weights; ``None`` exports the raw weights.
        export_path: where ``on_train_end`` writes the checkpoint ``ToyPolicy`` loads; ``None``
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
        super().__init__()
        problems = []
        if not 0.0 <= cfg_dropout < 1.0:
            problems.append(f"--model.init_args.cfg_dropout ({cfg_dropout}) must be in [0, 1)")
        if ema_decay is not None and not 0.0 < ema_decay < 1.0:
            problems.append(
                f"--model.init_args.ema_decay ({ema_decay}) must be in (0, 1), or null for no EMA"
            )
        if warmup_steps < 0:
            problems.append(f"--model.init_args.warmup_steps ({warmup_steps}) must be 0 or more")
        if logit_std <= 0:
            problems.append(f"--model.init_args.logit_std ({logit_std}) must be positive")
        if export_every_n_steps is not None and (export_every_n_steps < 1 or export_path is None):
            problems.append(
                f"--model.init_args.export_every_n_steps ({export_every_n_steps}) must be positive and "
                "needs --model.init_args.export_path"
            )
        if export_path is not None and not export_path.endswith(".safetensors"):
            problems.append(f"--model.init_args.export_path ({export_path}) must end with .safetensors")
        if problems:
            raise ValueError("; ".join(problems))
        self.save_hyperparameters(ignore=["optimizer"])
        self.optimizer = optimizer
        self.warmup_steps = warmup_steps
        self.cfg_dropout = cfg_dropout
        self.sigma_sampling = sigma_sampling
        self.logit_mean, self.logit_std = logit_mean, logit_std
        self.ema_decay = ema_decay
        self.export_path = export_path
        self.export_every_n_steps = export_every_n_steps
        self.export_dtype = export_dtype
        unet, text_encoder = self._build_networks(architecture, init_from)
        self.net = nn.ModuleDict({"unet": unet, "text_encoder": text_encoder})
        self.ema: nn.ModuleDict | None = None
        if ema_decay is not None:
            self.ema = copy.deepcopy(self.net).requires_grad_(False)

    def _build_networks(self, architecture: Any, init_from: str | None) -> tuple[nn.Module, nn.Module]:
        """The denoiser and the text encoder to train (the video pretraining builds its own)."""
        if init_from is not None:
            unet, text_encoder, _ = load_checkpoint(init_from)
            return unet, text_encoder
        return build_models(architecture or ToyModelConfig())

    def _velocity(self, unet: nn.Module, noisy: Tensor, sigma: Tensor, embeds: dict[str, Tensor]) -> Tensor:
        return predict_velocity(unet, noisy, sigma, embeds)

    def _save(self, path: str, net: nn.ModuleDict, dtype: torch.dtype, info: dict[str, str]) -> None:
        save_checkpoint(
            path, net["unet"], net["text_encoder"], dtype=dtype, info=info | {"made_by": PRETRAIN_COMMAND}
        )

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        pixels, prompts = batch["pixels"], list(batch["prompt"])
        n = pixels.shape[0]
        drop = (torch.rand(n) < self.cfg_dropout).tolist()
        prompts = ["" if d else p for p, d in zip(prompts, drop, strict=True)]
        embeds = self._encode(self.net, prompts)

        noise = torch.randn_like(pixels)
        sigma = self._sample_sigma(n)  # (B,) fp32
        s = sigma.view(n, *([1] * (pixels.ndim - 1)))
        noisy = (1.0 - s) * pixels + s * noise  # x_σ = (1 − σ)·x0 + σ·ε
        target = noise - pixels  # v = ε − x0
        pred = self._velocity(self.net["unet"], noisy, sigma, embeds).float()
        loss = F.mse_loss(pred, target)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def _encode(self, net: nn.ModuleDict, prompts: list[str]) -> dict[str, Tensor]:
        ids, mask = net["text_encoder"].tokenize(prompts)
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden, pooled = net["text_encoder"](ids, mask)
        return {"text_hidden": hidden, "text_mask": mask, "text_pooled": pooled}

    def _sample_sigma(self, n: int) -> Tensor:
        if self.sigma_sampling == "uniform":
            return torch.rand(n, device=self.device)
        # SD3 §3.1: σ = sigmoid(u), u ~ N(mean, std).
        return torch.sigmoid(self.logit_mean + self.logit_std * torch.randn(n, device=self.device))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.ema is not None:
            self._update_ema()
        step = self.global_step
        if self.export_every_n_steps and step % self.export_every_n_steps == 0:
            stem = self.export_path[: -len(".safetensors")]
            self._export(f"{stem}_step{step}.safetensors")

    @torch.no_grad()
    def _update_ema(self) -> None:
        # Warm-up of the decay, min(decay, (1 + s) / (10 + s)), as diffusers' EMAModel and flow_grpo's
        # EMA do; AveragedModel's avg_fn would need the step count as a tensor (a device sync a step).
        step = self.global_step
        decay = min(self.ema_decay, (1 + step) / (10 + step))
        ema = [p for p in self.ema.parameters()]
        cur = [p.detach() for p in self.net.parameters()]
        torch._foreach_lerp_(ema, cur, 1.0 - decay)

    def on_train_end(self) -> None:
        if self.export_path is not None:
            self._export(self.export_path)

    def _export(self, path: str) -> None:
        if not self.trainer.is_global_zero:
            return
        net = self.ema if self.ema is not None else self.net
        info = {"steps": str(self.global_step), "weights": "ema" if self.ema is not None else "raw"}
        self._save(path, net, _DTYPES[self.export_dtype], info)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = self.optimizer(self.net.parameters())
        warmup = self.warmup_steps

        def lr_factor(step: int) -> float:
            return min(1.0, (step + 1) / warmup) if warmup else 1.0

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
