"""The validation means of every reward component (``val-core/<c>/mean@1``, ``val-aux/<c>/mean@1``) and
how many samples each could not score (``val-aux/<c>/unscored_count``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics.aggregation import MeanMetric, SumMetric

__all__ = ["ValidationMeans"]


class ValidationMeans(nn.Module):
    """One ``MeanMetric`` (NaN ignored) and one unscored ``SumMetric`` per reward component, made the
    first time the component is seen: a reward's components are known only once it has run.

    Args:
        process_group: the data-parallel peers the metrics reduce over (``None``: every rank); with
            sequence parallelism, the ranks of one sequence-parallel group hold the same samples and
            must count once.
    """

    def __init__(self, process_group: Any = None) -> None:
        super().__init__()
        self.process_group = process_group
        self.means = nn.ModuleDict()
        self.unscored = nn.ModuleDict()

    def update(self, components: dict[str, Tensor], device: torch.device) -> list[tuple[str, str]]:
        """Add one batch's components; returns each component's (name, key), the key naming its two
        metrics as ``means.<key>`` and ``unscored.<key>`` under this module."""
        seen = []
        for name, values in components.items():
            key = name.replace("/", "__")  # a ModuleDict key holds no dot or slash
            if key not in self.means:
                self.means[key] = MeanMetric(nan_strategy="ignore", process_group=self.process_group).to(
                    device
                )
                self.unscored[key] = SumMetric(process_group=self.process_group).to(device)
            values = values.to(device)
            self.means[key].update(values)
            self.unscored[key].update((~torch.isfinite(values)).float())
            seen.append((name, key))
        return seen
