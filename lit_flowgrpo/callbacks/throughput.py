"""Stage timings, images per GPU per second, MFU, peak memory and rank balance of each RL step.

:class:`RLThroughputMonitor` reads what the training step returns (:class:`~lit_flowgrpo.step_output.StepOutput`:
``timings``, ``num_images``, ``transformer_forwards``; any key may be missing) and counts the
transformer's FLOPs once through Lightning's ``measure_flops``. The helpers below it are the formulas
and the peak-FLOPs lookup, usable on their own.

Which step the keys are logged at: the number of training batches so far (rollout steps), the
x-axis Lightning gives every metric the module logs through ``self.log``; not
``trainer.global_step``, which under manual optimization counts ``optimizer.step()`` calls, several
per rollout step (inner epochs x micro-batches), and would desynchronise our keys from ``critic/*``
and ``actor/*``. The callback writes straight to ``trainer.loggers`` with that step number (read where
Lightning's own ``LearningRateMonitor`` reads it) rather than through ``pl_module.log_dict``: a key
logged through ``log_dict`` in one step is logged again with its stale value at every later step of
the epoch where it is not logged (Lightning keeps it in its result collection), which would repeat,
say, an MFU figure on steps that report no timings. ``Trainer(log_every_n_steps=...)`` is honoured.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any, cast

import torch
from lightning.fabric.utilities.throughput import get_available_flops, measure_flops
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lit_flowgrpo.callbacks._lightning import rollout_step, should_log
from lit_flowgrpo.callbacks._module import as_mapping, image_size
from lit_flowgrpo.distributed import DataParallel
from lit_flowgrpo.policies.base import FlowPolicy
from lit_flowgrpo.step_output import INFERENCE_STAGES, StepOutput
from lit_flowgrpo.strategies import reshard

__all__ = [
    "RLThroughputMonitor",
    "available_flops",
    "dense_bf16_peak_flops",
    "images_per_gpu_per_second",
    "measure_transformer_flops",
    "model_flops_utilization",
]


class RLThroughputMonitor(Callback):
    r"""Stage timings, images per GPU per second, MFU, peak memory and rank balance of each RL step.

    Logged keys (per rollout step; "this rank" means rank 0's value, the one loggers write). For a
    video run (the step output's ``frames_per_sample`` F > 1) every "image" below is a frame, so the
    image keys compare across image and video models, and the ``video`` keys count whole videos:
    ``perf/video_throughput`` (videos per GPU per second, = ``perf/throughput`` / F),
    ``perf/total_num_videos``, ``perf/cumulative_num_videos`` and ``timing_per_video_ms/<stage>``.
    The FLOP count runs one forward at the run's frame count too.

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
    - ``perf/max_memory_reserved_gb``: the same for memory the caching allocator reserved.
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
            and one forward+backward). Needs ``pl_module.policy`` and the image size
            (``pl_module.sampler.height``/``width``, or ``pl_module.height``/``width``).
        log_memory: log ``perf/max_memory_{allocated,reserved}_gb`` (CUDA only).
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
        self._flops_resolution: tuple[int, ...] | None = None
        self.total_images = 0
        self.total_videos = 0
        self._t0: float | None = None

    # -- hooks ------------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        policy = getattr(pl_module, "policy", None)
        dtype = _compute_dtype(trainer, policy)
        self.peak_flops = available_flops(trainer.strategy.root_device, dtype, self.available_flops_override)
        if self.measure_flops and isinstance(policy, FlowPolicy):
            self._measure(policy, image_size(pl_module), _frames(pl_module))

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        _sync(trainer)
        if self._memory_tracked(trainer):
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
        self._t0 = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        _sync(trainer)
        own_step_s = time.perf_counter() - self._t0 if self._t0 is not None else float("nan")
        out = cast(StepOutput, as_mapping(outputs))  # any key may be missing: read with .get
        timings = {k: float(v) for k, v in as_mapping(out.get("timings")).items()}
        timings.setdefault("step", own_step_s)
        num_samples = _num_images(out)
        frames = int(out.get("frames_per_sample", 1))
        # A video counts as its frames in the image keys; the video keys count videos.
        num_images = None if num_samples is None else num_samples * frames

        metrics = _stage_metrics(timings, num_images)
        if frames > 1:
            metrics |= _stage_metrics(timings, num_samples, per="timing_per_video_ms")
        metrics |= self._throughput(trainer, pl_module, timings["step"], num_images, frames)
        metrics |= self._mfu(timings, as_mapping(out.get("transformer_forwards")))
        metrics |= self._memory(trainer)
        self._log(trainer, metrics)

    # -- resume -----------------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "total_images": self.total_images,
            "total_videos": self.total_videos,
            "flops_per_forward": self.flops_per_forward,
            "flops_per_train_forward": self.flops_per_train_forward,
            "flops_resolution": self._flops_resolution,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.total_images = int(state_dict["total_images"])
        self.total_videos = int(state_dict.get("total_videos", 0))
        self.flops_per_forward = state_dict.get("flops_per_forward")
        self.flops_per_train_forward = state_dict.get("flops_per_train_forward")
        resolution = state_dict.get("flops_resolution")
        self._flops_resolution = None if resolution is None else tuple(int(r) for r in resolution)

    # -- helpers ----------------------------------------------------------------------------------

    def _measure(self, policy: FlowPolicy, resolution: tuple[int, int] | None, frames: int = 1) -> None:
        if resolution is None:
            raise ValueError(
                "RLThroughputMonitor(measure_flops=True) needs the image size: the module has neither "
                "sampler.height/width nor height/width; set measure_flops=false or give the module them"
            )
        size = resolution if frames == 1 else (*resolution, frames)
        if self.flops_per_forward is not None and self._flops_resolution == size:
            return  # restored from the checkpoint for this resolution
        # every rank runs it: under FSDP the forward all-gathers parameters collectively
        self.flops_per_forward, self.flops_per_train_forward = measure_transformer_flops(
            policy, *resolution, frames=frames
        )
        self._flops_resolution = size

    def _throughput(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        step_s: float,
        num_images: int | None,
        frames: int = 1,
    ) -> dict[str, float]:
        # rank balance: one gather of (step seconds, images) per rank; -1 marks "not reported"
        local = torch.tensor(
            [step_s, -1.0 if num_images is None else float(num_images)],
            dtype=torch.float64,
            device=pl_module.device,
        )
        dp = DataParallel.of(trainer)
        gathered = dp.stack(local).reshape(-1, 2).cpu()  # (N, 2) fp64, one row per data-parallel peer
        world_size = gathered.shape[0] * dp.sequence_parallel  # GPUs: a sequence-parallel group has sp
        step_times, images = gathered[:, 0], gathered[:, 1]
        t_step = float(step_times.max())
        metrics = {
            "perf/time_per_step": t_step,
            "global_step_time_s/min": float(step_times.min()),
            "global_step_time_s/max": t_step,
            "global_step_time_s/minmax_diff": t_step - float(step_times.min()),
        }
        if not bool((images >= 0).all()):
            return metrics
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
        if frames > 1:
            videos = total // frames
            self.total_videos += videos
            metrics |= {
                "perf/total_num_videos": float(videos),
                "perf/cumulative_num_videos": float(self.total_videos),
            }
            if t_step > 0:
                metrics["perf/video_throughput"] = images_per_gpu_per_second(videos, t_step, world_size)
        return metrics

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

    def _memory_tracked(self, trainer: Trainer) -> bool:
        return self.log_memory and trainer.strategy.root_device.type == "cuda"

    def _memory(self, trainer: Trainer) -> dict[str, float]:
        if not self._memory_tracked(trainer):
            return {}
        device = trainer.strategy.root_device
        # Reserved includes the caching allocator's free blocks: the figure to compare with the card.
        return {
            "perf/max_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
            "perf/max_memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30,
        }

    @staticmethod
    def _log(trainer: Trainer, metrics: dict[str, float]) -> None:
        step = rollout_step(trainer)
        if trainer.is_global_zero and should_log(trainer, step):
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)


