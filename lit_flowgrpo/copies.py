"""Copies of the trained weights: the KL reference (frozen, refreshed or averaged) and DiffusionNFT's
old policy, the contexts that swap them in, and how they move after an update.

Each copy is a part (:mod:`lit_flowgrpo.parts`): it saves and restores itself and moves in its own
``after_update``. A copy is one of two forms, whatever it stands for:

- with LoRA, a stored set of the adapter's tensors, swapped into the adapter in place while the copy
  computes (:func:`swapped_in`); made on first use, so that under FSDP2 it copies the sharded tensors;
- for a full fine-tune, a frozen copy of the whole transformer, made when the weights are attached and
  standing in for the transformer while it computes (:func:`standing_in`); a sharded run shards it
  like the transformer.

The one copy that costs nothing is the LoRA reference that never moves: the network with its
adapters switched off.

They sit below :mod:`lit_flowgrpo.weights` (which makes them when it attaches the trained weights) and
know nothing of it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from lit_flowgrpo.errors import flag
from lit_flowgrpo.kl import ReferenceSettings
from lit_flowgrpo.parts import AfterUpdate
from lit_flowgrpo.strategies import reshard

__all__ = [
    "Copies",
    "OldPolicy",
    "Reference",
    "adapters_disabled",
    "cast_elementwise",
    "is_sharded",
    "standing_in",
    "swapped_in",
    "trainable_of",
]


class _Copy:
    """What both copies share: a stored adapter (LoRA) or a frozen network (full fine-tune), the
    policy they copy, and their tensors as a checkpoint holds them."""

    def __init__(self, lora: bool) -> None:
        self.lora = lora
        self.policy: Any = None
        self.network: nn.Module | None = None  # a full fine-tune's frozen copy
        self._adapter: dict[str, Tensor] | None = None  # LoRA: the stored adapter, made on first use

    def bind(self, policy: Any, master_dtype: torch.dtype | None, keep_network: bool) -> None:
        """Take the policy this copies (after its adapter is attached, before a full fine-tune's cast to
        ``master_dtype``); ``keep_network``: make the full fine-tune's frozen copy now."""
        self.policy = policy
        if not self.lora and keep_network:
            self.network = frozen_copy(policy.transformer, master_dtype)

    def adapter(self) -> dict[str, Tensor]:
        if self._adapter is None:
            # The adapter as it is now: θ at the first rollout (the old policy starts as θ; the reference
            # computes what the adapter switched off does, since peft's initialisations zero its B).
            self._adapter = {n: p.detach().clone() for n, p in trainable_of(self.policy, resharded=True)}
        return self._adapter

    def pairs(self) -> Iterator[tuple[Tensor, Tensor]]:
        """(copy tensor, trained tensor) pairs, to move the copy towards the trained weights."""
        if self.lora:
            stored = self.adapter()
            return ((stored[n], p) for n, p in trainable_of(self.policy, resharded=True))
        assert self.network is not None
        # Shard by shard (the two are sharded alike): an offloaded reference's shards sit in host
        # memory, the trained ones on the GPU, and every move here is elementwise.
        both = zip(_parameters(self.network), _parameters(self.policy.transformer), strict=True)
        return ((_local(c), _local(t)) for c, t in both)

    def tensors(self) -> dict[str, Tensor]:
        """The live tensors a checkpoint holds (this rank's shards, as DTensors, under FSDP2)."""
        if self.lora:
            return self.adapter()
        assert self.network is not None
        return state_tensors(self.network)

    def computing(self) -> AbstractContextManager[None]:
        """Inside, the policy computes with this copy."""
        if self.lora:
            return swapped_in(self.policy, self.adapter())
        assert self.network is not None
        return standing_in(self.policy, self.network)


