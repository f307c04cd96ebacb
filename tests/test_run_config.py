"""The run's saved config.yaml keeps every setting, None values included, through jsonargparse's
current API: no deprecated argument of ours (jsonargparse 5.0 removes ``skip_none``)."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import yaml
from cli_helpers import PROMPTS, TINY
from jsonargparse import Namespace

from lit_flowgrpo.cli import FlowGRPOCLI, LogRunConfig


def test_saved_config_keeps_none_values_without_deprecated_arguments(
    tiny_sd3_path: str, tmp_path: Path
) -> None:
    cli = FlowGRPOCLI(
        args=[
            "--config",
            str(TINY),
            f"--model.init_args.policy.init_args.pretrained={tiny_sd3_path}",
            f"--data.init_args.train={PROMPTS}",
            f"--data.init_args.val={PROMPTS}",
        ],
        run=False,
    )
    trainer = L.Trainer(logger=False, default_root_dir=str(tmp_path), enable_progress_bar=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        LogRunConfig(cli.parser, cli.config).setup(trainer, cli.model, "fit")
    ours = [w for w in caught if w.filename.endswith(str(Path("lit_flowgrpo", "cli.py")))]
    assert not ours, [str(w.message) for w in ours]

    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    # None-valued settings are written out, not dropped: the file is the whole resolved config.
    assert saved["model"]["init_args"]["lr_scheduler"] is None
    assert saved["model"]["init_args"]["weights"]["lora"]["target_modules"] is None
    # ... and it is the config that was parsed.
    assert saved == yaml.safe_load(cli.parser.dump(cli.config, skip_validation=True, skip_unset=False))
    assert isinstance(cli.config, Namespace)
