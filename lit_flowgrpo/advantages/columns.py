"""The seam of the advantage stage: every rank's gathered columns by name, the values the transforms pass
along, and what a transform declares.

A transform (:class:`AdvantageTransform`) names the columns it reads (``"total"``, ``"group_ids"``, a
reward component's key, ``"features"``); the stage gathers the union of what its transforms declare in
one collective and hands every transform the same :class:`Columns`. A transform that names a column the
batch does not have is refused before the collective, with the column and the ones there are
(:class:`MissingColumnError`), the way verl-omni's ``DiffusionLossFn.validate_inputs`` names missing keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from lit_flowgrpo.distributed import DataParallel

__all__ = [
    "AdvantageState",
    "AdvantageTransform",
    "Columns",
    "MissingColumnError",
    "declared_columns",
]


class MissingColumnError(ValueError):
    """A transform of the advantage stage needs a column that the batch does not have."""


@dataclass(frozen=True)
class Columns:
    """Every rank's values of one rollout batch, by name, rank-major (the one-process order of the
    step's samples): (N,) each, or (N, F) for a vector per sample (``features``).

    Args:
        values: the columns by name.
    """

    values: Mapping[str, Tensor]

    @property
    def names(self) -> list[str]:
        return list(self.values)

    @property
    def width(self) -> int:
        """N, the samples of every rank."""
        return len(next(iter(self.values.values())))

    def __getitem__(self, name: str) -> Tensor:
        if name not in self.values:
            raise MissingColumnError(
                f"no column {name!r} in this batch (its columns: {', '.join(self.names)})"
            )
        return self.values[name]

    @classmethod
    def gather(
        cls,
        local: Mapping[str, Tensor | Callable[[], Tensor]],
        names: Sequence[str],
        dp: DataParallel,
        device: torch.device,
    ) -> Columns:
        """Every rank's ``names`` columns, from this rank's ``local`` ones, in one collective.

        Args:
            local: this rank's columns by name, (B,) or (B, F), or a function that makes one
                (called only when it is gathered).
            names: the columns to gather (each in ``local``).
            dp: the data-parallel peers.
            device: where the gathered columns live.
        """
        made = {name: local[name]() if callable(local[name]) else local[name] for name in names}
        rows: list[Tensor] = []
        for value in made.values():
            rows += [value] if value.ndim == 1 else list(value.T)  # a (B, F) column travels as F rows
        # One gather of every rank's rows in fp32, as the stage always gathered: integer ids below 2^24
        # (the group ids) travel exactly.
        gathered = dp.gather(torch.stack([r.to(device, torch.float32) for r in rows]))  # (rows, R·B)
        out, start = {}, 0
        for name, value in made.items():
            width = 1 if value.ndim == 1 else value.shape[1]
            block = gathered[start : start + width]
            start += width
            column = block[0] if value.ndim == 1 else block.T  # (N,) or (N, F)
            # Ids and flags come back in their own dtype; floats stay fp32, whatever they were made in.
            out[name] = column if value.dtype.is_floating_point else column.to(value.dtype)
        return cls(out)


@dataclass(frozen=True)
class AdvantageState:
    """Every rank's values of one batch as the transforms hand them on; each transform returns a new one.

    Args:
        columns: the gathered columns (read only).
        values: (N,) the advantages, 0 where unscored.
        scored: (N,) bool, the samples that have an advantage.
        keep: (N,) bool, the samples the update trains (its loss is a mean over these rows).
        kl_weights: (N,) fp32 weight of each sample's KL penalty.
        log: what the stage reports, over all ranks.
    """

    columns: Columns
    values: Tensor
    scored: Tensor
    keep: Tensor
    kl_weights: Tensor
    log: dict[str, float] = field(default_factory=dict)

    @classmethod
    def start(cls, columns: Columns, device: torch.device) -> AdvantageState:
        """Before any transform: no advantage, nothing scored, every KL weight 1."""
        n = columns.width
        nothing = torch.zeros(n, dtype=torch.bool, device=device)
        return cls(columns, torch.zeros(n, device=device), nothing, nothing, torch.ones(n, device=device))

    def replace(self, **changes) -> AdvantageState:
        """This state with ``changes``; ``log`` entries are added to the ones there are."""
        if "log" in changes:
            changes["log"] = {**self.log, **changes["log"]}
        return dataclasses.replace(self, **changes)


@runtime_checkable
class AdvantageTransform(Protocol):
    """One step of the advantage stage."""

    #: Who it is in an error message: the flag that turns it on.
    label: str

    @property
    def columns(self) -> tuple[str, ...]:
        """The gathered columns it reads, by name."""
        ...

    def __call__(self, state: AdvantageState) -> AdvantageState: ...


def declared_columns(
    transforms: Iterable[AdvantageTransform], available: Iterable[str], hints: Mapping[str, str] | None = None
) -> list[str]:
    """The union of the columns ``transforms`` declare, in the order they first name them.

    Raises:
        MissingColumnError: a transform names a column not in ``available``; the message names the
            transform's flag, the column, the columns there are and, from ``hints``, how to get it.
    """
    there = list(available)
    names: list[str] = []
    for transform in transforms:
        missing = [c for c in transform.columns if c not in there]
        if missing:
            fixes = "".join(f"; {(hints or {})[c]}" for c in missing if c in (hints or {}))
            raise MissingColumnError(
                f"{transform.label} needs the column(s) {missing}, which this batch does not have "
                f"(its columns: {there}){fixes}"
            )
        names += [c for c in transform.columns if c not in names]
    return names
