"""Sharded training: ``--trainer.strategy=fsdp2``, FSDP2 (``fully_shard``) through Lightning's
``ModelParallelStrategy``.

Why FSDP2 and not Lightning's ``FSDPStrategy`` (FSDP1): FSDP1 wraps the whole LightningModule and runs
``training_step`` inside the root module's forward; the update runs many backward passes per step
(micro-batches × trained denoising steps), and FSDP1 refuses a backward inside its own forward.
``ModelParallelStrategy`` wraps nothing: the module shards its transformer in ``configure_model`` and
``training_step`` stays a plain method, so every forward/backward is an ordinary FSDP2 one.

What is sharded: the policy's transformer, one FSDP2 unit per block (every child of the transformer's
``nn.ModuleList`` s: SD3 ``transformer_blocks``, FLUX ``transformer_blocks`` + ``single_transformer_blocks``,
Qwen-Image ``transformer_blocks``), then the transformer itself for the rest (embedders, final norm and
projection); a full fine-tune's frozen reference copy the same way. Text encoders and the VAE are frozen
and only run in the rollout: they stay replicated.

A LoRA run's frozen base may stay replicated instead (``frozen_weights``): then only the adapter is
sharded, the whole transformer as one unit. Sharding a small base buys little memory and costs, in
every forward of the rollout and the update, a gather and a reshard per block, whose host-side launches
left the GPUs idle (SD3.5-M LoRA on 4 H200s: 85.9% of DDP's images/GPU/s, ``docs/scaling.md``). One unit
of adapter weights is gathered once per forward, and FSDP2 keeps its root unit gathered after a forward,
so the rollout's no-grad forwards gather nothing after the first: 99.4% and 98.6% of DDP on 4 H200s,
at DDP's memory (``benchmarks/results/scaling_frozen_weights_4xH200.json``). ``"auto"`` replicates the base when
it takes at most a quarter of the GPU's memory (SD3.5-M's 4.9 GB; not FLUX.1's 24 GB on an 80 GB card).

Dtypes, LoRA: FSDP2 all-gathers each parameter in its own dtype, so the frozen base stays in the policy's
dtype (bf16), a LoRA adapter in fp32, and every forward computes exactly what it computes unsharded (the
1-GPU equality depends on it). No ``MixedPrecisionPolicy`` is set there: one would cast the fp32 adapter
to bf16 for the forward, a different model from the one-GPU run (which computes the adapter under
autocast from its fp32 weights), for little gain (the adapter is a small share of the all-gather).

Dtypes, full fine-tune: the transformer's float32 master weights (``--model.init_args.weights.master_dtype``) are
sharded, each block cast as it is sharded (no rank holds a whole float32 copy), and each block's unit
gets ``MixedPrecisionPolicy(param_dtype=<compute dtype>, reduce_dtype=float32)``: the all-gathers move
bf16, as much as before, and the gradients are reduced and accumulated in float32 into the float32
shards that the optimizer steps. The root unit (embedders, final norm and projection, about 1% of the
weights) gathers in float32, as one GPU holds it: ``transformer.dtype``, which diffusers reads off the
first parameter (a root one), then reads float32 whether or not the root is left gathered after a
forward (``reshard_after_forward=false``). The blocks' matrix products compute what one GPU's autocast
computes from the same master weights (autocast rounds them to bf16 the same way); a block's parameter
used outside a matrix product (an RMSNorm scale) is multiplied in bf16 here and in float32 under one
GPU's autocast, a rounding apart. Frozen copies (the KL reference, the old policy) hold the policy's
dtype in their matrix weights and the masters' in the rest (``copies.py``), and are sharded under the
masters' policies, so that before any update they compute what the masters compute, here as on one GPU.

Checkpoints hold the trainable parameters only (the frozen base is re-read from ``pretrained``, as on one
GPU): a folder with one shard file per rank by default (``torch.distributed.checkpoint``), or one file
gathered on rank 0 with ``save_distributed_checkpoint=False``. Both resume on any number of ranks.

Sharded tensors elsewhere in the checkpoint (the copies of the weights that a run keeps beside them:
DiffusionNFT's old policy, a moving KL reference, each sharded like the weights it copies) travel the
same way: in a folder each rank writes its shards of them beside the weights' (``meta.pt``, which rank 0
alone writes, keeps a marker in their place), and a gathered file holds them whole. Lightning's
``ModelParallelStrategy`` would pickle them into ``meta.pt`` as rank 0 holds them, its shard only, which
every rank then loads as its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from torch import nn

from lit_flowgrpo.distributed import LAYOUT_ATTRIBUTE, ParallelLayout
from lit_flowgrpo.errors import SettingsError

__all__ = ["FSDP2Strategy", "parallel_layout", "reshard", "transformer_blocks"]

_FLAG = "--trainer.strategy"

#: The file of a checkpoint folder that holds everything but the tensors (Lightning's ``meta.pt``).
METADATA_FILENAME = _METADATA_FILENAME


def transformer_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a denoising network: the children of its top-level ``nn.ModuleList`` s.

    This finds the blocks of every family without a per-family table (SD3, FLUX, Qwen-Image
    transformers; the down/up blocks of a U-Net).
    """
    return [block for child in module.children() if isinstance(child, nn.ModuleList) for block in child]


