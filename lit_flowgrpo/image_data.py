"""Images as data: (prompt, image) records and preference pairs, read from a folder with a JSONL index,
dealt to the ranks and resumed exactly as prompts are (:class:`~lit_flowgrpo.data.PromptDataModule`'s
:class:`~lit_flowgrpo.data.GroupSampler`, a pure function of (seed, step)).

The index is a ``.jsonl`` file, one record a line, image paths relative to the index's folder:

- an image to learn (SFT): ``{"prompt": "a red cube", "image": "images/0001.png"}``;
- a preference pair (Diffusion-DPO): ``{"prompt": ..., "chosen": "a.png", "rejected": "b.png"}``, or
  Pick-a-Pic's form ``{"prompt": ..., "images": ["a.png", "b.png"], "preferred": 0}``.

Every other field is metadata, as in a prompt file. Every record and every image file is checked when
the data module is built, before any weight is read: a missing or unreadable image, a pair without its
label and an empty index are refused, naming the flag, the file and the line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from jsonargparse.typing import Path_fr
from torch import Tensor
from torch.utils.data import IterableDataset

from lit_flowgrpo.conditioning import CONDITION_KEY, image_header
from lit_flowgrpo.data import GroupSampler, PromptBatch, PromptDataModule, group_seed, sample_seed
from lit_flowgrpo.errors import SettingsError

__all__ = ["ImageBatch", "ImageDataModule", "LatentCache", "load_image", "read_image_records"]

_FLAG = "--data.init_args"
#: Problems listed at most, then a count of the rest (an index of a million broken lines stays readable).
_MAX_LISTED = 10


class LatentCache:
    """Each record image's latent after its first encoding, on the CPU, keyed by (record, ``image`` or
    ``rejected``): a data module's ``cache_latents``. A plain class, not a mapping, so that Lightning's
    batch transfer hands the batch the same cache instead of a copy. Its memory: one latent per image of
    the index (SD3.5 at 512 px: 16×64×64 fp32, 256 KiB)."""

    def __init__(self) -> None:
        self.store: dict[tuple[int, str], Tensor] = {}

    def __len__(self) -> int:
        return len(self.store)


@dataclass
class ImageBatch(PromptBatch):
    """A :class:`~lit_flowgrpo.data.PromptBatch` whose samples carry their records' images."""

    images: Tensor | None = None
    """(B, 3, H, W) fp32 in [0, 1]: the record's image (a pair's chosen one)."""
    rejected: Tensor | None = None
    """(B, 3, H, W) fp32 in [0, 1]: a pair's rejected image; ``None`` without pairs."""
    record_ids: Tensor | None = None
    """(B,) int64: each sample's line among the index's records (the key of a latent cache)."""
    latent_cache: LatentCache | None = None
    """The data module's latent cache (``cache_latents``), or ``None``."""


def read_image_records(path: str, flag: str, pairs: bool) -> list[dict[str, Any]]:
    """The records of a JSONL image index, each with its image paths made absolute: ``image`` (the
    image to learn, a pair's chosen one) and, with ``pairs``, ``rejected``.

    Raises :class:`~lit_flowgrpo.errors.SettingsError` naming ``flag``, the file, the line and what is
    wrong: not JSON, no prompt, no image, a pair without its label (with ``pairs``), an image that does
    not exist or cannot be read, or no record at all.
    """
    if not os.path.isfile(path) or not path.endswith(".jsonl"):
        raise SettingsError(
            f"{flag} ({path}) must be an existing .jsonl index: one record a line, such as "
            '{"prompt": "a red cube", "image": "images/0001.png"}, image paths relative to the index'
        )
    root = os.path.dirname(os.path.abspath(path))
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise SettingsError(f"{flag} ({path}) is not UTF-8 text: save it as UTF-8") from None
    records: list[dict[str, Any]] = []
    problems: list[str] = []
    opened: dict[str, str | None] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            problems.append(f"{where} is not valid JSON ({e.msg}, column {e.colno})")
            continue
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            problems.append(f'{where} has no string "prompt" field')
            continue
        if CONDITION_KEY in record:
            problems.append(
                f'{where} carries "{CONDITION_KEY}": learning edits or image-to-video from data (SFT, Diffusion-DPO) '
                "is not supported yet; train conditioned records with an RL objective on PromptDataModule"
            )
            continue
        found = _images_of(record, pairs, where)
        if isinstance(found, str):
            problems.append(found)
            continue
        meta = {
            k: v for k, v in record.items() if k not in ("image", "chosen", "rejected", "images", "preferred")
        }
        out = {**meta, "image": os.path.join(root, found[0])}
        if pairs:
            out["rejected"] = os.path.join(root, found[1])
        for key in ("image", "rejected") if pairs else ("image",):
            file = out[key]
            if file not in opened:
                opened[file] = _unreadable(file)
            if opened[file] is not None:
                problems.append(f"{where}: {opened[file]}")
        records.append(out)
    if problems:
        listed = problems[:_MAX_LISTED]
        more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise SettingsError(
            f"{flag} ({path}) has {len(problems)} bad records:\n  " + "\n  ".join(listed) + more
        )
    if not records:
        raise SettingsError(
            f"{flag} ({path}) holds no records: add at least one line such as "
            '{"prompt": "a red cube", "image": "images/0001.png"}'
        )
    return records


