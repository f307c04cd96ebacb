"""The tiny SD3 run the command-line tests share: its config, its prompts, and one rollout's flags."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny_sd3.yaml"
PROMPTS = REPO / "configs" / "data" / "tiny_prompts.txt"


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
