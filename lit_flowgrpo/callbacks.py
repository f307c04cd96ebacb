"""Callbacks: stage timing, throughput and MFU; an EMA of the trainable weights; sample images.

Three independent ``Callback`` s that read what ``FlowGRPOModule.training_step`` returns (its
contract: ``timings``, ``num_images``, ``transformer_forwards``, ``images``, ``prompts``,
``rewards``) and the module's ``policy``, ``height`` and ``width``. Any key may be missing: a user's
own module may return less, and every callback then logs what it can.

- :class:`RLThroughputMonitor`: ``timing_s/*``, ``timing_per_image_ms/*``, ``perf/*`` and the
  rank-balance figures ``global_step_time_s/*``, ``global_num_images/*``.
- :class:`TrainableEMA`: an exponential moving average of the parameters that require grad only
  (a LoRA's few megabytes, not the frozen multi-billion-parameter base), swapped in for validation
  and export, saved in the checkpoint.
- :class:`SampleImageLogger`: a grid of samples with prompts and rewards, to W&B, TensorBoard or PNG.

Which step the keys are logged at: the number of training batches so far (rollout steps), the
x-axis Lightning gives every metric the module logs through ``self.log``; not
``trainer.global_step``, which under manual optimization counts ``optimizer.step()`` calls, several
per rollout step (inner epochs x micro-batches), and would desynchronise our keys from ``critic/*``
and ``actor/*``. The callbacks write straight to ``trainer.loggers`` with that step number (read where
Lightning's own ``LearningRateMonitor`` reads it) rather than through ``pl_module.log_dict``: a key
logged through ``log_dict`` in one step is logged again with its stale value at every later step of
the epoch where it is not logged (Lightning keeps it in its result collection), which would repeat,
say, an MFU figure on steps that report no timings. ``Trainer(log_every_n_steps=...)`` is honoured.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.utilities.throughput import get_available_flops, measure_flops
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor, nn

from lit_flowgrpo.policies.base import FlowPolicy

__all__ = [
    "RLThroughputMonitor",
    "SampleImageLogger",
    "TrainableEMA",
    "available_flops",
    "dense_bf16_peak_flops",
    "images_per_gpu_per_second",
    "measure_transformer_flops",
    "model_flops_utilization",
]

# --------------------------------------------------------------------------------------------------
# Peak FLOPs
# --------------------------------------------------------------------------------------------------

# Dense (no structured sparsity) bf16/fp16 tensor-core peaks, FLOP/s, from NVIDIA's datasheets, where
# the headline figure is the 2:4-sparse one and the dense figure is half of it. Lightning 2.6's
# `get_available_flops` returns None for the name "NVIDIA H200" (it only knows "h200 sxm1"/"h200 nvl1",
# which no driver reports) and its H200 and H100 NVL entries are the sparse figures, so MFU against
# them would read half the truth. Other chips and dtypes fall back to Lightning.
_DENSE_BF16_PEAK: dict[str, float] = {
    "h200 nvl": 835.5e12,  # H200 NVL: 1,671 TFLOPS sparse
    "h200": 989.4e12,  # H200 SXM: 1,979 TFLOPS sparse (same tensor cores as H100 SXM)
    "h100 nvl": 835.5e12,  # H100 NVL: 1,671 TFLOPS sparse
    "h100 pcie": 756.0e12,  # H100 PCIe: 1,513 TFLOPS sparse
    "h100": 989.4e12,  # H100 SXM5 ("NVIDIA H100 80GB HBM3"): 1,979 TFLOPS sparse
    "a100": 312.0e12,  # A100 SXM4 and PCIe: 624 TFLOPS sparse
}


def dense_bf16_peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of an H100, H200 or A100 from its CUDA device name, else None.

    >>> dense_bf16_peak_flops("NVIDIA H200")
    989400000000000.0
    >>> dense_bf16_peak_flops("NVIDIA H100 PCIe") / 1e12
    756.0
    """
    name = device_name.lower()
    if "h200" in name:
        return _DENSE_BF16_PEAK["h200 nvl" if "nvl" in name else "h200"]
    if "h100" in name:
        if "nvl" in name:
            return _DENSE_BF16_PEAK["h100 nvl"]
        if "pcie" in name or "hbm2e" in name:
            return _DENSE_BF16_PEAK["h100 pcie"]
        return _DENSE_BF16_PEAK["h100"]
    if "a100" in name:
        return _DENSE_BF16_PEAK["a100"]
    return None


