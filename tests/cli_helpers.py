"""The tiny SD3 run the command-line tests share: its config, its prompts, and one rollout's flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "lit_flowgrpo" / "configs"  # the shipped recipes (a clone's configs/ links here)
TINY = CONFIGS / "tiny_sd3.yaml"
PROMPTS = CONFIGS / "data" / "tiny_prompts.txt"


def load_shipped(name: str) -> dict[str, Any]:
    """A shipped recipe as a dict, with the prompt files it names relative to its own folder made
    absolute, so that a changed copy written elsewhere reads the same files."""
    config = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text(encoding="utf-8"))
    data = config["data"]["init_args"]
    for key in ("train", "val"):
        if isinstance(data.get(key), str) and (CONFIGS / data[key]).is_file():
            data[key] = str((CONFIGS / data[key]).resolve())
    return config


def tiny_fit_args(pretrained: str, root: Path, *extra: str) -> list[str]:
    """``fit`` of configs/tiny_sd3.yaml on the pipeline at ``pretrained``: one rollout (2 optimizer
    steps), validated (with the EMA swapped in, as configured there), checkpointed into
    ``root``/checkpoints and logged to CSV under ``root``."""
    return [
        "fit",
        "--config",
        str(TINY),
        f"--model.init_args.policy.init_args.pretrained={pretrained}",
        f"--data.init_args.train={PROMPTS}",
        f"--data.init_args.val={PROMPTS}",
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=1",
        "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={root}",
        "--trainer.logger=CSVLogger",
        f"--trainer.logger.save_dir={root}",
        *extra,
    ]
