"""What the update trains (a LoRA adapter or the whole transformer), the KL reference, and export.

LoRA goes through the adapter API that every diffusers model class here already has
(``add_adapter``, ``disable_adapters``/``enable_adapters``; ``cast_training_params`` and
``get_peft_model_state_dict`` for the dtype and export), as diffusers' own LoRA training scripts do.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lit_flowgrpo.export import destination_problems, write_folder
from lit_flowgrpo.policies.base import FlowPolicy

__all__ = ["LoraSettings", "ReferenceSettings", "TrainableWeights"]

_FULL_FINE_TUNE_OF_SEVERAL = (
    "--model.init_args.lora=null (a full fine-tune) with a policy that trains {networks} networks (Wan 2.2 "
    "A14B's experts): only LoRA is supported there; set --model.init_args.lora"
)


@dataclass
class LoraSettings:
    """A LoRA adapter on the policy's transformer.

    Args:
        rank: r; ``None`` takes the policy's default (SD3 32, FLUX / Qwen-Image 64).
        alpha: LoRA α (scale α/r); ``None`` takes the policy's default (2·r).
        target_modules: module names peft matches; ``None`` takes the policy's attention projections.
        init: peft's ``init_lora_weights`` (``"gaussian"`` as Flow-GRPO, or ``"default"``).
        dropout: LoRA dropout (0 keeps the rollout and the update numerically identical).
    """

    rank: int | None = None
    alpha: float | None = None
    target_modules: list[str] | None = None
    init: Literal["gaussian", "default"] = "gaussian"
    dropout: float = 0.0

    def problems(self, flag: str = "--model.init_args.lora") -> list[str]:
        p = []
        if self.rank is not None and self.rank < 1:
            p.append(f"{flag}.rank ({self.rank}) must be at least 1, or null for the policy's default")
        if self.alpha is not None and not self.alpha > 0:
            p.append(f"{flag}.alpha ({self.alpha}) must be > 0, or null for 2·rank")
        if not 0 <= self.dropout < 1:
            p.append(f"{flag}.dropout ({self.dropout}) must lie in [0, 1)")
        if self.target_modules is not None and not self.target_modules:
            p.append(f"{flag}.target_modules is empty: list module names, or null for the policy's default")
        return p


@dataclass
class ReferenceSettings:
    """Which policy the KL penalty holds the trained one to.

    ``initial`` (the default) is the model as it was before training: with LoRA the network with its
    adapter switched off, for a full fine-tune the frozen copy (``reference_copy``). Holding a policy to
    its starting point for the whole run makes the penalty grow as the policy improves, until it stops
    learning; GARDO (arXiv:2512.24138, Sec. 4.2) moves the reference along instead:

    - ``refreshed``: the reference is set to the trained weights every ``refresh_every`` optimizer steps,
      and after any update whose mean KL to it (``actor/kl_loss``, over every rank) exceeded
      ``refresh_kl``, whichever comes first. GARDO's released script refreshes once more than
      ``reset_freq`` (15) epochs have passed since the last refresh, i.e. every ``reset_freq`` + 1 = 16
      epochs: at its 2 optimizer steps an epoch that is ``refresh_every: 32``
      ((``reset_freq`` + 1) × ``optimizer_steps_per_rollout``; 30 would refresh one epoch early). It
      also refreshes after an epoch in which any one optimizer step's KL passed ``kl_thres`` (3e-4 in
      its OCR/GenEval configs), where this compares the mean over the update's optimizer steps: the
      same with one optimizer step per rollout, a later refresh with more. And its KL is in another
      unit: ``refresh_kl`` ≈ ``kl_thres``/P, P the share of its micro-batches that hold a gated sample
      (:class:`~lit_flowgrpo.advantages.KLGate`; without a gate P = 1);
    - ``ema``: after each update, ref ← ``ema_decay``·ref + (1 − ``ema_decay``)·θ, a reference that trails
      the policy by about 1/(1 − ``ema_decay``) updates.

    Under either, the reference is a stored copy of the trained tensors (the adapter's, or the whole
    transformer's in ``reference_copy``) that is saved in checkpoints, so a resumed run holds the same
    reference.

    ``offload`` keeps a full fine-tune's frozen copy (``reference_copy``) in host memory, pinned, under
    ``--trainer.strategy=fsdp2``: FSDP2's ``CPUOffloadPolicy`` holds each rank's shards on the host and
    copies a block's shards in for its all-gather, so the reference costs no GPU memory beyond the
    block being computed (FLUX.1's 24 GB in bf16, 6 GB per GPU on 4), for a host-to-device copy of the
    rank's shards per reference forward. The copy is exact: the KL is the same, bit for bit.

    Args:
        mode: ``initial``, ``refreshed`` or ``ema``.
        refresh_every: ``refreshed``: optimizer steps between refreshes (``None``: only on ``refresh_kl``).
        refresh_kl: ``refreshed``: refresh after an update whose mean KL to the reference is above this
            (``None``: only every ``refresh_every``).
        ema_decay: ``ema``: the reference's decay per update, in [0, 1).
        offload: keep the frozen reference copy in host memory (fsdp2 only; see above).
    """

    mode: Literal["initial", "refreshed", "ema"] = "initial"
    refresh_every: int | None = None
    refresh_kl: float | None = None
    ema_decay: float = 0.9
    offload: bool = False

    def problems(self, uses_reference: bool, flag: str = "--model.init_args.reference") -> list[str]:
        p = []
        if self.mode not in ("initial", "refreshed", "ema"):
            return [f"{flag}.mode ({self.mode!r}) must be one of initial, refreshed, ema"]
        if self.refresh_every is not None and self.refresh_every < 1:
            p.append(
                f"{flag}.refresh_every ({self.refresh_every}) must be at least 1 optimizer step, or null to "
                "refresh only on refresh_kl"
            )
        if self.refresh_kl is not None and not self.refresh_kl > 0:
            p.append(
                f"{flag}.refresh_kl ({self.refresh_kl}) must be > 0, or null to refresh only every refresh_every"
            )
        if self.mode == "refreshed" and self.refresh_every is None and self.refresh_kl is None:
            p.append(
                f"{flag}.mode=refreshed needs {flag}.refresh_every or {flag}.refresh_kl (GARDO uses both: e.g. "
                "refresh_every: 32, refresh_kl: 3.0e-4)"
            )
        if self.mode != "refreshed" and (self.refresh_every is not None or self.refresh_kl is not None):
            p.append(
                f"{flag}.refresh_every / refresh_kl only apply to {flag}.mode=refreshed (mode is {self.mode!r}): "
                "set the mode or drop them"
            )
        if not 0 <= self.ema_decay < 1:
            p.append(f"{flag}.ema_decay ({self.ema_decay}) must lie in [0, 1)")
        if self.mode != "initial" and not uses_reference:
            p.append(
                f"{flag}.mode={self.mode} moves the KL reference, but no KL to it is computed: set "
                "--model.init_args.objective.init_args.kl_coef > 0 (or --model.init_args.diagnostics.reference_kl=true "
                "to only measure it), or drop the setting"
            )
        return p


class TrainableWeights:
    """The trained part of a policy: a LoRA adapter (``lora`` given) or the whole transformer.

    A policy with several trainable networks (:attr:`~lit_flowgrpo.policies.base.FlowPolicy.trainable_networks`:
    Wan 2.2 A14B's two experts) gets one adapter on each, with the same settings: the KL reference
    switches every adapter off, the old policy keeps every adapter's tensors, and the export writes
    one adapter per network. A full fine-tune of several networks is refused (two frozen copies of
    each 14B expert would not fit beside them).

    Args:
        lora: LoRA settings; ``None`` is a full fine-tune of the transformer.
        reference_copy: full fine-tune only: keep a frozen copy of the initial transformer as the KL
            reference (with LoRA the reference is the same network with the adapter switched off).
        seed: seeds the adapter's random initialisation.
        old_policy: keep a second, slowly averaged copy of the trained weights, the old policy that
            DiffusionNFT samples with and anchors its loss at (:meth:`old`, :meth:`update_old`).
        reference_settings: where the KL reference sits (the initial model, or one that moves along:
            :class:`ReferenceSettings`, :meth:`after_update`).
        master_dtype: the dtype the trained weights are kept in: ``float32`` (master weights; the
            matrix products still run in the compute dtype, under autocast) or ``model`` (the dtype the
            policy loads, bf16 in every recipe: a full fine-tune then trains bf16 weights in place, and
            AdamW keeps bf16 moments). A LoRA adapter is always float32.

    Why float32 masters for a full fine-tune: an AdamW step moves a weight by about the learning rate
    (1e-5 in the full fine-tune recipes), while bf16 rounds a weight of 0.03 to a multiple of 2^-13
    (1.2e-4): an update below half of that, 6e-5, is rounded away, so most of the weights would never
    move. Masters cost 2 more bytes per parameter (and AdamW's moments 4 more), which ``model`` saves.
    The frozen copies (the KL reference, DiffusionNFT's old policy) stay in the policy's dtype, and the
    export writes the policy's dtype; checkpoints hold the masters, so a resume is exact.
    """

    def __init__(
        self,
        lora: LoraSettings | None,
        reference_copy: bool = False,
        seed: int = 0,
        old_policy: bool = False,
        reference_settings: ReferenceSettings | None = None,
        master_dtype: Literal["float32", "model"] = "float32",
    ) -> None:
        self.lora = lora
        self.reference_copy = reference_copy
        self.seed = seed
        self.old_policy = old_policy
        self.reference_settings = reference_settings or ReferenceSettings()
        self.master = master_dtype
        # The dtype of each parameter of the trained network as the policy loaded it (set by attach):
        # what the export writes, and what "model" and the compute dtype "auto" refer to.
        self.loaded_dtypes: dict[str, torch.dtype] = {}
        self.model_dtype: torch.dtype | None = None
        # A moving reference with LoRA: a stored copy of the adapter's tensors (made on first use, as the
        # old policy's); a full fine-tune's moves the frozen copy's own weights.
        self._ref_state: dict[str, Tensor] | None = None
        self._steps_at_refresh = 0
        self.refreshes = 0
        self.peft_config: Any = None
        self._frozen: nn.Module | None = None
        # The old policy: with LoRA a stored copy of the adapter's tensors (made on first use, so that
        # under FSDP2 it is a copy of the sharded tensors), for a full fine-tune a frozen copy of the
        # transformer (made at attach, sharded like the reference copy).
        self._old_state: dict[str, Tensor] | None = None
        self._old_network: nn.Module | None = None

    def problems(self, uses_reference: bool, networks: int = 1) -> list[str]:
        """Every problem with these settings; ``networks``: the trainable networks the policy declares
        before loading (Wan 2.2 A14B: 2)."""
        p = [] if self.lora is None else self.lora.problems()
        p += self.reference_settings.problems(uses_reference)
        if self.lora is None and networks > 1:
            p.append(_FULL_FINE_TUNE_OF_SEVERAL.format(networks=networks))
        if self.lora is None and uses_reference and not self.reference_copy:
            p.append(
                "--model.init_args.objective.init_args.kl_coef > 0 with a full fine-tune (--model.init_args.lora=null) needs "
                "--model.init_args.reference_copy=true (a frozen copy of the initial transformer as the KL reference)"
            )
        if self.lora is not None and self.reference_copy:
            p.append(
                "--model.init_args.reference_copy=true is for full fine-tunes: with --model.init_args.lora the reference is the "
                "network with its adapter switched off; drop one of the two"
            )
        if self.master not in ("float32", "model"):
            p.append(f"--model.init_args.master_dtype ({self.master!r}) must be float32 or model")
        elif self.lora is not None and self.master == "model":
            p.append(
                "--model.init_args.master_dtype=model with --model.init_args.lora: a LoRA adapter is always trained in "
                "float32 (the frozen base keeps the policy's dtype); drop the setting, or set lora: null for a "
                "full fine-tune in the policy's dtype"
            )
        if self.reference_settings.offload and not (self.lora is None and self.reference_copy):
            p.append(
                "--model.init_args.reference.offload=true offloads a full fine-tune's frozen reference copy, and this run "
                "has none (with --model.init_args.lora the reference is the network with its adapter off; a full "
                "fine-tune needs --model.init_args.reference_copy=true): drop it"
            )
        return p

    @property
    def master_dtype(self) -> torch.dtype | None:
        """The dtype a full fine-tune's transformer is trained in when it differs from the loaded one
        (``None``: LoRA, which casts its adapter itself, or ``master_dtype=model``)."""
        return torch.float32 if self.lora is None and self.master == "float32" else None

    def attach(self, policy: FlowPolicy, cast: bool = True) -> None:
        """Make the trained parameters trainable (and only those); called once, after ``policy.load()``.

        ``cast``: cast a full fine-tune's transformer to :attr:`master_dtype` now; ``False`` leaves it
        to the sharding, which casts each block as it shards it (no whole float32 copy on one rank).
        """
        networks = _networks(policy)
        if self.lora is None and len(networks) > 1:
            from lit_flowgrpo.errors import SettingsError

            raise SettingsError(_FULL_FINE_TUNE_OF_SEVERAL.format(networks=len(networks)))
        transformer = policy.transformer
        self.loaded_dtypes = {n: p.dtype for n, p in transformer.named_parameters()}
        self.model_dtype = _most_common_dtype(transformer)
        if self.lora is None:
            transformer.requires_grad_(True)
            # The copies are taken before the cast: they keep the policy's dtype.
            if self.reference_copy:
                # Kept out of the module tree: never checkpointed, never trained; moved to the policy's
                # device on first use.
                self._frozen = copy.deepcopy(transformer).requires_grad_(False).eval()
            if self.old_policy:
                self._old_network = copy.deepcopy(transformer).requires_grad_(False).eval()
            if self.master_dtype is not None:
                for network in self.copies:
                    _cast_elementwise(network, self.master_dtype)
            if cast and self.master_dtype is not None:
                from diffusers.training_utils import cast_training_params

                # The same cast as a LoRA adapter's below: parameters only, buffers keep their dtype.
                cast_training_params(transformer, dtype=self.master_dtype)
            if self.master == "model" and self.model_dtype != torch.float32:
                from lightning.pytorch.utilities import rank_zero_warn

                rank_zero_warn(
                    f"--model.init_args.master_dtype=model: the full fine-tune trains {self.model_dtype} weights in "
                    "place, and updates smaller than half their rounding step (a few 1e-5 at typical weights) are "
                    "lost; float32 (the default) keeps master weights"
                )
            return
        config = self._peft_config(policy)
        from diffusers.training_utils import cast_training_params

        for i, network in enumerate(networks):
            network.requires_grad_(False)
            # The adapter's random init comes from the seed, not from whatever the global RNG holds
            # (each further network from its own seed, so that two experts start apart).
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed + 1_000_003 * i)
                if hasattr(network, "add_adapter"):  # every diffusers model class (PeftAdapterMixin)
                    network.add_adapter(config)
                else:
                    # A plain nn.Module (the toy model) has no adapter API: peft's injection is what
                    # add_adapter runs underneath.
                    from peft import inject_adapter_in_model

                    inject_adapter_in_model(config, network)
            # Trainable weights in fp32 whatever the base dtype: bf16 LoRA weights lose small updates.
            cast_training_params(network, dtype=torch.float32)
            if not any(p.requires_grad for p in network.parameters()):
                raise ValueError(
                    f"--model.init_args.lora.target_modules ({config.target_modules}) matched no module of the "
                    f"transformer{'' if i == 0 else f' (network {i})'}"
                )
        self.peft_config = config

    def _peft_config(self, policy: FlowPolicy) -> Any:
        from peft import LoraConfig

        lora = self.lora
        assert lora is not None
        rank = lora.rank or getattr(policy, "default_lora_rank", 32)
        alpha = lora.alpha if lora.alpha is not None else getattr(policy, "default_lora_alpha", 2 * rank)
        targets = lora.target_modules or list(policy.default_lora_targets)
        if not targets:
            raise ValueError(
                f"--model.init_args.lora.target_modules is empty and {type(policy).__name__} names no default: "
                "list the module names to adapt"
            )
        return LoraConfig(
            r=rank,
            lora_alpha=alpha,
            target_modules=targets,
            init_lora_weights=True if lora.init == "default" else lora.init,
            lora_dropout=lora.dropout,
        )

    @property
    def reference_network(self) -> nn.Module | None:
        """A full fine-tune's frozen copy of the initial transformer (``None`` with LoRA or without
        ``reference_copy``); a sharded run shards it like the transformer."""
        return self._frozen

    @contextmanager
    def reference(self, policy: FlowPolicy) -> Iterator[None]:
        """Inside, the policy computes with the KL reference's weights."""
        if self.lora is not None:
            if self.reference_settings.mode == "initial":
                with ExitStack() as stack:
                    for network in _networks(policy):
                        stack.enter_context(_adapters_disabled(network))
                    yield
            else:
                with _swapped_in(policy, self._ref_lora(policy)):
                    yield
            return
        if self._frozen is None:
            raise RuntimeError(
                "the KL reference of a full fine-tune needs --model.init_args.reference_copy=true"
            )
        with _standing_in(policy, self._frozen):
            yield

    # -- a moving reference (GARDO's refreshed one, or an EMA) ---------------------------------------

    def _ref_lora(self, policy: FlowPolicy) -> dict[str, Tensor]:
        if self._ref_state is None:
            # The adapter as it starts: peft's initialisations (gaussian or default) zero its B, so this
            # reference computes what the adapter switched off does, until it moves.
            self._ref_state = {n: p.detach().clone() for n, p in _trainable_of(policy, resharded=True)}
        return self._ref_state

    def _reference_pairs(self, policy: FlowPolicy) -> Iterator[tuple[Tensor, Tensor]]:
        """(reference tensor, trained tensor) pairs of a moving reference."""
        if self.lora is None:
            if self._frozen is None:
                raise RuntimeError(
                    "a moving KL reference of a full fine-tune needs --model.init_args.reference_copy=true"
                )
            # Shard by shard (the two are sharded alike): an offloaded reference's shards sit in host
            # memory, the trained ones on the GPU, and this is elementwise.
            pairs = zip(_parameters(self._frozen), _parameters(policy.transformer), strict=True)
            return ((_local(r), _local(t)) for r, t in pairs)
        ref = self._ref_lora(policy)
        return ((ref[n], p) for n, p in _trainable_of(policy, resharded=True))

    @torch.no_grad()
    def after_update(self, policy: FlowPolicy, optimizer_steps: int, kl: float) -> bool:
        """Move the reference after one rollout's update (:class:`ReferenceSettings`); ``kl`` is that
        update's mean KL to the reference, ``optimizer_steps`` the steps taken so far. Returns whether the
        reference was set to the trained weights."""
        settings = self.reference_settings
        if settings.mode == "ema":
            for target, source in self._reference_pairs(policy):
                target.copy_(
                    target * settings.ema_decay
                    + source.detach().to(target.device, target.dtype) * (1.0 - settings.ema_decay)
                )
            return False
        if settings.mode != "refreshed":
            return False
        due = (
            settings.refresh_every is not None
            and optimizer_steps - self._steps_at_refresh >= settings.refresh_every
        )
        # A non-finite KL is a broken update, not a drifted policy: it never refreshes the reference.
        drifted = settings.refresh_kl is not None and math.isfinite(kl) and kl > settings.refresh_kl
        if not (due or drifted):
            return False
        for target, source in self._reference_pairs(policy):
            target.copy_(source.detach())
        self._steps_at_refresh = optimizer_steps
        self.refreshes += 1
        return True

    def reference_state_dict(self, policy: FlowPolicy) -> dict[str, Any]:
        """A moving reference's tensors and schedule for a checkpoint (empty for ``initial``). Under
        FSDP2 the tensors are this rank's shards (DTensors), which the strategy saves as such."""
        if self.reference_settings.mode == "initial":
            return {}
        tensors = _state_tensors(self._frozen) if self.lora is None else self._ref_lora(policy)  # type: ignore[arg-type]
        return {
            "tensors": {k: v.detach().clone() for k, v in tensors.items()},
            "steps_at_refresh": self._steps_at_refresh,
            "refreshes": self.refreshes,
        }

    @torch.no_grad()
    def load_reference_state_dict(self, policy: FlowPolicy, state: dict[str, Any]) -> None:
        """Restore what :meth:`reference_state_dict` saved."""
        if self.reference_settings.mode == "initial":
            return
        if not state:
            raise ValueError(
                f"the checkpoint holds no moving KL reference, which --model.init_args.reference.mode="
                f"{self.reference_settings.mode} needs: it was written by a run with another reference; resume "
                "with the run's own config"
            )
        assert self.lora is not None or self._frozen is not None
        targets = _state_tensors(self._frozen) if self.lora is None else self._ref_lora(policy)  # type: ignore[arg-type]
        _copy_into(targets, state["tensors"], "KL reference")
        self._steps_at_refresh = int(state["steps_at_refresh"])
        self.refreshes = int(state["refreshes"])

    # -- the old policy (DiffusionNFT) ---------------------------------------------------------------

    @property
    def old_network(self) -> nn.Module | None:
        """A full fine-tune's copy of the transformer that holds the old policy (``None`` with LoRA or
        without ``old_policy``); a sharded run shards it like the transformer."""
        return self._old_network

    @property
    def copies(self) -> list[nn.Module]:
        """The transformer copies these weights hold beside the policy's own (the reference, the old
        policy): what a sharded run must shard too."""
        return [n for n in (self._frozen, self._old_network) if n is not None]

    def _old_lora(self, policy: FlowPolicy) -> dict[str, Tensor]:
        if self._old_state is None:
            # θ_old starts as θ (the reference copies the adapter before the first rollout).
            self._old_state = {n: p.detach().clone() for n, p in _trainable_of(policy, resharded=True)}
        return self._old_state

    @contextmanager
    def old(self, policy: FlowPolicy) -> Iterator[None]:
        """Inside, the policy computes with the old policy's weights (no gradient reaches them).

        LoRA: the stored adapter tensors are swapped in place (:func:`_swapped_in`); enter it before
        the θ forward of a visit.
        """
        if not self.old_policy:
            raise RuntimeError("this run keeps no old policy (TrainableWeights(old_policy=False))")
        if self.lora is None:
            assert self._old_network is not None
            with _standing_in(policy, self._old_network):
                yield
            return
        with _swapped_in(policy, self._old_lora(policy)):
            yield

    def sampling(self, policy: FlowPolicy) -> AbstractContextManager[None]:
        """The weights the rollout samples with: the old policy where there is one (DiffusionNFT's
        reference samples with its ``old`` adapter), else the trained ones."""
        return self.old(policy) if self.old_policy else nullcontext()

    @torch.no_grad()
    def update_old(self, policy: FlowPolicy, decay: float) -> None:
        """θ_old ← η·θ_old + (1 − η)·θ with η = ``decay`` (DiffusionNFT's soft update, in the
        reference's order of operations: ``old * decay + new * (1 - decay)``)."""
        if self.lora is None:
            assert self._old_network is not None
            pairs = zip(_parameters(self._old_network), _parameters(policy.transformer), strict=True)
        else:
            old = self._old_lora(policy)
            pairs = ((old[n], p) for n, p in _trainable_of(policy, resharded=True))
        for target, source in pairs:
            target.copy_(target * decay + source.detach().to(target.dtype) * (1.0 - decay))

    def old_state_dict(self, policy: FlowPolicy) -> dict[str, Tensor]:
        """The old policy's tensors for a checkpoint (empty without ``old_policy``). Under FSDP2 they
        are this rank's shards (DTensors), which the strategy saves as such."""
        if not self.old_policy:
            return {}
        if self.lora is None:
            assert self._old_network is not None
            return {k: v.detach().clone() for k, v in _state_tensors(self._old_network).items()}
        return {k: v.detach().clone() for k, v in self._old_lora(policy).items()}

    @torch.no_grad()
    def load_old_state_dict(self, policy: FlowPolicy, state: dict[str, Tensor]) -> None:
        """Restore what :meth:`old_state_dict` saved."""
        if not self.old_policy:
            return
        assert self.lora is not None or self._old_network is not None
        targets = _state_tensors(self._old_network) if self.lora is None else self._old_lora(policy)  # type: ignore[arg-type]
        _copy_into(targets, state, "old policy")

    @staticmethod
    @torch.no_grad()
    def load_checkpoint(path: str, module: nn.Module, *, use_ema: bool = True) -> None:
        """Load the trainable tensors of ``module`` from a checkpoint written by ``fit`` (a file, or the
        folder of a sharded run), its EMA weights in their place when present and ``use_ema``.

        In place, into the module's own tensors, so that the host holds them once: a full fine-tune's
        float32 masters are four bytes a parameter (48 GB for FLUX.1), and reading the checkpoint into
        tensors of its own beside them held them twice. A folder's shards are read straight into the
        module's tensors (those the EMA replaces not at all); a file, and a folder's metadata (where
        the EMA lives), are mapped rather than read whole, each tensor copied in from the mapping.
        """
        from lit_flowgrpo.strategies import METADATA_FILENAME, read_sharded_checkpoint

        trainable = {n: p for n, p in module.named_parameters() if p.requires_grad}
        folder = os.path.isdir(path)
        ckpt = torch.load(
            os.path.join(path, METADATA_FILENAME) if folder else path,
            map_location="cpu",
            mmap=True,
            weights_only=False,
        )
        ema: dict[str, Tensor] = {}
        if use_ema:
            for key, value in ckpt.get("callbacks", {}).items():
                if "TrainableEMA" in key and isinstance(value, dict) and value.get("ema_state_dict"):
                    ema.update(value["ema_state_dict"])
        state = {} if folder else dict(ckpt["state_dict"])
        if folder:
            raw = {n: p.detach() for n, p in trainable.items() if n not in ema}  # views: loaded in place
            state = {n: raw[n] for n in read_sharded_checkpoint(path, raw)}
        state.update(ema)
        missing = set(trainable) - set(state)
        if missing:
            raise ValueError(
                f"{path} lacks trainable tensors {sorted(missing)[:3]}…: use the run's own config"
            )
        for name, param in trainable.items():
            if state[name].data_ptr() != param.data_ptr():  # a folder's shards are in place already
                param.copy_(state[name])

    def export(self, policy: FlowPolicy, path: str, overwrite: bool = False) -> str:
        """Write what was trained so the family's diffusers pipeline loads it; returns what was written.

        LoRA: an adapter for ``pipeline.load_lora_weights(path)``. Full fine-tune: the transformer as a
        diffusers model folder (``save_pretrained``), for ``from_pretrained(path)``. ``path`` must be a
        new or empty folder unless ``overwrite``, which replaces its contents wholly; the export is
        written beside it and checked before it takes the folder's place (:mod:`lit_flowgrpo.export`).
        A sharded transformer is gathered on rank 0, which writes; every rank must call this.
        """
        networks = _networks(policy)
        transformer = networks[0]
        sharded = _is_sharded(transformer)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed and not sharded and torch.distributed.get_rank() != 0:
            # Every rank holds the whole weights: rank 0 writes them, alone (two ranks writing one
            # folder would race, and a rank checking the folder after rank 0 filled it would refuse).
            return f"(rank {torch.distributed.get_rank()} wrote nothing: rank 0 writes {path})"
        problems = destination_problems(path, overwrite)
        if problems:  # before the gather below, on every rank, so that no rank waits for one that raised
            raise ValueError("; ".join(problems))
        if self.lora is None and not hasattr(transformer, "save_pretrained"):
            raise ValueError(
                f"{type(transformer).__name__} is not a diffusers model: it has no save_pretrained"
            )
        states = [_full_state(n, trainable_only=self.lora is not None) for n in networks] if sharded else None
        state = None if states is None else states[0]
        if sharded and torch.distributed.get_rank() != 0:
            return f"(rank {torch.distributed.get_rank()} wrote nothing: rank 0 writes {path})"
        if self.lora is None:
            if state is None and any(
                p.dtype != self.loaded_dtypes.get(n, p.dtype) for n, p in transformer.named_parameters()
            ):
                state = {k: v.detach().cpu() for k, v in transformer.state_dict().items()}
            if state is not None:
                # In the dtype the policy loaded (bf16 in the recipes), as a bf16 pipeline loads it; the
                # float32 masters stay in the checkpoints. One tensor at a time, so that the host holds
                # the masters and one cast copy of a tensor, never both whole.
                for name, dtype in self.loaded_dtypes.items():
                    if name in state and state[name].dtype != dtype:
                        state[name] = state[name].to(dtype)
                transformer = _unsharded_copy(transformer, state)
            names = {name for name, _ in transformer.named_parameters()}
            write_folder(path, overwrite, transformer.save_pretrained, lambda d: _check_transformer(d, names))
            return f"the fine-tuned transformer ({type(transformer).__name__}) to {path}"
        from peft.utils import get_peft_model_state_dict

        lora_states = [
            get_peft_model_state_dict(n, state_dict=None if states is None else states[i])
            for i, n in enumerate(networks)
        ]
        metadata = {
            k: (sorted(v) if isinstance(v, set) else v) for k, v in self.peft_config.to_dict().items()
        }
        # The first network's adapter in the folder itself; each further one in the subfolder the
        # policy names (Wan 2.2 A14B: transformer_2/, for `load_lora_weights(..., load_into_transformer_2=True)`).
        folders = ["", *getattr(policy, "lora_subfolders", ())][: len(networks)]
        if len(folders) != len(networks):
            raise ValueError(
                f"{type(policy).__name__} trains {len(networks)} networks but names no lora_subfolders"
            )

        def write(d: str) -> None:
            for folder, lora_state in zip(folders, lora_states, strict=True):
                os.makedirs(os.path.join(d, folder), exist_ok=True)
                policy.save_lora(os.path.join(d, folder), lora_state, metadata)

        def check(d: str) -> None:
            for folder, lora_state in zip(folders, lora_states, strict=True):
                _check_lora(os.path.join(d, folder), len(lora_state))

        write_folder(path, overwrite, write, check)
        extra = f" (and {', '.join(folders[1:])}/)" if len(folders) > 1 else ""
        return f"the LoRA adapter to {path}{extra}"


# The file diffusers' `save_lora_weights` writes and `load_lora_weights(folder)` reads.
LORA_WEIGHTS_FILE = "pytorch_lora_weights.safetensors"


def _tensor_names(files: list[Path]) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:  # reads the header only
            names.update(f.keys())
    return names


def _check_lora(folder: str, expected: int) -> None:
    file = Path(folder) / LORA_WEIGHTS_FILE
    if not file.is_file():
        raise RuntimeError(f"the export wrote no {LORA_WEIGHTS_FILE} (it wrote {sorted(os.listdir(folder))})")
    written = len(_tensor_names([file]))
    if written != expected:
        raise RuntimeError(
            f"the export's {LORA_WEIGHTS_FILE} holds {written} tensors, not the adapter's {expected}"
        )


def _check_transformer(folder: str, parameters: set[str]) -> None:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not (Path(folder) / "config.json").is_file() or not files:
        raise RuntimeError(
            f"the export wrote no config.json and safetensors weights (it wrote {sorted(os.listdir(folder))})"
        )
    missing = parameters - _tensor_names(files)
    if missing:
        raise RuntimeError(
            f"the exported transformer lacks {len(missing)} parameters (e.g. {sorted(missing)[:3]})"
        )


def _is_sharded(module: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def _full_state(module: nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    """The whole (unsharded) state of a sharded ``module`` on rank 0's CPU, empty on other ranks; a
    collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(module, options=options)


def _unsharded_copy(module: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """A plain module of ``module``'s class and config holding ``state``, built without allocating or
    initialising weights (``state`` already holds them)."""
    with torch.device("meta"):
        copy_ = type(module).from_config(module.config)
    copy_.load_state_dict(state, strict=True, assign=True)
    return copy_


def _cast_elementwise(network: nn.Module, dtype: torch.dtype) -> None:
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


def _most_common_dtype(module: nn.Module) -> torch.dtype:
    counts: dict[torch.dtype, int] = {}
    for p in module.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.__getitem__) if counts else torch.float32


def _local(tensor: Tensor) -> Tensor:
    """This rank's shard of a sharded parameter (a view of its storage), else the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def _networks(policy: FlowPolicy) -> tuple[nn.Module, ...]:
    return tuple(getattr(policy, "trainable_networks", None) or (policy.transformer,))


def _trainable_of(policy: FlowPolicy, resharded: bool = False) -> list[tuple[str, nn.Parameter]]:
    """The trainable tensors of every trained network: the first network's under their own names (as
    a one-network policy's), a further network's prefixed ``network<i>.``.

    ``resharded``: reshard each network first (:func:`~lit_flowgrpo.strategies.reshard`), so that under
    FSDP2 these are the shards the optimizer steps and the next forward gathers, not weights that a
    forward left gathered (``reshard_after_forward=false``); only where no backward is pending.
    """
    out = []
    for i, network in enumerate(_networks(policy)):
        if resharded:
            from lit_flowgrpo.strategies import reshard

            reshard(network)
        prefix = "" if i == 0 else f"network{i}."
        out += [(prefix + n, p) for n, p in _trainable(network)]
    return out


def _parameters(network: nn.Module) -> list[nn.Parameter]:
    """``network``'s parameters, resharded first (see :func:`_trainable_of`)."""
    from lit_flowgrpo.strategies import reshard

    reshard(network)
    return list(network.parameters())


def _state_tensors(network: nn.Module) -> dict[str, Tensor]:
    """The live tensors of ``network``'s state dict, by its names (to read for a checkpoint and to load
    into); resharded first, so that a sharded network's are its shards (DTensors)."""
    from lit_flowgrpo.strategies import reshard

    reshard(network)
    live = dict(network.named_parameters(remove_duplicate=False))
    live.update(network.named_buffers(remove_duplicate=False))
    return {name: live[name] for name in network.state_dict()}


def _copy_into(targets: dict[str, Tensor], state: dict[str, Tensor], what: str) -> None:
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
def _standing_in(policy: FlowPolicy, network: nn.Module) -> Iterator[None]:
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
    if next(network.parameters()).device != device and not _is_sharded(network):
        network.to(device)
    policy._modules[name] = network
    try:
        yield
    finally:
        policy._modules[name] = transformer


@contextmanager
def _swapped_in(policy: FlowPolicy, stored: dict[str, Tensor]) -> Iterator[None]:
    """Inside, the adapter computes with ``stored``'s tensors, and with its own again afterwards.

    They are copied into the adapter in place and back, so no parameter is added, re-registered or has
    its ``requires_grad`` flipped (DDP's buckets and the optimizer keep seeing the same tensors), and an
    in-place copy also reaches FSDP2's shards. Enter it before the θ forward of a visit: the θ graph
    must not save tensors it swaps.
    """
    # Resharded on entry and on exit (no backward is pending at either): a unit that a forward left
    # gathered (reshard_after_forward=false) would compute its next forward with the gathered weights,
    # not with the shards written here.
    params = dict(_trainable_of(policy, resharded=True))
    with torch.no_grad():
        current = {n: p.detach().clone() for n, p in params.items()}
        for n, p in params.items():
            p.copy_(stored[n])
    try:
        yield
    finally:
        _trainable_of(policy, resharded=True)
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(current[n])


@contextmanager
def _adapters_disabled(transformer: nn.Module) -> Iterator[None]:
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