def available_flops(device: torch.device, dtype: torch.dtype, override: float | None = None) -> float | None:
    """Peak FLOP/s of one device for MFU: the override, else our dense table, else Lightning's figure.

    Args:
        device: the device the transformer runs on.
        dtype: its compute dtype; the table covers bf16 and fp16 only.
        override: an explicit peak (FLOP/s per device), used as given.

    Returns:
        FLOP/s, or None when unknown (CPU, an unlisted chip): MFU is then not logged.
    """
    if override is not None:
        if not override > 0:
            raise ValueError(
                f"available_flops ({override}) must be a positive FLOP/s figure per device, or None"
            )
        return float(override)
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        peak = dense_bf16_peak_flops(torch.cuda.get_device_name(device))
        if peak is not None:
            return peak
    found = get_available_flops(device, dtype)
    return None if found is None else float(found)


# --------------------------------------------------------------------------------------------------
# Formulas
# --------------------------------------------------------------------------------------------------


def images_per_gpu_per_second(total_images: float, step_time_s: float, world_size: int) -> float:
    """Throughput in images per GPU per second: B·n / (t_step·N).

    The image analogue of veRL's ``perf/throughput`` = total_num_tokens / (time · n_gpus)
    (``verl/trainer/ppo/metric_utils.py``, ``compute_throughout_metrics``).

    >>> images_per_gpu_per_second(total_images=64, step_time_s=8.0, world_size=4)
    2.0
    """
    return total_images / (step_time_s * world_size)


def model_flops_utilization(
    flops_per_forward: float, num_forwards: float, seconds: float, peak: float
) -> float:
    """MFU = achieved FLOP/s ÷ peak FLOP/s of one device (PaLM, Chowdhery et al. 2022, App. B).

    Args:
        flops_per_forward: FLOPs of one single-sample transformer forward (or forward+backward).
        num_forwards: how many such single-sample forwards ran (a CFG forward of B samples counts 2B).
        seconds: the wall time they took.
        peak: peak FLOP/s of the device.

    >>> model_flops_utilization(1e12, 300, 2.0, 1e15)
    0.15
    """
    return flops_per_forward * num_forwards / (seconds * peak)


def measure_transformer_flops(policy: FlowPolicy, height: int, width: int) -> tuple[int, int]:
    """FLOPs of one single-sample transformer forward, and of one forward plus backward.

    Counted by Lightning's ``measure_flops`` (torch's ``FlopCounterMode``) running
    ``policy.flops_forward(height, width)`` on the policy's own device, once. The backward is counted
    as autograd runs it, so it is ×2 the forward for trainable layers (input and weight gradients),
    ×1 for frozen layers that still pass a gradient through, and nothing for frozen layers before the
    first trainable one: exact for a LoRA, where the usual 3×forward rule overstates the work.

    Not on the meta device: ``flops_forward`` builds its latents on the transformer's device and
    uses the policy's (real) text encoders, so a meta copy of the transformer alone cannot run it.

    The empty prompt is encoded first so that the closure's own ``encode_prompts([""])`` is a cache
    hit and the count holds the transformer alone. Gradients already on the parameters are kept.
    When nothing in the transformer is trainable the second number is 3 x the first.
    """
    transformer = policy.transformer
    policy.encode_prompts([""])
    forward = policy.flops_forward(height, width)
    # Compiled blocks (--model.performance.compile_blocks) must run eagerly here: a first call of a
    # compiled module under FlopCounterMode leaves it uncompiled for the rest of the run.
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    with set_stance("force_eager") if set_stance is not None else contextlib.nullcontext():
        with torch.no_grad():
            fwd = measure_flops(transformer, forward)
        params = [p for p in transformer.parameters() if p.requires_grad]
        if not params:
            return fwd, 3 * fwd
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            fwd_bwd = measure_flops(transformer, forward, loss_fn=lambda out: out.float().sum())
        finally:
            for p, g in zip(params, saved, strict=True):
                p.grad = g
    return fwd, fwd_bwd


