"""Rewards: one module per family, a registry by name, and the weighted sum.

Importing this package registers every built-in family. Optional dependencies (the OCR engine,
the hub client) are imported when a reward is built or first used, never here, so a missing one
only fails the reward that needs it. Plugins register their own rewards when imported: the toy
world's ``shapes`` and ``shapes_video`` rewards come with ``import lit_flowgrpo.toy``.
"""

from lit_flowgrpo.rewards import (
    aesthetic,
    clip_score,
    edit,
    geneval,
    group,
    hps,
    image_reward,
    jpeg,
    ocr,
    pickscore,
    preservation,
    served,
    video,
    video_align,
    vlm_judge,
)
from lit_flowgrpo.rewards.base import (
    DEFAULT_MODALITIES,
    MultiReward,
    RewardOutput,
    as_reward,
    modality_problems,
    reward_modalities,
)
from lit_flowgrpo.rewards.registry import Reward, available_rewards, build_reward, register_reward
from lit_flowgrpo.rewards.remote import RemoteEndpoint, RemoteRewardError
from lit_flowgrpo.rewards.video import PerFrame, TemporalConsistencyReward

__all__ = [
    "DEFAULT_MODALITIES",
    "MultiReward",
    "PerFrame",
    "RemoteEndpoint",
    "RemoteRewardError",
    "Reward",
    "RewardOutput",
    "TemporalConsistencyReward",
    "aesthetic",
    "as_reward",
    "available_rewards",
    "build_reward",
    "clip_score",
    "edit",
    "geneval",
    "group",
    "hps",
    "image_reward",
    "jpeg",
    "modality_problems",
    "ocr",
    "pickscore",
    "preservation",
    "register_reward",
    "reward_modalities",
    "served",
    "video",
    "video_align",
    "vlm_judge",
]
