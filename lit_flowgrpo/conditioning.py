"""The images a record conditions its samples on (editing sources, first frames): read, checked and loaded.

A prompt record (``.jsonl``) may carry ``"condition_images": ["src.png", ...]`` (one path, or a list),
relative to the file that lists it. When the data module is built, every path is made absolute and every
image's header is read (it exists, PIL opens it, its size), before any weight is read; the module's setup
then asks the policy whether it takes that many images of those sizes (:func:`condition_problems`). In a
batch each sample carries its record's :class:`Condition`: the images decoded at the file's own size, which
the policy resizes as its diffusers pipeline does for the output size, and a key naming the sources, on
which the policy caches its encoding as it caches a prompt's.

A group is a record: its K samples share the prompt and the sources.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "CONDITION_KEY",
    "Condition",
    "ConditionImages",
    "condition_problems",
    "conditioning_problems",
    "image_header",
    "read_rgb",
    "record_sets",
    "resolve_condition_paths",
    "sources_of",
]

#: The record field that lists a record's conditioning images.
CONDITION_KEY = "condition_images"
#: Problems listed at most, then a count of the rest.
_MAX_LISTED = 10


@dataclass
class Condition:
    """What one sample is conditioned on besides its prompt."""

    images: list[Tensor]
    """Each (3, H, W) fp32 in [0, 1], at the file's own size, in the record's order."""
    key: str
    """The record's absolute image paths joined: equal sources give equal keys (the policy's cache key)."""

    def to(self, device: torch.device | str) -> Condition:
        return Condition([image.to(device) for image in self.images], self.key)


def image_header(file: str) -> tuple[int, int] | str:
    """(width, height) of the image ``file`` from its header (its pixels are not decoded), or why it
    cannot be read."""
    from PIL import Image, UnidentifiedImageError

    if not os.path.isfile(file):
        return f"image {file} does not exist"
    try:
        with Image.open(file) as image:
            return image.size
    except (OSError, UnidentifiedImageError) as err:
        return f"image {file} cannot be read ({type(err).__name__}: {err})"


def read_rgb(file: str) -> Tensor:
    """(3, H, W) fp32 in [0, 1]: the image as RGB at its own size."""
    from PIL import Image

    with Image.open(file) as opened:
        image = opened.convert("RGB")
    pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy())  # (H, W, 3) uint8
    return pixels.permute(2, 0, 1).float() / 255.0


def resolve_condition_paths(
    records: list[dict[str, Any]], path: str, flag: str
) -> dict[str, tuple[int, int]]:
    """Make every record's ``condition_images`` absolute (relative to ``path``'s folder) and read each
    image's header; returns each image's (width, height).

    Raises :class:`~lit_flowgrpo.errors.SettingsError` naming ``flag``, the file, the line and what is
    wrong: the field is not a path or a list of paths, an image does not exist or cannot be read.
    """
    from lit_flowgrpo.errors import SettingsError

    root = os.path.dirname(os.path.abspath(path))
    sizes: dict[str, tuple[int, int]] = {}
    problems: list[str] = []
    for n, record in enumerate(records):
        if CONDITION_KEY not in record:
            continue
        where = f"{path} record {n + 1}"
        given = record[CONDITION_KEY]
        if isinstance(given, str):
            given = [given]
        if not (isinstance(given, list) and given and all(isinstance(p, str) and p for p in given)):
            problems.append(
                f'{where}: "{CONDITION_KEY}" ({record[CONDITION_KEY]!r}) must be an image path or a non-empty '
                "list of image paths, relative to the file"
            )
            continue
        files = [os.path.join(root, os.path.expanduser(p)) for p in given]
        for file in files:
            if file not in sizes:
                found = image_header(file)
                if isinstance(found, str):
                    problems.append(f"{where}: {found}")
                    continue
                sizes[file] = found
        record[CONDITION_KEY] = files
    given_by = sum(CONDITION_KEY in r for r in records)
    if 0 < given_by < len(records):
        first = next(n for n, r in enumerate(records) if CONDITION_KEY not in r)
        problems.append(
            f"{path} record {first + 1} has no {CONDITION_KEY} while {given_by} of {len(records)} records have "
            "them: a prompt set is either conditioned or text-only (split it into two runs' files)"
        )
    if problems:
        more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise SettingsError(
            f"{flag} ({path}) has {len(problems)} bad conditioning records:\n  "
            + "\n  ".join(problems[:_MAX_LISTED])
            + more
        )
    return sizes


class ConditionImages:
    """The records' conditioning images as tensors, each file decoded once and kept (least recently used
    dropped past ``size`` files): a group repeats its record K times a step, validation every evaluation.

    A plain class, so that Lightning's batch transfer leaves the batch's reference to it alone.
    """

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._images: OrderedDict[str, Tensor] = OrderedDict()

    def condition(self, record: Mapping[str, Any]) -> Condition | None:
        """The :class:`Condition` of a record (``None`` for a text-only record)."""
        files = record.get(CONDITION_KEY)
        if not files:
            return None
        return Condition([self._image(f) for f in files], "|".join(files))

    def conditions(self, records: Sequence[Mapping[str, Any]]) -> list[Condition] | None:
        """One :class:`Condition` per record, or ``None`` when none of them is conditioned."""
        found = [self.condition(r) for r in records]
        if all(c is None for c in found):
            return None
        if any(c is None for c in found):
            # Mixed batches are refused when the data module is built (condition_problems); this is the
            # last guard for a caller that bypassed it.
            raise ValueError(f"a batch mixes records with and without {CONDITION_KEY}")
        return found  # type: ignore[return-value]

    def _image(self, file: str) -> Tensor:
        if file in self._images:
            self._images.move_to_end(file)
            return self._images[file]
        image = self._images[file] = read_rgb(file)
        while len(self._images) > self.size:
            self._images.popitem(last=False)
        return image

    def __reduce__(self) -> tuple[Any, ...]:
        # A spawned worker gets an empty store: the images are re-read there.
        return type(self), (self.size,)


def condition_problems(
    policy: Any,
    records: Mapping[str, Sequence[Mapping[str, Any]]],
    sizes: Mapping[str, tuple[int, int]],
    outputs: Mapping[str, tuple[int, int]],
) -> list[str]:
    """What ``policy`` cannot take of the records' conditioning (empty when it takes all), before load.

    Args:
        policy: the :class:`~lit_flowgrpo.policies.base.FlowPolicy` (its ``condition_images`` range,
            ``condition_name`` and ``condition_size_problems``).
        records: ``{flag: records}`` of each prompt set (train, val).
        sizes: each image's (width, height) (:func:`resolve_condition_paths`).
        outputs: ``{flag: (height, width)}`` of the images each set is sampled at.
    """
    fewest, most = getattr(policy, "condition_images", (0, 0))
    name = getattr(policy, "condition_name", "conditioning image")
    cls = type(policy).__name__
    out: list[str] = []
    for flag, recs in records.items():
        counts = [len(r.get(CONDITION_KEY) or ()) for r in recs]
        if not recs:
            continue
        if most == 0 and any(counts):
            n = sum(c > 0 for c in counts)
            out.append(
                f"{flag}: {n} of {len(recs)} records carry {CONDITION_KEY}, but {cls} is a text-only policy: "
                f"choose a policy that takes conditioning images (an editing or image-to-video family), or drop "
                f"the field"
            )
            continue
        bad = [i for i, c in enumerate(counts) if not fewest <= c <= most]
        if bad:
            i = bad[0]
            want = f"{fewest}" if fewest == most else f"{fewest} to {most}"
            out.append(
                f"{flag}: record {i + 1} gives {counts[i]} {CONDITION_KEY} ({len(bad)} of {len(recs)} records "
                f"are off), but {cls} takes {want} {name}(s) a record: give each record "
                f'"{CONDITION_KEY}": [...] with {want} path(s)'
            )
        if getattr(policy, "condition_counts_agree", False) and len(set(counts)) > 1:
            out.append(
                f"{flag}: its records give {sorted(set(counts))} {CONDITION_KEY} each, but {cls} batches the sources' "
                "tokens into one sequence length: give every record of the file the same number of images (or split "
                "the file by count, a run each)"
            )
        height, width = outputs.get(flag, (0, 0))
        checked: set[str] = set()
        for n, r in enumerate(recs):
            for file in r.get(CONDITION_KEY) or ():
                if file in checked or file not in sizes:
                    continue
                checked.add(file)
                for p in policy.condition_size_problems(*sizes[file], height, width):
                    out.append(f"{flag}: record {n + 1}: {name} {file}: {p}")
                    if len(out) >= _MAX_LISTED:
                        return out
    return out


def record_sets(datamodule: Any) -> dict[str, list[dict[str, Any]]]:
    """The prompt records of a data module by the flag that names their file: train and val (empty for a
    data module that has none, or none at all)."""
    return {
        "--data.init_args.train": list(getattr(datamodule, "train_records", None) or []),
        "--data.init_args.val": list(getattr(datamodule, "val_records", None) or []),
    }


def sources_of(batch: Any) -> list[list[Tensor]] | None:
    """Each sample's conditioning images (what a reward with ``uses_sources`` sees), or ``None`` for a
    text-only batch."""
    conditions = getattr(batch, "conditions", None)
    return None if conditions is None else [c.images for c in conditions]


def conditioning_problems(policy: Any, reward: Any, sampler: Any, datamodule: Any) -> list[str]:
    """Everything wrong with the data's conditioning images for this policy and reward, at setup (before
    load): the policy's count and sizes (:func:`condition_problems`), a reward that needs sources on
    text-only data, and a reward that scores whole groups given sources it would not see. Rewards that
    score the result without its source are said once, as a warning (a legitimate choice: a quality
    reward on an edit)."""
    from lightning.pytorch.utilities import rank_zero_warn

    from lit_flowgrpo.rewards.base import needs_sources, scores_groups, uses_sources

    sets = record_sets(datamodule)
    sizes = getattr(datamodule, "condition_sizes", None) or {}
    outputs = {
        "--data.init_args.train": (sampler.height, sampler.width),
        "--data.init_args.val": sampler.eval_size,
    }
    out = condition_problems(policy, sets, sizes, outputs) if datamodule is not None else []
    conditioned = any(CONDITION_KEY in r for records in sets.values() for r in records)
    parts = getattr(reward, "rewards", None) or {}
    for name, part in parts.items():
        if needs_sources(part) and not conditioned and datamodule is not None:
            out.append(
                f"reward {name!r} ({type(part).__name__}) needs each sample's source images, but the records carry "
                f'no {CONDITION_KEY}: give the records "{CONDITION_KEY}", or drop the reward'
            )
        if conditioned and uses_sources(part) and scores_groups(part):
            out.append(
                f"reward {name!r} ({type(part).__name__}) scores whole groups and uses sources: group rewards are "
                "not given conditioning images; score it per sample, or drop uses_sources"
            )
    blind = [n for n, part in parts.items() if conditioned and not uses_sources(part)]
    if blind:
        rank_zero_warn(
            f"the records carry {CONDITION_KEY}, but the rewards {blind} score each result without seeing its "
            "source (they declare no uses_sources): fine for a quality reward, not for one that judges an edit"
        )
    return out