def _images_of(record: dict[str, Any], pairs: bool, where: str) -> tuple[str, ...] | str:
    """(image,) or (chosen, rejected) of a record, or what is wrong with it."""
    if "images" in record:
        images = record["images"]
        if not (isinstance(images, list) and len(images) == 2 and all(isinstance(i, str) for i in images)):
            return f'{where}: "images" must be a list of two image paths (a pair)'
        label = record.get("preferred")
        if isinstance(label, bool) or label not in (0, 1):
            return (
                f'{where} is an unlabelled pair: "preferred" ({label!r}) must be 0 or 1, the index of the '
                'chosen image in "images" (drop ties: a tie teaches no preference)'
            )
        return images[label], images[1 - label]
    if "rejected" in record or "chosen" in record:
        chosen, rejected = record.get("chosen"), record.get("rejected")
        if not (isinstance(chosen, str) and isinstance(rejected, str)):
            return f'{where} is an unlabelled pair: give both "chosen" and "rejected" image paths'
        return chosen, rejected
    if pairs:
        return (
            f'{where} is not a preference pair: {_FLAG}.pairs=true needs "chosen" and "rejected", or '
            '"images" with "preferred"'
        )
    image = record.get("image")
    if not isinstance(image, str):
        return f'{where} has no "image" path (or "chosen"/"rejected", or "images" with "preferred")'
    return (image,)


def _unreadable(file: str) -> str | None:
    """Why ``file`` is not an image PIL can open (its header is read, not its pixels), or ``None``."""
    found = image_header(file)
    return found if isinstance(found, str) else None


def load_image(file: str, height: int, width: int) -> Tensor:
    """(3, height, width) fp32 in [0, 1]: the image as RGB, its shorter side resized and the centre
    cropped to the size (diffusers' training scripts' ``Resize`` + ``CenterCrop``, in PIL)."""
    from PIL import Image

    with Image.open(file) as opened:
        image = opened.convert("RGB")
    w, h = image.size
    if (w, h) != (width, height):
        scale = max(width / w, height / h)
        size = (max(width, round(w * scale)), max(height, round(h * scale)))
        image = image.resize(size, Image.Resampling.BICUBIC)
        left, top = (size[0] - width) // 2, (size[1] - height) // 2
        image = image.crop((left, top, left + width, top + height))
    pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy())  # (H, W, 3) uint8
    return pixels.permute(2, 0, 1).float() / 255.0


