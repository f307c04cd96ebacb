"""From rewards to advantages: the settings of the advantage stage and its one function.

The math is :func:`lit_flowgrpo.algorithms.group_advantages` (``aggregation: sum``: the weighted sum of
the reward components, normalised within its group) or :func:`~lit_flowgrpo.algorithms.gdpo_advantages`
(``aggregation: gdpo``: each weighted component normalised within its group, then combined and
normalised over the batch). This stage adds what a run needs around it: every rank's rewards are
gathered first, so a group that spans ranks is normalised whole and N ranks compute what one would;
unscored samples are dropped (never turned into a number), counted and reported; and a batch that fails
too often stops the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lit_flowgrpo.algorithms import gdpo_advantages, group_advantages
from lit_flowgrpo.distributed import DataParallel
from lit_flowgrpo.errors import MODEL
from lit_flowgrpo.errors import flag as flag_of
from lit_flowgrpo.rewards.base import CallableReward, MultiReward, RewardOutput

__all__ = ["AGGREGATIONS", "AdvantageSettings", "BatchAdvantages"]

#: How the reward components become one advantage (:attr:`AdvantageSettings.aggregation`).
AGGREGATIONS = ("sum", "gdpo")


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
    """

    std: Literal["global", "group"] = "global"
    filter_zero: bool = False
    max_reward_failure_rate: float = 1.0
    max_idle_rollouts: int = 5
    aggregation: Literal["sum", "gdpo"] = "sum"

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
        return p

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
        valid = torch.isfinite(rewards)
        failure_rate = self._failure_rate(valid)
        adv = torch.zeros_like(rewards)
        if failure_rate < 1:
            adv[valid] = group_advantages(rewards[valid], group_ids[valid], std=self.std)
        return adv, failure_rate

    def for_batch(
        self, rewards: RewardOutput, group_ids: Tensor, reward: MultiReward, dp: DataParallel
    ) -> BatchAdvantages:
        """This rank's advantages of one rollout batch, from every rank's rewards.

        Args:
            rewards: this rank's :class:`~lit_flowgrpo.rewards.base.RewardOutput` (B samples).
            group_ids: (B,) int64 group of each sample, on the device the advantages are wanted on.
            reward: the reward that produced ``rewards`` (its weights, for ``aggregation: gdpo``).
            dp: the data-parallel peers whose rewards are gathered.
        """
        device, batch = group_ids.device, len(group_ids)
        terms = reward.weighted_components(rewards.components) if self.aggregation == "gdpo" else {}
        rows = [rewards.total, group_ids.float(), *(value for _, value in terms.values())]
        # One gather of every rank's rows (rank-major: the one-process order of the step's samples).
        gathered = dp.gather(torch.stack([r.to(device, torch.float32) for r in rows]))  # (2 + C, W·B)
        ids = gathered[1].long()
        log: dict[str, float] = {}
        if self.aggregation == "gdpo":
            done = gdpo_advantages(gathered[2:], [w for w, _ in terms.values()], ids, std=self.std)
            failure_rate = self._failure_rate(done.scored)
            adv, scored = done.advantages, done.scored
            log.update(_gdpo_report(list(terms), done.empty_groups, ids, scored))
        else:
            adv, failure_rate = self.advantages(gathered[0], ids)
            scored = torch.isfinite(gathered[0])
        log["reward/failure_rate"] = failure_rate
        mine = dp.mine(scored, batch)
        dropped = int((~mine).sum())
        if dropped:
            rank_zero_warn(f"{dropped} of {batch} samples have no finite reward: dropped from the advantages")
        return BatchAdvantages(dp.mine(adv, batch), mine, dropped, log)

    def _failure_rate(self, scored: Tensor) -> float:
        """The fraction of ``scored`` that is False; raises above ``max_reward_failure_rate``."""
        failure_rate = 1 - int(scored.sum()) / max(scored.numel(), 1)  # one host read per rollout
        if failure_rate > self.max_reward_failure_rate:
            raise RuntimeError(
                f"{failure_rate:.0%} of the batch could not be scored (more than "
                f"--model.init_args.advantage.max_reward_failure_rate {self.max_reward_failure_rate}): check the "
                "reward's endpoint or inputs"
            )
        return failure_rate


@dataclass
class BatchAdvantages:
    """One rollout batch's advantages as this rank trains them, and what the stage reports."""

    values: Tensor
    """(B,) fp32: this rank's advantages, 0 where unscored."""
    scored: Tensor
    """(B,) bool: this rank's samples that have an advantage; the rest are never trained on."""
    dropped: int
    """This rank's samples without one."""
    log: dict[str, float] = field(default_factory=dict)
    """Over all ranks: ``reward/failure_rate``; under ``aggregation: gdpo`` also
    ``reward/nan_groups/<component>`` and ``reward/unscored_groups``."""


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


def _gdpo_report(keys: list[str], empty_groups: Tensor, ids: Tensor, scored: Tensor) -> dict[str, float]:
    """``reward/nan_groups/<component>`` and ``reward/unscored_groups`` of one batch (all ranks), each
    warned about when not 0: never a silent gap in what is trained."""
    num_groups = int(torch.unique(ids).numel())
    log = {}
    for key, count in zip(keys, empty_groups.tolist(), strict=True):
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
