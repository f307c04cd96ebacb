"""Training runs of the tiny Wan 2.1 image-to-video pipeline as tests/policies/test_wan_i2v_sp.py launches
them: tests/sp_worker.py's run (its Recorder, reward, sampler, update and optimizer) with the
image-to-video policy and a .jsonl of first frames (``config["prompts"]``).

    python -m torch.distributed.run --nproc_per_node=2 tests/policies/wan_i2v_sp_worker.py CONFIG.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: sp_worker and its helpers

import sp_worker

from lit_flowgrpo.policies.wan_i2v import WanImageToVideoPolicy
from lit_flowgrpo.strategies import end_distributed_process


def run(config: dict[str, Any]) -> None:
    sp_worker.POLICIES["wan_i2v"] = WanImageToVideoPolicy  # the same run, this family
    sp_worker.run(dict(config, family="wan_i2v"))


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()))
    end_distributed_process()
