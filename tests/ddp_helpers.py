"""What the tests' spawned DDP ranks (``strategy="ddp_spawn"`` on CPU, gloo) share."""

from __future__ import annotations

import lightning as L
import torch


class CloseProcessGroup(L.Callback):
    """Closes the process group at the end of a spawned rank's fit, as the CLI does for its runs
    (``lit_flowgrpo.strategies.end_distributed_process``): left open, gloo's background thread is
    destroyed during the interpreter's teardown and now and then aborts a rank that succeeded
    ("terminate called without an active exception", signal 6: seen in two of about 30 short runs of
    two ddp_spawn tests, under a full suite)."""

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
