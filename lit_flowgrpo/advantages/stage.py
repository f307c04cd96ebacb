"""From rewards to advantages: the settings of the advantage stage and its one function, a sequence of
transforms over every rank's gathered columns.

The math is :func:`lit_flowgrpo.algorithms.group_advantages` (``aggregation: sum``: the weighted sum of
the reward components, normalised within its group) or :func:`~lit_flowgrpo.algorithms.gdpo_advantages`
(``aggregation: gdpo``: each weighted component normalised within its group, then combined and
normalised over the batch), then GARDO's diversity bonus, and the KL gate when the run has one
(:class:`~lit_flowgrpo.kl.KLGate`, whose controller the module hands to :meth:`AdvantageSettings.for_batch`). This stage adds what a
run needs around it: every rank's columns are gathered first, in one collective, so a group that spans
ranks is normalised whole and N ranks compute what one would; unscored samples are dropped (never
turned into a number), counted and reported; and a batch that fails too often stops the run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lit_flowgrpo.advantages.columns import (
    AdvantageState,
    AdvantageTransform,
    Columns,
    declared_columns,
)
from lit_flowgrpo.advantages.kl_gate import GatedKL, KLGateController
from lit_flowgrpo.advantages.transforms import (
    DiversityBonus,
    DiversityScaling,
    DropZeroAdvantages,
    FailureBudget,
    GDPONormalisation,
    GroupNormalisation,
)
from lit_flowgrpo.distributed import DataParallel
from lit_flowgrpo.errors import MODEL
from lit_flowgrpo.errors import flag as flag_of
from lit_flowgrpo.rewards.base import CallableReward, MultiReward, RewardOutput

__all__ = ["AGGREGATIONS", "BUILT_IN_COLUMNS", "AdvantageSettings", "BatchAdvantages"]

#: How the reward components become one advantage (:attr:`AdvantageSettings.aggregation`).
AGGREGATIONS = ("sum", "gdpo")

#: The columns every batch has besides its reward components (``features`` when images are given).
BUILT_IN_COLUMNS = ("total", "group_ids", "features")

#: How a batch gets a column it lacks, for the error that names it.
_HINTS = {"features": "the features are made from the rollout's images: pass images to for_batch"}


@dataclass
class AdvantageSettings:
    """From rewards to advantages.

    Args:
        std: normalise by the std of all rewards (``"global"``) or of each group. Under
            ``aggregation: gdpo``: the scale of each component's normalisation, its std within the group
            (``"group"``, the GDPO paper's) or over the batch (``"global"``).
        filter_zero: skip samples whose advantage is exactly 0 (saturated groups carry no gradient).
        max_reward_failure_rate: stop the run when more than this fraction of a batch fails to be
            scored (1.0 never stops on that ground).
        max_idle_rollouts: stop the run after this many consecutive rollouts without an optimizer step
            (every sample unscored or filtered, or every gradient non-finite): such a run would never
            reach ``max_steps``.
        aggregation: ``"sum"``: the weighted sum of the reward components is normalised within its
            group (Flow-GRPO). ``"gdpo"``: each weighted component is normalised within its group, the
            weighted sum of those is normalised over the batch (GDPO, arXiv:2601.05242), so a component
            with a wide spread cannot drown one with a narrow spread, and distinct combinations of
            component scores keep distinct advantages. Needs a ``MultiReward`` with at least two non-zero
            weights. A component a sample lacks (NaN) is left out of that sample's sum (its other
            components keep their weights); a component a whole group lacks is left out of that group,
            counted in ``reward/nan_groups/<component>``; a group no component scored is not trained on
            (``reward/unscored_groups``).
        diversity_bonus: GARDO's diversity-aware advantage (:class:`DiversityBonus`); ``None``: off.
    """

    std: Literal["global", "group"] = "global"
    filter_zero: bool = False
    max_reward_failure_rate: float = 1.0
    max_idle_rollouts: int = 5
    aggregation: Literal["sum", "gdpo"] = "sum"
    diversity_bonus: DiversityBonus | None = None

    def problems(self, flag: str = "--model.init_args.advantage", reward: Any = None) -> list[str]:
        """Every problem with these settings, and with ``reward`` for this aggregation (empty when fine)."""
        p = []
        if not 0 < self.max_reward_failure_rate <= 1:
            p.append(f"{flag}.max_reward_failure_rate ({self.max_reward_failure_rate}) must lie in (0, 1]")
        if self.max_idle_rollouts < 1:
            p.append(f"{flag}.max_idle_rollouts ({self.max_idle_rollouts}) must be at least 1")
        if self.aggregation not in AGGREGATIONS:
            p.append(f"{flag}.aggregation ({self.aggregation!r}) must be one of {', '.join(AGGREGATIONS)}")
        elif self.aggregation == "gdpo" and reward is not None:
            p += _gdpo_reward_problems(flag, reward)
        if self.diversity_bonus is not None:
            p += self.diversity_bonus.problems(f"{flag}.diversity_bonus")
        return p

    def transforms(
        self, reward: MultiReward, components: Mapping[str, Tensor], gate: KLGateController | None = None
    ) -> list[AdvantageTransform]:
        """The stage's transforms in the order they run, for a batch of ``reward`` with ``components``
        (``gate``: the run's KL gate controller, if it has one).

        The normalisation first (the total's or, under ``gdpo``, each weighted component's), the failure
        budget, the diversity bonus, ``filter_zero`` (after every transform that moves an advantage),
        and the KL gate last (its weights are normalised over the samples the update trains)."""
        if self.aggregation == "gdpo":
            terms = reward.weighted_components(components)
            steps: list[AdvantageTransform] = [
                GDPONormalisation({key: w for key, (w, _) in terms.items()}, std=self.std)
            ]
        else:
            steps = [GroupNormalisation(std=self.std)]
        steps.append(FailureBudget(self.max_reward_failure_rate))
        if self.diversity_bonus is not None:
            steps.append(DiversityScaling(self.diversity_bonus.distance))
        if self.filter_zero:
            steps.append(DropZeroAdvantages())
        if gate is not None:
            steps.append(GatedKL(gate))
        return steps

    def advantages(self, rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, float]:
        """Advantages of every rank's samples from their total rewards (``aggregation: sum``), and the
        fraction that could not be scored.

        Args:
            rewards: (N,) rewards of all ranks; NaN/inf where a sample could not be scored.
            group_ids: (N,) integer group of each sample.

        Returns:
            ((N,) advantages, 0 where unscored; the failure rate). Raises when the failure rate is
            above ``max_reward_failure_rate``.
        """
        failure_rate = FailureBudget(self.max_reward_failure_rate).rate(torch.isfinite(rewards))
        columns = Columns({"total": rewards, "group_ids": group_ids})
        state = GroupNormalisation(std=self.std)(AdvantageState.start(columns, rewards.device))
        return state.values, failure_rate

    def for_batch(
        self,
        rewards: RewardOutput,
        group_ids: Tensor,
        reward: MultiReward,
        dp: DataParallel,
        images: Tensor | None = None,
        gate: KLGateController | None = None,
    ) -> BatchAdvantages:
        """This rank's advantages of one rollout batch, from every rank's rewards.

        The columns the transforms declare (:meth:`transforms`) are gathered from every rank in one
        collective, and the transforms run on them in order.

        Args:
            rewards: this rank's :class:`~lit_flowgrpo.rewards.base.RewardOutput` (B samples).
            group_ids: (B,) int64 group of each sample, on the device the advantages are wanted on.
            reward: the reward that produced ``rewards`` (its weights, for ``aggregation: gdpo``).
            dp: the data-parallel peers whose rewards are gathered.
            images: (B, 3, H, W) this rank's samples; read by ``diversity_bonus`` only (the
                ``features`` column).
            gate: the run's KL gate controller (:class:`~lit_flowgrpo.advantages.KLGateController`), which
                weighs the KL penalty per sample and moves its gated share here.

        Raises:
            MissingColumnError: a transform needs a column this batch lacks (a reward component the
                reward did not produce, or ``features`` without ``images``), before the collective.
        """
        device, batch = group_ids.device, len(group_ids)
        steps = self.transforms(reward, rewards.components, gate)
        local = self._local_columns(rewards, group_ids, images)
        names = declared_columns(steps, local, _HINTS)
        state = AdvantageState.start(Columns.gather(local, names, dp, device), device)
        for step in steps:
            state = step(state)
        # Over all ranks: rank 0 warns for every rank's, and the module's counter counts them all.
        dropped = int((~state.scored).sum())
        if dropped:
            rank_zero_warn(
                f"{dropped} of {state.scored.numel()} samples have no finite reward: dropped from the advantages"
            )
        adv = state.values
        return BatchAdvantages(
            dp.mine(adv, batch),
            dp.mine(state.scored, batch),
            dropped,
            state.log,
            dp.mine(state.kl_weights.to(adv.device), batch),
            dp.mine(state.keep.to(adv.device), batch),
        )

    def _local_columns(
        self, rewards: RewardOutput, group_ids: Tensor, images: Tensor | None
    ) -> dict[str, Tensor | Callable[[], Tensor]]:
        """This rank's columns by name: the built-in ones and every reward component under its key."""
        clash = sorted(set(rewards.components) & set(BUILT_IN_COLUMNS))
        if clash:
            raise ValueError(
                f"the reward's components {clash} share a name with the advantage stage's own columns "
                f"{list(BUILT_IN_COLUMNS)}: rename the reward in {flag_of('reward')}.weights"
            )
        local: dict[str, Tensor | Callable[[], Tensor]] = {
            "total": rewards.total,
            "group_ids": group_ids,
            **rewards.components,
        }
        if images is not None and self.diversity_bonus is not None:
            local["features"] = partial(self.diversity_bonus.features, images)  # pooled only when asked for
        return local