# --------------------------------------------------------------------------------------------------
# Throughput, timing and MFU
# --------------------------------------------------------------------------------------------------

#: Stages whose transformer forwards run without backward (rollout, old log-prob, reference).
INFERENCE_STAGES = ("gen", "old_log_prob", "ref")


def _as_mapping(outputs: Any) -> Mapping[str, Any]:
    return outputs if isinstance(outputs, Mapping) else {}


def _num_images(out: Mapping[str, Any]) -> int | None:
    if "num_images" in out:
        return int(out["num_images"])
    if "images" in out:
        return len(out["images"])
    return None


def _logging_step(trainer: Trainer) -> int:
    # the step Lightning stamps on metrics the module logs through self.log (rollout steps under manual
    # optimization); LearningRateMonitor reads the same counter
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def _should_log(trainer: Trainer, step: int) -> bool:
    # Lightning's own rule for on-step metrics (the logger connector's `should_update_logs`)
    every = trainer.log_every_n_steps
    return every > 0 and ((step + 1) % every == 0 or trainer.should_stop)


def _sync(trainer: Trainer) -> None:
    device = trainer.strategy.root_device
    if device.type == "cuda":
        # kernels are asynchronous: without this the clock reads when work is queued, not done
        torch.cuda.synchronize(device)


