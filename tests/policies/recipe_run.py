"""One recipe end to end on a tiny pipeline: fit, export read back by the family's pipeline, resume."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from lit_flowgrpo.cli import FlowGRPOCLI, main

#: A reward that needs no weights, for the recipes' image rewards.
NO_DOWNLOAD_REWARD = {"weights": {"jpeg_compressibility": 1.0}}


def fit_export_resume(
    recipe: str,
    tiny: str,
    pipeline: type,
    prompt_file: str,
    tmp_path: Path,
    size: int = 32,
    max_len: int = 24,
    *,
    frames: int = 1,
    reward: dict[str, Any] | None = None,
    load_adapter: Callable[[Any, str], None] | None = None,
) -> None:
    """Fit ``recipe`` (a shipped config) on the ``tiny`` pipeline on the CPU for one rollout (2 optimizer
    steps; ``reward``: the reward's ``init_args``, a no-download one by default), export its LoRA, read it
    back into ``pipeline`` (bit for bit) with ``load_adapter(pipe, folder)`` (by default the pipeline's own
    ``load_lora_weights``), and resume from the checkpoint for one more rollout. ``frames``: a video
    recipe's frames per sample."""
    cfg = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "lit_flowgrpo" / "configs" / recipe).read_text()
    )
    trainer, model = cfg["trainer"], cfg["model"]["init_args"]
    trainer.update(
        accelerator="cpu",
        devices=1,
        num_nodes=1,  # a recipe of several nodes (FLUX.1 Kontext: 4) would wait for the others
        strategy="auto",
        max_steps=2,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        logger={
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(tmp_path)},
        },
        callbacks=[
            {
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {"every_n_train_steps": 2, "dirpath": str(tmp_path / "ckpt"), "save_last": True},
            }
        ],
    )
    model["policy"]["init_args"].update(pretrained=tiny, max_sequence_length=max_len)
    model["reward"]["init_args"] = NO_DOWNLOAD_REWARD if reward is None else reward
    window = model["sampler"].get("sde_window_range")  # a recipe with a window: up to its end
    steps = 2 if window is None else window[1]
    model["sampler"].update(
        height=size, width=size, frames=frames, num_steps=steps, eval_num_steps=2, batch_size=4
    )
    model["update"]["micro_batch_size"] = 4
    cfg["data"]["init_args"].update(train=prompt_file, val=None, prompts_per_step=2, group_size=4)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))

    cli = FlowGRPOCLI(args=["fit", "--config", str(path)])
    assert cli.trainer.global_step == 2
    logged = {k: float(v) for k, v in cli.trainer.logged_metrics.items()}
    assert math.isfinite(logged["actor/loss"]) and logged["reward/failure_rate"] == 0.0
    assert logged["actor/on_policy_ratio_err"] <= 1e-3  # bf16 weights: the module's on-policy tolerance
    trained = {
        n: p.detach().clone() for n, p in cli.model.policy.transformer.named_parameters() if p.requires_grad
    }

    out = tmp_path / "lora"
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    main(["export", "--config", str(path), "--ckpt_path", str(ckpt), "--out", str(out)])
    pipe = pipeline.from_pretrained(tiny)
    if load_adapter is None:
        pipe.load_lora_weights(str(out), adapter_name="rl")  # the family pipeline's own LoRA loader
    else:
        load_adapter(pipe, str(out))
    loaded = dict(pipe.transformer.named_parameters())
    for name, value in trained.items():  # the checkpoint's adapter, bit for bit
        torch.testing.assert_close(
            loaded[name.replace(".default.", ".rl.")].float(), value.float(), atol=0, rtol=0
        )

    resumed = FlowGRPOCLI(args=["fit", "--config", str(path), "--trainer.max_steps=4", f"--ckpt_path={ckpt}"])
    assert resumed.trainer.global_step == 4
    assert math.isfinite(float(resumed.trainer.logged_metrics["actor/loss"]))
