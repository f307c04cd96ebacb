"""The trained weights: a LoRA adapter or the whole transformer, float32 masters, the checkpoint
reader and export.

LoRA goes through the adapter API that every diffusers model class here already has
(``add_adapter``, ``disable_adapters``/``enable_adapters``; ``cast_training_params`` and
``get_peft_model_state_dict`` for the dtype and export), as diffusers' own LoRA training scripts do.
The copies of these weights (the KL reference, DiffusionNFT's old policy) are :mod:`lit_flowgrpo.copies`,
made here when the weights are attached.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lit_flowgrpo.copies import Copies, OldPolicy, Reference, copy_into, is_sharded, trainable_of
from lit_flowgrpo.errors import MODEL, SettingsError
from lit_flowgrpo.export import destination_problems, write_folder
from lit_flowgrpo.kl import ReferenceSettings
from lit_flowgrpo.policies.base import FlowPolicy
from lit_flowgrpo.strategies import METADATA_FILENAME, read_sharded_checkpoint

__all__ = ["LORA_WEIGHTS_FILE", "LoraSettings", "TrainableWeights", "WeightsSettings"]

_FLAG = f"{MODEL}.weights"
_FULL_FINE_TUNE_OF_SEVERAL = (
    f"{_FLAG}.lora=null (a full fine-tune) with a policy that trains {{networks}} networks (Wan 2.2 "
    f"A14B's experts): only LoRA is supported there; set {_FLAG}.lora"
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

    def problems(self, flag: str = f"{_FLAG}.lora") -> list[str]:
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
class WeightsSettings:
    """What the update trains, and the dtype it keeps it in (``--model.init_args.weights``).

    Args:
        lora: LoRA settings; ``None`` is a full fine-tune of the transformer.
        master_dtype: the dtype the trained weights are kept in: ``float32`` (the default: master
            weights, computing in the compute dtype under autocast) or ``model`` (a full fine-tune
            trains the policy's dtype, bf16, in place, and loses updates smaller than its rounding;
            saves 2 bytes per parameter and 4 of AdamW's). A LoRA adapter is always float32.
        init_from: start the trained weights from a previous run's export (the folder `lit-flowgrpo
            export` writes): with ``lora``, its LoRA adapter (``pytorch_lora_weights.safetensors``, the
            same rank and target modules) becomes this run's adapter; with ``lora: null``, its transformer
            folder (``config.json`` and safetensors) becomes the weights that are fine-tuned. Read when
            the weights are attached, before the KL reference and the old policy are made. SFT, then RL
            from what SFT learnt. ``None``: the policy's pretrained weights.
        init_reference: the KL reference (and Diffusion-DPO's) of a run started ``init_from``: ``init``
            (the default) the weights it starts from, so RL is held to the SFT model; ``base`` the
            policy's pretrained weights, as flow_grpo's GRPO started from an SFT adapter computes its
            reference (``PeftModel.from_pretrained`` then ``disable_adapter``). With LoRA, ``init`` keeps
            one stored copy of the adapter (saved in checkpoints) and ``base`` costs nothing; for a full
            fine-tune either is the frozen copy ``kl.reference.copy`` makes.
    """

    lora: LoraSettings | None = field(default_factory=LoraSettings)
    master_dtype: Literal["float32", "model"] = "float32"
    init_from: str | None = None
    init_reference: Literal["init", "base"] = "init"

    def problems(self, networks: int = 1) -> list[str]:
        """Every problem with these settings; ``networks``: the trainable networks the policy declares
        before loading (Wan 2.2 A14B: 2)."""
        p = [] if self.lora is None else self.lora.problems()
        p += init_from_problems(self.init_from, self.lora is not None)
        if self.init_reference not in ("init", "base"):
            p.append(f"{_FLAG}.init_reference ({self.init_reference!r}) must be init or base")
        if self.lora is None and networks > 1:
            p.append(_FULL_FINE_TUNE_OF_SEVERAL.format(networks=networks))
        if self.master_dtype not in ("float32", "model"):
            p.append(f"{_FLAG}.master_dtype ({self.master_dtype!r}) must be float32 or model")
        elif self.lora is not None and self.master_dtype == "model":
            p.append(
                f"{_FLAG}.master_dtype=model with {_FLAG}.lora: a LoRA adapter is always trained in float32 "
                "(the frozen base keeps the policy's dtype); drop the setting, or set lora: null for a full "
                "fine-tune in the policy's dtype"
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
        settings: what is trained (:class:`WeightsSettings`: LoRA or full, the master dtype).
        seed: seeds the adapter's random initialisation.
        old_policy: η of DiffusionNFT's old policy as a function of the optimizer steps taken, or
            ``None``: keep a second, slowly averaged copy of the trained weights that the rollout samples
            with and the loss anchors at (:class:`~lit_flowgrpo.copies.OldPolicy`).
        reference: which policy the KL holds the trained one to (:class:`~lit_flowgrpo.kl.ReferenceSettings`;
            with ``copy``, a full fine-tune keeps a frozen copy of the initial transformer).

    Why float32 masters for a full fine-tune: an AdamW step moves a weight by about the learning rate
    (1e-5 in the full fine-tune recipes), while bf16 rounds a weight of 0.03 to a multiple of 2^-13
    (1.2e-4): an update below half of that, 6e-5, is rounded away, so most of the weights would never
    move. Masters cost 2 more bytes per parameter (and AdamW's moments 4 more), which ``model`` saves.
    The frozen copies (the KL reference, DiffusionNFT's old policy) stay in the policy's dtype, and the
    export writes the policy's dtype; checkpoints hold the masters, so a resume is exact.
    """

    def __init__(
        self,
        settings: WeightsSettings | None = None,
        seed: int = 0,
        old_policy: Callable[[int], float | None] | None = None,
        reference: ReferenceSettings | None = None,
    ) -> None:
        self.settings = settings or WeightsSettings()
        self.lora = self.settings.lora
        self.master = self.settings.master_dtype
        self.seed = seed
        self.reference_settings = reference or ReferenceSettings()
        # The dtype of each parameter of the trained network as the policy loaded it (set by attach):
        # what the export writes, and what "model" and the compute dtype "auto" refer to.
        self.loaded_dtypes: dict[str, torch.dtype] = {}
        self.model_dtype: torch.dtype | None = None
        self.peft_config: Any = None
        trains_lora = self.lora is not None
        self.copies = Copies(
            # A LoRA run held to the adapter it starts from keeps that adapter (ReferenceAtInit); a moving
            # reference starts there anyway, and a full fine-tune's copy is taken after init_from is read.
            (ReferenceAtInit if self._held_to_init_adapter else Reference)(
                self.reference_settings, trains_lora
            ),
            None if old_policy is None else OldPolicy(trains_lora, old_policy),
        )

    @property
    def _held_to_init_adapter(self) -> bool:
        s = self.settings
        return (
            s.lora is not None
            and s.init_from is not None
            and s.init_reference == "init"
            and self.reference_settings.mode == "initial"
        )

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
        networks = policy.trainable_networks
        if self.lora is None and len(networks) > 1:
            raise SettingsError(_FULL_FINE_TUNE_OF_SEVERAL.format(networks=len(networks)))
        transformer = policy.transformer
        self.loaded_dtypes = {n: p.dtype for n, p in transformer.named_parameters()}
        self.model_dtype = _most_common_dtype(transformer)
        if self.lora is None:
            transformer.requires_grad_(True)
            # The copies are taken before the cast: they keep the policy's dtype. A reference of the
            # base is taken before the weights init_from names are read, every other copy after.
            base_reference = self.settings.init_from is not None and self.settings.init_reference == "base"
            if base_reference:
                self.copies.kl_reference.bind(policy, self.master_dtype, self.reference_settings.copy)
            self._load_init(policy)
            self._bind_copies(policy, skip_reference=base_reference)
            if cast and self.master_dtype is not None:
                from diffusers.training_utils import cast_training_params

                # The same cast as a LoRA adapter's below: parameters only, buffers keep their dtype.
                cast_training_params(transformer, dtype=self.master_dtype)
            if self.master == "model" and self.model_dtype != torch.float32:
                from lightning.pytorch.utilities import rank_zero_warn

                rank_zero_warn(
                    f"{_FLAG}.master_dtype=model: the full fine-tune trains {self.model_dtype} weights in "
                    "place, and updates smaller than half their rounding step (a few 1e-5 at typical weights) are "
                    "lost; float32 (the default) keeps master weights"
                )
            return
        problems = self.init_problems(policy)
        if problems:
            raise SettingsError("; ".join(problems))
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
                    f"{_FLAG}.lora.target_modules ({config.target_modules}) matched no module of the "
                    f"transformer{'' if i == 0 else f' (network {i})'}"
                )
        self.peft_config = config
        self._load_init(policy)
        self._bind_copies(policy)

    def _bind_copies(self, policy: FlowPolicy, skip_reference: bool = False) -> None:
        keep = {self.copies.kl_reference: self.reference_settings.copy, self.copies.old_policy: True}
        for part in self.copies.parts:
            if not (skip_reference and part is self.copies.kl_reference):
                part.bind(policy, self.master_dtype, keep_network=keep[part])

    @torch.no_grad()
    def _load_init(self, policy: FlowPolicy) -> None:
        """Copy the weights ``init_from`` names into the trained ones, bit for bit (nothing when unset):
        each network's adapter from its folder (the first network's from the folder itself, each further
        one from the policy's ``lora_subfolders``), or the transformer's parameters from a transformer
        folder; refused, naming the flag, when a tensor is missing, extra or of another shape."""
        if self.settings.init_from is None:
            return
        flag = f"{_FLAG}.init_from ({self.settings.init_from})"
        folder = os.path.expanduser(self.settings.init_from)
        if self.lora is None:
            transformer = policy.transformer
            config = _read_json(Path(folder) / "config.json")
            name = config.get("_class_name")
            if name != type(transformer).__name__:
                raise SettingsError(
                    f"{flag} holds a {name}, but this policy's transformer is a {type(transformer).__name__}: "
                    "give the export of a run of the same family"
                )
            state = _read_tensors(sorted(Path(folder).glob("*.safetensors")))
            targets = dict(transformer.named_parameters())
            # save_pretrained writes the persistent buffers too: they are read back where this run has them
            targets.update({n: b for n, b in transformer.named_buffers() if n in state})
            _copy_matching(targets, state, flag, "transformer")
            return
        from peft.utils import get_peft_model_state_dict

        folders = ["", *policy.lora_subfolders][: len(policy.trainable_networks)]
        for sub, network in zip(folders, policy.trainable_networks, strict=True):
            file = Path(folder) / sub / LORA_WEIGHTS_FILE
            if not file.is_file():
                raise SettingsError(
                    f"{flag} has no {sub + '/' if sub else ''}{LORA_WEIGHTS_FILE}: {_INIT_FIX}"
                )
            # diffusers' save_lora_weights prefixes each key with the component ("transformer."); the
            # adapter's own tensors are named as peft's get_peft_model_state_dict names them.
            saved = {
                k.split(".", 1)[1] if k.startswith(("transformer.", "transformer_2.")) else k: v
                for k, v in _read_tensors([file]).items()
            }
            names = get_peft_model_state_dict(network)
            params = dict(network.named_parameters())
            # peft names a tensor without its adapter name; the parameter carries it (".default").
            targets = {
                k: params[k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")]
                for k in names
            }
            _copy_matching(targets, saved, flag, "LoRA adapter")

    def init_problems(self, policy: FlowPolicy) -> list[str]:
        """An adapter ``init_from`` names against this run's LoRA settings as the policy resolves them
        (rank, alpha, target modules; read from the export's metadata, before its tensors)."""
        folder, lora = self.settings.init_from, self.lora
        if folder is None or lora is None:
            return []
        meta = _lora_metadata(Path(folder).expanduser() / LORA_WEIGHTS_FILE)
        if not meta:
            return []
        want = self._peft_config(policy)
        out = []
        for key, ours in (("r", want.r), ("lora_alpha", want.lora_alpha)):
            if key in meta and float(meta[key]) != float(ours):
                out.append(f"{key} {meta[key]} (this run: {ours})")
        theirs = meta.get("target_modules")
        if theirs is not None and sorted(theirs) != sorted(want.target_modules):
            out.append(f"target_modules {sorted(theirs)} (this run: {sorted(want.target_modules)})")
        if not out:
            return []
        return [
            f"{_FLAG}.init_from ({folder}) is an adapter of {', '.join(out)}: set {_FLAG}.lora.rank, alpha and "
            "target_modules to the export's (its run's config), so that its tensors fit this run's adapter"
        ]

    def _peft_config(self, policy: FlowPolicy) -> Any:
        from peft import LoraConfig

        lora = self.lora
        assert lora is not None
        rank = lora.rank or policy.default_lora_rank
        default_alpha = policy.default_lora_alpha
        alpha = (
            lora.alpha if lora.alpha is not None else default_alpha if default_alpha is not None else 2 * rank
        )
        targets = lora.target_modules or list(policy.default_lora_targets)
        if not targets:
            raise ValueError(
                f"{_FLAG}.lora.target_modules is empty and {type(policy).__name__} names no default: "
                "list the module names to adapt"
            )
        unused = list(policy.unused_modules())  # no gradient would reach them (DDP refuses such a parameter)
        return LoraConfig(
            r=rank,
            lora_alpha=alpha,
            target_modules=targets,
            exclude_modules=unused or None,
            init_lora_weights=True if lora.init == "default" else lora.init,
            lora_dropout=lora.dropout,
        )

    @staticmethod
    def check_resumed(saved: dict[str, Any], trainable: dict[str, nn.Parameter]) -> None:
        """Refuse a checkpoint whose trainable tensors are not this run's (``saved``: its state dict,
        ``trainable``: this run's trainable parameters by name), naming what differs; before
        Lightning's ``load_state_dict``, which would list every tensor of another shape."""
        missing = set(trainable) - set(saved)
        if trainable and missing:
            raise SettingsError(
                f"the checkpoint lacks {len(missing)} trainable tensors (e.g. {sorted(missing)[:3]}): it was "
                "written with other LoRA settings or another policy; resume with the run's own config"
            )
        other = sorted(
            (name, tuple(saved[name].shape), tuple(p.shape))
            for name, p in trainable.items()
            if torch.is_tensor(saved[name]) and saved[name].shape != p.shape
        )
        if other:
            name, was, now = other[0]
            raise SettingsError(
                f"the checkpoint's trainable tensors have other shapes than this run's ({len(other)} of "
                f"{len(trainable)}, e.g. {name}: checkpoint {list(was)}, this run {list(now)}): it was written "
                f"with another {_FLAG}.lora.rank or another policy; resume with the run's own config"
            )

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
        networks = policy.trainable_networks
        transformer = networks[0]
        sharded = is_sharded(transformer)
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
        folders = ["", *policy.lora_subfolders][: len(networks)]
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


def _most_common_dtype(module: nn.Module) -> torch.dtype:
    counts: dict[torch.dtype, int] = {}
    for p in module.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.__getitem__) if counts else torch.float32


_INIT_FIX = (
    "give the folder `lit-flowgrpo export` wrote for the run to start from (a LoRA run's adapter with "
    f"{_FLAG}.lora set, a full fine-tune's transformer folder with {_FLAG}.lora=null)"
)


def init_from_problems(folder: str | None, lora: bool) -> list[str]:
    """What is wrong with ``init_from`` for a LoRA run (``lora``) or a full fine-tune, from the folder's
    files alone (no tensor is read)."""
    if folder is None:
        return []
    flag = f"{_FLAG}.init_from ({folder})"
    path = Path(folder).expanduser()
    if not path.is_dir():
        return [f"{flag} is not a folder: {_INIT_FIX}"]
    adapter = (path / LORA_WEIGHTS_FILE).is_file()
    transformer = (path / "config.json").is_file() and any(path.glob("*.safetensors"))
    if lora and not adapter:
        what = "a transformer (a full fine-tune's export)" if transformer else "no LoRA adapter"
        return [
            f"{flag} holds {what}, not {LORA_WEIGHTS_FILE}: set {_FLAG}.lora=null to fine-tune that transformer "
            f"wholly, or {_INIT_FIX}"
        ]
    if not lora and not transformer:
        what = "a LoRA adapter" if adapter else "no config.json and safetensors weights"
        return [
            f"{flag} holds {what}, not a transformer folder: set {_FLAG}.lora to continue training the adapter, "
            f"or {_INIT_FIX}"
        ]
    return []


class ReferenceAtInit(Reference):
    """The KL reference of a LoRA run started from an adapter (``init_from`` with ``init_reference: init``):
    the adapter as loaded, as a stored copy that never moves, instead of the network with its adapter
    switched off (the base). The loaded tensors are kept on the host when the copies are bound and fill
    the stored copy when it is first made (laid out as the trained tensors then are: FSDP2's shards), so
    it holds them whatever the updates did before its first use; it is saved in checkpoints, so a
    resumed run holds it too."""

    def __init__(self, settings: ReferenceSettings, lora: bool) -> None:
        super().__init__(settings, lora)
        self._loaded: dict[str, Tensor] | None = None

    @property
    def moves(self) -> bool:
        return True  # a stored copy, saved and restored; after_update moves only ema / refreshed ones

    def bind(self, policy: Any, master_dtype: torch.dtype | None, keep_network: bool) -> None:
        super().bind(policy, master_dtype, keep_network)
        self._loaded = {n: p.detach().to("cpu", copy=True) for n, p in trainable_of(policy)}

    def adapter(self) -> dict[str, Tensor]:
        stored = super().adapter()
        if self._loaded is not None:
            copy_into(stored, self._loaded, "KL reference (the adapter init_from loaded)")
            self._loaded = None
        return stored


def _read_json(path: Path) -> dict[str, Any]:
    import json

    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _read_tensors(files: list[Path]) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    out: dict[str, Tensor] = {}
    for file in files:
        out.update(load_file(str(file)))
    return out


def _lora_metadata(file: Path) -> dict[str, Any]:
    """The adapter's settings diffusers' ``save_lora_weights`` writes in the safetensors header
    (``lora_adapter_metadata``), empty where it wrote none."""
    import json

    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        raw = (f.metadata() or {}).get("lora_adapter_metadata")
    if not raw:
        return {}
    meta = json.loads(raw)
    # one entry per component ("transformer.r": ...) or the config itself
    return {
        k.split(".", 1)[1] if k.startswith(("transformer.", "transformer_2.")) else k: v
        for k, v in meta.items()
    }


def _copy_matching(params: dict[str, Tensor], saved: dict[str, Tensor], flag: str, what: str) -> None:
    """Copy ``saved`` into ``params`` by name (cast to each parameter's dtype), refusing any difference."""
    missing, extra = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
    shapes = [
        (n, tuple(saved[n].shape), tuple(p.shape))
        for n, p in params.items()
        if n in saved and saved[n].shape != p.shape
    ]
    if missing or extra or shapes:
        detail = (
            f"lacks {len(missing)} tensors of this run's {what} (e.g. {missing[:2]})"
            if missing
            else f"has {len(extra)} tensors this run's {what} lacks (e.g. {extra[:2]})"
            if extra
            else f"has tensors of other shapes (e.g. {shapes[0][0]}: export {list(shapes[0][1])}, this run {list(shapes[0][2])})"
        )
        raise SettingsError(
            f"{flag} {detail}: it was exported by a run of another policy or other LoRA settings; start from "
            "an export of this family with this run's weights settings"
        )
    for name, param in params.items():
        param.copy_(saved[name].to(param.dtype))
