"""The transforms of the advantage stage, each over the gathered columns it names: the group
normalisation of the total (Flow-GRPO) or of each component (GDPO), the failure budget, GARDO's
diversity bonus and ``filter_zero``. GARDO's KL gate, which carries state, is in
:mod:`~lit_flowgrpo.advantages.kl_gate`.

Each is a small frozen object over the pure functions of :mod:`lit_flowgrpo.algorithms`: it reads the
columns it declares and returns a new :class:`~lit_flowgrpo.advantages.columns.AdvantageState`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lit_flowgrpo.advantages.columns import AdvantageState
from lit_flowgrpo.algorithms import diversity_multipliers, gdpo_advantages, group_advantages
from lit_flowgrpo.errors import MODEL

__all__ = [
    "DiversityBonus",
    "DiversityScaling",
    "DropZeroAdvantages",
    "FailureBudget",
    "GDPONormalisation",
    "GroupNormalisation",
]

ADVANTAGE = f"{MODEL}.advantage"


@dataclass(frozen=True)
class GroupNormalisation:
    """``aggregation: sum``: the total reward normalised within its group
    (:func:`~lit_flowgrpo.algorithms.group_advantages`, Flow-GRPO's); a sample without a finite total
    is unscored, advantage 0.

    Args:
        std: ``"global"`` or ``"group"``, as :attr:`AdvantageSettings.std`.
    """

    std: Literal["global", "group"] = "global"
    label: str = f"{ADVANTAGE}.aggregation=sum"

    @property
    def columns(self) -> tuple[str, ...]:
        return ("total", "group_ids")

    def __call__(self, state: AdvantageState) -> AdvantageState:
        total, ids = state.columns["total"], state.columns["group_ids"]
        scored = torch.isfinite(total)
        values = torch.zeros_like(total)
        if bool(scored.any()):
            values[scored] = group_advantages(total[scored], ids[scored], std=self.std)
        return state.replace(values=values, scored=scored, keep=scored)


@dataclass(frozen=True)
class GDPONormalisation:
    """``aggregation: gdpo``: each weighted component normalised within its group, the weighted sum
    normalised over the batch (:func:`~lit_flowgrpo.algorithms.gdpo_advantages`), and its gaps reported.

    Args:
        weights: the weight of each component, by its key (the reward's non-zero terms).
        std: ``"global"`` or ``"group"``, the scale of each component's normalisation.
    """

    weights: Mapping[str, float]
    std: Literal["global", "group"] = "global"
    label: str = f"{ADVANTAGE}.aggregation=gdpo"

    @property
    def columns(self) -> tuple[str, ...]:
        return ("group_ids", *self.weights)

    def __call__(self, state: AdvantageState) -> AdvantageState:
        ids = state.columns["group_ids"]
        components = torch.stack([state.columns[key] for key in self.weights])  # (C, N)
        done = gdpo_advantages(components, list(self.weights.values()), ids, std=self.std)
        log = self._report(done.empty_groups, ids, done.scored)
        return state.replace(values=done.advantages, scored=done.scored, keep=done.scored, log=log)

    def _report(self, empty_groups: Tensor, ids: Tensor, scored: Tensor) -> dict[str, float]:
        """``reward/nan_groups/<component>`` and ``reward/unscored_groups`` of one batch (all ranks), each
        warned about when not 0: never a silent gap in what is trained."""
        num_groups = int(torch.unique(ids).numel())
        log = {}
        for key, count in zip(self.weights, empty_groups.tolist(), strict=True):
            log[f"reward/nan_groups/{key}"] = float(count)
            if count:
                rank_zero_warn(
                    f"reward component {key!r} scored no sample of {count} of {num_groups} groups: left out of "
                    f"those groups' advantages (reward/nan_groups/{key})"
                )
        unscored = num_groups - int(torch.unique(ids[scored]).numel())
        log["reward/unscored_groups"] = float(unscored)
        if unscored:
            rank_zero_warn(
                f"{unscored} of {num_groups} groups have no scored sample (every weighted reward component "
                "failed on each): not trained on (reward/unscored_groups)"
            )
        return log


@dataclass(frozen=True)
class FailureBudget:
    """``reward/failure_rate``, the share of every rank's samples without an advantage; above
    ``max_rate`` the run stops (a reward that fails that often is broken, not noisy).

    Args:
        max_rate: :attr:`AdvantageSettings.max_reward_failure_rate`.
    """

    max_rate: float = 1.0
    label: str = f"{ADVANTAGE}.max_reward_failure_rate"

    @property
    def columns(self) -> tuple[str, ...]:
        return ()

    def __call__(self, state: AdvantageState) -> AdvantageState:
        return state.replace(log={"reward/failure_rate": self.rate(state.scored)})

    def rate(self, scored: Tensor) -> float:
        """The fraction of ``scored`` that is False; raises above ``max_rate``."""
        failure_rate = 1 - int(scored.sum()) / max(scored.numel(), 1)  # one host read per rollout
        if failure_rate > self.max_rate:
            raise RuntimeError(
                f"{failure_rate:.0%} of the batch could not be scored (more than {self.label} "
                f"{self.max_rate}): check the reward's endpoint or inputs"
            )
        return failure_rate


@dataclass
class DiversityBonus:
    """GARDO's diversity-aware advantage (arXiv:2512.24138, Sec. 4.3): each positive advantage scaled by
    its sample's distance to the nearest other sample of its group, over the group's mean
    (:func:`~lit_flowgrpo.algorithms.diversity_multipliers`).

    The features are the images averaged down to ``pool``×``pool`` cells
    (:func:`~lit_flowgrpo.diversity.pooled_pixels`: no model to download); GARDO uses DINOv3 embeddings
    with ``cosine``. Layout and colour are what pooled pixels keep, which is what tells two drawings of
    one prompt apart in the shapes world. An all-black image pools to the zero vector, which has no
    cosine distance: it keeps its advantage and is nobody's neighbour.

    The multipliers scale the advantages after their normalisation (``std``), where GARDO's script
    scales the raw centred rewards: with ``std: global`` the same direction at a β divided by the
    batch's std + 1e-4 (:func:`~lit_flowgrpo.algorithms.diversity_multipliers`).

    Args:
        pool: cells a side of the pooled image.
        distance: ``cosine`` (1 − cos, GARDO's) or ``mse`` (mean squared difference per feature).
    """

    pool: int = 16
    distance: Literal["mse", "cosine"] = "cosine"

    def problems(self, flag: str) -> list[str]:
        p = []
        if self.pool < 1:
            p.append(f"{flag}.pool ({self.pool}) must be at least 1")
        if self.distance not in ("mse", "cosine"):
            p.append(f"{flag}.distance ({self.distance!r}) must be mse or cosine")
        return p

    def features(self, images: Tensor) -> Tensor:
        """(B, pool²·3) the ``features`` column of this rank's images."""
        from lit_flowgrpo.diversity import pooled_pixels  # layer 1, loaded only when the bonus is on

        return pooled_pixels(images, self.pool)


@dataclass(frozen=True)
class DiversityScaling:
    """The diversity bonus as a transform: every positive advantage times its sample's multiplier
    (:class:`DiversityBonus`), over the ``features`` column.

    Args:
        distance: as :attr:`DiversityBonus.distance`.
    """

    distance: Literal["mse", "cosine"] = "cosine"
    label: str = f"{ADVANTAGE}.diversity_bonus"

    @property
    def columns(self) -> tuple[str, ...]:
        return ("group_ids", "features")

    def __call__(self, state: AdvantageState) -> AdvantageState:
        features, ids = state.columns["features"], state.columns["group_ids"]
        mult = diversity_multipliers(features, ids, state.values, distance=self.distance)
        values = state.values * mult.to(state.values.device)
        boosted = mult[values > 0]
        scale_max = float(boosted.max()) if boosted.numel() else 1.0
        return state.replace(values=values, log={"critic/advantages/diversity_scale_max": scale_max})


@dataclass(frozen=True)
class DropZeroAdvantages:
    """``filter_zero``: the update skips the samples whose advantage is exactly 0 (a saturated group
    carries no gradient), after every transform that moves an advantage."""

    label: str = f"{ADVANTAGE}.filter_zero"

    @property
    def columns(self) -> tuple[str, ...]:
        return ()

    def __call__(self, state: AdvantageState) -> AdvantageState:
        return state.replace(keep=state.keep & (state.values != 0))
