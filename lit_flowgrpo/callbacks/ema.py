"""An exponential moving average of the trainable weights only, swapped in for validation and export.

The average itself is diffusers' ``training_utils.EMAModel`` (its update, ``store``/``copy_to``/
``restore`` swap and warm-up formula). This callback adds what a Lightning RL run needs around it:
the trainable subset by name, the optimizer-step clock, the swap around validation, and a checkpoint
format keyed by parameter name that resumes bit-exactly.

Under FSDP2 (``--trainer.strategy=fsdp2``) the parameters are DTensors, for which ``torch._foreach_*``
(what ``EMAModel`` runs) has no sharding rule. The average is elementwise, so each rank averages its own
shards: the shadows are plain fp32 tensors shaped like this rank's shards, and ``EMAModel`` is handed the
parameters' local shards (views of their storage). That is the one-process arithmetic value for value,
with no communication; only the checkpoint state gathers the shadows whole.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from diffusers.training_utils import EMAModel
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor
from typing_extensions import override

from lit_flowgrpo.callbacks._module import as_mapping
from lit_flowgrpo.strategies import reshard

__all__ = ["TrainableEMA"]


class TrainableEMA(Callback):
    r"""Exponential moving average of the parameters that require grad, and nothing else.

    Lightning's ``EMAWeightAveraging`` deep-copies the whole LightningModule, frozen base included:
    tens of GB for a 2-12B transformer trained through a LoRA of a few MB. This keeps an fp32 shadow
    of ``{name: p for name, p in pl_module.named_parameters() if p.requires_grad}`` only, on the
    parameters' devices, in a diffusers ``EMAModel``; under FSDP2, of this rank's shards only.

    Update (flow_grpo's ``EMAModuleWrapper``, ``flow_grpo/ema.py``; diffusers' ``EMAModel.step``
    with its default warm-up): after optimizer step k (k = 1, 2, ...; counted by a post-step hook on
    the first optimizer, so every ``optimizer.step()`` of a manual-optimization ``training_step``
    counts) and when k is a multiple of ``update_every``,

    .. math:: d_k = \min\left(\frac{1 + k}{10 + k}, \text{decay}\right), \qquad
              \text{ema} \leftarrow \text{ema} - (1 - d_k)(\text{ema} - \theta).

    flow_grpo uses decay 0.9 every 8 steps (the defaults).

    The EMA is swapped into the module for validation (``validate_with_ema``) and, through
    :meth:`swapped`, for export; a checkpoint saved while swapped still holds the training weights in
    its ``state_dict``. The EMA lives in the checkpoint under ``checkpoint["callbacks"]["TrainableEMA"]
    ["ema_state_dict"]``, keyed like ``checkpoint["state_dict"]``; :meth:`weights_from_checkpoint` reads it for
    an offline export: ``module.load_state_dict(TrainableEMA.weights_from_checkpoint(path),
    strict=False)``.

    Where the shadows live: by default beside the parameters (on the GPU: 4 bytes a trained parameter,
    for a full fine-tune of FLUX.1 on 4 GPUs 11 GiB per GPU; in host memory already under
    ``FSDP2Strategy(cpu_offload=true)``). ``device="cpu"`` keeps them in host memory (pinned where
    there is a GPU): each update then copies this rank's trained tensors to the host and averages
    there, and a swap copies the shadows in; the arithmetic is the same, value for value.

    Args:
        decay: the ceiling of the decay schedule, in [0, 1).
        update_every: update after every this many optimizer steps.
        validate_with_ema: run validation with the EMA weights swapped in.
        device: ``"parameters"`` (the default) or ``"cpu"``: where the shadows are kept.
    """

    def __init__(
        self,
        decay: float = 0.9,
        update_every: int = 8,
        validate_with_ema: bool = True,
        device: Literal["parameters", "cpu"] = "parameters",
    ) -> None:
        super().__init__()
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay ({decay}) must be in [0, 1): the EMA keeps a `decay` share of itself")
        if update_every < 1:
            raise ValueError(
                f"update_every ({update_every}) must be at least 1 (optimizer steps between updates)"
            )
        if device not in ("parameters", "cpu"):
            raise ValueError(f"device ({device!r}) must be 'parameters' or 'cpu': where the EMA is kept")
        self.decay = decay
        self.update_every = update_every
        self.validate_with_ema = validate_with_ema
        self.device = device
        self.optimizer_steps = 0
        self.num_updates = 0
        self._names: list[str] = []  # the trainable parameters, in the order of the EMA's shadow list
        self._layouts: list[_Layout] = []  # how each parameter is placed (sharded or not), same order
        self._ema: EMAModel | None = None
        self._loaded: dict[str, Tensor] | None = None  # restored before the module had its parameters
        self._hook: Any = None

    @staticmethod
    def current_decay(step: int, decay: float) -> float:
        """d_k = min((1 + k) / (10 + k), decay): a short warm-up so early weights do not dominate.

        >>> TrainableEMA.current_decay(8, 0.9), TrainableEMA.current_decay(200, 0.9)
        (0.5, 0.9)
        """
        return min((1 + step) / (10 + step), decay)

    @property
    def ema(self) -> dict[str, Tensor] | None:
        """The averaged weights, ``{name: fp32 tensor}`` (the live shadows, not copies), placed like
        the parameters (sharded DTensors under FSDP2); None before the module has its parameters."""
        if self._ema is None:
            return None
        return {
            name: layout.wrap(shadow)
            for name, layout, shadow in zip(self._names, self._layouts, self._ema.shadow_params, strict=True)
        }

    # -- hooks ------------------------------------------------------------------------------------

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._initialize(pl_module)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.optimizers:
            raise ValueError("TrainableEMA needs an optimizer: configure_optimizers returned none")
        self._initialize(pl_module)
        self._hook = trainer.optimizers[0].register_step_post_hook(self._after_optimizer_step(pl_module))

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._remove_hook()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._remove_hook()
        self._swap_out(pl_module)  # an exception inside validation left the EMA swapped in

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.validate_with_ema and not trainer.sanity_checking:
            self._swap_in(pl_module)

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._swap_out(pl_module)

    @override
    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._ema is None or self._ema.temp_stored_params is None or "state_dict" not in checkpoint:
            return
        # saved while the EMA is swapped in (e.g. from a validation hook): keep the training weights
        # in the model state so that a resume continues from them
        state = checkpoint["state_dict"]
        # FSDP2 saves either each rank's shards (DTensors, a checkpoint folder) or whole tensors on rank 0
        # only (the other ranks' dicts are empty, so this reads the same on every rank: the gathers
        # below are collectives that every rank must enter).
        sharded = any(isinstance(v, DTensor) for v in state.values())
        for name, layout, value in zip(self._names, self._layouts, self._ema.temp_stored_params, strict=True):
            if layout.mesh is not None:
                value = value.to(layout.device)
                value = layout.wrap(value) if sharded else layout.whole(value).cpu()
            if name in state:
                state[name] = value.detach().clone()

    # -- the average ------------------------------------------------------------------------------

    @torch.no_grad()
    def update(self, pl_module: LightningModule) -> None:
        """One EMA update at the current optimizer-step count (called by the post-step hook)."""
        self._initialize(pl_module)
        assert self._ema is not None
        # diffusers warms the decay up over its own step() calls; flow_grpo's schedule warms up over
        # optimizer steps, of which we average only every `update_every`-th. step() first increments
        # the counter, then takes d = min((1 + s) / (10 + s), decay) with s = counter - 1: set it to
        # k so that s = k.
        self._ema.optimization_step = self.optimizer_steps
        params = self._params(pl_module)
        if self.device == "cpu":
            # Host copies beside the host shadows (one fused update needs one device); marked as
            # requiring grad, since EMAModel averages only those and copies the others.
            params = [p.detach().to("cpu", torch.float32).requires_grad_(True) for p in params]
        self._ema.step(params)
        self.num_updates += 1

    @contextmanager
    def swapped(self, pl_module: LightningModule) -> Iterator[None]:
        """Run a block with the EMA weights in ``pl_module``; the training weights come back after.

        Example::

            with ema.swapped(module):
                module.export_lora("lora/")
        """
        self._swap_in(pl_module)
        try:
            yield
        finally:
            self._swap_out(pl_module)

    @staticmethod
    def weights_from_checkpoint(
        checkpoint: str | os.PathLike | Mapping[str, Any], weights_only: bool = True
    ) -> dict[str, Tensor]:
        """The EMA weights stored in a Lightning checkpoint (a path or the loaded dict).

        Keys are the module's parameter names, as in ``checkpoint["state_dict"]``.

        Args:
            checkpoint: a ``.ckpt`` path or the dict ``torch.load`` returned.
            weights_only: passed to ``torch.load``; set False only for checkpoints you trust that
                pickle objects other than tensors and containers (e.g. custom hyper-parameters).
        """
        if not isinstance(checkpoint, Mapping):
            path = Path(checkpoint)
            if path.is_dir():  # a sharded (FSDP2) checkpoint folder: the callbacks' states are in meta.pt
                path = path / "meta.pt"
            checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only)
        states = as_mapping(checkpoint.get("callbacks"))
        found = [v for k, v in states.items() if k.split("{")[0] == TrainableEMA.__qualname__]
        if len(found) != 1 or found[0].get("ema_state_dict") is None:
            raise ValueError(
                "checkpoint has no TrainableEMA weights: train with the TrainableEMA callback "
                "(--trainer.callbacks+=lit_flowgrpo.callbacks.TrainableEMA), or export the raw weights"
            )
        return dict(found[0]["ema_state_dict"])

    # Not EMAModel.state_dict: that is a list in parameter order, which an offline export (and
    # FlowGRPOModule.load_trainable_checkpoint) could not map onto names without rebuilding the
    # module, and which would load silently into a module whose trainable set changed (other LoRA
    # settings). Keyed by name, fp32 on the CPU, it is copied back value for value: bit-exact resume.
    @override
    def state_dict(self) -> dict[str, Any]:
        ema = self._loaded
        if self._ema is not None:
            # every shadow whole: a collective under FSDP2 (every rank saves the callback's state)
            shadows = zip(self._names, self._layouts, self._ema.shadow_params, strict=True)
            ema = {name: layout.whole(shadow) for name, layout, shadow in shadows}
        return {
            "decay": self.decay,
            "update_every": self.update_every,
            "optimizer_steps": self.optimizer_steps,
            "num_updates": self.num_updates,
            "ema_state_dict": None if ema is None else {k: v.detach().cpu().clone() for k, v in ema.items()},
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer_steps = int(state_dict["optimizer_steps"])
        self.num_updates = int(state_dict["num_updates"])
        loaded = state_dict.get("ema_state_dict")
        if loaded is None:
            return
        ema = self.ema
        if ema is None:
            self._loaded = dict(loaded)  # the module's parameters may not exist yet (configure_model)
            return
        self._check_names(set(loaded), set(ema))
        assert self._ema is not None
        with torch.no_grad():
            for name, layout, shadow in zip(self._names, self._layouts, self._ema.shadow_params, strict=True):
                shadow.copy_(layout.local_copy(loaded[name]))

    # -- helpers ----------------------------------------------------------------------------------

    def _after_optimizer_step(self, pl_module: LightningModule) -> Any:
        def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if all(group.get("lr") == 0 for group in optimizer.param_groups):
                # Lightning's sharded checkpointing takes a zero-lr step to create the optimizer's
                # state: no weight changed, so no optimizer step to count.
                return
            self.optimizer_steps += 1
            if self.optimizer_steps % self.update_every == 0:
                self.update(pl_module)

        return hook

    @staticmethod
    def _trainable(pl_module: nn.Module) -> dict[str, nn.Parameter]:
        return {name: p for name, p in pl_module.named_parameters() if p.requires_grad}

    def _params(self, pl_module: nn.Module) -> list[Tensor]:
        """The tensors ``EMAModel`` reads and writes: the parameters, or under FSDP2 this rank's shards
        of them (views: writing one writes the parameter's shard)."""
        # by name, in the shadows' order: EMAModel pairs shadows and parameters by position
        params = dict(pl_module.named_parameters())
        # Grad mode on: EMAModel.step averages only tensors that require grad (it copies the others),
        # and a shard taken under no_grad does not.
        with torch.enable_grad():
            return [_local(params[name]) for name in self._names]

    @staticmethod
    def _check_names(loaded: set[str], current: set[str]) -> None:
        if loaded != current:
            missing, unexpected = sorted(current - loaded), sorted(loaded - current)
            raise ValueError(
                "TrainableEMA state does not match the module's trainable parameters "
                f"(missing {missing[:5]}, unexpected {unexpected[:5]}): resume with the same model and "
                "LoRA settings, or drop the EMA state from the checkpoint"
            )

    @torch.no_grad()
    def _initialize(self, pl_module: LightningModule) -> None:
        if self._ema is not None:
            return
        params = self._trainable(pl_module)
        if not params:
            raise ValueError(
                "TrainableEMA found no parameter with requires_grad=True in the module: "
                "nothing to average (is the model loaded and its LoRA attached?)"
            )
        if self._loaded is not None:
            self._check_names(set(self._loaded), set(params))
            source: Mapping[str, Tensor] = self._loaded
        else:
            source = params
        # foreach: one fused kernel per update over all tensors (a full fine-tune has hundreds).
        self._ema = EMAModel([], decay=self.decay, min_decay=0.0, update_after_step=0, foreach=True)
        # fp32 shadows built directly: EMAModel would first clone each parameter in its own dtype (a
        # transient bf16 copy of a whole transformer in a full fine-tune), and a resume starts from
        # the saved values, not the module's
        self._layouts = [_Layout.of(p) for p in params.values()]
        self._ema.shadow_params = [
            self._placed(layout.local_copy(source[n]))
            for n, layout in zip(params, self._layouts, strict=True)
        ]
        self._names = list(params)
        self._loaded = None

    def _placed(self, shadow: Tensor) -> Tensor:
        if self.device != "cpu":
            return shadow
        shadow = shadow.cpu()
        # Pinned, so the copies to and from the GPU run at full speed (pinning needs a GPU).
        return shadow.pin_memory() if torch.cuda.is_available() else shadow

    @torch.no_grad()
    def _swap_in(self, pl_module: LightningModule) -> None:
        self._initialize(pl_module)
        assert self._ema is not None
        if self._ema.temp_stored_params is not None:
            raise RuntimeError("TrainableEMA weights are already swapped in")
        reshard(pl_module)  # shards, not weights gathered by a forward
        params = self._params(pl_module)
        # To the host, this rank's shards only: no second copy of the trained weights on the device,
        # and nothing gathered.
        self._ema.store(params)
        self._ema.copy_to(params)

    @torch.no_grad()
    def _swap_out(self, pl_module: LightningModule) -> None:
        if self._ema is None or self._ema.temp_stored_params is None:
            return
        reshard(pl_module)  # shards, not weights gathered by a forward
        self._ema.restore(self._params(pl_module))

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


class _Layout(NamedTuple):
    """Where a parameter lives: its device, and under FSDP2 its mesh, placements and whole shape."""

    device: torch.device
    mesh: Any = None  # DeviceMesh, None for an unsharded parameter
    placements: tuple[Any, ...] = ()
    shape: torch.Size = torch.Size()
    stride: tuple[int, ...] = ()

    @staticmethod
    def of(param: Tensor) -> _Layout:
        if isinstance(param, DTensor):
            local = param.to_local()
            return _Layout(
                local.device, param.device_mesh, tuple(param.placements), param.shape, param.stride()
            )
        return _Layout(param.device)

    def local_copy(self, value: Tensor) -> Tensor:
        """An fp32 copy of ``value`` (whole, or a DTensor) as this rank holds it: its shard when sharded.
        A whole ``value`` is on every rank, so cutting out the shard needs no communication."""
        value = value.detach()
        if self.mesh is not None:
            if not isinstance(value, DTensor):
                value = distribute_tensor(value.float(), self.mesh, self.placements, src_data_rank=None)
            value = value.to_local()
        return value.to(device=self.device, dtype=torch.float32, copy=True)

    def wrap(self, local: Tensor) -> Tensor:
        """This rank's shard as the DTensor it is part of (sharing its storage); ``local`` itself when
        unsharded."""
        if self.mesh is None:
            return local
        return DTensor.from_local(
            local, self.mesh, self.placements, shape=self.shape, stride=self.stride, run_check=False
        )

    def whole(self, local: Tensor) -> Tensor:
        """The whole tensor of which ``local`` is this rank's shard, on every rank (a collective)."""
        if self.mesh is None:
            return local.detach()
        if local.device.type != self.mesh.device_type:
            # shards kept in host memory (cpu_offload) are gathered on the mesh's devices
            kind = self.mesh.device_type
            index = torch.get_device_module(kind).current_device() if kind != "cpu" else None
            local = local.to(torch.device(kind, index))
        return self.wrap(local).full_tensor()


def _local(tensor: Tensor) -> Tensor:
    """This rank's part of a parameter: the local shard of a DTensor (a view of its storage), else the
    parameter itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