class Reference(_Copy):
    """The policy the KL penalty holds the trained one to, and how it moves (:class:`ReferenceSettings`).

    Args:
        settings: which reference, its schedule, and whether a full fine-tune keeps a frozen copy of
            the initial transformer (``copy``).
        lora: the trained weights are a LoRA adapter (else the whole transformer).
    """

    key = "reference"

    def __init__(self, settings: ReferenceSettings, lora: bool) -> None:
        super().__init__(lora)
        self.settings = settings
        self.steps_at_refresh = 0
        self.refreshes = 0

    @property
    def moves(self) -> bool:
        return self.settings.mode != "initial"

    @contextmanager
    def context(self) -> Iterator[None]:
        """Inside, the policy computes with the reference's weights."""
        if self.lora and not self.moves:
            with ExitStack() as stack:
                for network in self.policy.trainable_networks:
                    stack.enter_context(adapters_disabled(network))
                yield
            return
        if not self.lora and self.network is None:
            raise RuntimeError(f"the KL reference of a full fine-tune needs {flag('kl')}.reference.copy=true")
        with self.computing():
            yield

    @torch.no_grad()
    def after_update(self, done: AfterUpdate) -> None:
        """ema: average towards θ; refreshed: set to θ when due or when the update's KL passed the bound."""
        settings = self.settings
        if settings.mode == "ema":
            for target, source in self.pairs():
                target.copy_(
                    target * settings.ema_decay
                    + source.detach().to(target.device, target.dtype) * (1.0 - settings.ema_decay)
                )
            return
        if settings.mode != "refreshed":
            return
        steps = done.optimizer_steps
        due = settings.refresh_every is not None and steps - self.steps_at_refresh >= settings.refresh_every
        # A non-finite KL is a broken update, not a drifted policy: it never refreshes the reference.
        drifted = settings.refresh_kl is not None and math.isfinite(done.kl) and done.kl > settings.refresh_kl
        if not (due or drifted):
            return
        for target, source in self.pairs():
            target.copy_(source.detach())
        self.steps_at_refresh = steps
        self.refreshes += 1

    def state_dict(self) -> dict[str, Any]:
        """A moving reference's tensors and schedule (empty for ``initial``: nothing to save)."""
        if not self.moves:
            return {}
        return {
            "tensors": {k: v.detach().clone() for k, v in self.tensors().items()},
            "steps_at_refresh": self.steps_at_refresh,
            "refreshes": self.refreshes,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not self.moves:
            return
        if not state:
            raise ValueError(
                f"the checkpoint holds no moving KL reference, which {flag('kl')}.reference.mode="
                f"{self.settings.mode} needs: it was written by a run with another reference; resume "
                "with the run's own config"
            )
        copy_into(self.tensors(), state["tensors"], "KL reference")
        self.steps_at_refresh = int(state["steps_at_refresh"])
        self.refreshes = int(state["refreshes"])


class OldPolicy(_Copy):
    """DiffusionNFT's old policy: a slowly averaged copy of the trained weights that the rollout samples
    with and the loss anchors at. After each update θ_old ← η·θ_old + (1 − η)·θ, with η = ``decay`` of the
    optimizer steps taken so far (the objective's schedule).

    Args:
        lora: the trained weights are a LoRA adapter (else the whole transformer).
        decay: η as a function of the optimizer steps taken so far (the objective's
            ``old_policy_decay``).
    """

    key = "old_policy"

    def __init__(self, lora: bool, decay: Callable[[int], float | None]) -> None:
        super().__init__(lora)
        self.decay = decay
        # What needs it, for the message when a checkpoint lacks it: the objective of a bound method.
        owner = getattr(decay, "__self__", None)
        self.needed_by = "the objective" if owner is None else type(owner).__name__

    @torch.no_grad()
    def after_update(self, done: AfterUpdate) -> None:
        eta = self.decay(done.optimizer_steps)
        if eta is None:
            return
        # DiffusionNFT's soft update, in the reference's order of operations: old * η + new * (1 − η).
        for target, source in self.pairs():
            target.copy_(target * eta + source.detach().to(target.dtype) * (1.0 - eta))

    def state_dict(self) -> dict[str, Tensor]:
        return {k: v.detach().clone() for k, v in self.tensors().items()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Tensor] | None) -> None:
        if not state:
            raise ValueError(
                f"the checkpoint holds no old policy, which {self.needed_by} needs: it was written by a run "
                "with another objective; resume with the run's own config"
            )
        copy_into(self.tensors(), state, "old policy")


