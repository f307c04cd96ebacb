"""Reward contract and the weighted sum (the registry by name is :mod:`lit_flowgrpo.rewards.registry`).

A reward is any callable ``(images (B,3,H,W) in [0,1], prompts, metadata) -> Tensor (B,)`` or a
dict of named (B,) components. A video-capable reward takes ``(B, F, 3, H, W)`` videos in [0, 1] the
same way, one value per video. A sample the reward could not score is NaN in every component: it
is never turned into a number here, and the module drops it from the advantage computation.

A reward is a per-sample function: a sample's value depends on its own image, prompt and metadata,
never on the other samples of the call (up to the rounding of a neural scorer's kernels, which may
differ with the batch size). The training step relies on it: it scores the rollout chunk by chunk,
as the sampler decodes each (:mod:`lit_flowgrpo.rewards.overlap`), and a chunk's values must be those
the whole batch would get. A reward that raises stops the step, whichever thread ran it; the way to
give up on one sample is NaN.

Optional attributes a reward may carry:

- ``modalities``: a ``frozenset`` of what it can score, ``"image"`` and/or ``"video"``; without it
  ``{"image"}`` (:data:`DEFAULT_MODALITIES`, read through :func:`reward_modalities`). An image reward
  scores a video frame by frame when wrapped in :class:`lit_flowgrpo.rewards.video.PerFrame`;
- ``primary``: for a dict-valued reward, the component that a bare weight applies to;
- ``core_components``: a tuple of the components that measure accuracy (the fraction of prompts
  done right: GenEval's ``strict``, OCR's text accuracy), whose validation mean is logged under
  ``val-core/``; every other component goes under ``val-aux/``. Dict keys for a dict-valued reward,
  ``None`` for the one value of a Tensor-valued reward. Without it every component is auxiliary;
- ``required_metadata``: metadata keys every sample must carry (checked before the first rollout);
- ``check()``: a start-up check (a remote endpoint answers), called once before the first rollout;
- ``problems(records) -> list[str]``: what is wrong with the prompt records (train and val) for this
  reward, one message per bad record naming its index; called at setup, before any rollout;
- ``thread_safe``: ``False`` when the reward must run on the thread that calls :class:`MultiReward`
  (the training loop's), e.g. because it keeps thread-local state or shares non-reentrant state with
  the policy. It then never runs in a worker thread: neither beside the other rewards nor beside the
  sampler; the training step scores it on the whole batch once the rollout is done. Without the
  attribute a reward may be called from a worker thread (never from two threads at once);
- ``uses_sources``: ``True`` for a reward that sees the images a sample was conditioned on (an edit's
  source, a video's first frame): it is called ``reward(images, prompts, metadata, sources=sources)``,
  ``sources`` one list per sample of (3, H, W) fp32 tensors in [0, 1] at their files' size (read through
  :func:`uses_sources`); on text-only data each sample's list is empty. ``needs_sources``: ``True`` for one
  that cannot score without them (refused at setup on text-only data);
- ``scores_groups``: ``True`` for a reward that scores whole groups (a win rate or a rank within the
  group), the one exception to the per-sample rule. It is called with every member of its groups and
  their ids, assembled across ranks, once the rollout is done (:mod:`lit_flowgrpo.rewards.group`,
  read through :func:`scores_groups`); a plain call here, without groups, gives it NaN.

:func:`as_reward` turns any reward spec into a :class:`MultiReward`, which checks every output's
shape where it is produced and returns a :class:`RewardOutput`.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lit_flowgrpo.errors import SettingsError, flag
from lit_flowgrpo.rewards.registry import (  # re-exported: plugins registered through base before registry.py
    Reward,
    RewardValue,
    available_rewards,
    build_reward,
    qualname,
    register_reward,
    unknown_rewards_hint,
)

__all__ = [
    "DEFAULT_MODALITIES",
    "MODALITIES",
    "CallableReward",
    "MultiReward",
    "Reward",
    "RewardOutput",
    "RewardValue",
    "Scored",
    "as_reward",
    "available_rewards",
    "build_reward",
    "checked_output",
    "modality_problems",
    "note",
    "register_reward",
    "reward_modalities",
    "scores_groups",
    "thread_safe",
]

MODALITIES = frozenset({"image", "video"})
"""What a reward may declare it scores: images ``(B, 3, H, W)``, videos ``(B, F, 3, H, W)``."""

DEFAULT_MODALITIES = frozenset({"image"})
"""The modalities of a reward that declares none: every reward written before video scores images."""


@dataclass
class RewardOutput:
    """What one reward evaluation produced for a batch of B samples."""

    total: Tensor
    """(B,) fp32 weighted sum; NaN where a weighted component failed (the sample is dropped)."""
    components: dict[str, Tensor] = field(default_factory=dict)
    """(B,) fp32 per component, keyed ``name`` or ``name/component``; NaN where it failed."""
    latency_s: dict[str, float] = field(default_factory=dict)
    """Wall time each reward took for this batch (scored in chunks: the sum over its chunks)."""
    failures: dict[str, int] = field(default_factory=dict)
    """Samples each reward could not score (non-finite in any of its components) in this batch."""
    exposed_s: float | None = None
    """Seconds the training step waited for this output once the rollout was done: the part of the
    rewards' time that sampling did not hide. ``None`` when not scored by a training step."""

    @property
    def valid(self) -> Tensor:
        return torch.isfinite(self.total)

    @property
    def unscored_count(self) -> dict[str, int]:
        """Samples each component could not score (NaN), keyed like :attr:`components`.

        A mean over the scored samples alone says nothing of how many there were: log this next to it.
        """
        return {key: int((~torch.isfinite(value)).sum()) for key, value in self.components.items()}

    def log_dict(self) -> dict[str, float]:
        """Scalars to log for this batch (this rank).

        ``critic/rewards/<component>/mean`` (NaN-skipping mean), ``reward/failure_rate`` (fraction of
        samples dropped: non-finite total), ``reward/failure_rate/<name>`` (fraction each reward
        failed), ``reward/latency_s`` (slowest reward; they run concurrently),
        ``reward/latency_s/<name>`` and, from a training step, ``reward/exposed_s``.
        """
        batch = max(int(self.total.numel()), 1)
        out: dict[str, float] = {}
        for key, value in self.components.items():
            finite = value[torch.isfinite(value)]
            out[f"critic/rewards/{key}/mean"] = float(finite.mean()) if finite.numel() else float("nan")
        out["reward/failure_rate"] = float((~self.valid).sum()) / batch
        for name, count in self.failures.items():
            out[f"reward/failure_rate/{name}"] = count / batch
        if self.latency_s:
            out["reward/latency_s"] = max(self.latency_s.values())
        for name, seconds in self.latency_s.items():
            out[f"reward/latency_s/{name}"] = seconds
        if self.exposed_s is not None:
            out["reward/exposed_s"] = self.exposed_s
        return out


