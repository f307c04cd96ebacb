"""What Lightning reads from the launcher's environment, reported by each rank of a tiny FSDP2 fit.

Started once per rank by torchrun or (as srun would) with SLURM's variables; writes
``<out>/rank<global rank>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

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
        env = strategy.cluster_environment
        rank_sum = strategy.reduce(torch.tensor(float(self.global_rank)), reduce_op="sum")
        report = {
            "environment": type(env).__name__,
            "global_rank": self.global_rank,
            "local_rank": self.local_rank,
            "node_rank": strategy.node_rank,
            "world_size": self.trainer.world_size,
            "num_nodes": self.trainer.num_nodes,
            "mesh": list(strategy.device_mesh.shape),
            "main_address": env.main_address,
            "main_port": env.main_port,
            "rank_sum": float(rank_sum),
        }
        (Path(self.out) / f"rank{self.global_rank}.json").write_text(json.dumps(report))


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
