"""The machinery every metric of :mod:`lit_flowgrpo.metrics` (and :mod:`lit_flowgrpo.diversity`) shares:
a metric whose ``compute()`` is a dict of named scalars, row states gathered with ``cat`` whatever a rank
holds, the exact merge of per-group rows by id, and the check of a per-sample input."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors

__all__ = ["DictMetric", "check_vector", "merge_moments", "sum_by_id"]


def sum_by_id(ids: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
    """Sum the rows (m, F) that share an id; returns the sorted unique ids and the (G, F) sums."""
    uniq, inv = torch.unique(ids, sorted=True, return_inverse=True)
    sums = torch.zeros((uniq.numel(), rows.shape[1]), dtype=rows.dtype, device=rows.device)
    return uniq, sums.index_add_(0, inv, rows)


def merge_moments(ids: Tensor, moments: Tensor) -> tuple[Tensor, Tensor]:
    """Merge rows of (n, mean, M2, max, min) that share an id, M2 = Σ(x − mean)².

    The parts' means and M2 combine as in Chan, Golub & LeVeque (1979), generalised to many parts:
    n = Σ nᵢ, mean = Σ nᵢ·meanᵢ / n, M2 = Σ M2ᵢ + Σ nᵢ·(meanᵢ − mean)². Unlike Σx² − n·mean², this
    keeps the digits of a spread that is small next to the mean. Rows with one sample are (1, x, 0, x, x).
    Returns the sorted unique ids and the merged (G, 5) rows.
    """
    uniq, inv = torch.unique(ids, sorted=True, return_inverse=True)
    groups = uniq.numel()
    n_i, mean_i, m2_i, max_i, min_i = moments.unbind(dim=1)
    n = torch.zeros(groups, dtype=moments.dtype, device=moments.device).index_add_(0, inv, n_i)
    mean = torch.zeros_like(n).index_add_(0, inv, n_i * mean_i) / n
    m2 = torch.zeros_like(n).index_add_(0, inv, m2_i + n_i * (mean_i - mean[inv]) ** 2)
    mx = torch.full_like(n, -math.inf).scatter_reduce_(0, inv, max_i, reduce="amax")
    mn = torch.full_like(n, math.inf).scatter_reduce_(0, inv, min_i, reduce="amin")
    return uniq, torch.stack([n, mean, m2, mx, mn], dim=1)


def check_vector(name: str, value: Any, length: int | None = None) -> int:
    """Check that ``value`` is a 1-D tensor (of ``length`` when given) and return its length."""
    if not isinstance(value, Tensor):
        raise ValueError(f"{name} must be a 1-D torch.Tensor, got {type(value).__name__}")
    if value.ndim != 1 or (length is not None and value.shape[0] != length):
        expected = "(N,)" if length is None else f"({length},)"
        raise ValueError(
            f"{name} has shape {tuple(value.shape)}, expected {expected}: pass one value per sample "
            "(reduce per-element tensors to one value per sample before the update)"
        )
    return value.shape[0]


class DictMetric(Metric):
    """A metric whose ``compute()`` is a flat ``{key: scalar tensor}`` and whose keys get ``prefix``.

    Subclasses register row states with :meth:`add_row_state`: lists of (m, *shape) tensors gathered
    with ``cat``. A rank that holds no rows would send torchmetrics' 1-D float32 placeholder, which does
    not match the other ranks' rows in shape or dtype (a wrong gather or a hang), so the sync first puts
    in an empty tensor of the right shape and dtype.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(self, prefix: str, process_group: Any = None) -> None:
        # process_group: the ranks the states reduce over (None: every rank), given when the metric is
        # built (torchmetrics' Metric argument), so nothing rewrites it later.
        super().__init__(process_group=process_group)
        if not isinstance(prefix, str):
            raise ValueError(f"prefix must be a string such as 'actor/', got {prefix!r}")
        self.prefix = prefix
        self._row_states: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def add_row_state(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Register ``name`` as a list of (m, *shape) ``dtype`` rows, gathered with ``cat`` (torchmetrics'
        :meth:`add_state` with a list default, made safe for a rank that holds none)."""
        self.add_state(name, default=[], dist_reduce_fx="cat")
        self._row_states[name] = (shape, dtype)

    def gathered_rows(self, name: str) -> Tensor:
        """The rows of a row state as one (m, *shape) tensor: this rank's, or every rank's inside
        ``compute()`` after the sync."""
        shape, dtype = self._row_states[name]
        parts = getattr(self, name)
        if isinstance(parts, Tensor):  # inside compute() after a sync: the gathered rows, concatenated
            return parts
        if not parts:
            return torch.zeros((0, *shape), dtype=dtype, device=self.device)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _sync_dist(
        self, dist_sync_fn: Callable = gather_all_tensors, process_group: Any | None = None
    ) -> None:
        for name, (shape, dtype) in self._row_states.items():
            if not getattr(self, name):
                setattr(self, name, [torch.zeros((0, *shape), dtype=dtype, device=self.device)])
        super()._sync_dist(dist_sync_fn, process_group)

    def _prefixed_key(self, key: str) -> str:
        return self.prefix + key

    def compute_prefixed(self) -> dict[str, Tensor]:
        """``compute()`` with every key under its logged name (``prefix`` + key)."""
        return {self._prefixed_key(k): v for k, v in self.compute().items()}

    def logged_values(self) -> dict[str, float]:
        """What a logger gets: :meth:`compute_prefixed` as floats (a collective: every rank calls it)."""
        return {k: float(v) for k, v in self.compute_prefixed().items()}
