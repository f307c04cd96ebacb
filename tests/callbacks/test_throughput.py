"""RLThroughputMonitor and its FLOP/peak helpers, against the stand-in module through a real Trainer."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
from callback_helpers import LAYER_FLOPS, RecordingLogger, StandIn, TinyPolicy, loader, trainer
from ddp_helpers import CloseProcessGroup
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor

import lit_flowgrpo.callbacks.throughput as throughput
from lit_flowgrpo.callbacks import (
    RLThroughputMonitor,
    available_flops,
    dense_bf16_peak_flops,
    images_per_gpu_per_second,
    measure_transformer_flops,
    model_flops_utilization,
)
from lit_flowgrpo.distributed import DataParallel

# --------------------------------------------------------------------------------------------------
# Peak FLOPs and formulas
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H200", 989.4e12),
        ("NVIDIA H200 NVL", 835.5e12),
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835.5e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_dense_bf16_table(name: str, peak: float | None) -> None:
    assert dense_bf16_peak_flops(name) == peak


def test_available_flops_prefers_override_then_table_then_lightning(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert available_flops(cuda, torch.bfloat16) == 989.4e12
    assert available_flops(cuda, torch.bfloat16, override=5e14) == 5e14
    # fp32 is not in the table: Lightning's lookup answers (None for this name)
    assert available_flops(cuda, torch.float32) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA RTX A6000")
    assert available_flops(cuda, torch.bfloat16) == 38.7e12  # Lightning's own table
    assert available_flops(torch.device("cpu"), torch.float32) is None
    with pytest.raises(ValueError, match="available_flops"):
        available_flops(cuda, torch.bfloat16, override=0)
    with pytest.raises(ValueError, match="available_flops"):
        RLThroughputMonitor(available_flops=-1.0)


def test_formulas_on_known_numbers() -> None:
    # 16 prompts x 8 images over 8 GPUs in a 32 s step: 128 / (32 · 8) = 0.5 images/GPU/s
    assert images_per_gpu_per_second(128, 32.0, 8) == 0.5
    # 2 TFLOP per forward, 640 forwards in 4 s on a 989.4 TFLOP/s chip
    assert model_flops_utilization(2e12, 640, 4.0, 989.4e12) == pytest.approx(1280e12 / 3957.6e12, rel=1e-12)


@pytest.mark.parametrize(
    ("trainable", "expected_fwd_bwd"),
    [
        # backward: weight grad (×1) for trainable layers, input grad (×1) only where a trainable layer sits below
        ((True, True), 2 * LAYER_FLOPS + 2 * LAYER_FLOPS + LAYER_FLOPS),
        ((False, True), 2 * LAYER_FLOPS + LAYER_FLOPS),
        ((True, False), 2 * LAYER_FLOPS + LAYER_FLOPS + LAYER_FLOPS),
        ((False, False), 3 * 2 * LAYER_FLOPS),  # nothing trainable: the 3×forward convention
    ],
)
def test_measure_transformer_flops(trainable: tuple[bool, bool], expected_fwd_bwd: int) -> None:
    policy = TinyPolicy()
    for layer, flag in zip(policy.net, trainable, strict=True):
        layer.requires_grad_(flag)
    marker = torch.full_like(policy.net[1].weight, 7.0)
    policy.net[1].weight.grad = marker.clone() if trainable[1] else None
    fwd, fwd_bwd = measure_transformer_flops(policy, 16, 16)
    assert fwd == 2 * LAYER_FLOPS  # the text encoder's matmul is not in it (cache warmed first)
    assert fwd_bwd == expected_fwd_bwd
    if trainable[1]:  # gradients already there are left as they were
        assert torch.equal(policy.net[1].weight.grad, marker)


# --------------------------------------------------------------------------------------------------
# RLThroughputMonitor through a Trainer
# --------------------------------------------------------------------------------------------------

STEP_OUTPUTS = [
    {
        "timings": {
            "gen": 0.5,
            "reward": 0.1,
            "old_log_prob": 0.25,
            "ref": 0.25,
            "adv": 0.01,
            "update_actor": 1.0,
            "step": 2.5,
        },
        "num_images": 8,
        "transformer_forwards": {"gen": 40, "old_log_prob": 10, "ref": 10, "update_actor": 20},
    },
    {},  # a module that returns nothing the monitor knows
    {"num_images": 4, "timings": {"gen": 0.2}},  # no step timing: the callback's own clock
]


def test_throughput_monitor_logs_exact_values(tmp_path: Any) -> None:
    logger = RecordingLogger()
    monitor = RLThroughputMonitor(available_flops=1e6)
    model = StandIn(STEP_OUTPUTS)
    # our clock reads: start/end of each batch (0→3 s, 10→10.75 s, 20→21.5 s)
    clock = mock.Mock(perf_counter=mock.Mock(side_effect=[0.0, 3.0, 10.0, 10.75, 20.0, 21.5]))
    with mock.patch.object(throughput, "time", clock):
        trainer(tmp_path, [monitor], logger=logger, limit_train_batches=3).fit(model, loader(3))

    assert monitor.flops_per_forward == 2 * LAYER_FLOPS
    assert monitor.flops_per_train_forward == 5 * LAYER_FLOPS
    steps = [s for s, _ in logger.calls]
    assert steps == [0, 1, 2]
    first, second, third = (m for _, m in logger.calls)

    t = STEP_OUTPUTS[0]["timings"]
    expected = {f"timing_s/{k}": v for k, v in t.items()}
    expected |= {f"timing_per_image_ms/{k}": 1000 * v / 8 for k, v in t.items()}
    expected |= {
        "perf/time_per_step": 2.5,  # the module's step time wins over our 3.0 s
        "perf/total_num_images": 8.0,
        "perf/cumulative_num_images": 8.0,
        "perf/throughput": 8 / 2.5,
        "global_step_time_s/min": 2.5,
        "global_step_time_s/max": 2.5,
        "global_step_time_s/minmax_diff": 0.0,
        "global_num_images/min": 8.0,
        "global_num_images/max": 8.0,
        "global_num_images/minmax_diff": 0.0,
        # 2048 FLOPs x (40 + 10 + 10) forwards / ((0.5 + 0.25 + 0.25) s x 1e6 FLOP/s)
        "perf/mfu/actor_infer": 2048 * 60 / (1.0 * 1e6),
        # 5120 FLOPs (fwd + bwd) x 20 / (1.0 s x 1e6 FLOP/s)
        "perf/mfu/actor": 5120 * 20 / (1.0 * 1e6),
    }
    assert first == expected

    assert second == pytest.approx(
        {
            "timing_s/step": 0.75,
            "perf/time_per_step": 0.75,
            "global_step_time_s/min": 0.75,
            "global_step_time_s/max": 0.75,
            "global_step_time_s/minmax_diff": 0.0,
        },
        rel=1e-12,
    )
    assert third == pytest.approx(
        {
            "timing_s/gen": 0.2,
            "timing_s/step": 1.5,
            "timing_per_image_ms/gen": 50.0,
            "timing_per_image_ms/step": 375.0,
            "perf/time_per_step": 1.5,
            "perf/total_num_images": 4.0,
            "perf/cumulative_num_images": 12.0,
            "perf/throughput": 4 / 1.5,
            "global_step_time_s/min": 1.5,
            "global_step_time_s/max": 1.5,
            "global_step_time_s/minmax_diff": 0.0,
            "global_num_images/min": 4.0,
            "global_num_images/max": 4.0,
            "global_num_images/minmax_diff": 0.0,
        },
        rel=1e-12,
    )


def test_throughput_monitor_honours_log_every_n_steps(tmp_path: Any) -> None:
    logger = RecordingLogger()
    outputs = [{"num_images": 3, "timings": {"step": 1.0}}] * 4
    trainer(tmp_path, [RLThroughputMonitor()], logger=logger, limit_train_batches=4, log_every_n_steps=2).fit(
        StandIn(outputs), loader(4)
    )
    assert [(s, m["perf/cumulative_num_images"]) for s, m in logger.calls] == [(1, 6.0), (3, 12.0)]


def test_throughput_monitor_rank_balance_from_gather(tmp_path: Any) -> None:
    """Two ranks' (step time, images) as the all-gather returns them: max time, summed images, min/max."""
    logger = RecordingLogger()
    monitor = RLThroughputMonitor(measure_flops=False)
    model = StandIn([{"num_images": 6, "timings": {"step": 2.0}}])
    other_rank = torch.tensor([3.0, 10.0], dtype=torch.float64)
    with mock.patch.object(DataParallel, "stack", lambda self, t: torch.stack([t, other_rank])):
        trainer(tmp_path, [monitor], logger=logger, limit_train_batches=1).fit(model, loader(1))
    (_, metrics), *_ = logger.calls
    assert metrics["perf/time_per_step"] == 3.0
    assert metrics["perf/total_num_images"] == 16.0
    assert metrics["perf/throughput"] == pytest.approx(16 / (3.0 * 2), rel=1e-6)
    assert metrics["global_num_images/minmax_diff"] == 4.0
    assert metrics["global_step_time_s/min"] == 2.0
    assert metrics["global_step_time_s/minmax_diff"] == 1.0
    assert "perf/mfu/actor" not in metrics  # no FLOPs measured, no peak on CPU


