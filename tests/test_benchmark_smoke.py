"""benchmarks/throughput.py end to end on tiny configs on the CPU: the real module under a real Trainer,
the callback's figures read back, the results file and its table."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

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


@pytest.fixture(scope="module")
def throughput():
    spec = importlib.util.spec_from_file_location("throughput_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_tiny_run_writes_the_results_and_table(throughput, tmp_path):
    args = ["--tiny", "--variants", "eager,bf16_compute", "--warmup", "0", "--steps", "1", "--num-steps", "2"]
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
    summary = throughput.main(args)

    path = tmp_path / "cpu_sd35m_tiny_32px.json"
    saved = json.loads(path.read_text())
    assert saved == json.loads(json.dumps(summary))
    assert all(key in saved for key in REQUIRED)
    full = [v for v in saved["variants"] if not v.get("fast")]
    assert [v["name"] for v in full] == ["eager", "bf16_compute"]
    assert saved["baseline_images_per_gpu_s"] == full[0]["images_per_gpu_s"]
    assert saved["images_per_gpu_s"] == max(v["images_per_gpu_s"] for v in full)
    for v in saved["variants"]:
        # read back from the callback's perf/throughput and timing_per_image_ms/<stage> keys
        assert (
            v["images_per_gpu_s"] > 0
            and v["ms_per_image"]["gen"] > 0
            and v["ms_per_image"]["update_actor"] > 0
        )
        # bf16 base: the module's own on-policy tolerance
        assert 0 <= v["onpolicy_ratio_abs_dev"] <= 1e-3
        assert v["flops_per_image_forward"] > 0
    assert saved["fast_images_per_gpu_s"] > 0
    fast = saved["variants"][-1]
    assert fast["name"] == "fast_nocfg"
    best = next(v for v in full if v["name"] == saved["best_variant"])
    assert fast["performance"] == best["performance"]  # Fast runs with the fastest full-step settings
    table = (tmp_path / "README.md").read_text()
    assert "sd35m_tiny_32px on cpu" in table
    for name in ("eager", "bf16_compute", "fast_nocfg"):
        assert f"| {name} |" in table


def test_unknown_variant_names_the_choices(throughput, tmp_path):
    with pytest.raises(SystemExit, match="bf16_compute"):
        throughput.main(["--tiny", "--variants", "eager,warp_drive", "--out", str(tmp_path)])


@pytest.mark.parametrize("objective", ["flow_dppo", "diffusion_nft"])
def test_the_full_step_runs_with_each_objective(throughput, tmp_path, objective):
    args = ["--tiny", "--variants", "eager", "--warmup", "0", "--steps", "1", "--num-steps", "2", "--no-fast"]
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
    summary = throughput.main([*args, "--objective", objective])
    saved = json.loads((tmp_path / f"cpu_sd35m_tiny_32px_{objective}.json").read_text())
    assert saved == json.loads(json.dumps(summary)) and saved["setup"]["objective"] == objective
    (run,) = saved["variants"]
    assert run["images_per_gpu_s"] > 0 and run["ms_per_image"]["update_actor"] > 0