def reshard(module: nn.Module) -> None:
    """Reshard every FSDP2 unit in ``module``: free its gathered weights and register its shards again.

    Needed before reading or writing parameters outside a forward/backward pair. A unit built with
    ``reshard_after_forward=False`` stays gathered after a forward until its backward (for good after a
    forward under ``torch.no_grad``, which has none), with its gathered, plain tensors registered as its
    parameters:
    ``module.parameters()`` then yields those, not the sharded ones the optimizer holds, so a gradient
    set or cleared through them misses the shards; and a write to the shards goes unseen by the next
    forward, which skips the gather. A no-op for a resharded unit and for a module without FSDP2.
    """
    from torch.distributed.fsdp import FSDPModule

    for submodule in module.modules():
        if isinstance(submodule, FSDPModule):
            submodule.reshard()


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 data-parallel sharding over all ranks (``--trainer.strategy=fsdp2``).

    A ``ModelParallelStrategy`` with a one-dimensional mesh (every rank one data-parallel shard, no
    tensor parallelism). The LightningModule applies the sharding in ``configure_model`` through
    :meth:`shard`; ``FlowGRPOModule`` does so for every network it holds, through
    :func:`lit_flowgrpo.placement.place`. The strategy also holds the run's (dp, sp) layout
    (:attr:`parallel_layout`, built once by :func:`parallel_layout`): FSDP2 shards over every rank,
    and sequence parallelism exchanges tokens within the layout's mesh.

    The memory levers are settings of the strategy, since only a sharded run can honour them here;
    give them with the class path::

        --trainer.strategy=lit_flowgrpo.strategies.FSDP2Strategy
        --trainer.strategy.reshard_after_forward=false

    Args:
        activation_checkpointing: refused: activation checkpointing has one flag,
            ``--model.init_args.performance.activation_checkpointing``, which every strategy honours.
        cpu_offload: keep the sharded parameters, gradients and optimizer state in host memory
            (FSDP2's ``CPUOffloadPolicy``); each block is copied to the GPU for its forward and backward,
            and the optimizer step runs on the CPU. Needs GPUs.
        reshard_after_forward: free each block's gathered weights after its forward (ZeRO-3); ``False``
            keeps them until the backward (ZeRO-2: less communication, the memory of the whole model).
        frozen_weights: a LoRA run's frozen base weights: ``"shard"`` them with their blocks, or
            ``"replicate"`` them on every rank (the memory of DDP) and shard the adapter only, the
            transformer as one unit (see the module docstring); ``"auto"`` replicates them on GPUs
            when they take at most a quarter of a GPU's memory and without ``cpu_offload``. A full
            fine-tune has no frozen base: its blocks are sharded either way.
        save_distributed_checkpoint: write a checkpoint as a folder of per-rank shards; ``False``
            gathers the trainable weights and optimizer state on rank 0 into one file.
        process_group_backend: ``None`` chooses NCCL on GPUs, gloo on CPUs.
        timeout: collective timeout.
    """

    strategy_name = "fsdp2"

    def __init__(
        self,
        activation_checkpointing: bool = False,
        cpu_offload: bool = False,
        reshard_after_forward: bool = True,
        frozen_weights: Literal["auto", "shard", "replicate"] = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        problems = []
        if activation_checkpointing:
            problems.append(
                f"{_FLAG}.activation_checkpointing is no longer a setting of the strategy: use "
                "--model.init_args.performance.activation_checkpointing=true (the one flag, which every "
                "strategy honours)"
            )
        if frozen_weights not in ("auto", "shard", "replicate"):
            problems.append(f"{_FLAG}.frozen_weights ({frozen_weights!r}) must be auto, shard or replicate")
        elif frozen_weights == "replicate" and cpu_offload:
            problems.append(
                f"{_FLAG}.frozen_weights=replicate keeps the frozen base on every GPU, and "
                f"{_FLAG}.cpu_offload=true moves the weights to host memory: choose one"
            )
        if problems:
            raise SettingsError("; ".join(problems))
        self.cpu_offload = cpu_offload
        self.reshard_after_forward = reshard_after_forward
        self.frozen_weights = frozen_weights
        #: The run's (dp, sp) layout (:func:`parallel_layout`), built once in the module's setup.
        self.parallel_layout: ParallelLayout | None = None

    # -- processes and mesh -------------------------------------------------------------------------

    def setup_environment(self) -> None:
        if self.cpu_offload and self.root_device.type != "cuda":
            raise SettingsError(
                f"{_FLAG}.cpu_offload=true needs GPUs (it moves shards between host and device memory); on "
                f"{self.root_device.type} drop it"
            )
        # Every rank is one data-parallel shard: a (world, 1) mesh. The parent's "auto" would make
        # the ranks of a node one tensor-parallel group.
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    # -- sharding -----------------------------------------------------------------------------------

    def replicates_frozen(self, networks: Sequence[nn.Module]) -> bool:
        """Whether the frozen base weights of the trained ``networks`` stay whole on every rank
        (``frozen_weights``; ``"auto"``: on GPUs, without ``cpu_offload``, when they take at most a
        quarter of this GPU's memory)."""
        frozen = sum(
            p.numel() * p.element_size() for n in networks for p in n.parameters() if not p.requires_grad
        )
        if self.frozen_weights != "auto" or not frozen:
            return self.frozen_weights == "replicate" and frozen > 0
        device = self.root_device
        if device.type != "cuda" or self.cpu_offload:
            return False
        return frozen <= torch.cuda.get_device_properties(device).total_memory / 4

    def shard(
        self,
        module: nn.Module,
        master_dtype: torch.dtype | None = None,
        compute_dtype: torch.dtype | None = None,
        offload: bool = False,
        replicate_frozen: bool = False,
    ) -> None:
        """Shard ``module`` for this strategy: one FSDP2 unit per block, then the module itself.

        Called by :func:`lit_flowgrpo.placement.place` on each network to shard (the trained
        transformers, a frozen reference copy). The module may sit on the CPU: each block moves to its
        device as it is sharded, so no rank ever holds the whole model on the GPU.

        Args:
            module: the network.
            master_dtype: cast its trainable parameters to this dtype, block by block, before sharding
                (a full fine-tune's float32 master weights); ``None`` leaves them.
            compute_dtype: with ``master_dtype``, the dtype the blocks' weights are all-gathered and
                computed in (``MixedPrecisionPolicy.param_dtype``; gradients reduce in ``master_dtype``).
            offload: keep this network's shards in host memory (``CPUOffloadPolicy``), whatever
                ``cpu_offload`` says: for a frozen copy that only runs forwards.
            replicate_frozen: leave its frozen parameters whole (FSDP2's ``ignored_params``; the
                strategy moves them to the device with the rest of the model) and shard the trainable
                ones as one unit (:meth:`replicates_frozen`).
        """
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        blocks = transformer_blocks(module)
        if not blocks:
            raise ValueError(
                f"{_FLAG}=fsdp2: {type(module).__name__} has no nn.ModuleList of blocks to shard as units; "
                "sharding it as one unit would gather the whole model for every forward"
            )
        # Pinned host memory needs an accelerator; on CPUs the offload keeps the shards where they are.
        pin = self.root_device.type == "cuda"
        options: dict[str, Any] = {
            "mesh": self.device_mesh["data_parallel"],
            "reshard_after_forward": self.reshard_after_forward,
            "offload_policy": CPUOffloadPolicy(pin_memory=pin)
            if self.cpu_offload or offload
            else OffloadPolicy(),
        }
        if replicate_frozen:
            frozen = {p for p in module.parameters() if not p.requires_grad}
            fully_shard(module, ignored_params=frozen, **options)
            return
        block_options, root_options = dict(options), dict(options)
        if master_dtype is not None:
            # Inputs are not cast: the policy casts them as on one GPU, and autocast (the transformer's
            # forward scope) casts each matrix product's operands.
            param_dtype = compute_dtype if compute_dtype not in (None, master_dtype) else None
            block_options["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=param_dtype, reduce_dtype=master_dtype, cast_forward_inputs=False
            )
            # The root gathers its (few) weights in float32: see the module docstring.
            root_options["mp_policy"] = MixedPrecisionPolicy(
                reduce_dtype=master_dtype, cast_forward_inputs=False
            )
        for block in blocks:
            if master_dtype is not None:
                _cast_trainable(block, master_dtype)
            fully_shard(block, **block_options)
        if master_dtype is not None:
            _cast_trainable(module, master_dtype)  # the root's own: the blocks' are sharded already
        fully_shard(module, **root_options)

    def model_to_device(self) -> None:
        if not self.cpu_offload:
            super().model_to_device()
            return
        # The parent's `.to(device)` would pull the offloaded shards onto the GPU: move only what
        # FSDP2 does not manage (text encoders, VAE, metric states).
        assert self.model is not None
        _to_device_except_sharded(self.model, self.root_device)

    # -- checkpoints --------------------------------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The trainable parameters and the buffers, sharded (or whole on rank 0 with
        ``save_distributed_checkpoint=False``): the frozen base is never copied to the host."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        assert self.model is not None
        gather = not self._save_distributed_checkpoint
        # Host copies only for the gathered form: the sharded save stages its tensors itself.
        options = StateDictOptions(full_state_dict=gather, cpu_offload=gather, ignore_frozen_params=True)
        state = get_model_state_dict(self.model, options=options)
        # ignore_frozen_params misses the second name of a tied frozen weight (T5's embed_tokens).
        frozen = {n for n, p in self.model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        return {k: v for k, v in state.items() if k not in frozen}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        """Save as the parent does, with the sharded tensors outside the model and optimizer states
        (the module's copies of its weights) sharded in a folder and gathered whole in a file (see the
        module docstring). Every rank calls it: the gathers are collectives."""
        rest = [key for key in checkpoint if key not in ("state_dict", "optimizer_states")]
        if not self._save_distributed_checkpoint:
            for key in rest:
                checkpoint[key] = _gathered(checkpoint[key], self.global_rank)
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        shards: dict[str, Any] = {}
        for key in rest:
            checkpoint[key] = _set_apart(checkpoint[key], key, shards)
        if not shards:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        if storage_options is not None:  # as the parent refuses it
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported"
            )
        import torch.distributed.checkpoint as dcp

        # The parent's folder, written here with one more entry: the shards set apart.
        path = Path(self.broadcast(filepath))
        if path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        state = {"state_dict": checkpoint.pop("state_dict"), _SHARDED: shards}
        state.update({f"optimizer_{i}": o for i, o in enumerate(checkpoint.pop("optimizer_states", []))})
        dcp.save(state, checkpoint_id=path)
        if self.global_rank == 0:
            torch.save(checkpoint, path / _METADATA_FILENAME)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load what the checkpoint holds into the sharded model and optimizers.

        Unlike the parent, the checkpoint may hold a subset of the model (the trainable weights): the
        LightningModule's ``on_load_checkpoint`` checks what must be there against
        ``checkpoint["state_dict"]``, which holds the keys that were loaded. The sharded tensors set
        apart on saving come back in their places, as this rank's shards (DTensors on this run's mesh,
        in host memory; whole tensors from a gathered file): their owners copy them into their own.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(checkpoint_path))
        assert self.model is not None
        model = self.model
        if path.is_dir():
            reader = dcp.FileSystemReader(path)
            saved = set(reader.read_metadata().state_dict_metadata)
            wanted = get_model_state_dict(model)
            state = {k: v for k, v in wanted.items() if f"state_dict.{k}" in saved}
            dcp.load({"state_dict": state}, storage_reader=reader)
            set_model_state_dict(model, state, options=StateDictOptions(strict=False))
            for i, optimizer in enumerate(self.optimizers):
                key = f"optimizer_{i}"
                wanted_optim = get_optimizer_state_dict(model, optimizer)
                # A parameter that never had a gradient has no optimizer state in the checkpoint (Qwen-Image's
                # last block computes a text-stream output the model never reads, so its LoRA weights there
                # get none), while a fresh optimizer's state dict lists every parameter: load what was
                # saved, and leave the rest without state, as in the run that saved it.
                wanted_optim["state"] = {
                    fqn: entry
                    for fqn, entry in wanted_optim["state"].items()
                    if all(f"{key}.state.{fqn}.{name}" in saved for name in entry)
                }
                optim_state = {key: wanted_optim}
                dcp.load(optim_state, storage_reader=reader)
                # not strict: the parameters left out above
                set_optimizer_state_dict(
                    model, optimizer, optim_state[key], options=StateDictOptions(strict=False)
                )
            checkpoint = torch.load(path / _METADATA_FILENAME, weights_only=weights_only)
            checkpoint["state_dict"] = state
            self._load_set_apart(checkpoint, reader)
            return checkpoint
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
        full = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_model_state_dict(model, checkpoint["state_dict"], options=full)
        for optimizer, optim_state in zip(
            self.optimizers, checkpoint.get("optimizer_states", []), strict=False
        ):
            set_optimizer_state_dict(model, optimizer, _by_name(optim_state, model), options=full)
        return checkpoint

    def _load_set_apart(self, checkpoint: dict[str, Any], reader: Any) -> None:
        """Replace each marker :func:`_set_apart` left in ``checkpoint`` by this rank's shards of its
        tensor, read from the folder (with any number of ranks: the reader reshards)."""
        import torch.distributed.checkpoint as dcp

        markers: dict[str, dict[str, Any]] = {}
        _find_markers(checkpoint, markers)
        if not markers:
            return
        mesh = self.device_mesh["data_parallel"]
        shards = {key: _empty_shards(marker, mesh) for key, marker in markers.items()}
        dcp.load({_SHARDED: shards}, storage_reader=reader)
        _replace_markers(checkpoint, shards)


