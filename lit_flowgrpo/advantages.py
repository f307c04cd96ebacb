"""From rewards to advantages: the settings of the advantage stage and its one function.

The math is :func:`lit_flowgrpo.algorithms.group_advantages`; this stage adds what a run needs around
it: unscored samples are dropped (never turned into a number), and a batch that fails too often
stops the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from lit_flowgrpo.algorithms import group_advantages

__all__ = ["AdvantageSettings"]


@dataclass
class AdvantageSettings:
    """From rewards to advantages.

    Args:
        std: normalise by the std of all rewards (``"global"``) or of each group.
        filter_zero: skip samples whose advantage is exactly 0 (saturated groups carry no gradient).
        max_reward_failure_rate: stop the run when more than this fraction of a batch fails to be
            scored (1.0 never stops on that ground).
        max_idle_rollouts: stop the run after this many consecutive rollouts without an optimizer step
            (every sample unscored or filtered, or every gradient non-finite): such a run would never
            reach ``max_steps``.
    """

    std: Literal["global", "group"] = "global"
    filter_zero: bool = False
    max_reward_failure_rate: float = 1.0
    max_idle_rollouts: int = 5

    def problems(self, flag: str = "--model.init_args.advantage") -> list[str]:
        p = []
        if not 0 < self.max_reward_failure_rate <= 1:
            p.append(f"{flag}.max_reward_failure_rate ({self.max_reward_failure_rate}) must lie in (0, 1]")
        if self.max_idle_rollouts < 1:
            p.append(f"{flag}.max_idle_rollouts ({self.max_idle_rollouts}) must be at least 1")
        return p

    def advantages(self, rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, float]:
        """Advantages of every rank's samples, and the fraction that could not be scored.

        Args:
            rewards: (N,) rewards of all ranks; NaN/inf where a sample could not be scored.
            group_ids: (N,) integer group of each sample.

        Returns:
            ((N,) advantages, 0 where unscored; the failure rate). Raises when the failure rate is
            above ``max_reward_failure_rate``.
        """
        valid = torch.isfinite(rewards)
        scored = int(valid.sum())  # one host read per rollout
        failure_rate = 1 - scored / max(rewards.numel(), 1)
        if failure_rate > self.max_reward_failure_rate:
            raise RuntimeError(
                f"{failure_rate:.0%} of the batch could not be scored (more than "
                f"--model.init_args.advantage.max_reward_failure_rate {self.max_reward_failure_rate}): check the "
                "reward's endpoint or inputs"
            )
        adv = torch.zeros_like(rewards)
        if scored:
            adv[valid] = group_advantages(rewards[valid], group_ids[valid], std=self.std)
        return adv, failure_rate