class _ImageStream(IterableDataset):
    def __init__(
        self,
        records: list[dict[str, Any]],
        sampler: GroupSampler,
        start_step: int,
        size: tuple[int, int],
        pairs: bool,
        same_initial_noise: bool,
        cache: LatentCache | None = None,
    ) -> None:
        self.cache = cache
        self.records = records
        self.sampler = sampler
        self.start_step = start_step
        self.size = size
        self.pairs = pairs
        self.same_initial_noise = same_initial_noise

    def __iter__(self) -> Iterator[ImageBatch]:
        step = self.start_step
        while True:
            indices, group_ids, sample_ids = self.sampler.step_indices(step)
            chosen = [self.records[i] for i in indices]
            seed = self.sampler.seed
            initial = None
            if self.same_initial_noise:
                initial = torch.tensor([group_seed(seed, step, int(g)) for g in group_ids], dtype=torch.long)
            yield ImageBatch(
                prompts=[r["prompt"] for r in chosen],
                metadata=[
                    {k: v for k, v in r.items() if k not in ("prompt", "image", "rejected")} for r in chosen
                ],
                group_ids=group_ids.long(),
                sample_ids=sample_ids.long(),
                step=step,
                seeds=torch.tensor([sample_seed(seed, step, int(s)) for s in sample_ids], dtype=torch.long),
                initial_seeds=initial,
                images=torch.stack([load_image(r["image"], *self.size) for r in chosen]),
                rejected=torch.stack([load_image(r["rejected"], *self.size) for r in chosen])
                if self.pairs
                else None,
                record_ids=torch.tensor(indices, dtype=torch.long),
                latent_cache=self.cache,
            )
            step += 1


class ImageDataModule(PromptDataModule):
    """Images with their prompts (SFT) or preference pairs (Diffusion-DPO) from a folder with a JSONL
    index, dealt to the ranks and resumed as :class:`~lit_flowgrpo.data.PromptDataModule` deals prompts.

    Args:
        train: the ``.jsonl`` index (format: :mod:`lit_flowgrpo.image_data`), image paths relative to it.
        val: held-out prompts (``.txt`` or ``.jsonl``), sampled and scored as in RL; ``None``: none.
        prompts_per_step: records per step (all ranks together).
        group_size: samples per record in a step (1 for SFT and offline DPO; an RL objective on this
            module needs at least 2).
        height: the images' height in pixels after the resize and centre crop (the sampler's height).
        width: their width.
        pairs: every record is a preference pair (Diffusion-DPO from data); refused otherwise.
        cache_latents: keep each image's latent after its first encoding (CPU memory: one latent an
            image) instead of encoding it at every visit of its record. A VAE encodes a batch in an
            order of its own, so a cached latent may differ from a fresh one in the last bits: a resumed
            run (its cache empty) is then not bit-exact. A family without a VAE caches nothing.
        val_seeds: see :class:`~lit_flowgrpo.data.PromptDataModule`.
        val_batch_size: see there.
        max_val_prompts: see there.
        seed: seeds the record order and every draw.
        same_initial_noise: see there.
    """

    min_group_size: ClassVar[int] = 1
    group_size_reason: ClassVar[str] = "each record is drawn at least once a step"

    def __init__(
        self,
        train: Path_fr | str,
        val: Path_fr | str | None = None,
        prompts_per_step: int = 8,
        group_size: int = 1,
        height: int = 512,
        width: int = 512,
        pairs: bool = False,
        cache_latents: bool = False,
        val_seeds: int = 1,
        val_batch_size: int = 16,
        max_val_prompts: int | None = None,
        seed: int = 0,
        same_initial_noise: bool = False,
    ) -> None:
        if height < 1 or width < 1:
            raise SettingsError(
                f"{_FLAG}.height and {_FLAG}.width ({height}x{width}) must be at least 1 pixel"
            )
        self.pairs = pairs
        self.height, self.width = height, width
        self.latent_cache = LatentCache() if cache_latents else None
        super().__init__(
            train,
            val,
            prompts_per_step=prompts_per_step,
            group_size=group_size,
            val_seeds=val_seeds,
            val_batch_size=val_batch_size,
            max_val_prompts=max_val_prompts,
            seed=seed,
            same_initial_noise=same_initial_noise,
        )

    def read_train(self, path: str, flag: str) -> list[dict[str, Any]]:
        return read_image_records(path, flag, self.pairs)

    def train_stream(self, sampler: GroupSampler, start_step: int) -> IterableDataset:
        size = (self.height, self.width)
        return _ImageStream(
            self.train_records,
            sampler,
            start_step,
            size,
            self.pairs,
            self.same_initial_noise,
            self.latent_cache,
        )
