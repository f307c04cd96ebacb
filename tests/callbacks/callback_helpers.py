"""A small stand-in LightningModule that follows FlowGRPOModule's step contract, and test plumbing.

Shared by the callback tests (imported as ``from callback_helpers import ...``: pytest puts this
folder on ``sys.path``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lit_flowgrpo.policies.base import Embeds, FlowPolicy

TOKENS, DIM, HIDDEN = 4, 8, 16
LAYER_FLOPS = 2 * TOKENS * DIM * HIDDEN  # one (T x D) @ (D x H) matmul: 2·m·n·k multiply-adds


class TinyPolicy(FlowPolicy):
    """Two linear layers over (T, D) latent tokens; a text 'encoder' that costs a matmul when not cached."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM))
        self.text = nn.Linear(DIM, DIM)
        self.text.requires_grad_(False)
        self._cache: dict[str, Tensor] = {}

    def load(self) -> None:
        pass

    @property
    def transformer(self) -> nn.Module:
        return self.net

    def encode_prompts(self, prompts: Sequence[str]) -> Embeds:
        for p in prompts:
            if p not in self._cache:
                with torch.no_grad():
                    self._cache[p] = self.text(torch.full((1, DIM), float(len(p))))[0]
        return {"x": torch.stack([self._cache[p] for p in prompts])}

    def velocity(self, latents: Tensor, sigma: Tensor, embeds: Embeds, guidance_scale: float) -> Tensor:
        return self.net(latents + embeds["x"][:, None, :]).float()

    def decode(self, latents: Tensor) -> Tensor:
        return torch.zeros(latents.shape[0], 3, 2, 2)

    def sigmas(self, num_steps: int, height: int, width: int) -> Tensor:
        return torch.linspace(1, 0, num_steps + 1)

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        return (TOKENS, DIM)


class StandIn(LightningModule):
    """Manual optimization; training_step returns outputs[batch_idx] and takes ``opt_steps`` SGD steps."""

    def __init__(self, outputs: Sequence[Any] = (), opt_steps: int = 1) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.policy = TinyPolicy()
        self.height = self.width = 16
        self.frozen = nn.Linear(2, 2)
        self.frozen.requires_grad_(False)
        self.outputs = list(outputs)
        self.opt_steps = opt_steps
        self.history: list[Tensor] = []  # trainable weights after each optimizer step
        self.seen_in_validation: list[Tensor] = []

    def training_step(self, batch: Tensor, batch_idx: int) -> Any:
        opt = self.optimizers()
        x = torch.ones(1, TOKENS, DIM) * (1 + batch.float().mean())
        for _ in range(self.opt_steps):
            opt.zero_grad()
            self.manual_backward(self.policy.net(x).pow(2).mean())
            opt.step()
            self.history.append(self._flat_trainable())
        return self.outputs[batch_idx] if batch_idx < len(self.outputs) else None

    def validation_step(self, batch: Tensor, batch_idx: int) -> Any:
        self.seen_in_validation.append(self._flat_trainable())
        return self.outputs[batch_idx] if batch_idx < len(self.outputs) else None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

    def _flat_trainable(self) -> Tensor:
        return torch.cat([p.detach().flatten() for p in self.parameters() if p.requires_grad]).clone()


class RecordingLogger(Logger):
    """A real Logger that keeps every (step, metrics) it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((int(step), {k: v for k, v in metrics.items() if k != "epoch"}))


def loader(n: int) -> DataLoader:
    return DataLoader(torch.arange(n), batch_size=1)


def trainer(tmp_path: Any, callbacks: list, logger: Any = False, **kwargs: Any) -> Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
    )
    return Trainer(callbacks=callbacks, **{**defaults, **kwargs})


def constant_loader(n: int) -> DataLoader:
    """``n`` identical batches: a run resumed mid-epoch (which restarts a plain DataLoader from its
    first batch) sees the same data as an uninterrupted one."""
    return DataLoader(torch.zeros(n, dtype=torch.long), batch_size=1)
