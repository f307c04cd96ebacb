"""Drop FlowGRPOModule into an existing Lightning project: your Trainer, loggers, callbacks, reward.

The reward is a plain Python function; nothing here is specific to lit_flowgrpo except the module
and the data module. Runs on a CPU in about a minute with the tiny SD3 pipeline it builds:

    python examples/existing_project.py

Swap `pretrained` for `stabilityai/stable-diffusion-3.5-medium` (or a local folder) and the
function for your own reward to run it for real.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lit_flowgrpo import (
    FlowGRPO,
    FlowGRPOModule,
    KLSettings,
    LoraSettings,
    PromptDataModule,
    Sampler,
    UpdateSettings,
    WeightsSettings,
)
from lit_flowgrpo.callbacks import RLThroughputMonitor
from lit_flowgrpo.policies import SD3Policy
from lit_flowgrpo.tiny.sd3 import build_tiny_sd3


def warm_colours(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
    """Any callable (images (B,3,H,W) in [0,1], prompts, metadata) -> (B,) works as a reward."""
    red, blue = images[:, 0], images[:, 2]
    return (red - blue).mean(dim=(1, 2))


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="lit_flowgrpo_example_"))
    pretrained = build_tiny_sd3(str(work / "tiny_sd3"))
    prompts = work / "prompts.txt"
    prompts.write_text("a sunset over the sea\na bowl of cherries\na fox in the snow\na red bicycle\n")

    model = FlowGRPOModule(
        policy=SD3Policy(pretrained, dtype="float32", max_sequence_length=32),
        reward=warm_colours,
        objective=FlowGRPO(clip_range=1e-4),
        kl=KLSettings(coef=0.01),
        sampler=Sampler(num_steps=4, eval_num_steps=4, height=32, width=32),
        update=UpdateSettings(micro_batch_size=4),
        weights=WeightsSettings(lora=LoraSettings(rank=4, alpha=8)),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-4),
    )
    data = PromptDataModule(
        train=str(prompts), val=str(prompts), prompts_per_step=2, group_size=4, val_batch_size=4
    )

    # Your project's own Trainer, logger and callbacks: lit_flowgrpo adds only its throughput monitor.
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=6,
        val_check_interval=3,
        check_val_every_n_epoch=None,
        logger=CSVLogger(str(work), name="logs"),
        callbacks=[
            RLThroughputMonitor(),
            LearningRateMonitor(logging_interval="step"),
            ModelCheckpoint(dirpath=str(work / "checkpoints"), save_last=True),
        ],
        log_every_n_steps=1,
        enable_progress_bar=False,
    )
    trainer.fit(model, datamodule=data)
    model.export_lora(str(work / "lora"))
    print(f"metrics: {trainer.logger.log_dir}/metrics.csv")
    print(f"LoRA adapter for diffusers' load_lora_weights: {work / 'lora'}")


if __name__ == "__main__":
    main()
