"""Model families behind one small interface (see :mod:`lit_flowgrpo.policies.base`).

The toy world's policy is a plugin: ``lit_flowgrpo.toy.ToyPolicy``.
"""

from lit_flowgrpo.policies.base import FlowPolicy
from lit_flowgrpo.policies.flux import FluxPolicy
from lit_flowgrpo.policies.flux2 import Flux2DevPolicy, Flux2KleinPolicy
from lit_flowgrpo.policies.flux_kontext import FluxKontextPolicy
from lit_flowgrpo.policies.hunyuanvideo15 import HunyuanVideo15Policy
from lit_flowgrpo.policies.packed import PackedLatentPolicy
from lit_flowgrpo.policies.qwenimage import QwenImagePolicy
from lit_flowgrpo.policies.qwenimage_edit import QwenImageEditPlusPolicy
from lit_flowgrpo.policies.sd3 import SD3Policy
from lit_flowgrpo.policies.wan import WanPolicy
from lit_flowgrpo.policies.wan_i2v import WanImageToVideoPolicy
from lit_flowgrpo.policies.zimage import ZImagePolicy

__all__ = [
    "FlowPolicy",
    "Flux2DevPolicy",
    "Flux2KleinPolicy",
    "FluxKontextPolicy",
    "FluxPolicy",
    "HunyuanVideo15Policy",
    "PackedLatentPolicy",
    "QwenImageEditPlusPolicy",
    "QwenImagePolicy",
    "SD3Policy",
    "WanImageToVideoPolicy",
    "WanPolicy",
    "ZImagePolicy",
]