#: The folder entry of the sharded tensors set apart from ``meta.pt``, and their markers' key there.
_SHARDED = "sharded_state"
_MARKER = "sharded_state_key"


def _set_apart(value: Any, key: str, shards: dict[str, Any]) -> Any:
    """``value`` with every DTensor in it (through dicts, lists and tuples) moved into ``shards`` under
    a key of its path, and a marker left in its place; containers without one come back as they are."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if isinstance(value, DTensor):
        mesh, (placement,) = value.device_mesh, value.placements
        if mesh.ndim != 1 or not isinstance(placement, (Shard, Replicate)):
            raise NotImplementedError(
                f"saving {key}: only tensors sharded over one mesh dimension are supported"
            )
        shards[key] = value
        dim = placement.dim if isinstance(placement, Shard) else None
        return {_MARKER: key, "shape": list(value.shape), "dtype": str(value.dtype), "shard_dim": dim}
    if isinstance(value, dict):
        out = {k: _set_apart(v, f"{key}/{k}", shards) for k, v in value.items()}
        return out if any(out[k] is not value[k] for k in value) else value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        items = [_set_apart(v, f"{key}/{i}", shards) for i, v in enumerate(value)]
        return type(value)(items) if any(a is not b for a, b in zip(items, value, strict=True)) else value
    return value


def _gathered(value: Any, rank: int) -> Any:
    """``value`` with every DTensor in it whole on rank 0's host (for the file rank 0 writes; the other
    ranks' copies are not written and keep their shards). A collective: every rank calls it."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local, mesh = value.to_local(), value.device_mesh
        if local.device.type != mesh.device_type:  # shards kept in host memory gather on the mesh's devices
            kind = mesh.device_type
            local = local.to(torch.device(kind, torch.get_device_module(kind).current_device()))
            value = DTensor.from_local(
                local, mesh, value.placements, shape=value.shape, stride=value.stride(), run_check=False
            )
        whole = value.full_tensor()
        return whole.cpu() if rank == 0 else value
    if isinstance(value, dict):
        out = {k: _gathered(v, rank) for k, v in value.items()}
        return out if any(out[k] is not value[k] for k in value) else value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        items = [_gathered(v, rank) for v in value]
        return type(value)(items) if any(a is not b for a, b in zip(items, value, strict=True)) else value
    return value


