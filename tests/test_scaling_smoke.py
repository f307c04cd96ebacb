"""benchmarks/scaling.py on its tiny SD3 and FLUX sizes, one CPU process: a rollout trains, the
figures and rows are written, and a LoRA export loads back with diffusers holding the trained weights."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "scaling.py"


@pytest.mark.slow
@pytest.mark.parametrize(("size", "extra"), [("tiny", ["--export"]), ("flux_tiny", ["--full"])])
def test_scaling_script_runs_one_rollout(size: str, extra: list[str], tmp_path: Path) -> None:
    out = tmp_path / size
    args = ["run", "--strategy", "single", "--size", size, "--rollouts", "1", "--per_gpu", "8"]
    args += ["--global_ranks", "1", "--micro_batch", "4", "--out", str(out), *extra]
    subprocess.run([sys.executable, str(SCRIPT), *args], check=True, capture_output=True, timeout=600)
    info = json.loads((out / "info_rank0.json").read_text())
    assert info["world_size"] == 1 and info["lora"] == ("--full" not in extra)
    assert len(info["step_seconds"]) == 1
    rows = json.loads((out / "rows_rank0_step0.json").read_text())
    assert len(rows) == 8 and all(math.isfinite(reward) for _, reward, _ in rows)
    logged = json.loads((out / "metrics.json").read_text())
    assert any("perf/throughput" in row for row in logged.values())
    if "--export" in extra:
        assert info["exported_ok"] is True