class Copies:
    """The copies a run keeps beside the trained weights, and the contexts an objective computes in.

    Args:
        reference: the KL reference (always: the LoRA one that never moves costs nothing).
        old: DiffusionNFT's old policy, or ``None``.
    """

    def __init__(self, reference: Reference, old: OldPolicy | None = None) -> None:
        self.kl_reference = reference
        self.old_policy = old

    @property
    def parts(self) -> list[Any]:
        """The copies as parts, in the order they move after an update (the old policy first)."""
        return [p for p in (self.old_policy, self.kl_reference) if p is not None]

    @property
    def networks(self) -> list[nn.Module]:
        """The frozen transformer copies (a full fine-tune's): what a run places and shards beside the
        policy's own networks."""
        return [c.network for c in self.parts if c.network is not None]

    @property
    def offloaded(self) -> list[nn.Module]:
        """The copies kept in host memory (``reference.offload``)."""
        network = self.kl_reference.network
        return [network] if network is not None and self.kl_reference.settings.offload else []

    def reference(self) -> AbstractContextManager[None]:
        """Inside, the policy computes with the KL reference's weights."""
        return self.kl_reference.context()

    def old(self) -> AbstractContextManager[None]:
        """Inside, the policy computes with the old policy's weights (no gradient reaches them). LoRA
        swaps the stored adapter in place: enter it before the θ forward of a visit."""
        if self.old_policy is None:
            raise RuntimeError(
                "this run keeps no old policy (its objective samples with the trained weights)"
            )
        return self.old_policy.computing()

    def sampling(self) -> AbstractContextManager[None]:
        """The weights the rollout samples with: the old policy where there is one, else the trained ones."""
        return nullcontext() if self.old_policy is None else self.old_policy.computing()


# -- helpers over a policy's networks ------------------------------------------------------------------


def frozen_copy(network: nn.Module, master_dtype: torch.dtype | None) -> nn.Module:
    """A frozen copy of ``network``, kept out of the module tree (never checkpointed as a parameter,
    never trained), its elementwise parameters in ``master_dtype`` beside float32 masters."""
    frozen = copy.deepcopy(network).requires_grad_(False).eval()
    if master_dtype is not None:
        cast_elementwise(frozen, master_dtype)
    return frozen


def cast_elementwise(network: nn.Module, dtype: torch.dtype) -> None:
    """Cast the parameters of ``network`` that no matrix product uses (norm scales, modulation tables:
    everything but the weights and biases of linear and convolution layers) to ``dtype``, in place.

    For a frozen copy beside float32 master weights: autocast rounds the masters' matrix weights to the
    copy's dtype (the values the copy holds, before any update), but a norm's scale multiplies outside
    autocast, in its own dtype; held in the masters' dtype, the copy's multiplies as the masters' do,
    so before any update the two compute the same velocity, bit for bit (a first-step KL of exactly 0).
    They are a small share of the weights (vectors, next to matrices).
    """
    matrix = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.ConvTranspose3d)
    for module in network.modules():
        if isinstance(module, matrix):
            continue
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def _local(tensor: Tensor) -> Tensor:
    """This rank's shard of a sharded parameter (a view of its storage), else the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def trainable_of(policy: Any, resharded: bool = False) -> list[tuple[str, nn.Parameter]]:
    """The trainable tensors of every trained network: the first network's under their own names (as
    a one-network policy's), a further network's prefixed ``network<i>.``.

    ``resharded``: reshard each network first (:func:`~lit_flowgrpo.strategies.reshard`), so that under
    FSDP2 these are the shards the optimizer steps and the next forward gathers, not weights that a
    forward left gathered (``reshard_after_forward=false``); only where no backward is pending.
    """
    out = []
    for i, network in enumerate(policy.trainable_networks):
        if resharded:
            reshard(network)
        prefix = "" if i == 0 else f"network{i}."
        out += [(prefix + n, p) for n, p in network.named_parameters() if p.requires_grad]
    return out


def _parameters(network: nn.Module) -> list[nn.Parameter]:
    """``network``'s parameters, resharded first (see :func:`trainable_of`)."""
    reshard(network)
    return list(network.parameters())