@dataclass
class BatchAdvantages:
    """One rollout batch's advantages as this rank trains them, and what the stage reports."""

    values: Tensor
    """(B,) fp32: this rank's advantages, 0 where unscored."""
    scored: Tensor
    """(B,) bool: this rank's samples that have an advantage; the rest are never trained on."""
    dropped: int
    """The samples without one, over all ranks."""
    log: dict[str, float] = field(default_factory=dict)
    """Over all ranks: ``reward/failure_rate``; under ``aggregation: gdpo`` also
    ``reward/nan_groups/<component>`` and ``reward/unscored_groups``; under a KL gate
    ``actor/kl_gated_fraction`` and ``actor/kl_gate_target``; under ``diversity_bonus``
    ``critic/advantages/diversity_scale_max``."""
    kl_weights: Tensor | None = None
    """(B,) fp32: this rank's weights of the KL penalty (all 1 without a KL gate); their mean over
    every rank's trained samples is 1 where any is gated."""
    keep: Tensor | None = None
    """(B,) bool: this rank's samples the update trains: ``scored``, and a non-zero advantage under
    ``filter_zero`` (``None``: ``scored``)."""


def _gdpo_reward_problems(flag: str, reward: Any) -> list[str]:
    """GDPO normalises each weighted component on its own: a reward with fewer than two is refused."""
    fix = f"or use {flag}.aggregation=sum"
    if isinstance(reward, CallableReward) or not isinstance(reward, MultiReward):
        return [
            f"{flag}.aggregation=gdpo normalises each weighted reward component on its own, but "
            f"{MODEL}.reward is a plain callable (one total): give a MultiReward "
            f"with at least two non-zero weights, e.g. {{shapes/strict: 1.0, shapes/partial: 0.5}}, {fix}"
        ]
    weighted = [key for key, weight in reward.weights.items() if weight != 0]
    if len(weighted) >= 2:
        return []
    return [
        f"{flag}.aggregation=gdpo normalises each weighted reward component on its own and needs at least "
        f"two, but {flag_of('reward')}.weights gives {len(weighted)} a non-zero weight ({reward.weights}): "
        f"weight a second component, e.g. {{shapes/strict: 1.0, shapes/partial: 0.5}}, {fix}"
    ]
