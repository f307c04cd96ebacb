"""The embedded toy world, a plugin above the core: shapes renderer and prompts (``world``), the
verifier (``verifier``) behind the ``shapes`` reward (``reward``), the tiny model that learns to draw
it (``model``, ``pretrain``) and its policy (``policy``).

Video prompts (``video_world``) and their verifier (``video_verifier``) are behind ``shapes_video``;
the tiny video model that learns to draw them (``video_model``, ``video_pretrain``) and its policy
(``video_policy``, :class:`ToyVideoPolicy`) run ``configs/quickstart_video.yaml``.

Editing (``edit_world``: source scenes, instructions and their exact targets; ``edit_verifier`` behind
the ``shapes_edit`` reward, ``edit_reward``) has its own tiny model (``edit_model``, ``edit_pretrain``)
and policy (``edit_policy``, :class:`ToyEditPolicy`, the source image concatenated to the U-Net's input),
run by ``configs/quickstart_edit.yaml``.

Importing this package registers the ``shapes`` reward, its gameable proxy ``shapes_color`` and the
video reward ``shapes_video`` and the editing reward ``shapes_edit``; the core (``lit_flowgrpo.policies``,
``lit_flowgrpo.rewards``, the module) imports nothing from it.
"""

from lit_flowgrpo.toy.edit_policy import ToyEditPolicy
from lit_flowgrpo.toy.edit_reward import ShapesEditReward
from lit_flowgrpo.toy.policy import ToyPolicy
from lit_flowgrpo.toy.reward import ColorCoverageReward, ShapesReward, ShapesVideoReward
from lit_flowgrpo.toy.video_policy import ToyVideoPolicy

__all__ = [
    "ColorCoverageReward",
    "ShapesEditReward",
    "ShapesReward",
    "ShapesVideoReward",
    "ToyEditPolicy",
    "ToyPolicy",
    "ToyVideoPolicy",
]
