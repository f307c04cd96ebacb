"""benchmarks/throughput.py end to end on tiny configs on the CPU: the real module under a real Trainer,
the callback's figures read back, the results file and its table."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "throughput.py"
REQUIRED = (
    "device",
    "config",
    "images_per_gpu_s",
    "baseline_images_per_gpu_s",
    "mfu_transformer",
    "onpolicy_ratio_abs_dev",
    "peak_memory_gb",
    "fast_images_per_gpu_s",
)


def tiny_args(tmp_path: Path, variants: str, *extra: str) -> list[str]:
    """One measured rollout of 2 steps of ``variants`` on the CPU, 2 images a prompt, results in ``tmp_path``."""
    args = ["--tiny", "--variants", variants, "--warmup", "0", "--steps", "1", "--num-steps", "2"]
    args += [
        "--prompts",
        "1",
        "--group",
        "2",
        "--micro-batch",
        "2",
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
    ]
    return [*args, *extra]


@pytest.fixture(scope="module")
def throughput():
    spec = importlib.util.spec_from_file_location("throughput_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_tiny_run_writes_the_results_table_and_profiles(throughput, tmp_path, monkeypatch):
    """Two variants with one between them that fails (flash attention with float32 compute, which the
    settings refuse), each run profiled: the failure is a row of its own, the others and the Fast run
    are measured and profiled."""
    listed = throughput.variants

    def with_a_failure(micro_batch):
        eager, bf16, *rest = listed(micro_batch)
        broken = throughput.Variant(
            "broken",
            "fails",
            throughput.PerformanceSettings(compute_dtype="float32", attention_backend="flash"),
        )
        return [eager, broken, bf16, *rest]

    monkeypatch.setattr(throughput, "variants", with_a_failure)
    prof = tmp_path / "prof"
    args = tiny_args(tmp_path, "eager,broken,bf16_compute", "--profile", str(prof), "--tag", "smoke")
    summary = throughput.main(args)

    path = tmp_path / "cpu_sd35m_tiny_32px_smoke.json"  # --tag: the results file's name
    saved = json.loads(path.read_text())
    assert saved == json.loads(json.dumps(summary))
    assert all(key in saved for key in REQUIRED)
    full = [v for v in saved["variants"] if not v.get("fast")]
    assert [v["name"] for v in full] == ["eager", "broken", "bf16_compute"]
    broken = full[1]
    assert broken["images_per_gpu_s"] is None and "flash" in broken["error"] and "profile" not in broken
    ok = [v for v in saved["variants"] if v["name"] != "broken"]
    assert saved["baseline_images_per_gpu_s"] == full[0]["images_per_gpu_s"]
    assert saved["images_per_gpu_s"] == max(v["images_per_gpu_s"] for v in ok if not v.get("fast"))
    for v in ok:
        # read back from the callback's perf/throughput and timing_per_image_ms/<stage> keys
        assert (
            v["images_per_gpu_s"] > 0
            and v["ms_per_image"]["gen"] > 0
            and v["ms_per_image"]["update_actor"] > 0
        )
        # bf16 base: the module's own on-policy tolerance
        assert 0 <= v["onpolicy_ratio_abs_dev"] <= 1e-3
        assert v["flops_per_image_forward"] > 0
        # the step after the measured one, on the CPU's timeline (operators: no kernels here)
        profile = v["profile"]
        assert profile["steps"] == [1] and profile["source"] == "cpu_op"
        for part in ("step", "rollout", "decode", "update"):
            assert 0 < profile[part]["gpu_busy_fraction"] <= 1 and profile[part]["by_category_ms"]["gemm"] > 0
        assert profile["decode"]["window_ms"] < profile["rollout"]["window_ms"] < profile["step"]["window_ms"]
        assert profile["update"]["thin_products"]["kernels"] > 0  # shapes recorded (rank-32 LoRA)
        folder = prof / profile["folder"]  # under --profile: <results name>/<variant>
        assert folder == prof / "cpu_sd35m_tiny_32px_smoke" / v["name"]
        assert (folder / "rank0_trace.json.gz").exists() and (folder / "rank0_summary.json").exists()
    assert saved["fast_images_per_gpu_s"] > 0
    fast = saved["variants"][-1]
    assert fast["name"] == "fast_nocfg"
    best = next(v for v in full if v["name"] == saved["best_variant"])
    assert fast["performance"] == best["performance"]  # Fast runs with the fastest full-step settings
    table = (tmp_path / "README.md").read_text()
    assert "sd35m_tiny_32px on cpu" in table
    for name in ("eager", "bf16_compute", "fast_nocfg"):
        assert f"| {name} |" in table
    assert "| broken | failed: SettingsError" in table
    profiles = (prof / "cpu_sd35m_tiny_32px_smoke" / "profiles.txt").read_text()
    assert all(f"######## {n}" in profiles for n in ("eager", "bf16_compute", "fast_nocfg"))
    assert "== part decode" in profiles


def test_every_variant_is_a_valid_setting_and_the_levers_add_one_each(throughput):
    listed = {v.name: v for v in throughput.variants(8)}
    for v in listed.values():
        assert v.performance.problems() == [], v.name
    base = dataclasses.asdict(listed["compile_batch16_decoder"].performance)
    for name, mode in (("cudagraphs", "reduce-overhead"), ("autotune", "max-autotune-no-cudagraphs")):
        lever = listed[f"compile_batch16_decoder_{name}"]
        assert dataclasses.asdict(lever.performance) == dict(base, compile_mode=mode)
        assert (lever.rollout_batch_size, lever.micro_batch) == (16, 16)
    assert listed["compile_batch16_decoder_cudagraphs"].performance.uses_cudagraphs


# The marks themselves are checked in tests/test_performance.py; this runs the variant through the
# whole harness (~30 s of compilation), before a change to it: LIT_FLOWGRPO_CUDAGRAPH_SMOKE=1.
@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("LIT_FLOWGRPO_CUDAGRAPH_SMOKE"),
    reason="the CUDA-graph variant through the harness compiles for ~30 s: set LIT_FLOWGRPO_CUDAGRAPH_SMOKE=1",
)
def test_the_cuda_graph_variant_runs_on_the_cpu(throughput, tmp_path, monkeypatch):
    """compile_batch16_decoder_cudagraphs through the harness on the CPU (at this run's batch: 16 does
    not divide 2 images): its blocks and decoder compile with aot_eager, which ignores the mode, and
    each no-grad transformer forward begins a CUDA graph step (none with gradients)."""
    listed = throughput.variants

    def at_this_batch(micro_batch):
        return [
            dataclasses.replace(v, rollout_batch_size=None, micro_batch=None)
            if v.name.endswith("cudagraphs")
            else v
            for v in listed(micro_batch)
        ]

    monkeypatch.setattr(throughput, "variants", at_this_batch)
    marks: list[bool] = []
    monkeypatch.setattr(
        torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(torch.is_grad_enabled())
    )
    args = tiny_args(
        tmp_path, "compile_batch16_decoder_cudagraphs", "--no-fast", "--profile", str(tmp_path / "p")
    )
    (run,) = throughput.main(args)["variants"]
    assert run["images_per_gpu_s"] > 0 and run["performance"]["compile_mode"] == "reduce-overhead"
    assert run["compile_counts"]["unique_graphs"] > 0 and run["profile"]["rollout"]["gpu_busy_fraction"] > 0
    # the FLOP count's forward at train start, and 2 steps (1 measured, 1 profiled) of 2 sampling
    # steps, each one CFG forward
    assert len(marks) == 1 + 4 and not any(marks)


def test_unknown_variant_names_the_choices(throughput, tmp_path):
    with pytest.raises(SystemExit, match="bf16_compute"):
        throughput.main(["--tiny", "--variants", "eager,warp_drive", "--out", str(tmp_path)])


@pytest.mark.parametrize("objective", ["flow_dppo", "diffusion_nft"])
def test_the_full_step_runs_with_each_objective(throughput, tmp_path, objective):
    summary = throughput.main(tiny_args(tmp_path, "eager", "--no-fast", "--objective", objective))
    saved = json.loads((tmp_path / f"cpu_sd35m_tiny_32px_{objective}.json").read_text())
    assert saved == json.loads(json.dumps(summary)) and saved["setup"]["objective"] == objective
    (run,) = saved["variants"]
    assert run["images_per_gpu_s"] > 0 and run["ms_per_image"]["update_actor"] > 0


def test_a_remote_reward_scored_after_and_beside_the_rollout(throughput, tmp_path):
    # Rollout chunks of 2 images (the variant's batch = --micro-batch): 4 images are 2 chunks.
    args = tiny_args(tmp_path, "rollout_batch", "--no-fast", "--group", "4", "--reward", "remote:20")
    summary = throughput.main([*args, "--reward-overlap", "both"])
    saved = json.loads((tmp_path / "cpu_sd35m_tiny_32px_reward_remote20ms.json").read_text())
    assert saved == json.loads(json.dumps(summary))
    assert (saved["setup"]["reward"], saved["setup"]["reward_overlap"]) == ("remote:20", "both")
    off, on = saved["variants"]
    assert (off["name"], off["reward_overlap"], on["name"], on["reward_overlap"]) == (
        "rollout_batch_overlap_off",
        False,
        "rollout_batch_overlap_on",
        True,
    )
    for run in (off, on):
        # the VLM-judge client's time, and the step's wait for it (a part of the step)
        assert run["reward_compute_s"] > 0 and run["reward_compute_ms_per_image"] > 0
        assert run["reward_exposed_s"] > 0 and 0 < run["reward_share"] < 1
    table = (tmp_path / "README.md").read_text()
    assert "reward remote:20" in table and "reward waited ms/image" in table
    assert "| rollout_batch_overlap_on |" in table


def test_pickscore_sized_runs_the_real_reward_on_a_tiny_clip(throughput, tmp_path):
    throughput.main(tiny_args(tmp_path, "eager", "--no-fast", "--reward", "pickscore_sized"))
    saved = json.loads((tmp_path / "cpu_sd35m_tiny_32px_reward_pickscore_sized.json").read_text())
    (run,) = saved["variants"]
    assert run["reward_overlap"] and run["images_per_gpu_s"] > 0 and run["reward_compute_s"] > 0


def test_ocr_reads_the_drawn_text_with_rapidocr(throughput, tmp_path):
    pytest.importorskip("rapidocr")
    throughput.main(tiny_args(tmp_path, "eager", "--no-fast", "--reward", "ocr"))
    (run,) = json.loads((tmp_path / "cpu_sd35m_tiny_32px_reward_ocr.json").read_text())["variants"]
    assert run["images_per_gpu_s"] > 0 and run["reward_compute_s"] > 0


def test_reward_choices_and_a_missing_ocr_engine_fail_in_one_line(throughput, tmp_path, monkeypatch):
    with pytest.raises(SystemExit):
        throughput.parse_args(["--reward", "remote:soon"])
    monkeypatch.setitem(sys.modules, "rapidocr", None)  # as where the OCR extra is not installed
    with pytest.raises(SystemExit, match=r"--reward ocr .*pip install 'lit-flowgrpo\[ocr\]'"):
        throughput.main(tiny_args(tmp_path, "eager", "--no-fast", "--reward", "ocr"))


def test_wan_videos_through_the_same_harness(throughput, tmp_path):
    # The tiny Wan pipeline's configs (lit_flowgrpo.tiny.wan) on random weights: 5-frame videos, a
    # window of one trained step, bf16 records, the update's blocks checkpointed.
    args = tiny_args(tmp_path, "activation_checkpointing", "--no-fast", "--model", "wan1p3b", "--frames", "5")
    throughput.main([*args, "--record-dtype", "bfloat16", "--sde-window-size", "1"])
    saved = json.loads((tmp_path / "cpu_wan1p3b_tiny_32px_5f.json").read_text())
    assert (saved["frames"], saved["setup"]["record_dtype"], saved["setup"]["sde_window_size"]) == (
        5,
        "bfloat16",
        1,
    )
    (run,) = saved["variants"]
    assert run["performance"]["activation_checkpointing"]
    # the callback's perf/throughput counts frames, perf/video_throughput videos
    assert run["frames_per_gpu_s"] == run["images_per_gpu_s"] > 0
    assert run["videos_per_gpu_s"] == pytest.approx(run["frames_per_gpu_s"] / 5)
    assert saved["videos_per_gpu_s"] == run["videos_per_gpu_s"] and run["ms_per_video"]["update_actor"] > 0
    assert 0 <= run["onpolicy_ratio_abs_dev"] <= 1e-3 and run["flops_per_image_forward"] > 0
    table = (tmp_path / "README.md").read_text()
    assert "32 px, 5 frames" in table and "| frames/GPU/s | videos/GPU/s |" in table


def test_a_video_run_refuses_image_rewards_and_frames_of_image_models(throughput):
    with pytest.raises(SystemExit):
        throughput.parse_args(["--model", "wan1p3b", "--reward", "pickscore_sized"])
    with pytest.raises(SystemExit):
        throughput.parse_args(["--model", "sd35m", "--frames", "5"])
