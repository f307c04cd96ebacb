"""Flow-GRPO and GRPO-Guard for flow-matching text-to-image models, as PyTorch Lightning parts.

Exports are resolved on first use, so importing a leaf module (``lit_flowgrpo.toy.world``, a spawned
DDP worker) does not pay for Lightning and diffusers up front.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "AdvantageSettings": "lit_flowgrpo.advantages",
    "DiagnosticsSettings": "lit_flowgrpo.metrics",
    "DiffusionDPO": "lit_flowgrpo.data_objective",
    "DiversityBonus": "lit_flowgrpo.advantages",
    "FlowDPPO": "lit_flowgrpo.objective",
    "FlowGRPO": "lit_flowgrpo.objective",
    "FlowGRPOModule": "lit_flowgrpo.module",
    "FSDP2Strategy": "lit_flowgrpo.strategies",
    "GRPOGuard": "lit_flowgrpo.objective",
    "GRPOGuardRatioNorm": "lit_flowgrpo.objective",
    "GroupSampler": "lit_flowgrpo.data",
    "ImageDataModule": "lit_flowgrpo.image_data",
    "KLGate": "lit_flowgrpo.kl",
    "KLSettings": "lit_flowgrpo.kl",
    "LoraSettings": "lit_flowgrpo.weights",
    "WeightsSettings": "lit_flowgrpo.weights",
    "Objective": "lit_flowgrpo.objective",
    "PerformanceSettings": "lit_flowgrpo.performance",
    "PromptBatch": "lit_flowgrpo.data",
    "PromptDataModule": "lit_flowgrpo.data",
    "ReferenceSettings": "lit_flowgrpo.kl",
    "SFT": "lit_flowgrpo.data_objective",
    "Sampler": "lit_flowgrpo.rollout",
    "UpdateSettings": "lit_flowgrpo.update",
}

__all__ = [
    "SFT",
    "AdvantageSettings",
    "DiagnosticsSettings",
    "DiffusionDPO",
    "DiversityBonus",
    "FSDP2Strategy",
    "FlowDPPO",
    "FlowGRPO",
    "FlowGRPOModule",
    "GRPOGuard",
    "GRPOGuardRatioNorm",
    "GroupSampler",
    "ImageDataModule",
    "KLGate",
    "KLSettings",
    "LoraSettings",
    "Objective",
    "PerformanceSettings",
    "PromptBatch",
    "PromptDataModule",
    "ReferenceSettings",
    "Sampler",
    "UpdateSettings",
    "WeightsSettings",
]

if TYPE_CHECKING:
    from lit_flowgrpo.advantages import AdvantageSettings, DiversityBonus
    from lit_flowgrpo.data import GroupSampler, PromptBatch, PromptDataModule
    from lit_flowgrpo.data_objective import SFT, DiffusionDPO
    from lit_flowgrpo.image_data import ImageDataModule
    from lit_flowgrpo.kl import KLGate, KLSettings, ReferenceSettings
    from lit_flowgrpo.metrics import DiagnosticsSettings
    from lit_flowgrpo.module import FlowGRPOModule
    from lit_flowgrpo.objective import FlowDPPO, FlowGRPO, GRPOGuard, GRPOGuardRatioNorm, Objective
    from lit_flowgrpo.performance import PerformanceSettings
    from lit_flowgrpo.rollout import Sampler
    from lit_flowgrpo.strategies import FSDP2Strategy
    from lit_flowgrpo.update import UpdateSettings
    from lit_flowgrpo.weights import LoraSettings, WeightsSettings


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lit_flowgrpo' has no attribute {name!r}")
