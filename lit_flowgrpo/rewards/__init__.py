"""Rewards: one module per family, a registry by name, and the weighted sum.

Importing this package registers every built-in family. Optional dependencies (the OCR engine,
the hub client) are imported when a reward is built or first used, never here, so a missing one
only fails the reward that needs it. Plugins register their own rewards when imported: the toy
world's ``shapes`` reward comes with ``import lit_flowgrpo.toy``.
"""

from lit_flowgrpo.rewards import aesthetic, clip_score, geneval, jpeg, ocr, pickscore, vlm_judge
from lit_flowgrpo.rewards.base import (
    MultiReward,
    Reward,
    RewardOutput,
    as_reward,
    available_rewards,
    build_reward,
    register_reward,
)
from lit_flowgrpo.rewards.remote import RemoteEndpoint, RemoteRewardError

__all__ = [
    "MultiReward",
    "RemoteEndpoint",
    "RemoteRewardError",
    "Reward",
    "RewardOutput",
    "aesthetic",
    "as_reward",
    "available_rewards",
    "build_reward",
    "clip_score",
    "geneval",
    "jpeg",
    "ocr",
    "pickscore",
    "register_reward",
    "vlm_judge",
]
