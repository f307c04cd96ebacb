"""Training runs of the tiny Wan pipeline, as the sequence-parallel tests launch them.

Run in-process (``run(config)``) or once per rank by torchrun
(``python -m torch.distributed.run --nproc_per_node=2 tests/sp_worker.py CONFIG.json``). Each rank
writes to ``config["out"]``, per step: the rollout it trained (sample ids, final latents, rollout
log-probs) and its (sample id, reward, advantage) rows; and at the end its trained LoRA weights and
rank 0's logged metrics.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from fsdp_worker import MemoryLogger

from lit_flowgrpo import (
    FlowGRPO,
    FlowGRPOModule,
    LoraSettings,
    PromptDataModule,
    Sampler,
    UpdateSettings,
    WeightsSettings,
)
from lit_flowgrpo.performance import PerformanceSettings
from lit_flowgrpo.policies import HunyuanVideo15Policy, WanPolicy
from lit_flowgrpo.strategies import FSDP2Strategy, end_distributed_process


class Brightness:
    """The mean of each video: a reward every rank computes alike from the same frames."""

    modalities = frozenset({"video"})

    def __call__(self, videos, prompts, metadata):
        return videos.mean(dim=(1, 2, 3, 4))


class Recorder(FlowGRPOModule):
    def __init__(self, out: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.out = out

    def _update(self, rollout, step, *rest):
        traj = rollout.trajectory
        record = {"sample_ids": rollout.sample_ids, "final": traj.final, "log_probs": traj.log_probs}
        torch.save({k: v.detach().cpu() for k, v in record.items()}, self._path(f"rollout_step{step}.pt"))
        return super()._update(rollout, step, *rest)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        rows = [
            [int(s), float(r), float(a)]
            for s, r, a in zip(
                outputs["sample_ids"].tolist(),
                outputs["rewards"].tolist(),
                outputs["advantages"].tolist(),
                strict=True,
            )
        ]
        self._path(f"adv_step{batch.step}.json").write_text(json.dumps(rows))

    def on_train_start(self) -> None:
        self._save_trainable("lora_init.pt")

    def on_train_end(self) -> None:
        self._save_trainable("lora.pt")

    def _save_trainable(self, name: str) -> None:
        state = {n: p.detach() for n, p in self.named_parameters() if p.requires_grad}
        # FSDP2: each DTensor gathered whole (a collective: every rank takes part)
        state = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in state.items()}
        torch.save({n: p.cpu().clone() for n, p in state.items()}, self._path(name))

    def _path(self, name: str) -> Path:
        return Path(self.out) / f"rank{self.global_rank}_{name}"


#: The tiny pipeline's family (``config["family"]``, Wan by default).
POLICIES = {"wan": WanPolicy, "hunyuanvideo15": HunyuanVideo15Policy}


def build(config: dict[str, Any]) -> tuple[Recorder, PromptDataModule]:
    module = Recorder(
        out=config["out"],
        policy=POLICIES[config.get("family", "wan")](
            config["pipeline"], dtype="float32", max_sequence_length=16
        ),
        reward=Brightness(),
        objective=FlowGRPO(clip_range=1e-2),
        # 4 samples per rollout chunk: every run here draws the same chunks of the same samples, whatever
        # its ranks (4 samples per data-parallel peer with 2 peers, 2 chunks of 4 with one).
        sampler=Sampler(num_steps=3, height=32, width=32, frames=5, guidance_scale=4.5, batch_size=4),
        # No clipping: a clipped step has the norm of the limit, whatever the gradient's scale.
        update=UpdateSettings(micro_batch_size=2, optimizer_steps_per_rollout=1, max_grad_norm=None),
        weights=WeightsSettings(lora=LoraSettings(rank=2, alpha=4)),
        # SGD: the weights move by lr × gradient, so a gradient off by a factor (the sp partial
        # gradients averaged instead of summed) moves them visibly; Adam's first step would hide it.
        optimizer=functools.partial(torch.optim.SGD, lr=config.get("lr", 1.0)),
        performance=PerformanceSettings(
            sequence_parallel=config.get("sp", 1), **config.get("performance", {})
        ),
    )
    data = PromptDataModule(train=config["prompts"], prompts_per_step=2, group_size=4, seed=5)
    return module, data


def run(config: dict[str, Any]) -> None:
    out = Path(config["out"])
    out.mkdir(parents=True, exist_ok=True)
    module, data = build(config)
    strategy = config.get("strategy", "auto")
    if isinstance(strategy, dict):
        strategy = FSDP2Strategy(**strategy)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=config.get("devices", 1),
        strategy=strategy,
        max_steps=config.get("max_steps", 2),
        logger=MemoryLogger(out / "metrics.json"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, datamodule=data)


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()))
    end_distributed_process()  # the results are on disk: no interpreter teardown to abort on