def test_throughput_monitor_state_survives_resume(tmp_path: Any) -> None:
    outputs = [{"num_images": 5, "timings": {"step": 1.0}}] * 4
    monitor = RLThroughputMonitor(available_flops=1e6)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    trainer(tmp_path, [monitor, ckpt], limit_train_batches=2, enable_checkpointing=True).fit(
        StandIn(outputs), loader(2)
    )
    assert monitor.total_images == 10

    logger = RecordingLogger()
    resumed = RLThroughputMonitor(available_flops=1e6)
    with mock.patch.object(
        throughput, "measure_transformer_flops", side_effect=AssertionError("re-measured")
    ):
        trainer(tmp_path, [resumed], logger=logger, limit_train_batches=2, max_epochs=2).fit(
            StandIn(outputs), loader(2), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt")
        )
    assert resumed.flops_per_forward == 2 * LAYER_FLOPS  # from the checkpoint, not measured again
    assert [m["perf/cumulative_num_images"] for _, m in logger.calls] == [15.0, 20.0]
    assert [s for s, _ in logger.calls] == [2, 3]


class SamplerSized(StandIn):
    """The module after the settings regroup: the image size lives in ``sampler``, not on the module."""

    def __init__(self, outputs: Any = ()) -> None:
        super().__init__(outputs)
        del self.height, self.width
        self.sampler = SimpleNamespace(height=24, width=40)


