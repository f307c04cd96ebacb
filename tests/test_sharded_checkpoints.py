"""`--ckpt_path` naming a sharded checkpoint folder (`--trainer.strategy=fsdp2`): the resume-settings
guard reads the folder as it reads a file, and an incomplete folder or a strategy that cannot read one
is refused, naming the flag, before anything is instantiated.

The folder comes from a real `lit-flowgrpo fit` of the tiny SD3 config under fsdp2 on one CPU process
(FSDP2 on a one-rank mesh: DTensor parameters, a torch.distributed.checkpoint folder), run once.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_helpers import tiny_fit_args

from lit_flowgrpo.cli import FlowGRPOCLI, main

KL_FLAG, KL_SAVED = "--model.init_args.kl.coef", 0.04
LR_FLAG, LR_SAVED = "--model.init_args.optimizer.init_args.lr", 3e-4


def _fit_args(pretrained: str, root: Path, *extra: str) -> list[str]:
    """One rollout (2 optimizer steps) of configs/tiny_sd3.yaml under fsdp2, validated (with the EMA
    swapped in, as configured there) and checkpointed into ``root``/checkpoints."""
    return tiny_fit_args(pretrained, root, "--trainer.strategy=fsdp2", *extra)


@pytest.fixture(scope="module")
def sharded_run(tiny_sd3_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("sharded_run")
    # A process of its own: the run opens a process group, and main() ends a distributed run's process.
    proc = subprocess.run(
        [sys.executable, "-m", "lit_flowgrpo.cli", *_fit_args(tiny_sd3_path, root)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    ckpt = root / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir() and (ckpt / "meta.pt").is_file()
    return {"root": root, "pretrained": tiny_sd3_path, "ckpt": ckpt}


def _forbid_instantiation(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Any) -> None:
        raise AssertionError("the CLI instantiated classes before refusing the input")

    monkeypatch.setattr(FlowGRPOCLI, "instantiate_classes", refuse)


def _main_error(argv: list[str], capfd: pytest.CaptureFixture[str]) -> str:
    """The one-line error ``main`` prints before exiting with status 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    out, err = capfd.readouterr()
    assert "Traceback" not in err
    return out + err


def _copy(sharded_run: dict[str, Any], tmp_path: Path) -> Path:
    folder = tmp_path / "copy.ckpt"
    shutil.copytree(sharded_run["ckpt"], folder)
    return folder


# --------------------------------------------------------------------------------------------------
# The resume-settings guard reads a folder's meta.pt and optimizer entries
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_changed_settings_on_resume_from_a_folder_are_refused_or_applied(
    sharded_run: dict[str, Any],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root, pretrained = sharded_run["root"], sharded_run["pretrained"]
    ckpt = f"--ckpt_path={sharded_run['ckpt']}"

    with monkeypatch.context() as m:
        _forbid_instantiation(m)
        # A module setting: refused unless overridden.
        text = _main_error(_fit_args(pretrained, root, ckpt, f"{KL_FLAG}=0.5"), capfd)
        assert f"--ckpt_path ({sharded_run['ckpt']}) was written with other settings" in text
        assert f"{KL_FLAG}: command line 0.5, checkpoint {KL_SAVED}" in text
        assert "--override_checkpoint_settings=true" in text
        # The optimizer's: refused, overridden or not (its state would restore the saved lr).
        for override in ([], ["--override_checkpoint_settings=true"]):
            text = _main_error(_fit_args(pretrained, root, ckpt, f"{LR_FLAG}=0.001", *override), capfd)
            assert f"{LR_FLAG}: command line 0.001, checkpoint {LR_SAVED}" in text
            assert "cannot change them" in text

    # The same settings pass the guard (the classes are about to be built from them).
    with monkeypatch.context() as m:
        m.setattr(FlowGRPOCLI, "instantiate_classes", _reached)
        with pytest.raises(_Reached) as reached:
            main(_fit_args(pretrained, root, ckpt))
        assert reached.value.config.fit.model.init_args.kl.coef == KL_SAVED

    # Overridden, the run resumes from the folder (`last` finds it) with the command line's value; its
    # max_steps is reached, so it restores the checkpoint and stops.
    resume = [
        *_fit_args(pretrained, root, "--ckpt_path=last", f"{KL_FLAG}=0.5"),
        "--override_checkpoint_settings=true",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "lit_flowgrpo.cli", *resume], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert f"{KL_FLAG}: command line 0.5, checkpoint {KL_SAVED}" in proc.stderr
    assert "Restored all states from the checkpoint" in proc.stderr + proc.stdout
    saved = yaml.safe_load((root / "lightning_logs" / "version_1" / "config.yaml").read_text())
    assert saved["model"]["init_args"]["kl"]["coef"] == 0.5
    assert saved["ckpt_path"] == str(sharded_run["ckpt"])


class _Reached(Exception):
    def __init__(self, config: Any) -> None:
        super().__init__("instantiation reached")
        self.config = config


def _reached(self: FlowGRPOCLI) -> None:
    raise _Reached(self.config)


# --------------------------------------------------------------------------------------------------
# Refused before anything is instantiated: an incomplete folder, a strategy that cannot read one
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("__0_0.distcp", r"is missing __0_0\.distcp, listed in its \.metadata \(1 shard files in all\)"),
        ("meta.pt", r"is a folder without meta\.pt"),
        (".metadata", r"has no \.metadata \(the index of its weight shards\)"),
        ("truncate", r"__0_0\.distcp is shorter than its \.metadata says \(truncated\)"),
    ],
)
def test_incomplete_folder_is_refused_naming_the_file(
    sharded_run: dict[str, Any],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    damage: str,
    message: str,
) -> None:
    _forbid_instantiation(monkeypatch)
    folder = _copy(sharded_run, tmp_path)
    if damage == "truncate":
        shard = folder / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    else:
        (folder / damage).unlink()
    text = _main_error(_fit_args(sharded_run["pretrained"], tmp_path, f"--ckpt_path={folder}"), capfd)
    (line,) = [line for line in text.splitlines() if line.strip()]  # one message
    assert line.startswith(f"lit-flowgrpo: error: --ckpt_path ({folder})")
    assert re.search(message, line), line
    assert "copy the whole folder, or use an earlier checkpoint" in line


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [None, "ddp"])
def test_folder_under_another_strategy_is_refused_naming_fsdp2(
    sharded_run: dict[str, Any],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    strategy: str | None,
) -> None:
    _forbid_instantiation(monkeypatch)
    args = _fit_args(sharded_run["pretrained"], tmp_path, f"--ckpt_path={sharded_run['ckpt']}")
    args.remove("--trainer.strategy=fsdp2")  # the config's own: the default single-device strategy
    if strategy is not None:
        args.append(f"--trainer.strategy={strategy}")
    text = _main_error(args, capfd)
    assert f"--ckpt_path ({sharded_run['ckpt']}) is a sharded checkpoint folder" in text
    assert f"--trainer.strategy={strategy or 'auto'} cannot load" in text
    assert "resume with --trainer.strategy=fsdp2" in text
