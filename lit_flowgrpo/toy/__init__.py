"""The embedded toy world, a plugin above the core: shapes renderer and prompts (``world``), the
verifier (``verifier``) behind the ``shapes`` reward (``reward``), the tiny model that learns to draw
it (``model``, ``pretrain``) and its policy (``policy``).

Video prompts (``video_world``) and their verifier (``video_verifier``) are behind ``shapes_video``;
the tiny video model that learns to draw them (``video_model``, ``video_pretrain``) and its policy
(``video_policy``, :class:`ToyVideoPolicy`) run ``configs/quickstart_video.yaml``.

Importing this package registers the ``shapes`` reward, its gameable proxy ``shapes_color`` and the
video reward ``shapes_video``; the core (``lit_flowgrpo.policies``, ``lit_flowgrpo.rewards``, the
module) imports nothing from it.
"""

from lit_flowgrpo.toy.policy import ToyPolicy
from lit_flowgrpo.toy.reward import ColorCoverageReward, ShapesReward, ShapesVideoReward
from lit_flowgrpo.toy.video_policy import ToyVideoPolicy

__all__ = ["ColorCoverageReward", "ShapesReward", "ShapesVideoReward", "ToyPolicy", "ToyVideoPolicy"]