def state_tensors(network: nn.Module) -> dict[str, Tensor]:
    """The live tensors of ``network``'s state dict, by its names (to read for a checkpoint and to load
    into); resharded first, so that a sharded network's are its shards (DTensors)."""
    reshard(network)
    live = dict(network.named_parameters(remove_duplicate=False))
    live.update(network.named_buffers(remove_duplicate=False))
    return {name: live[name] for name in network.state_dict()}


def copy_into(targets: dict[str, Tensor], state: dict[str, Tensor], what: str) -> None:
    """Copy a checkpoint's ``state`` into the live ``targets`` by name: a copy's tensors restored.

    What comes from the checkpoint is either laid out as the target (a sharded folder's: this rank's
    shards, as DTensors) or whole (a file's, or a gathered one's), which is cut to this rank's shard
    here, without communication; the copy is value for value either way.
    """
    if set(state) != set(targets):
        raise ValueError(
            f"the checkpoint's {what} holds {len(state)} tensors, this run's {len(targets)} (e.g. "
            f"{sorted(set(state) ^ set(targets))[:2]}): resume with the run's own config"
        )
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, target in targets.items():
            value = state[name].detach()
            if isinstance(target, DTensor):
                if not isinstance(value, DTensor):
                    mesh, placements = target.device_mesh, target.placements
                    value = distribute_tensor(value, mesh, placements, src_data_rank=None)
                elif tuple(value.placements) != tuple(target.placements) or value.shape != target.shape:
                    raise ValueError(
                        f"the checkpoint's {what} tensor {name} is laid out as {value.placements} "
                        f"{tuple(value.shape)}, this run's as {target.placements} {tuple(target.shape)}"
                    )
                target.to_local().copy_(value.to_local())
            else:
                target.copy_(value.full_tensor() if isinstance(value, DTensor) else value)


@contextmanager
def standing_in(policy: Any, network: nn.Module) -> Iterator[None]:
    """Inside, ``network`` takes the transformer's place in the policy: no weight is copied, and it
    works the same whether the two networks are plain or sharded (FSDP2 gathers a sharded network's
    weights from its own storage, so swapping parameter data would not do)."""
    transformer = policy.transformer
    name = next((n for n, m in policy.named_children() if m is transformer), None)
    if name is None:
        raise RuntimeError(
            f"{type(policy).__name__}.transformer is not a direct submodule of the policy: a frozen "
            "copy cannot stand in for it"
        )
    device = next(transformer.parameters()).device
    # A sharded network is where FSDP2 put it (an offloaded reference's shards stay in host memory).
    if next(network.parameters()).device != device and not is_sharded(network):
        network.to(device)
    policy._modules[name] = network
    try:
        yield
    finally:
        policy._modules[name] = transformer


@contextmanager
def swapped_in(policy: Any, stored: dict[str, Tensor]) -> Iterator[None]:
    """Inside, the adapter computes with ``stored``'s tensors, and with its own again afterwards.

    They are copied into the adapter in place and back, so no parameter is added, re-registered or has
    its ``requires_grad`` flipped (DDP's buckets and the optimizer keep seeing the same tensors), and an
    in-place copy also reaches FSDP2's shards. Enter it before the θ forward of a visit: the θ graph
    must not save tensors it swaps.
    """
    # Resharded on entry and on exit (no backward is pending at either): a unit that a forward left
    # gathered (reshard_after_forward=false) would compute its next forward with the gathered weights,
    # not with the shards written here.
    params = dict(trainable_of(policy, resharded=True))
    with torch.no_grad():
        current = {n: p.detach().clone() for n, p in params.items()}
        for n, p in params.items():
            p.copy_(stored[n])
    try:
        yield
    finally:
        trainable_of(policy, resharded=True)
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(current[n])


@contextmanager
def adapters_disabled(transformer: nn.Module) -> Iterator[None]:
    if hasattr(transformer, "disable_adapters"):  # diffusers' PeftAdapterMixin
        transformer.disable_adapters()
        try:
            yield
        finally:
            transformer.enable_adapters()
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    # The same loop diffusers' disable_adapters runs, for a model without that mixin.
    layers = [m for m in transformer.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
