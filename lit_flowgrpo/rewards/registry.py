"""What a reward is, and the registry that builds one by name for YAML.

Each family's file registers its rewards with :func:`register_reward` when it is imported; this file
imports none of them, so it sits below them all. Importing any module of ``lit_flowgrpo.rewards``
runs the package's ``__init__`` first, which imports every built-in family: by the time anything can
call :func:`build_reward` or :func:`available_rewards`, the built-ins are registered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

__all__ = [
    "Reward",
    "RewardValue",
    "available_rewards",
    "build_reward",
    "qualname",
    "register_reward",
    "unknown_rewards_hint",
]

RewardValue = Tensor | dict[str, Tensor]


@runtime_checkable
class Reward(Protocol):
    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> RewardValue: ...


_REGISTRY: dict[str, Callable[..., Reward]] = {}

#: Rewards that a plugin registers when it is imported, and how to get them. Only text: the core
#: imports no plugin, so naming one of these without its plugin fails with this hint.
_PLUGIN_REWARDS = {
    "shapes": (
        "the toy world's reward, registered by `import lit_flowgrpo.toy` (a config does that by naming "
        "one of its classes, e.g. --model.init_args.policy.class_path lit_flowgrpo.toy.ToyPolicy)"
    ),
    "shapes_video": (
        "the toy world's video reward, registered by `import lit_flowgrpo.toy` (a config does that by naming "
        "one of its classes, e.g. --model.init_args.policy.class_path lit_flowgrpo.toy.ToyPolicy)"
    ),
    "shapes_color": (
        "the toy world's gameable proxy reward, registered by `import lit_flowgrpo.toy` (a config does that "
        "by naming one of its classes, e.g. --model.init_args.policy.class_path lit_flowgrpo.toy.ToyPolicy)"
    ),
}


def register_reward(name: str) -> Callable[[Callable[..., Reward]], Callable[..., Reward]]:
    """Class or factory decorator: make a reward buildable by ``name`` from YAML."""

    def wrap(factory: Callable[..., Reward]) -> Callable[..., Reward]:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"reward name {name!r} is already registered by {_REGISTRY[name]!r}")
        _REGISTRY[name] = factory
        return factory

    return wrap


def available_rewards() -> list[str]:
    """The names :func:`build_reward` accepts, sorted."""
    return sorted(_REGISTRY)


def build_reward(name: str, **kwargs: Any) -> Reward:
    """Instantiate the reward registered as ``name`` with ``kwargs``."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown reward {name!r}: {unknown_rewards_hint([name])}")
    return _REGISTRY[name](**kwargs)


def unknown_rewards_hint(names: Sequence[str]) -> str:
    """What to do about reward names that are not registered: the registered ones, and the plugin
    that registers a name the core knows of."""
    hints = "".join(f"; {n!r} is {_PLUGIN_REWARDS[n]}" for n in names if n in _PLUGIN_REWARDS)
    return (
        f"registered rewards are {sorted(_REGISTRY)}{hints}; register a new one with "
        "@lit_flowgrpo.rewards.register_reward"
    )


def qualname(reward: Any) -> str:
    """``__qualname__`` of a function, or of the class of a callable object: how messages name a reward."""
    return getattr(reward, "__qualname__", None) or type(reward).__qualname__
