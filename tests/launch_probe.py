"""What Lightning reads from the launcher's environment, reported by each rank of a tiny FSDP2 fit.

Started once per rank by torchrun or (as srun would) with SLURM's variables; writes
``<out>/rank<global rank>.json``.

``LaunchRecorder`` reports the same from inside a real ``lit-flowgrpo fit`` (named in
``--trainer.callbacks``), with the samples each rank was dealt and every file it wrote.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from lit_flowgrpo.strategies import end_distributed_process  # also registers "fsdp2"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Probe(L.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.net = Net()

    def configure_model(self) -> None:
        self.trainer.strategy.shard(self.net)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)

    def on_train_end(self) -> None:
        strategy = self.trainer.strategy
        rank_sum = strategy.reduce(torch.tensor(float(self.global_rank)), reduce_op="sum")
        report = _report(self.trainer) | {
            "mesh": list(strategy.device_mesh.shape),
            "rank_sum": float(rank_sum),
        }
        (Path(self.out) / f"rank{self.global_rank}.json").write_text(json.dumps(report))


def _report(trainer: L.Trainer) -> dict[str, Any]:
    """The launch as Lightning read it on this rank."""
    env = getattr(trainer.strategy, "cluster_environment", None)  # None: one process, no launcher
    return {
        "environment": type(env).__name__ if env else None,
        "global_rank": trainer.global_rank,
        "local_rank": trainer.local_rank,
        "node_rank": trainer.node_rank,
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "main_address": env.main_address if env else None,
        "main_port": env.main_port if env else None,
    }


def brightness(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
    """The images' mean: a reward continuous in the weights (JPEG sizes jump by whole bytes)."""
    return images.mean(dim=(1, 2, 3))  # (B,) fp32


class LaunchRecorder(L.Callback):
    """Per rank, into ``out``: ``rank<R>.json`` (the launch as Lightning read it), ``rows_rank<R>_step<S>.json``
    (each dealt sample's id, group id, prompt, reward and advantage) and ``writes_rank<R>.txt`` (every
    path under ``watch`` this process opened for writing, created, renamed or removed).

    The writes are seen by an audit hook (PEP 578) installed when the CLI builds the callback, before
    the Trainer exists, so they include everything the run writes from then on. ``R`` there is the
    launcher's ``RANK`` (0 without a launcher)."""

    _WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    _EVENTS = ("os.mkdir", "os.rename", "os.replace", "os.remove", "os.symlink", "os.link", "shutil.copyfile")

    def __init__(self, out: str, watch: str) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.watch = os.path.realpath(watch)
        self._log = open(self.out / f"writes_rank{os.environ.get('RANK', '0')}.txt", "a", buffering=1)  # noqa: SIM115
        sys.addaudithook(self._audit)

    def _audit(self, event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & self._WRITE_FLAGS
            )
            paths = [path] if writes else []
        elif event in self._EVENTS:
            paths = [a for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))]
        else:
            return
        for path in paths:
            if isinstance(path, (str, os.PathLike)) and not isinstance(path, int):
                full = os.path.realpath(os.fspath(path))
                if full.startswith(self.watch + os.sep):
                    self._log.write(f"{event} {os.path.relpath(full, self.watch)}\n")

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(_report(trainer)))

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        rows = [
            [int(s), int(g), p, float(r), float(a)]
            for s, g, p, r, a in zip(
                outputs["sample_ids"].tolist(),
                batch.group_ids.tolist(),
                batch.prompts,
                outputs["rewards"].tolist(),
                outputs["advantages"].tolist(),
                strict=True,
            )
        ]
        path = self.out / f"rows_rank{trainer.global_rank}_step{batch.step}.json"
        path.write_text(json.dumps(rows))


if __name__ == "__main__":
    out, num_nodes, devices = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy="fsdp2",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Probe(out))
    end_distributed_process()
