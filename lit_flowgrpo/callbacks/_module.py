"""What the callbacks read from a LightningModule and its step outputs, duck-typed.

The callbacks work with ``FlowGRPOModule`` and with a user's own module that returns less: every
reader here answers ``None`` (or an empty mapping) rather than failing when something is missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def as_mapping(outputs: Any) -> Mapping[str, Any]:
    """A step's output as a mapping (see :mod:`lit_flowgrpo.step_output`); anything else reads as empty.

    >>> as_mapping({"num_images": 8})["num_images"], dict(as_mapping(None))
    (8, {})
    """
    return outputs if isinstance(outputs, Mapping) else {}


def image_size(pl_module: Any) -> tuple[int, int] | None:
    """(height, width) the module generates at: ``pl_module.sampler.{height,width}``, else
    ``pl_module.{height,width}``, else None.

    >>> from types import SimpleNamespace as NS
    >>> image_size(NS(sampler=NS(height=512, width=768))), image_size(NS(height=32, width=16)), image_size(NS())
    ((512, 768), (32, 16), None)
    """
    for owner in (getattr(pl_module, "sampler", None), pl_module):
        height, width = getattr(owner, "height", None), getattr(owner, "width", None)
        if height is not None and width is not None:
            return int(height), int(width)
    return None


def optimizer_steps_per_rollout(pl_module: Any) -> int | None:
    """Optimizer steps one rollout batch takes: ``optimizer_steps_per_rollout × num_inner_epochs``.

    Read from ``pl_module.update`` (the module's update settings), else from the module itself;
    ``num_inner_epochs`` defaults to 1 where absent. None when the module does not say.

    >>> from types import SimpleNamespace as NS
    >>> optimizer_steps_per_rollout(NS(update=NS(optimizer_steps_per_rollout=2, num_inner_epochs=3)))
    6
    >>> optimizer_steps_per_rollout(NS(optimizer_steps_per_rollout=2)), optimizer_steps_per_rollout(NS())
    (2, None)
    """
    for owner in (getattr(pl_module, "update", None), pl_module):
        steps = getattr(owner, "optimizer_steps_per_rollout", None)
        if isinstance(steps, int) and steps > 0:
            epochs = getattr(owner, "num_inner_epochs", 1)
            return steps * (epochs if isinstance(epochs, int) and epochs > 0 else 1)
    return None
