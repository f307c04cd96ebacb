"""DiffusionNFT's per-sample statistics (:class:`~lit_flowgrpo.algorithms.NFTStats`), averaged over every
(sample, visit) of an update (``actor/nft_...``)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from lit_flowgrpo.metrics.base import DictMetric

__all__ = ["NFTDiagnostics"]


class NFTDiagnostics(DictMetric):
    """Means of DiffusionNFT's per-sample statistics (:class:`~lit_flowgrpo.algorithms.NFTStats`) over
    every (sample, visit) of an update, from sums and a count, so 1 rank and N ranks agree exactly.

    Logged as ``actor/nft_<stat>``: ``r_mean`` (mean optimality probability; 1/2 is no preference),
    ``positive_loss``/``negative_loss`` (the implicit policies' weighted x0 losses),
    ``positive_error``/``negative_error`` (their unweighted velocity errors mean((v± − v)²)),
    ``old_deviation`` (mean((v_θ − v_old)²): how far θ moved from the old policy), ``loss``.

    >>> m = NFTDiagnostics()
    >>> one = torch.ones(2)
    >>> m.update(r=torch.tensor([0.0, 1.0]), positive_loss=one, negative_loss=one, loss=one,
    ...          positive_error=one, negative_error=one, old_deviation=torch.zeros(2))
    >>> float(m.compute_prefixed()["actor/nft_r_mean"])
    0.5
    """

    STATS: ClassVar[tuple[str, ...]] = (
        "r",
        "positive_loss",
        "negative_loss",
        "loss",
        "positive_error",
        "negative_error",
        "old_deviation",
    )

    def __init__(self, prefix: str = "actor/nft_", process_group: Any = None) -> None:
        super().__init__(prefix, process_group)
        for name in self.STATS:
            self.add_state(f"sum_{name}", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, **stats: Tensor) -> None:  # type: ignore[override]
        if set(stats) != set(self.STATS):
            raise ValueError(f"NFTDiagnostics.update takes {list(self.STATS)}, got {sorted(stats)}")
        for name in self.STATS:
            state = getattr(self, f"sum_{name}")
            setattr(self, f"sum_{name}", state + stats[name].detach().double().sum())
        self.count = self.count + stats["r"].numel()

    def compute(self) -> dict[str, Tensor]:
        n = self.count.clamp_min(1)
        out = {name: getattr(self, f"sum_{name}") / n for name in self.STATS}
        out["r_mean"] = out.pop("r")
        return out