class RLThroughputMonitor(Callback):
    r"""Stage timings, images per GPU per second, MFU, peak memory and rank balance of each RL step.

    Logged keys (per rollout step; "this rank" means rank 0's value, the one loggers write):

    - ``timing_s/<stage>``: seconds this rank spent in each stage the training step reports
      (``gen, reward, old_log_prob, ref, adv, update_actor, step``). These read the module's clock
      (``perf_counter`` after a CUDA synchronize, inside ``training_step``). ``timing_s/step`` is the
      module's ``step`` when it gives one, else this callback's own clock: ``perf_counter`` after a
      CUDA synchronize in ``on_train_batch_start`` and ``on_train_batch_end`` (validation, which runs
      after the batch ends, is outside that window).
    - ``timing_per_image_ms/<stage>``: 1000 · ``timing_s/<stage>`` / images this rank generated.
    - ``perf/time_per_step``: t_step = the largest ``timing_s/step`` over ranks (a step is as slow as
      its slowest rank).
    - ``perf/total_num_images``: images generated this step over all ranks (B·n).
    - ``perf/throughput``: B·n / (t_step · N), images per GPU per second (N = world size).
    - ``perf/cumulative_num_images``: images generated since the run began (kept across resume).
    - ``perf/mfu/actor_infer``: F_fwd · (n_gen + n_old_log_prob + n_ref) / ((t_gen + t_old_log_prob +
      t_ref) · peak), with F_fwd the FLOPs of one single-sample transformer forward and n the
      single-sample forwards of each stage (CFG counts twice), on this rank.
    - ``perf/mfu/actor``: F_fwd+bwd · n_update_actor / (t_update_actor · peak).
    - ``perf/max_memory_allocated_gb``: peak CUDA memory allocated during the step, GiB (the peak
      counter is reset at each step start).
    - ``global_step_time_s/{min,max,minmax_diff}`` and ``global_num_images/{min,max,minmax_diff}``:
      rank balance, the image analogue of veRL's ``global_seqlen/minmax_diff``. One all-gather of two
      numbers per step.

    Skips sanity checking (only training batches are timed). Keys whose inputs are missing are not
    logged. Rank 0 writes them to ``trainer.loggers``; every rank takes part in the gather.

    Args:
        available_flops: peak FLOP/s of one device for MFU. None: our dense bf16 table for H100, H200
            and A100 (when the compute dtype is bf16/fp16), else Lightning's ``get_available_flops``;
            MFU is not logged when neither knows the device.
        measure_flops: count the transformer's FLOPs once at train start (one single-sample forward
            and one forward+backward). Needs ``pl_module.policy``, ``height`` and ``width``.
        log_memory: log ``perf/max_memory_allocated_gb`` (CUDA only).
    """

    def __init__(
        self, available_flops: float | None = None, measure_flops: bool = True, log_memory: bool = True
    ) -> None:
        super().__init__()
        if available_flops is not None and not available_flops > 0:
            raise ValueError(
                f"available_flops ({available_flops}) must be a positive FLOP/s figure per device "
                "(e.g. 989.4e12 for an H100 SXM in bf16), or None to look it up"
            )
        self.available_flops_override = available_flops
        self.measure_flops = measure_flops
        self.log_memory = log_memory
        self.peak_flops: float | None = None
        self.flops_per_forward: int | None = None
        self.flops_per_train_forward: int | None = None
        self._flops_resolution: tuple[int, int] | None = None
        self.total_images = 0
        self._t0: float | None = None

    # -- hooks ------------------------------------------------------------------------------------

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        policy = getattr(pl_module, "policy", None)
        dtype = self._compute_dtype(trainer, policy)
        self.peak_flops = available_flops(trainer.strategy.root_device, dtype, self.available_flops_override)
        if not self.measure_flops or not isinstance(policy, FlowPolicy):
            return
        size = getattr(pl_module, "sampler", pl_module)
        resolution = (int(size.height), int(size.width))
        if self.flops_per_forward is not None and self._flops_resolution == resolution:
            return  # restored from the checkpoint for this resolution
        # every rank runs it: under FSDP the forward all-gathers parameters collectively
        self.flops_per_forward, self.flops_per_train_forward = measure_transformer_flops(policy, *resolution)
        self._flops_resolution = resolution

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        _sync(trainer)
        if self.log_memory and trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
        self._t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        _sync(trainer)
        own_step_s = time.perf_counter() - self._t0 if self._t0 is not None else float("nan")
        out = _as_mapping(outputs)
        timings = {k: float(v) for k, v in _as_mapping(out.get("timings")).items()}
        timings.setdefault("step", own_step_s)
        num_images = _num_images(out)

        metrics: dict[str, float] = {f"timing_s/{k}": v for k, v in timings.items()}
        if num_images:
            metrics |= {f"timing_per_image_ms/{k}": 1000.0 * v / num_images for k, v in timings.items()}

        # rank balance: one gather of (step seconds, images) per rank; -1 marks "not reported"
        local = torch.tensor(
            [timings["step"], -1.0 if num_images is None else float(num_images)],
            dtype=torch.float64,
            device=pl_module.device,
        )
        gathered = pl_module.all_gather(local).reshape(-1, 2).cpu()  # (N, 2)
        world_size = gathered.shape[0]
        step_times, images = gathered[:, 0], gathered[:, 1]
        t_step = float(step_times.max())
        metrics |= {
            "perf/time_per_step": t_step,
            "global_step_time_s/min": float(step_times.min()),
            "global_step_time_s/max": t_step,
            "global_step_time_s/minmax_diff": t_step - float(step_times.min()),
        }
        if bool((images >= 0).all()):
            total = int(images.sum())
            self.total_images += total
            metrics |= {
                "perf/total_num_images": float(total),
                "perf/cumulative_num_images": float(self.total_images),
                "global_num_images/min": float(images.min()),
                "global_num_images/max": float(images.max()),
                "global_num_images/minmax_diff": float(images.max() - images.min()),
            }
            if t_step > 0:
                metrics["perf/throughput"] = images_per_gpu_per_second(total, t_step, world_size)

        metrics |= self._mfu(timings, _as_mapping(out.get("transformer_forwards")))
        if self.log_memory and trainer.strategy.root_device.type == "cuda":
            peak_bytes = torch.cuda.max_memory_allocated(trainer.strategy.root_device)
            metrics["perf/max_memory_allocated_gb"] = peak_bytes / 2**30
        step = _logging_step(trainer)
        if trainer.is_global_zero and _should_log(trainer, step):
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    # -- resume -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "total_images": self.total_images,
            "flops_per_forward": self.flops_per_forward,
            "flops_per_train_forward": self.flops_per_train_forward,
            "flops_resolution": self._flops_resolution,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.total_images = int(state_dict["total_images"])
        self.flops_per_forward = state_dict.get("flops_per_forward")
        self.flops_per_train_forward = state_dict.get("flops_per_train_forward")
        resolution = state_dict.get("flops_resolution")
        self._flops_resolution = None if resolution is None else (int(resolution[0]), int(resolution[1]))

    # -- helpers ----------------------------------------------------------------------------------

    def _mfu(self, timings: Mapping[str, float], forwards: Mapping[str, Any]) -> dict[str, float]:
        peak, metrics = self.peak_flops, {}
        if peak is None or self.flops_per_forward is None:
            return metrics
        stages = [s for s in INFERENCE_STAGES if s in forwards and s in timings]
        n_infer = sum(float(forwards[s]) for s in stages)
        t_infer = sum(timings[s] for s in stages)
        if n_infer > 0 and t_infer > 0:
            metrics["perf/mfu/actor_infer"] = model_flops_utilization(
                self.flops_per_forward, n_infer, t_infer, peak
            )
        n_update, t_update = float(forwards.get("update_actor", 0)), timings.get("update_actor", 0.0)
        if self.flops_per_train_forward is not None and n_update > 0 and t_update > 0:
            metrics["perf/mfu/actor"] = model_flops_utilization(
                self.flops_per_train_forward, n_update, t_update, peak
            )
        return metrics

    @staticmethod
    def _compute_dtype(trainer: Trainer, policy: Any) -> torch.dtype:
        precision = str(trainer.precision)
        if precision.startswith("bf16"):
            return torch.bfloat16
        if precision.startswith("16"):
            return torch.float16
        # "32-true" with a policy loaded in bf16 still computes in bf16: take the dtype that holds
        # most of the transformer's parameters
        if isinstance(policy, FlowPolicy):
            counts: dict[torch.dtype, int] = {}
            for p in policy.transformer.parameters():
                counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
            if counts:
                return max(counts, key=counts.__getitem__)
        return torch.float32


