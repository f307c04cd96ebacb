"""RL diagnostics as ``torchmetrics.Metric`` subclasses, exact under any number of ranks and micro-batches.

One file per concern; every public name is re-exported here (``from lit_flowgrpo.metrics import X``):

- :mod:`~lit_flowgrpo.metrics.rewards`: :class:`RewardGroupStats`, the rewards, per-group spread and
  advantages of one rollout batch (logged as ``critic/rewards/...`` and ``critic/advantages/...``);
- :mod:`~lit_flowgrpo.metrics.policy`: :class:`PolicyRatioStats`, importance ratio, clip fractions and
  KL of the policy update, where one "token" is an (image, denoising step) pair (logged as
  ``actor/...``), optionally per denoising step; :class:`FlowDPPOStats`, the same plus Flow-DPPO's
  trust-region mask; their options (:class:`DiagnosticsSettings`); the clip interval's one rule;
- :mod:`~lit_flowgrpo.metrics.nft`: :class:`NFTDiagnostics`, DiffusionNFT's per-sample statistics;
- :mod:`~lit_flowgrpo.metrics.data`: :class:`SFTDiagnostics` and :class:`DPODiagnostics`, the objectives
  that learn from given images;
- :mod:`~lit_flowgrpo.metrics.base`: what they share (:class:`DictMetric`, row states, the merge by id).

Every state is a sufficient statistic (Σx, Σx², n, max, min, counts) reduced across ranks with sum, max
or min, or a row of per-group (per-trajectory) sufficient statistics, (n, mean, Σ(x − mean)², max, min)
or sums, gathered with ``cat`` and merged by id after the gather. Hence the result on N ranks equals the
result of one process on the same data, and any micro-batch split gives the same numbers, up to
floating-point summation order (fp64 states).

Logging with Lightning: ``self.log(name, metric)`` needs a metric whose ``compute()`` is one scalar
tensor, and these return a dict of them, so the module logs the synced values and resets the state::

    self.log_dict(self.ratio_stats.compute_prefixed(), on_step=True, on_epoch=False)
    self.ratio_stats.reset()

``compute()`` gathers the states of all ranks itself (torchmetrics' ``sync_on_compute``), so every rank
gets identical global values and ``sync_dist`` must stay off; every rank must call ``compute()`` at the
same point (it is a collective). ``MetricCollection([metric], prefix=...)`` flattens the dicts too.
"""

from __future__ import annotations

from lit_flowgrpo.metrics.base import DictMetric, check_vector, merge_moments, sum_by_id
from lit_flowgrpo.metrics.data import DPODiagnostics, SFTDiagnostics
from lit_flowgrpo.metrics.nft import NFTDiagnostics
from lit_flowgrpo.metrics.policy import (
    DiagnosticsSettings,
    FlowDPPOStats,
    PolicyRatioStats,
    clip_range_problems,
    resolve_clip_range_high,
)
from lit_flowgrpo.metrics.rewards import RewardGroupStats

__all__ = [
    "DPODiagnostics",
    "DiagnosticsSettings",
    "DictMetric",
    "FlowDPPOStats",
    "NFTDiagnostics",
    "PolicyRatioStats",
    "RewardGroupStats",
    "SFTDiagnostics",
    "check_vector",
    "clip_range_problems",
    "merge_moments",
    "resolve_clip_range_high",
    "sum_by_id",
]
