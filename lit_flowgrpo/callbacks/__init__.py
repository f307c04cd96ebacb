"""Lightning callbacks for RL fine-tuning, one per file.

- :class:`RLThroughputMonitor` (``throughput.py``): ``timing_s/*``, ``timing_per_image_ms/*``,
  ``perf/*`` and the rank-balance figures ``global_step_time_s/*``, ``global_num_images/*``.
- :class:`TrainableEMA` (``ema.py``): an exponential moving average of the parameters that require
  grad only (a LoRA's few megabytes, not the frozen base), swapped in for validation and export,
  saved in the checkpoint.
- :class:`SampleImageLogger` (``images.py``): a grid of samples with prompts and rewards, and a table
  of validation samples, to W&B, TensorBoard or PNG/JSON; videos as animated GIFs (``videos.py``).
- :class:`FinalCheckpoint` (``final_checkpoint.py``): the trainer's ``ModelCheckpoint`` saves the
  last state at the end of fit and on SIGTERM (which then exits 143).
- :class:`RolloutProgressBar` (``progress.py``): a TQDM bar counting rollouts to the end of the run,
  with the reward and the last validation score.
- :class:`OverOptimizationMonitor` (``over_optimization.py``): ``rollout/diversity``,
  ``val-aux/diversity`` and ``val-aux/drift``, signs of over-optimisation in the images themselves.
- :class:`RunCardRecorder` (``run_card.py``): the run card (:mod:`lit_flowgrpo.run_card`) in every
  checkpoint; ``lit-flowgrpo fit`` adds one to every run.

They read what ``FlowGRPOModule``'s steps return (:mod:`lit_flowgrpo.step_output`); any key may be
missing, so a user's own module that returns less gets what can be logged from it. In YAML:
``class_path: lit_flowgrpo.callbacks.<Name>``.
"""

from lit_flowgrpo.callbacks.ema import TrainableEMA
from lit_flowgrpo.callbacks.final_checkpoint import FinalCheckpoint
from lit_flowgrpo.callbacks.images import SampleImageLogger
from lit_flowgrpo.callbacks.over_optimization import OverOptimizationMonitor
from lit_flowgrpo.callbacks.progress import RolloutProgressBar
from lit_flowgrpo.callbacks.run_card import RunCardRecorder
from lit_flowgrpo.callbacks.throughput import (
    RLThroughputMonitor,
    available_flops,
    dense_bf16_peak_flops,
    images_per_gpu_per_second,
    measure_transformer_flops,
    model_flops_utilization,
)

__all__ = [
    "FinalCheckpoint",
    "OverOptimizationMonitor",
    "RLThroughputMonitor",
    "RolloutProgressBar",
    "RunCardRecorder",
    "SampleImageLogger",
    "TrainableEMA",
    "available_flops",
    "dense_bf16_peak_flops",
    "images_per_gpu_per_second",
    "measure_transformer_flops",
    "model_flops_utilization",
]