def test_throughput_monitor_reads_the_size_from_the_sampler(tmp_path: Any) -> None:
    measured = mock.Mock(return_value=(7, 21))
    monitor = RLThroughputMonitor(available_flops=1e6)
    with mock.patch.object(throughput, "measure_transformer_flops", measured):
        trainer(tmp_path, [monitor], limit_train_batches=1).fit(SamplerSized(), loader(1))
    model_policy = measured.call_args.args[0]
    assert isinstance(model_policy, TinyPolicy)
    assert measured.call_args.args[1:] == (24, 40)
    assert (monitor.flops_per_forward, monitor.flops_per_train_forward) == (7, 21)


def test_throughput_monitor_names_the_missing_size(tmp_path: Any) -> None:
    model = SamplerSized()
    del model.sampler
    with pytest.raises(ValueError, match="measure_flops=false"):
        trainer(tmp_path, [RLThroughputMonitor()], limit_train_batches=1).fit(model, loader(1))


class JsonLogger(RecordingLogger):
    """Writes its calls to a file, so that a spawned rank 0 can report them to the test process."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        super().log_metrics(metrics, step)
        with open(self.path, "w") as f:
            json.dump(self.calls, f)


class PerRank(StandIn):
    def training_step(self, batch: Tensor, batch_idx: int) -> Any:
        super().training_step(batch, batch_idx)
        rank = self.global_rank
        return {"num_images": 2 + rank, "timings": {"step": 1.0 + rank}}


@pytest.mark.slow
def test_throughput_monitor_two_gloo_ranks(tmp_path: Any) -> None:
    """A real 2-process all-gather: t_step is the slower rank's, images add up, the spread is reported."""
    path = str(tmp_path / "calls.json")
    t = trainer(
        tmp_path,
        [RLThroughputMonitor(measure_flops=False), CloseProcessGroup()],
        logger=JsonLogger(path),
        strategy="ddp_spawn",
        devices=2,
        limit_train_batches=1,
    )
    t.fit(PerRank(), loader(2))
    with open(path) as f:
        ((step, metrics),) = json.load(f)
    assert step == 0
    assert metrics["timing_s/step"] == 1.0  # rank 0's own
    assert metrics["perf/time_per_step"] == 2.0
    assert metrics["perf/total_num_images"] == 5.0
    assert metrics["perf/throughput"] == 5 / (2.0 * 2)
    assert (metrics["global_num_images/min"], metrics["global_num_images/max"]) == (2.0, 3.0)
    assert metrics["global_step_time_s/minmax_diff"] == 1.0


def test_throughput_monitor_counts_a_video_as_its_frames_and_as_one_video(tmp_path: Any) -> None:
    """frames_per_sample F: the image keys count frames (B·F), the video keys count videos (B); the
    FLOP count runs one forward at the sampler's frame count."""
    logger = RecordingLogger()
    measured = mock.Mock(return_value=(7, 21))
    model = SamplerSized(
        [{"num_images": 4, "frames_per_sample": 33, "timings": {"gen": 2.0, "step": 4.0}}] * 2
    )
    model.sampler.frames = 33
    monitor = RLThroughputMonitor(available_flops=1e6)
    with mock.patch.object(throughput, "measure_transformer_flops", measured):
        trainer(tmp_path, [monitor], logger=logger, limit_train_batches=2).fit(model, loader(2))
    assert measured.call_args.args[1:] == (24, 40) and measured.call_args.kwargs == {"frames": 33}
    (_, first), (_, second) = logger.calls
    assert first["perf/total_num_images"] == 4 * 33 and first["perf/throughput"] == 4 * 33 / 4.0
    assert first["perf/total_num_videos"] == 4 and first["perf/video_throughput"] == 4 / 4.0
    assert first["timing_per_image_ms/gen"] == pytest.approx(1000 * 2.0 / (4 * 33), rel=1e-12)
    assert first["timing_per_video_ms/gen"] == 1000 * 2.0 / 4
    assert second["perf/cumulative_num_videos"] == 8 and second["perf/cumulative_num_images"] == 8 * 33
    assert monitor.state_dict()["flops_resolution"] == (24, 40, 33)
    # Images (F = 1) keep their keys and meaning, and log no video key.
    logger = RecordingLogger()
    trainer(tmp_path, [RLThroughputMonitor(measure_flops=False)], logger=logger, limit_train_batches=1).fit(
        StandIn([{"num_images": 4, "frames_per_sample": 1, "timings": {"step": 2.0}}]), loader(1)
    )
    (_, metrics), *_ = logger.calls
    assert metrics["perf/throughput"] == 2.0 and not any("video" in k for k in metrics)