def _num_images(out: StepOutput) -> int | None:
    if "num_images" in out:
        return int(out["num_images"])
    if "images" in out:
        return len(out["images"])
    return None


def _stage_metrics(
    timings: Mapping[str, float], num_images: int | None, per: str = "timing_per_image_ms"
) -> dict[str, float]:
    metrics = {} if per != "timing_per_image_ms" else {f"timing_s/{k}": v for k, v in timings.items()}
    if num_images:
        metrics |= {f"{per}/{k}": 1000.0 * v / num_images for k, v in timings.items()}
    return metrics


def _frames(pl_module: Any) -> int:
    """Frames per sample the module draws (``pl_module.sampler.frames``; 1 for images)."""
    frames = getattr(getattr(pl_module, "sampler", None), "frames", 1)
    return frames if isinstance(frames, int) and frames >= 1 else 1


def _sync(trainer: Trainer) -> None:
    device = trainer.strategy.root_device
    if device.type == "cuda":
        # kernels are asynchronous: without this the clock reads when work is queued, not done
        torch.cuda.synchronize(device)


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
# FLOPs, peak FLOPs and formulas
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


def measure_transformer_flops(
    policy: FlowPolicy, height: int, width: int, frames: int = 1
) -> tuple[int, int]:
    """FLOPs of one single-sample transformer forward, and of one forward plus backward.

    Counted by Lightning's ``measure_flops`` (torch's ``FlopCounterMode``) running
    ``policy.flops_forward(height, width[, frames])`` on the policy's own device, once. The backward is counted
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
    # An image policy's flops_forward may take (height, width) alone.
    forward = (
        policy.flops_forward(height, width) if frames == 1 else policy.flops_forward(height, width, frames)
    )
    # Compiled blocks (--model.init_args.performance.compile_blocks) must run eagerly here: a first call of a
    # compiled module under FlopCounterMode leaves it uncompiled for the rest of the run.
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    with set_stance("force_eager") if set_stance is not None else contextlib.nullcontext():
        with torch.no_grad():
            fwd = measure_flops(transformer, forward)
        # Under FSDP2 with reshard_after_forward=False that forward left every unit gathered, and
        # parameters() would yield the gathered copies: the gradients saved and restored below must be
        # the shards', or the count's backward (of a sum over the whole output) stays on them and is
        # added to the first update's gradient.
        reshard(transformer)
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
        # MFU counts the model's FLOPs, not the rematerialisation (PaLM, Chowdhery et al. 2022, App. B):
        # the blocks that activation checkpointing runs again in the backward are taken out again.
        fwd_bwd -= _recomputed_flops(transformer, forward)
    return fwd, fwd_bwd


def _recomputed_flops(transformer: torch.nn.Module, forward: Any) -> int:
    """FLOPs of one forward of the blocks that gradient checkpointing recomputes in the backward (the
    model's repeated blocks, which diffusers checkpoints one by one); 0 without checkpointing."""
    if not getattr(transformer, "is_gradient_checkpointing", False):
        return 0
    from torch.utils.flop_counter import FlopCounterMode

    from lit_flowgrpo.performance import repeated_blocks

    blocks = {id(m) for m in repeated_blocks(transformer, "activation_checkpointing")}
    # FlopCounterMode names each module by the outermost module's class and the path below it.
    root = type(transformer).__name__
    names = {f"{root}.{name}" for name, m in transformer.named_modules() if id(m) in blocks}
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        forward()
    return sum(sum(ops.values()) for name, ops in counter.get_flop_counts().items() if name in names)