def _find_markers(value: Any, found: dict[str, dict[str, Any]]) -> None:
    if isinstance(value, dict):
        if isinstance(value.get(_MARKER), str):
            found[value[_MARKER]] = value
            return
        for v in value.values():
            _find_markers(v, found)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _find_markers(v, found)


def _replace_markers(value: Any, shards: dict[str, Any]) -> Any:
    """``value`` with every marker replaced by its tensor in ``shards``; dicts and lists in place."""
    if isinstance(value, dict):
        if isinstance(value.get(_MARKER), str):
            return shards[value[_MARKER]]
        for k, v in value.items():
            value[k] = _replace_markers(v, shards)
    elif isinstance(value, list):
        value[:] = [_replace_markers(v, shards) for v in value]
    elif isinstance(value, tuple) and not hasattr(value, "_fields"):
        return type(value)(_replace_markers(v, shards) for v in value)
    return value


def _empty_shards(marker: dict[str, Any], mesh: Any) -> Any:
    """An empty DTensor on ``mesh`` laid out as ``marker`` says, its local shard in host memory (the
    owner copies it where its own tensor lives): a target for ``torch.distributed.checkpoint.load``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    shape = torch.Size(marker["shape"])
    dtype = getattr(torch, marker["dtype"].removeprefix("torch."))
    dim = marker["shard_dim"]
    placement = Replicate() if dim is None else Shard(dim)
    local_shape = shape
    if dim is not None:
        # DTensor's Shard cuts as torch.chunk does; ranks past the last chunk hold an empty shard.
        chunks = torch.empty(shape, device="meta").chunk(mesh.size(), dim)
        index = mesh.get_local_rank()
        local_shape = chunks[index].shape if index < len(chunks) else (*shape[:dim], 0, *shape[dim + 1 :])
    stride = torch.empty(shape, device="meta").stride()
    local = torch.empty(local_shape, dtype=dtype)
    return DTensor.from_local(local, mesh, [placement], shape=shape, stride=stride, run_check=False)


def _by_name(optim_state: Mapping[str, Any], model: nn.Module) -> dict[str, Any]:
    """A full optimizer state keyed by parameter id (``torch.optim`` order) re-keyed by name, the form
    ``set_optimizer_state_dict`` takes."""
    from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

    if optim_state["state"] and isinstance(next(iter(optim_state["state"])), int):
        return FullyShardedDataParallel.rekey_optim_state_dict(
            optim_state, OptimStateKeyType.PARAM_NAME, model
        )
    return dict(optim_state)


def _cast_trainable(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast the trainable, not yet sharded parameters of ``module`` to ``dtype`` in place (as diffusers'
    ``cast_training_params``, which would also reach the blocks sharded already)."""
    from torch.distributed.tensor import DTensor

    for p in module.parameters():
        if p.requires_grad and p.dtype != dtype and not isinstance(p, DTensor):
            p.data = p.data.to(dtype)