class Scored(NamedTuple):
    """One reward's checked output on one batch, and the wall time it took."""

    components: dict[str, Tensor]
    """(B,) fp32 CPU per component, keyed as in :attr:`RewardOutput.components`."""
    seconds: float


def thread_safe(reward: Any) -> bool:
    """Whether ``reward`` may run in a worker thread (its ``thread_safe`` attribute; default yes)."""
    return bool(getattr(reward, "thread_safe", True))


def scores_groups(reward: Any) -> bool:
    """Whether ``reward`` scores whole groups (its ``scores_groups`` attribute; default no)."""
    return getattr(reward, "scores_groups", False) is True


def uses_sources(reward: Any) -> bool:
    """Whether ``reward`` takes the samples' conditioning images (its ``uses_sources``; default no)."""
    return getattr(reward, "uses_sources", False) is True or needs_sources(reward)


def needs_sources(reward: Any) -> bool:
    """Whether ``reward`` cannot score without conditioning images (its ``needs_sources``; default no)."""
    return getattr(reward, "needs_sources", False) is True


def reward_modalities(reward: Any) -> frozenset[str]:
    """What ``reward`` can score: its ``modalities`` attribute, :data:`DEFAULT_MODALITIES` without one.

    Raises:
        TypeError: naming the reward, when the declaration is not a set of names from
            :data:`MODALITIES` (a bare string would otherwise read as a set of letters).
    """
    declared = getattr(reward, "modalities", DEFAULT_MODALITIES)
    if (
        not isinstance(declared, set | frozenset)
        or not declared
        or not all(isinstance(m, str) and m in MODALITIES for m in declared)
    ):
        raise TypeError(
            f"reward {qualname(reward)}.modalities is {declared!r}: declare a non-empty frozenset of "
            f"{sorted(MODALITIES)}, e.g. frozenset({{'image', 'video'}})"
        )
    return frozenset(declared)


