"""benchmarks/gradient_direction.py on the CPU: a step along the on-policy gradient of a dense reward
(a clip's mean brightness) raises it, a step against it lowers it, under both samplers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


# slow: one rollout of 32 clips, its gradient, and 3 x 2 evaluations of 32 clips (about 45 s on 2 cores)
@pytest.mark.slow
def test_a_step_along_the_gradient_of_brightness_raises_it(tmp_path: Path) -> None:
    out = tmp_path / "direction.json"
    args = ["--world", "video", "--guidance", "1", "--reward", "brightness", "--prompts", "8"]
    args += ["--group", "4", "--eval_seeds", "4", "--alphas", "-2", "2", "--workers", "0", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gradient_direction.py"), *args], check=True, env=env
    )
    result = json.loads(out.read_text())
    assert result["gradient_rollout"]["samples"] == 32 and result["gradient_rollout"]["grad_norm"] > 0
    rows = {row["alpha"]: row for row in result["steps"]}
    assert sorted(rows) == [-2.0, 0.0, 2.0]
    for sampler in ("sde_reward", "ode_reward"):
        assert rows[0.0][sampler + "_diff"] == 0.0
        # Paired differences of 32 clips: the signal is tens of standard errors; 5 leaves a margin.
        up, down = rows[2.0], rows[-2.0]
        assert up[sampler + "_diff"] > 5 * up[sampler + "_diff_se"] > 0, up
        assert down[sampler + "_diff"] < -5 * down[sampler + "_diff_se"] < 0, down