def _to_device_except_sharded(module: nn.Module, device: torch.device) -> None:
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        return
    if not any(isinstance(m, FSDPModule) for m in module.modules()):
        module.to(device)
        return
    module._apply(lambda t: t.to(device), recurse=False)
    for child in module.children():
        _to_device_except_sharded(child, device)


StrategyRegistry.register(
    FSDP2Strategy.strategy_name,
    FSDP2Strategy,
    description="FSDP2 (fully_shard per transformer block) data-parallel sharding over all ranks",
)


def unsupported_strategy(cls: type, name: str) -> str | None:
    """Why ``FlowGRPOModule``'s update cannot run under the strategy class ``cls`` (given as ``name``:
    a registered alias or a class path), or ``None``.

    Judged from the class alone, so the CLI asks before the Trainer builds the strategy (whose own
    checks, "needs a GPU" or "install deepspeed", would otherwise speak first), and ``setup`` asks again
    for a strategy built in Python.
    """
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    if issubclass(cls, FSDPStrategy):
        return (
            f"--trainer.strategy={name} (Lightning's FSDPStrategy, FSDP1) runs training_step inside the root "
            "module's forward, where the update's backward passes (one per micro-batch and trained step) "
            "are illegal: use --trainer.strategy=fsdp2 (FSDP2, sharded per transformer block)"
        )
    if issubclass(cls, DeepSpeedStrategy):
        return (
            f"--trainer.strategy={name} is not supported: DeepSpeed's engine expects one backward per "
            "forward of the whole module, the update runs many per training step; use "
            "--trainer.strategy=fsdp2 to shard (or ddp)"
        )
    if issubclass(cls, ModelParallelStrategy) and not issubclass(cls, FSDP2Strategy):
        return (
            f"--trainer.strategy={name} ({cls.__name__}): FlowGRPOModule applies no tensor parallelism; "
            "use --trainer.strategy=fsdp2 (data-parallel sharding over all ranks)"
        )
    return None


