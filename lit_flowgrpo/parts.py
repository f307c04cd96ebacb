"""The lifecycle of every part of a run that carries state from one rollout to the next.

A part is anything whose state a resumed run must get back for the run to go on as if it had never
stopped: the copies of the weights (the KL reference when it moves, DiffusionNFT's old policy), the
KL gate's controller, the guard against rollouts that make no progress, the run's counters, and
whatever the next capability adds (a running reward baseline, an SFT data cursor). Each part:

- says where its state sits in a checkpoint (``key``),
- saves and restores itself (``state_dict`` / ``load_state_dict``, as ``nn.Module`` and Lightning's
  callbacks do: plain values and tensors; a sharded copy's tensors are this rank's shards, which the
  FSDP2 strategy saves as such),
- and moves once after each update (``after_update``), given what the update did.

:class:`~lit_flowgrpo.module.FlowGRPOModule` keeps a :class:`Parts` list and loops over it to
checkpoint, restore and move; a new part registers once and adds no line to the module's hooks.
Nothing here changes state inside logging: logging reads what ``after_update`` left.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["AfterUpdate", "Counters", "Part", "Parts"]


@dataclass(frozen=True)
class AfterUpdate:
    """What one rollout's update did, as every rank sees it (the same values on every rank).

    Args:
        policy: the policy the update trained (its networks hold the new weights).
        optimizer_steps: optimizer steps taken since the run began, this update's included.
        update_steps: the optimizer steps this update took (0: it changed no weight).
        losses: the update's mean losses over every rank's micro-batches (``actor/loss``,
            ``actor/pg_loss``, ``actor/kl_loss``) and how many there were (``count``).
    """

    policy: Any
    optimizer_steps: int
    update_steps: int
    losses: dict[str, float] = field(default_factory=dict)

    @property
    def kl(self) -> float:
        """The update's mean KL to the reference over every rank (NaN when no loss was computed)."""
        return self.losses["actor/kl_loss"] if self.losses.get("count") else float("nan")


@runtime_checkable
class Part(Protocol):
    """What a part with state implements (see the module docstring)."""

    #: Where the part's state sits in the checkpoint's ``lit_flowgrpo`` entry; unique among the parts.
    key: str

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...

    def after_update(self, done: AfterUpdate) -> None: ...


class Parts:
    """The parts of a run, in the order they move after an update."""

    def __init__(self, parts: Iterable[Part] = ()) -> None:
        self._parts: list[Part] = []
        for part in parts:
            self.add(part)

    def add(self, part: Part) -> Part:
        """Register ``part``; its ``key`` must be new. Returns it."""
        if not isinstance(part, Part):
            raise TypeError(
                f"{type(part).__name__} is not a part: it needs key, state_dict, load_state_dict and after_update"
            )
        if any(p.key == part.key for p in self._parts):
            raise ValueError(f"two parts save under the key {part.key!r}: give each part its own")
        self._parts.append(part)
        return part

    def __iter__(self) -> Iterator[Part]:
        return iter(self._parts)

    def __len__(self) -> int:
        return len(self._parts)

    def state_dict(self) -> dict[str, Any]:
        """Every part's state, by its key."""
        return {part.key: part.state_dict() for part in self._parts}

    def load_state_dict(self, states: dict[str, Any]) -> None:
        """Give each part its state from ``states``. A part whose key is absent is told so through
        ``load_state_dict(None)``: it decides whether it can start afresh (the counters) or the
        checkpoint was written by another run (an old policy that was never saved)."""
        for part in self._parts:
            part.load_state_dict(states.get(part.key))

    def after_update(self, done: AfterUpdate) -> None:
        for part in self._parts:
            part.after_update(done)


class Counters:
    """Counts of what went wrong along the run (``actor/<name>`` in the logs), saved with it.

    Args:
        names: the counters, each starting at 0.
    """

    key = "counters"

    def __init__(self, names: Iterable[str]) -> None:
        self.values = dict.fromkeys(names, 0)

    def add(self, name: str, n: int = 1) -> None:
        if name not in self.values:
            raise KeyError(f"no counter {name!r} (the counters: {sorted(self.values)})")
        self.values[name] += int(n)

    def state_dict(self) -> dict[str, int]:
        return dict(self.values)

    def load_state_dict(self, state: dict[str, int] | None) -> None:
        # A counter the checkpoint lacks (it was written before the counter existed) counts from 0.
        self.values.update({k: int(v) for k, v in (state or {}).items() if k in self.values})

    def after_update(self, done: AfterUpdate) -> None:
        pass
