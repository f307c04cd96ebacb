"""Pure tensor math: from rewards to advantages, the policy losses (Flow-GRPO, GRPO-Guard, Flow-DPPO,
DiffusionNFT), and the KL.

Every function takes tensors and returns tensors; the module, the advantage stage and the metrics hold
the state. One concern per file:

- :mod:`~lit_flowgrpo.algorithms.advantages`: group advantages, GDPO, GARDO's uncertainty, KL gate and
  diversity multipliers;
- :mod:`~lit_flowgrpo.algorithms.losses`: the ratio losses, their :class:`PolicyStats`, and the KL to
  the reference;
- :mod:`~lit_flowgrpo.algorithms.nft`: DiffusionNFT's loss and schedules;
- :mod:`~lit_flowgrpo.algorithms.data_losses`: the losses on given images, SFT and Diffusion-DPO.

Import from here (``from lit_flowgrpo.algorithms import flow_grpo_loss``): the files are a layout,
this is the API.
"""

from lit_flowgrpo.algorithms.advantages import (
    GDPOAdvantages,
    diversity_multipliers,
    gardo_uncertainty,
    gated_kl_weights,
    gdpo_advantages,
    group_advantages,
    win_rates,
)
from lit_flowgrpo.algorithms.data_losses import (
    DPOStats,
    WeightingScheme,
    diffusion_dpo_loss,
    flow_matching_errors,
    preference_pairs,
    sft_loss,
    training_sigma,
)
from lit_flowgrpo.algorithms.losses import (
    DPPOStats,
    PolicyStats,
    clip_range_problems,
    flow_dppo_loss,
    flow_grpo_loss,
    gaussian_step_kl,
    grpo_guard_loss,
    kl_to_reference,
    ratio_norm_loss,
    resolve_clip_range_high,
)
from lit_flowgrpo.algorithms.nft import (
    NFT_DECAY_SCHEDULES,
    NFTRewardMode,
    NFTStats,
    nft_loss,
    nft_old_policy_decay,
    nft_reward_probability,
    nft_sample_times,
)

__all__ = [
    "NFT_DECAY_SCHEDULES",
    "DPOStats",
    "DPPOStats",
    "GDPOAdvantages",
    "NFTRewardMode",
    "NFTStats",
    "PolicyStats",
    "WeightingScheme",
    "clip_range_problems",
    "diffusion_dpo_loss",
    "diversity_multipliers",
    "flow_dppo_loss",
    "flow_grpo_loss",
    "flow_matching_errors",
    "gardo_uncertainty",
    "gated_kl_weights",
    "gaussian_step_kl",
    "gdpo_advantages",
    "group_advantages",
    "grpo_guard_loss",
    "kl_to_reference",
    "nft_loss",
    "nft_old_policy_decay",
    "nft_reward_probability",
    "nft_sample_times",
    "preference_pairs",
    "ratio_norm_loss",
    "resolve_clip_range_high",
    "sft_loss",
    "training_sigma",
    "win_rates",
]
