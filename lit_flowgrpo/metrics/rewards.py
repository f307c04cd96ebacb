"""Rewards, their spread within prompt groups, and the advantages of one rollout batch
(``critic/rewards/...``, ``critic/advantages/...``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lit_flowgrpo.metrics.base import DictMetric, check_vector, merge_moments

__all__ = ["RewardGroupStats"]

_F64 = torch.float64


class RewardGroupStats(DictMetric):
    r"""Rewards, their spread within prompt groups, and the advantages of one rollout batch.

    Formulas, over the samples whose reward is finite (population statistics, ddof = 0, the same
    convention as the advantage's std):

    - ``mean``, ``std``, ``max``, ``min``: of the rewards; ``count``: how many there were;
      ``nonfinite_count``: samples whose reward was NaN/inf (excluded from everything, never scored).
    - per group g (the samples that share a group id, wherever they ran): n_g, μ_g = Σr/n_g,
      s_g = sqrt(Σ(r − μ_g)²/n_g), and s_g = 0 exactly when the group's max equals its min.
    - ``zero_std_ratio`` = #{g : s_g ≤ tol} / G. With ``tol = 0`` the test is exact (max_g == min_g),
      not a rounded variance. Such groups (a group of one included) give zero advantage: no signal.
    - ``std_mean`` = mean_g s_g; ``group_size`` = mean_g n_g; ``num_groups`` = G.
    - ``<component>/mean``: mean of each reward component over its own finite values.
    - ``advantages/{mean,std,max,min}`` of the advantages, and ``advantages/effective_ratio`` =
      #{|A| > adv_threshold} / count: the fraction of the batch that carries a gradient.

    Reading it: ``zero_std_ratio`` near 1 means the reward cannot tell a group's images apart (saturated
    or too coarse); ``std_mean`` falling toward 0 means the groups collapse to one answer.

    Logged names (``compute_prefixed``): ``critic/rewards/<key>`` for reward keys and
    ``critic/advantages/<stat>`` for the ``advantages/<stat>`` keys (veRL's names).

    Exact groups across ranks: each rank reduces its own samples to one row per group id it saw,
    (n, mean, Σ(r − mean)², max, min), kept in a ``cat`` state. After the gather, rows with the same id
    are merged (Chan et al.'s combination of moments, max, min), which is exact whatever the split of a
    group over ranks or micro-batches. This needs
    no ``num_groups`` argument and no agreement on the largest id (sum-reduced per-group tensors would
    need equal shapes on every rank); its size is the number of groups a rank saw, not the batch size.

    Args:
        tol: a group counts in ``zero_std_ratio`` when its std is at most ``tol``; 0 means exactly equal
            rewards.
        adv_threshold: a sample is effective when ``|advantage| > adv_threshold``.
        prefix: prefix of the reward keys in :meth:`compute_prefixed`.
        advantages_prefix: prefix that replaces ``advantages/`` in :meth:`compute_prefixed`.
        components: reward component names, declared up front. When empty, the names of the first
            update that passes ``components`` are registered then; every rank must then make that
            update (empty tensors are fine) with the same names, or the ranks' states do not match.

    Example:
        >>> metric = RewardGroupStats()
        >>> rewards = torch.tensor([1.0, 3.0, 2.0, 2.0, float("nan")])
        >>> group_ids = torch.tensor([0, 0, 1, 1, 1])
        >>> advantages = torch.tensor([-1.0, 1.0, 0.0, 0.0, 0.0])
        >>> metric.update(rewards, group_ids, advantages)
        >>> out = metric.compute()
        >>> [round(float(out[k]), 4) for k in ("mean", "std", "zero_std_ratio", "std_mean", "nonfinite_count")]
        [2.0, 0.7071, 0.5, 0.5, 1.0]
        >>> float(out["advantages/effective_ratio"])
        0.5
        >>> sorted(metric.compute_prefixed())[:2]
        ['critic/advantages/effective_ratio', 'critic/advantages/max']
    """

    def __init__(
        self,
        tol: float = 0.0,
        adv_threshold: float = 1e-6,
        prefix: str = "critic/rewards/",
        advantages_prefix: str = "critic/advantages/",
        components: Sequence[str] = (),
        process_group: Any = None,
    ) -> None:
        super().__init__(prefix, process_group)
        if not (tol >= 0.0 and math.isfinite(tol)):
            raise ValueError(f"tol ({tol}) must be a finite number >= 0: 0 counts only exactly equal rewards")
        if not (adv_threshold >= 0.0 and math.isfinite(adv_threshold)):
            raise ValueError(f"adv_threshold ({adv_threshold}) must be a finite number >= 0, e.g. 1e-6")
        if not isinstance(advantages_prefix, str):
            raise ValueError(
                f"advantages_prefix must be a string such as 'critic/advantages/', got {advantages_prefix!r}"
            )
        self.tol = float(tol)
        self.adv_threshold = float(adv_threshold)
        self.advantages_prefix = advantages_prefix
        self.component_names: list[str] | None = None

        self.add_state("nonfinite", torch.zeros((), dtype=_F64), dist_reduce_fx="sum")
        # advantage sums: (n, ΣA, ΣA², #|A|>τ)
        self.add_state("adv_sums", torch.zeros(4, dtype=_F64), dist_reduce_fx="sum")
        self.add_state("adv_max", torch.tensor(-math.inf, dtype=_F64), dist_reduce_fx="max")
        self.add_state("adv_min", torch.tensor(math.inf, dtype=_F64), dist_reduce_fx="min")
        self.add_row_state("group_ids", (), torch.int64)
        # per-group rows: (n, mean, M2, max, min), M2 = Σ(r − mean)²
        self.add_row_state("group_rows", (5,), _F64)
        if components:
            self._register_components(components)

    def _register_components(self, names: Sequence[str]) -> None:
        if isinstance(names, str) or len(set(names)) != len(names):
            raise ValueError(f"components must be a list of distinct names, got {names!r}")
        self.component_names = sorted(names)
        # per-component sums: rows (n, Σc)
        self.add_state("comp_sums", torch.zeros((len(names), 2), dtype=_F64), dist_reduce_fx="sum")
        self.comp_sums = self.comp_sums.to(self.device)  # registered after .to(device) perhaps

    def forward(
        self,
        rewards: Tensor,
        group_ids: Tensor,
        advantages: Tensor,
        components: Mapping[str, Tensor] | None = None,
    ) -> dict[str, Tensor]:
        """Update with this batch and return the batch's own statistics (torchmetrics' ``forward``)."""
        # forward() merges the batch's states into the saved ones, so they must exist before it saves them
        if components and self.component_names is None:
            self._register_components(list(components))
        return super().forward(rewards, group_ids, advantages, components)

    def update(
        self,
        rewards: Tensor,
        group_ids: Tensor,
        advantages: Tensor,
        components: Mapping[str, Tensor] | None = None,
    ) -> None:
        """Add this rank's samples.

        Args:
            rewards: (N,) total reward per sample; non-finite values are excluded and counted.
            group_ids: (N,) int64 GLOBAL group id per sample (the same id on every rank for one group).
            advantages: (N,) advantage per sample; must be finite wherever the reward is.
            components: optional ``{name: (N,)}`` reward components; each is averaged over its own
                finite values.
        """
        n = check_vector("rewards", rewards)
        check_vector("group_ids", group_ids, n)
        check_vector("advantages", advantages, n)
        if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool or group_ids.is_complex():
            raise ValueError(f"group_ids must be an integer tensor (int64), got {group_ids.dtype}")

        rewards = rewards.detach().to(self.device, _F64)
        group_ids = group_ids.detach().to(self.device, torch.int64)
        advantages = advantages.detach().to(self.device, _F64)
        finite = torch.isfinite(rewards)
        self.nonfinite += (~finite).sum()

        r, ids, adv = rewards[finite], group_ids[finite], advantages[finite]
        if not bool(torch.isfinite(adv).all()):
            raise ValueError(
                "advantages has non-finite values for samples whose reward is finite: the advantage "
                "computation must give every scored sample a finite advantage"
            )
        if r.numel():
            samples = torch.stack([torch.ones_like(r), r, torch.zeros_like(r), r, r], dim=1)
            uniq, moments = merge_moments(ids, samples)
            self.group_ids.append(uniq)
            self.group_rows.append(moments)
            effective = (adv.abs() > self.adv_threshold).to(_F64)
            self.adv_sums += torch.stack([torch.ones_like(adv), adv, adv * adv, effective], dim=1).sum(dim=0)
            self.adv_max = torch.maximum(self.adv_max, adv.max())
            self.adv_min = torch.minimum(self.adv_min, adv.min())

        if components:
            if self.component_names is None:
                self._register_components(list(components))
            unknown = sorted(set(components) - set(self.component_names or []))
            if unknown:
                raise ValueError(
                    f"components {unknown} are not among the registered components {self.component_names}: "
                    "declare every name with RewardGroupStats(components=[...]) or pass the same names at "
                    "every update"
                )
            for i, name in enumerate(self.component_names or []):
                if name not in components:
                    continue
                value = components[name]
                check_vector(f"components[{name!r}]", value, n)
                value = value.detach().to(self.device, _F64)
                ok = torch.isfinite(value)
                self.comp_sums[i, 0] += ok.sum()
                self.comp_sums[i, 1] += value[ok].sum()

    def compute(self) -> dict[str, Tensor]:
        """The statistics described in the class docstring, keyed without prefix."""
        nan = torch.tensor(math.nan, dtype=_F64, device=self.device)
        _, groups = merge_moments(self.gathered_rows("group_ids"), self.gathered_rows("group_rows"))
        n_g, _, m2_g, max_g, min_g = groups.unbind(dim=1)
        equal = max_g == min_g
        # population std per group; exactly 0 when every reward of the group is the same number
        std_g = torch.where(equal, torch.zeros_like(m2_g), (m2_g / n_g).sqrt())
        zero = equal if self.tol == 0.0 else (std_g <= self.tol)
        num_groups = n_g.numel()
        # all finite rewards: the groups merged as parts of one set
        _, pooled = merge_moments(torch.zeros_like(n_g, dtype=torch.int64), groups)
        count, mean, m2, r_max, r_min = pooled[0] if num_groups else (n_g.sum(), nan, nan, nan, nan)
        out = {
            "mean": mean,
            "std": (m2 / count).sqrt(),
            "max": r_max,
            "min": r_min,
            "count": count,
            "nonfinite_count": self.nonfinite.clone(),
            "zero_std_ratio": zero.to(_F64).mean() if num_groups else nan,
            "std_mean": std_g.mean() if num_groups else nan,
            "group_size": n_g.mean() if num_groups else nan,
            "num_groups": torch.tensor(float(num_groups), dtype=_F64, device=self.device),
        }
        for i, name in enumerate(self.component_names or []):
            out[f"{name}/mean"] = self.comp_sums[i, 1] / self.comp_sums[i, 0]

        a_n, a_s, a_ss, a_eff = self.adv_sums.unbind()
        a_mean = a_s / a_n
        out.update(
            {
                "advantages/mean": a_mean,
                "advantages/std": (a_ss / a_n - a_mean * a_mean).clamp_min(0.0).sqrt(),
                "advantages/max": self.adv_max.clone() if a_n > 0 else nan,
                "advantages/min": self.adv_min.clone() if a_n > 0 else nan,
                "advantages/effective_ratio": a_eff / a_n,
            }
        )
        return out

    def _prefixed_key(self, key: str) -> str:
        if key.startswith("advantages/"):
            return self.advantages_prefix + key[len("advantages/") :]
        return self.prefix + key