# --------------------------------------------------------------------------------------------------
# EMA of the trainable parameters
# --------------------------------------------------------------------------------------------------


class TrainableEMA(Callback):
    r"""Exponential moving average of the parameters that require grad, and nothing else.

    Lightning's ``EMAWeightAveraging`` deep-copies the whole LightningModule, frozen base included:
    tens of GB for a 2-12B transformer trained through a LoRA of a few MB. This keeps an fp32 shadow
    of ``{name: p for name, p in pl_module.named_parameters() if p.requires_grad}`` only, on the
    parameters' devices.

    Update (flow_grpo's ``EMAModuleWrapper``, ``flow_grpo/ema.py``): after optimizer step k
    (k = 1, 2, ...; counted by a post-step hook on the first optimizer, so every ``optimizer.step()``
    of a manual-optimization ``training_step`` counts) and when k is a multiple of ``update_every``,

    .. math:: d_k = \min\left(\frac{1 + k}{10 + k}, \text{decay}\right), \qquad
              \text{ema} \leftarrow \text{ema} + (1 - d_k)(\theta - \text{ema}).

    flow_grpo uses decay 0.9 every 8 steps (the defaults).

    The EMA is swapped into the module for validation (``validate_with_ema``) and, through
    :meth:`swapped`, for export; a checkpoint saved while swapped still holds the training weights in
    its ``state_dict``. The EMA lives in the checkpoint under ``checkpoint["callbacks"]["TrainableEMA"]
    ["ema_state_dict"]``, keyed like ``checkpoint["state_dict"]``; :meth:`weights_from_checkpoint` reads it for
    an offline export: ``module.load_state_dict(TrainableEMA.weights_from_checkpoint(path),
    strict=False)``.

    Args:
        decay: the ceiling of the decay schedule, in [0, 1).
        update_every: update after every this many optimizer steps.
        validate_with_ema: run validation with the EMA weights swapped in.
    """

    def __init__(self, decay: float = 0.9, update_every: int = 8, validate_with_ema: bool = True) -> None:
        super().__init__()
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay ({decay}) must be in [0, 1): the EMA keeps a `decay` share of itself")
        if update_every < 1:
            raise ValueError(
                f"update_every ({update_every}) must be at least 1 (optimizer steps between updates)"
            )
        self.decay = decay
        self.update_every = update_every
        self.validate_with_ema = validate_with_ema
        self.optimizer_steps = 0
        self.num_updates = 0
        self.ema: dict[str, Tensor] | None = None
        self._loaded: dict[str, Tensor] | None = None
        self._backup: dict[str, Tensor] | None = None
        self._hook: Any = None

    @staticmethod
    def current_decay(step: int, decay: float) -> float:
        """d_k = min((1 + k) / (10 + k), decay): a short warm-up so early weights do not dominate.

        >>> TrainableEMA.current_decay(8, 0.9), TrainableEMA.current_decay(200, 0.9)
        (0.5, 0.9)
        """
        return min((1 + step) / (10 + step), decay)

    # -- hooks ------------------------------------------------------------------------------------

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._initialize(pl_module)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.optimizers:
            raise ValueError("TrainableEMA needs an optimizer: configure_optimizers returned none")
        self._initialize(pl_module)

        def after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self.optimizer_steps += 1
            if self.optimizer_steps % self.update_every == 0:
                self.update(pl_module)

        self._hook = trainer.optimizers[0].register_step_post_hook(after_step)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._remove_hook()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._remove_hook()
        if self._backup is not None:  # an exception inside validation left the EMA swapped in
            self._swap_out(pl_module)

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.validate_with_ema and not trainer.sanity_checking:
            self._swap_in(pl_module)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._backup is not None:
            self._swap_out(pl_module)

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._backup is None or "state_dict" not in checkpoint:
            return
        # saved while the EMA is swapped in (e.g. from a validation hook): keep the training weights
        # in the model state so that a resume continues from them
        for name, value in self._backup.items():
            if name in checkpoint["state_dict"]:
                checkpoint["state_dict"][name] = value.detach().clone()

    # -- the average ------------------------------------------------------------------------------

    @torch.no_grad()
    def update(self, pl_module: LightningModule) -> None:
        """One EMA update at the current optimizer-step count (called by the post-step hook)."""
        self._initialize(pl_module)
        assert self.ema is not None
        one_minus_decay = 1.0 - self.current_decay(self.optimizer_steps, self.decay)
        for name, param in self._trainable(pl_module).items():
            shadow = self.ema[name]
            shadow.add_(param.detach().to(shadow.dtype) - shadow, alpha=one_minus_decay)  # fp32
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
            checkpoint = torch.load(checkpoint, map_location="cpu", weights_only=weights_only)
        states = _as_mapping(checkpoint.get("callbacks"))
        found = [v for k, v in states.items() if k.split("{")[0] == TrainableEMA.__qualname__]
        if len(found) != 1 or found[0].get("ema_state_dict") is None:
            raise ValueError(
                "checkpoint has no TrainableEMA weights: train with the TrainableEMA callback "
                "(--trainer.callbacks+=lit_flowgrpo.callbacks.TrainableEMA), or export the raw weights"
            )
        return dict(found[0]["ema_state_dict"])

    def state_dict(self) -> dict[str, Any]:
        ema = self.ema if self.ema is not None else self._loaded
        return {
            "decay": self.decay,
            "update_every": self.update_every,
            "optimizer_steps": self.optimizer_steps,
            "num_updates": self.num_updates,
            "ema_state_dict": None if ema is None else {k: v.detach().cpu().clone() for k, v in ema.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer_steps = int(state_dict["optimizer_steps"])
        self.num_updates = int(state_dict["num_updates"])
        loaded = state_dict.get("ema_state_dict")
        if loaded is None:
            return
        if self.ema is None:
            self._loaded = dict(loaded)  # the module's parameters may not exist yet (configure_model)
            return
        self._check_names(set(loaded), set(self.ema))
        for name, value in loaded.items():
            self.ema[name].copy_(value)

    # -- helpers ----------------------------------------------------------------------------------

    @staticmethod
    def _trainable(pl_module: nn.Module) -> dict[str, nn.Parameter]:
        return {name: p for name, p in pl_module.named_parameters() if p.requires_grad}

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
        if self.ema is not None:
            return
        params = self._trainable(pl_module)
        if not params:
            raise ValueError(
                "TrainableEMA found no parameter with requires_grad=True in the module: "
                "nothing to average (is the model loaded and its LoRA attached?)"
            )
        if self._loaded is not None:
            self._check_names(set(self._loaded), set(params))
            self.ema = {
                n: self._loaded[n].to(device=p.device, dtype=torch.float32) for n, p in params.items()
            }
            self._loaded = None
        else:
            self.ema = {n: p.detach().to(dtype=torch.float32, copy=True) for n, p in params.items()}

    @torch.no_grad()
    def _swap_in(self, pl_module: LightningModule) -> None:
        if self._backup is not None:
            raise RuntimeError("TrainableEMA weights are already swapped in")
        self._initialize(pl_module)
        assert self.ema is not None
        params = self._trainable(pl_module)
        self._backup = {n: p.detach().clone() for n, p in params.items()}
        for name, param in params.items():
            param.copy_(self.ema[name])

    @torch.no_grad()
    def _swap_out(self, pl_module: LightningModule) -> None:
        if self._backup is None:
            return
        params = dict(pl_module.named_parameters())
        for name, value in self._backup.items():
            params[name].copy_(value)
        self._backup = None

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


# --------------------------------------------------------------------------------------------------
# Sample images
# --------------------------------------------------------------------------------------------------


def _to_uint8(images: Tensor) -> Tensor:
    """(B, 3, H, W) floats in [0, 1] -> uint8 on the CPU, rounded."""
    return (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()


def _caption(prompt: str, rewards: Mapping[str, float]) -> str:
    parts = [f"{k}={v:.4g}" if math.isfinite(v) else f"{k}=nan (failed)" for k, v in rewards.items()]
    return " | ".join([prompt, *parts])


def image_grid(images: Tensor, pad: int = 2) -> Tensor:
    """(B, C, H, W) uint8 -> (C, H', W') grid of ceil(sqrt(B)) columns, ``pad`` black pixels apart."""
    b, c, h, w = images.shape
    cols = math.ceil(math.sqrt(b))
    rows = math.ceil(b / cols)
    grid = torch.zeros((c, rows * h + (rows - 1) * pad, cols * w + (cols - 1) * pad), dtype=images.dtype)
    for i in range(b):
        r, col = divmod(i, cols)
        grid[:, r * (h + pad) : r * (h + pad) + h, col * (w + pad) : col * (w + pad) + w] = images[i]
    return grid


class SampleImageLogger(Callback):
    """Logs a grid of generated samples with their prompts and rewards, every N steps and at validation.

    Training: the ``images``, ``prompts`` and ``rewards`` (B,) the training step returns, every
    ``every_n_steps`` rollout steps, under ``train/samples``. Validation: the first ``max_images`` of
    what ``validation_step`` returns (``rewards`` is a dict of named components), under
    ``val/samples``. Rank 0 only; sanity checking is skipped.

    Where it goes, per logger: W&B (``WandbLogger.log_image``: one ``wandb.Image`` per sample with its
    caption, works offline); TensorBoard (``add_images`` plus the captions through ``add_text``);
    any other logger, or none, gets ``images/<key>_step<step>.png`` (a grid) and a ``.json`` of the
    captions in its ``log_dir`` (else the trainer's ``default_root_dir``).

    Args:
        every_n_steps: log training samples at every this many rollout steps (0: never).
        max_images: the most samples per grid.
        log_validation: log validation samples.
    """

    def __init__(self, every_n_steps: int = 50, max_images: int = 8, log_validation: bool = True) -> None:
        super().__init__()
        if every_n_steps < 0:
            raise ValueError(f"every_n_steps ({every_n_steps}) must be >= 0 (0 turns training samples off)")
        if max_images < 1:
            raise ValueError(f"max_images ({max_images}) must be at least 1")
        self.every_n_steps = every_n_steps
        self.max_images = max_images
        self.log_validation = log_validation
        self._val_images: list[Tensor] = []
        self._val_captions: list[str] = []

    @rank_zero_only
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        out = _as_mapping(outputs)
        step = _logging_step(trainer)
        if not self.every_n_steps or step % self.every_n_steps or out.get("images") is None:
            return
        images = out["images"][: self.max_images]
        prompts = list(out.get("prompts", [""] * len(images)))
        rewards = out.get("rewards")
        captions = [
            _caption(prompts[i], {} if rewards is None else {"reward": float(rewards[i])})
            for i in range(len(images))
        ]
        self.log_images(trainer, "train/samples", images, captions, step)

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._val_images, self._val_captions = [], []

    @rank_zero_only
    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        out = _as_mapping(outputs)
        room = self.max_images - len(self._val_images)
        if not self.log_validation or trainer.sanity_checking or room <= 0 or out.get("images") is None:
            return
        images = out["images"][:room]
        prompts = list(out.get("prompts", [""] * len(images)))
        rewards = _as_mapping(out.get("rewards"))
        for i in range(len(images)):
            self._val_images.append(images[i])
            self._val_captions.append(_caption(prompts[i], {k: float(v[i]) for k, v in rewards.items()}))

    @rank_zero_only
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._val_images:
            self.log_images(
                trainer,
                "val/samples",
                torch.stack(self._val_images),
                self._val_captions,
                _logging_step(trainer),
            )
        self._val_images, self._val_captions = [], []

    def log_images(
        self, trainer: Trainer, key: str, images: Tensor, captions: Sequence[str], step: int
    ) -> None:
        """Write (B, 3, H, W) images in [0, 1] with one caption each to every logger of ``trainer``."""
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be (B, 3, H, W) in [0, 1]; got shape {tuple(images.shape)}")
        if len(captions) != len(images):
            raise ValueError(f"{len(captions)} captions for {len(images)} images: give one caption per image")
        pixels = _to_uint8(images)  # (B, 3, H, W) uint8
        if not trainer.loggers:
            self._write_png(trainer.default_root_dir, key, pixels, captions, step)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                hwc = [img.permute(1, 2, 0).numpy() for img in pixels]
                logger.log_image(key=key, images=hwc, step=step, caption=list(captions))
            elif isinstance(logger, TensorBoardLogger):
                logger.experiment.add_images(key, pixels, global_step=step, dataformats="NCHW")
                text = "\n\n".join(f"{i}: {c}" for i, c in enumerate(captions))
                logger.experiment.add_text(f"{key}/captions", text, global_step=step)
            else:
                self._write_png(
                    getattr(logger, "log_dir", None) or trainer.default_root_dir, key, pixels, captions, step
                )

    @staticmethod
    def _write_png(root: str, key: str, pixels: Tensor, captions: Sequence[str], step: int) -> None:
        from PIL import Image

        folder = os.path.join(root, "images")
        os.makedirs(folder, exist_ok=True)
        stem = os.path.join(folder, f"{key.replace('/', '_')}_step{step:07d}")
        grid = image_grid(pixels).permute(1, 2, 0).numpy()  # (H', W', 3) uint8
        Image.fromarray(grid).save(stem + ".png")
        with open(stem + ".json", "w") as f:
            json.dump({"step": step, "captions": list(captions)}, f, indent=1)
