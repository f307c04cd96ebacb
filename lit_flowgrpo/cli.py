"""``lit-flowgrpo``: LightningCLI over any LightningModule / LightningDataModule, plus ``export``.

    lit-flowgrpo fit --config configs/quickstart.yaml
    lit-flowgrpo validate --config configs/tiny_sd3.yaml --ckpt_path last.ckpt
    lit-flowgrpo fit --config configs/tiny_sd3.yaml --print_config
    lit-flowgrpo export --config run/config.yaml --ckpt_path last.ckpt --out lora/

Model and data are chosen by ``class_path`` (``FlowGRPOModule`` for RL, the toy pretraining
module for the base model), and scale comes from the Trainer's own flags
(``--trainer.strategy=ddp|fsdp``, ``--trainer.devices``, ``--trainer.num_nodes``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import lightning as L
from lightning.pytorch.cli import LightningCLI

import lit_flowgrpo.strategies  # noqa: F401  (registers --trainer.strategy=fsdp2)


class FlowGRPOCLI(LightningCLI):
    """LightningCLI with subclass mode for model and data and the config saved beside each run."""

    def __init__(self, args: Sequence[str] | None = None, run: bool = True) -> None:
        super().__init__(
            L.LightningModule,
            L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            args=list(args) if args is not None else None,
            run=run,
        )


def export(argv: Sequence[str]) -> None:
    """Write the LoRA adapter of a checkpoint as a diffusers-loadable folder."""
    parser = argparse.ArgumentParser(
        prog="lit-flowgrpo export",
        description="Export a checkpoint's LoRA adapter (EMA weights if the checkpoint has them) "
        "for diffusers' `pipeline.load_lora_weights`.",
    )
    parser.add_argument("--config", required=True, help="the run's config (the one `fit` used or saved)")
    parser.add_argument("--ckpt_path", required=True, help="a checkpoint written by `fit`")
    parser.add_argument("--out", required=True, help="folder to write the adapter to")
    parser.add_argument(
        "--no_ema", action="store_true", help="export the raw weights even if EMA weights exist"
    )
    opts = parser.parse_args(list(argv))

    from lit_flowgrpo.module import FlowGRPOModule

    cli = FlowGRPOCLI(args=["--config", opts.config], run=False)
    module = cli.model
    if not isinstance(module, FlowGRPOModule):
        raise SystemExit(f"--config ({opts.config}) does not train a FlowGRPOModule: nothing to export")
    module.load_trainable_checkpoint(opts.ckpt_path, use_ema=not opts.no_ema)
    module.export_lora(opts.out)
    print(f"wrote the LoRA adapter to {opts.out}")


def main(argv: Sequence[str] | None = None) -> None:
    words = list(sys.argv[1:] if argv is None else argv)
    if words and words[0] == "export":
        export(words[1:])
        return
    # LightningCLI reads sys.argv itself when given no args (and warns when given both).
    FlowGRPOCLI(args=None if argv is None else words)


if __name__ == "__main__":
    main()