def modality_problems(rewards: Mapping[str, Any], modality: str) -> list[str]:
    """One message per reward of ``rewards`` (``{name: reward}``) that cannot score ``modality``.

    For a video policy, each message names the wrapper that scores an image reward frame by frame.
    """
    if modality not in MODALITIES:
        raise ValueError(f"modality {modality!r} must be one of {sorted(MODALITIES)}")
    out = []
    for name, reward in rewards.items():
        declared = reward_modalities(reward)
        if modality in declared:
            continue
        if modality == "video" and "image" in declared:
            fix = (
                "wrap it to score each frame and reduce per video: lit_flowgrpo.rewards.video.PerFrame "
                f"(in YAML: weights {{per_frame: w}}, config {{per_frame: {{reward: {name}}}}})"
            )
        else:
            fix = f"use a reward that declares {modality!r} in its modalities"
        out.append(
            f"reward {name!r} ({qualname(reward)}) scores {sorted(declared)} only, not {modality}s: {fix}"
        )
    return out


class MultiReward:
    """Weighted sum of named rewards, each evaluated once per batch.

    Every reward's output is checked where it is produced: a Tensor of shape (B,), or a dict of
    such tensors, one value per image; anything else raises naming the reward. Values come back fp32
    on the CPU, non-finite ones as NaN (a failed sample is never turned into a number).

    Args:
        weights: ``{name: weight}``. ``name`` is a registered reward (its primary component is
            weighted) or ``name/component`` for one component of a dict-valued reward. A weight of
            0 still computes and logs the reward, for monitoring.
        config: keyword arguments per reward name, passed to its constructor.
        rewards: already-built rewards by name (Python use); they take precedence over the registry.
        max_workers: rewards are evaluated concurrently in this many threads (remote rewards spend
            their time waiting); 1 evaluates them in order.
        overlap: the training step scores each rollout chunk (``--model.init_args.sampler.batch_size``
            samples) in a background thread as soon as it is decoded, while the next chunk samples;
            the step then waits only for what is left (``reward/exposed_s``). The values are those of
            one call on the whole batch (rewards are per-sample). ``False`` scores the whole batch
            after the rollout. A reward with ``thread_safe = False`` is scored that way either way.
    """

    def __init__(
        self,
        weights: dict[str, float],
        config: dict[str, dict[str, Any]] | None = None,
        rewards: dict[str, Reward] | None = None,
        max_workers: int = 4,
        overlap: bool = True,
    ) -> None:
        if not weights:
            raise SettingsError(
                "--model.init_args.reward.init_args.weights is empty: name at least one reward, e.g. {shapes: 1.0}"
            )
        # A NaN weight would make every total NaN: each sample would be dropped as unscored, and the run
        # would stop only after max_idle_rollouts, blaming the reward.
        bad = {k: w for k, w in weights.items() if not isinstance(w, (int, float)) or not math.isfinite(w)}
        if bad:
            raise SettingsError(
                f"--model.init_args.reward.init_args.weights gives {', '.join(f'{k!r} the weight {w!r}' for k, w in bad.items())}: "
                "each weight must be a finite number (0 computes and logs a reward without training on it)"
            )
        self.weights = dict(weights)
        self.max_workers = max_workers
        self.overlap = overlap
        built = dict(rewards or {})
        config = dict(config or {})
        unknown = sorted({k.split("/", 1)[0] for k in self.weights} - set(built) - set(available_rewards()))
        if unknown:
            raise SettingsError(
                f"--model.init_args.reward.init_args.weights names unregistered rewards {unknown}: {unknown_rewards_hint(unknown)}"
            )
        for key in self.weights:
            name = key.split("/", 1)[0]
            if name not in built:
                built[name] = build_reward(name, **config.pop(name, {}))
        if config:
            raise SettingsError(
                f"--model.init_args.reward.init_args.config names rewards without a weight: {sorted(config)}: give each a weight "
                "in --model.init_args.reward.init_args.weights (0 to only log it), or drop its config"
            )
        self.rewards: dict[str, Reward] = built

    def check(self) -> None:
        for reward in self.rewards.values():
            check = getattr(reward, "check", None)
            if callable(check):
                check()

    def problems(self, records: Sequence[Mapping[str, Any]]) -> list[str]:
        """What the rewards find wrong with these prompt records, each message naming its reward.

        Asks every reward with a ``problems(records)`` hook; call it at setup with the train and val
        records, so a prompt no reward can score fails before the first rollout.
        """
        out = []
        for name, reward in self.rewards.items():
            hook = getattr(reward, "problems", None)
            if callable(hook):
                out.extend(f"reward {name!r}: {problem}" for problem in hook(records))
        return out

    def settings_problems(self) -> list[str]:
        """Problems of the reward's own settings (empty when fine), found before any weight is read."""
        p = []
        weights = getattr(self, "weights", None)
        if isinstance(weights, dict) and weights and not any(weights.values()):
            p.append(f"{flag('reward')}.weights are all 0 ({weights}): the reward is 0 by construction")
        try:
            _ = self.core_components  # checks each reward's declaration
        except TypeError as err:
            p.append(str(err))
        return p

    def prompt_problems(self, prompts: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
        """What the rewards find wrong with every prompt the run will draw (``{flag: records}``, e.g.
        ``{"--data.init_args.train": [...]}``): missing metadata fields and each reward's :meth:`problems`, at
        most 10 lines per flag. Called at setup, not when a rollout first draws a prompt."""
        records = [r for part in prompts.values() for r in part]
        out = []
        for name, keys in self.required_metadata().items():
            for key in keys:
                missing = sum(1 for r in records if key not in r)
                if missing:
                    out.append(
                        f"reward {name!r} needs metadata field {key!r}, missing in {missing} of "
                        f"{len(records)} prompts: use a .jsonl prompt file whose records carry it"
                    )
        for data_flag, part in prompts.items():
            found = self.problems(list(part))
            out += [f"{data_flag}: {line}" for line in found[:10]]
            if len(found) > 10:
                out.append(f"{data_flag}: ... and {len(found) - 10} more")
        return out

    def required_metadata(self) -> dict[str, tuple[str, ...]]:
        return {n: tuple(getattr(r, "required_metadata", ())) for n, r in self.rewards.items()}

    @property
    def modalities(self) -> frozenset[str]:
        """What every reward of the sum can score (the intersection of their ``modalities``)."""
        return frozenset.intersection(*(reward_modalities(r) for r in self.rewards.values()))

    @property
    def core_components(self) -> frozenset[str]:
        """The keys of :attr:`RewardOutput.components` that measure accuracy, as each reward declares
        them in its ``core_components`` (a reward that declares none has no core component).

        Raises:
            TypeError: naming the reward, when its declaration is not a tuple of names.
        """
        return frozenset(
            self._key(name, key)
            for name, reward in self.rewards.items()
            for key in _declared_core(name, reward)
        )

    def validation_keys(self, component: str) -> tuple[str, str]:
        """The logged names of ``component``'s validation mean and of its unscored-sample count.

        ``val-core/<component>/mean@1`` for a core component, ``val-aux/<component>/mean@1`` for any
        other (veRL's split of the validation metrics), and ``val-aux/<component>/unscored_count``.
        ``@1``: the score of one sample, averaged over every validation (prompt, seed) pair.
        """
        section = "val-core" if component in self.core_components else "val-aux"
        return f"{section}/{component}/mean@1", f"val-aux/{component}/unscored_count"

    def check_metadata(self, metadata: Sequence[dict]) -> None:
        """Raise a ``ValueError`` naming the reward and the keys when a sample lacks required metadata."""
        for name, keys in self.required_metadata().items():
            for i, meta in enumerate(metadata):
                missing = [k for k in keys if k not in meta]
                if missing:
                    raise ValueError(
                        f"reward {name!r} (--model.init_args.reward.init_args.weights) needs metadata {list(keys)} for every prompt; "
                        f"sample {i} lacks {missing}: use a prompt file that carries them, or drop {name!r}"
                    )

    def __call__(
        self,
        images: Tensor,
        prompts: Sequence[str],
        metadata: Sequence[dict],
        sources: Sequence[Sequence[Tensor]] | None = None,
    ) -> RewardOutput:
        return self.combine(self.score(images, prompts, metadata, sources=sources), images.shape[0])

    def score(
        self,
        images: Tensor,
        prompts: Sequence[str],
        metadata: Sequence[dict],
        names: Collection[str] | None = None,
        sources: Sequence[Sequence[Tensor]] | None = None,
    ) -> dict[str, Scored]:
        """Run the rewards ``names`` (default: all) on one batch; ``{name: Scored}`` in reward order.

        Each output is checked where it is produced. Thread-safe rewards run concurrently in up to
        ``max_workers`` threads, the others in the calling thread. An exception a reward raises
        propagates, with a note naming the reward. ``sources``: each sample's conditioning images, given
        to the rewards that declare ``uses_sources`` (``None``: text-only samples, an empty list each).
        """
        batch = images.shape[0]
        prompts, metadata = list(prompts), list(metadata)
        given = [[] for _ in range(batch)] if sources is None else [list(s) for s in sources]
        if len(given) != batch:
            raise ValueError(f"{batch} images but {len(given)} samples' sources: one list per sample")
        chosen = [(n, r) for n, r in self.rewards.items() if names is None or n in names]
        # An image reward given videos would fail deep inside its model, or read frames as channels.
        problems = modality_problems(dict(chosen), "video" if images.ndim == 5 else "image")
        if problems:
            raise ValueError("; ".join(problems))

        def run(name: str, reward: Reward) -> Scored:
            if scores_groups(reward):  # without its groups (lit_flowgrpo.rewards.group): unscored
                return Scored({self._key(name, None): torch.full((batch,), torch.nan)}, 0.0)
            start = time.perf_counter()
            try:
                if uses_sources(reward):
                    value = reward(images, prompts, metadata, sources=given)
                else:
                    value = reward(images, prompts, metadata)
            except Exception as err:
                note(err, f"raised by reward {name!r} ({qualname(reward)})")
                raise
            seconds = time.perf_counter() - start
            components = self._components(name, reward, value, batch)
            missing = [key for key in _declared_core(name, reward) if self._key(name, key) not in components]
            if missing:
                raise ValueError(
                    f"reward {name!r} ({qualname(reward)}) declares core_components {missing} but returned "
                    f"{sorted(components)}: declare components it returns (None for a Tensor-valued reward)"
                )
            return Scored(components, seconds)

        pooled = [(n, r) for n, r in chosen if thread_safe(r)] if self.max_workers > 1 else []
        if len(pooled) < 2:
            pooled = []
        workers = min(self.max_workers, len(pooled))
        with ThreadPoolExecutor(max_workers=workers) if pooled else contextlib.nullcontext() as pool:
            futures = {n: pool.submit(run, n, r) for n, r in pooled}
            done = {n: run(n, r) for n, r in chosen if n not in futures}
            done.update({n: future.result() for n, future in futures.items()})
        return {n: done[n] for n, _ in chosen}

    def combine(self, scored: Mapping[str, Scored], batch: int) -> RewardOutput:
        """One :class:`RewardOutput` of every reward's :class:`Scored` on a batch of ``batch`` samples."""
        components: dict[str, Tensor] = {}
        latency: dict[str, float] = {}
        failures: dict[str, int] = {}
        for name, (comps, seconds) in scored.items():
            components.update(comps)
            latency[name] = seconds
            failed = torch.zeros(batch, dtype=torch.bool)
            for value in comps.values():
                failed |= torch.isnan(value)
            failures[name] = int(failed.sum())
        total = self._total(components, batch)
        return RewardOutput(total=total, components=components, latency_s=latency, failures=failures)

    def _components(self, name: str, reward: Reward, value: Any, batch: int) -> dict[str, Tensor]:
        """One reward's output as ``{name or name/component: (B,) fp32 CPU}``, its shape checked."""
        return {
            self._key(name, key): tensor
            for key, tensor in checked_output(value, batch, f"reward {name!r} ({qualname(reward)})").items()
        }

    def _key(self, name: str, component: str | None) -> str:
        """The key of one reward's component in :attr:`RewardOutput.components`."""
        return name if component is None else f"{name}/{component}"

    def weighted_components(self, components: Mapping[str, Tensor]) -> dict[str, tuple[float, Tensor]]:
        """The terms of :attr:`RewardOutput.total`: ``{component key: (weight, (B,) values)}`` for every
        non-zero weight, in the order of :attr:`weights` (a weight that names a reward applies to its
        primary component; two weights that name one component add up)."""
        out: dict[str, tuple[float, Tensor]] = {}
        for key, weight in self.weights.items():
            found, value = self._weighted(key, components)
            if weight != 0:
                out[found] = (out[found][0] + weight, value) if found in out else (weight, value)
        return out

    def _weighted(self, key: str, components: Mapping[str, Tensor]) -> tuple[str, Tensor]:
        """The component a weight's ``key`` applies to: (its key in ``components``, its values)."""
        if key in components:
            return key, components[key]
        primary = getattr(self.rewards[key], "primary", None) if key in self.rewards else None
        if primary and f"{key}/{primary}" in components:
            return f"{key}/{primary}", components[f"{key}/{primary}"]
        raise ValueError(
            f"--model.init_args.reward.init_args.weights names {key!r}, but the reward produced {sorted(components)}: "
            "weight one of those"
        )

    def _total(self, components: dict[str, Tensor], batch: int) -> Tensor:
        total = torch.zeros(batch)
        for key, weight in self.weights.items():
            _, value = self._weighted(key, components)
            if weight != 0:
                total = total + weight * value  # NaN propagates: the sample is dropped, never scored 0
        return total


class CallableReward(MultiReward):
    """A plain reward callable (Python use) behind the :class:`MultiReward` interface.

    A Tensor output is the component ``reward``; a dict output keeps its own component names. The
    total is the sum of the components. Failures and latency are reported under ``reward``.

    Args:
        reward: ``(images, prompts, metadata) -> Tensor (B,) | {component: Tensor (B,)}``.
        overlap: as :class:`MultiReward`'s.
    """

    def __init__(self, reward: Reward, overlap: bool = True) -> None:
        # MultiReward's constructor resolves names through the registry; a callable needs none of it.
        self.weights = {"reward": 1.0}
        self.max_workers = 1
        self.overlap = overlap
        self.rewards = {"reward": reward}

    def _components(self, name: str, reward: Reward, value: Any, batch: int) -> dict[str, Tensor]:
        found = checked_output(value, batch, f"reward {qualname(reward)!r}")
        return {self._key(name, key): tensor for key, tensor in found.items()}

    def _key(self, name: str, component: str | None) -> str:
        return name if component is None else component

    def weighted_components(self, components: Mapping[str, Tensor]) -> dict[str, tuple[float, Tensor]]:
        return {key: (1.0, value) for key, value in components.items()}

    def _total(self, components: dict[str, Tensor], batch: int) -> Tensor:
        total = torch.zeros(batch)
        for value in components.values():
            total = total + value
        return total


def as_reward(spec: MultiReward | Mapping[str, float] | Reward) -> MultiReward:
    """The one entry point from a reward setting to an object that returns :class:`RewardOutput`.

    Args:
        spec: a :class:`MultiReward` (returned as is), a ``{name: weight}`` mapping of registered
            rewards (a :class:`MultiReward` of them), or a callable ``(images, prompts, metadata) ->
            Tensor (B,)`` or a dict of named (B,) components (a :class:`CallableReward`).

    Raises:
        TypeError: ``spec`` is none of these.
    """
    if isinstance(spec, MultiReward):
        return spec
    if isinstance(spec, Mapping):
        return MultiReward(dict(spec))
    if callable(spec):
        return CallableReward(spec)
    raise TypeError(
        f"--model.init_args.reward ({type(spec).__name__}) must be a MultiReward, a {{name: weight}} mapping of "
        "registered rewards, or a callable (images, prompts, metadata) -> Tensor (B,)"
    )


def checked_output(value: Any, batch: int, label: str) -> dict[str | None, Tensor]:
    """A reward's output as ``{component or None: (B,) fp32 CPU tensor}``, non-finite values as NaN.

    Raises:
        ValueError, TypeError: naming ``label`` when the output is not one value per image, so a
            wrong shape fails here and not inside the advantage computation.
    """
    if isinstance(value, Mapping):
        if not value:
            raise ValueError(
                f"{label} returned an empty dict: return a Tensor (B,) or a dict of (B,) tensors"
            )
        items: list[tuple[str | None, Any]] = list(value.items())
    else:
        items = [(None, value)]
    out: dict[str | None, Tensor] = {}
    for key, raw in items:
        where = label if key is None else f"{label}, component {key!r},"
        try:
            tensor = torch.as_tensor(raw)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(
                f"{where} returned a {type(raw).__name__}; expected a Tensor of shape (B,) = ({batch},)"
            ) from err
        if tuple(tensor.shape) != (batch,):
            raise ValueError(
                f"{where} returned shape {tuple(tensor.shape)} for {batch} images; expected (B,) = ({batch},), "
                "one value per image"
            )
        tensor = tensor.detach().to("cpu", torch.float32)
        out[key] = torch.where(
            torch.isfinite(tensor), tensor, torch.nan
        )  # inf is a failure too, never a score
    return out


def _declared_core(name: str, reward: Any) -> tuple[str | None, ...]:
    """A reward's ``core_components``, checked: a bare string would otherwise iterate as letters."""
    declared = getattr(reward, "core_components", ())
    if not isinstance(declared, tuple | list | set | frozenset) or not all(
        key is None or isinstance(key, str) for key in declared
    ):
        raise TypeError(
            f"reward {name!r} ({qualname(reward)}).core_components is {declared!r}: declare a tuple of "
            "component names, e.g. ('strict',), or (None,) for a Tensor-valued reward"
        )
    return tuple(declared)


def note(err: BaseException, text: str) -> None:
    """Add ``text`` to what ``err``'s traceback prints (``add_note``; on Python 3.10, a warning)."""
    if hasattr(err, "add_note"):
        err.add_note(text)
    else:
        warnings.warn(f"{type(err).__name__}: {err} ({text})", RuntimeWarning, stacklevel=3)