def sharding(trainer: Any) -> FSDP2Strategy | None:
    """The trainer's :class:`FSDP2Strategy`, or ``None`` under any other strategy (or no trainer)."""
    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    return strategy if isinstance(strategy, FSDP2Strategy) else None


def parallel_layout(
    strategy: Any, sequence_parallel: int = 1, rank: int | None = None, world: int | None = None
) -> ParallelLayout:
    """The (dp, sp) layout of ``strategy``'s ranks (``rank`` of ``world``: the trainer's), built once
    and held by the strategy, where the data module, the callbacks and
    :meth:`DataParallel.of <lit_flowgrpo.distributed.DataParallel.of>` find it. :class:`FSDP2Strategy`
    declares it; another strategy (DDP, one device) carries it as one attribute. A collective the
    first time with sp > 1: every rank calls it at the same point (the module's ``setup``)."""
    held = getattr(strategy, LAYOUT_ATTRIBUTE, None)
    same = isinstance(held, ParallelLayout) and held.sequence_parallel == sequence_parallel
    if same and world in (None, held.world) and rank in (None, held.rank):
        return held
    layout = ParallelLayout.build(strategy, sequence_parallel, rank, world)
    setattr(strategy, LAYOUT_ATTRIBUTE, layout)
    return layout


def strategy_problems(trainer: Any, dm: Any, performance: Any, offload_reference: bool = False) -> list[str]:
    """The strategies ``FlowGRPOModule``'s update cannot run under, and what sharding asks of the data
    and the performance settings (checked in ``setup``, before any weight is read)."""
    strategy = trainer.strategy
    name = getattr(strategy, "strategy_name", None) or type(strategy).__name__
    unsupported = unsupported_strategy(type(strategy), name)
    if unsupported:
        return [unsupported]
    if offload_reference and not isinstance(strategy, FSDP2Strategy):
        # A memory lever the strategy cannot honour is an error, never a silent no-op. Streaming a
        # whole frozen copy in block by block on one device (diffusers' group offloading) is not wired
        # here: the reference would then run outside the sharded path every other network takes.
        return [
            f"--model.init_args.kl.reference.offload=true needs --trainer.strategy=fsdp2, whose CPUOffloadPolicy "
            f"streams the reference copy's shards in block by block; under {name} drop it (or shard the run)"
        ]
    if getattr(performance, "fp8_base_matmuls", False):
        from lit_flowgrpo.fp8 import fp8_problems

        sharded = isinstance(strategy, FSDP2Strategy)
        problems = fp8_problems(device=None if sharded else strategy.root_device, sharded=sharded)
        if problems:
            return problems
    if not isinstance(strategy, FSDP2Strategy):
        return []
    if getattr(performance, "rollout_merged_lora", False):
        return [
            "--model.init_args.performance.rollout_merged_lora merges the adapter into the base weights' storage, "
            "which FSDP2 does not read back (it gathers from its own shards): drop it under "
            "--trainer.strategy=fsdp2"
        ]
    world = trainer.world_size
    val = len(getattr(dm, "val_records", None) or []) * getattr(dm, "val_seeds", 1)
    if val % world:
        # Each sharded forward gathers weights from every rank: all ranks must run the same number.
        return [
            f"--data.init_args.val prompts × --data.init_args.val_seeds ({val}) must be a multiple of the number of ranks "
            f"({world}) under --trainer.strategy=fsdp2, whose forwards are collective: set "
            "--data.init_args.max_val_prompts or --data.init_args.val_seeds so"
        ]
    return []


def read_sharded_checkpoint(path: _PATH, targets: Mapping[str, torch.Tensor]) -> list[str]:
    """Read the trainable tensors a ``--trainer.strategy=fsdp2`` checkpoint folder holds straight into
    ``targets`` (whole tensors of this process, by parameter name), in place, in one process; returns
    the names it read (those the folder holds)."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(path)
    saved = set(reader.read_metadata().state_dict_metadata)
    found = {name: t for name, t in targets.items() if f"state_dict.{name}" in saved}
    if found:
        dcp.load({"state_dict": dict(found)}, storage_reader=reader, no_dist=True)
    return list(found)


def end_distributed_process(exit_code: int = 0) -> None:
    """End a process of a finished distributed run: close the process group Lightning leaves open,
    flush, and leave without the interpreter's teardown.

    Hand-written because no launcher does it: with gloo, a background thread destroyed during that
    teardown now and then aborts a run that succeeded ("terminate called without an active
    exception", exit status -6), which a launcher or scheduler reports as a failure. Does nothing
    when no process group is open.
    """
    import os
    import sys

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
