"""`lit-flowgrpo export` writes a whole export or nothing, and says so.

Destinations that cannot take an export (a file, a folder under a file, a folder holding an earlier
export without `--overwrite`) are refused before the checkpoint is read, as one message naming
`--out`; `--overwrite=true` replaces the earlier export wholly, a LoRA adapter over a full fine-tune
included; an export that wrote nothing, or crashed half-way, leaves the destination as it was.

Every run here is the tiny SD3 config (`configs/tiny_sd3.yaml`) on the tiny pipeline, in-process.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import PROMPTS, TINY, tiny_fit_args
from safetensors.torch import load_file

from lit_flowgrpo.cli import FlowGRPOCLI, main

LORA_FILE = "pytorch_lora_weights.safetensors"
CARD_FILE = "README.md"  # the run card (lit_flowgrpo.run_card), beside the weights


def _fit(pretrained: str, root: Path, *extra: str) -> dict[str, Path]:
    """One rollout (2 optimizer steps), checkpointed, logged to CSV under ``root``."""
    FlowGRPOCLI(args=tiny_fit_args(pretrained, root, *extra))
    return {"config": next(root.rglob("config.yaml")), "ckpt": root / "checkpoints" / "last.ckpt"}


@pytest.fixture(scope="module")
def lora_run(tiny_sd3_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _fit(tiny_sd3_path, tmp_path_factory.mktemp("lora_run"))


@pytest.fixture(scope="module")
def full_run(tiny_sd3_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    # A full fine-tune needs a KL reference copy unless β = 0.
    return _fit(
        tiny_sd3_path,
        tmp_path_factory.mktemp("full_run"),
        "--model.init_args.weights.lora=null",
        "--model.init_args.kl.coef=0.0",
    )


def _export(run: dict[str, Path], out: Path, *extra: str) -> None:
    main(
        ["export", "--config", str(run["config"]), "--ckpt_path", str(run["ckpt"]), "--out", str(out), *extra]
    )


def _refused(run: dict[str, Path], out: Path, capfd: pytest.CaptureFixture[str], *extra: str) -> str:
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        _export(run, out, *extra)
    assert exit_info.value.code == 2
    out_text, err = capfd.readouterr()
    assert "exported" not in out_text + err
    return err


def _forbid_instantiation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refusals must come before the module is built, so before the checkpoint is read."""

    def refuse(self: Any) -> None:
        raise AssertionError("the CLI instantiated classes before refusing --out")

    monkeypatch.setattr(FlowGRPOCLI, "instantiate_classes", refuse)


def _entries(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# --------------------------------------------------------------------------------------------------
# Refused destinations: one message naming --out, before the checkpoint is read
# --------------------------------------------------------------------------------------------------


def test_out_naming_a_file_is_refused(
    lora_run: dict[str, Path],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _forbid_instantiation(monkeypatch)
    out = tmp_path / "adapter.safetensors"
    out.write_bytes(b"not a folder")
    err = _refused(lora_run, out, capfd)
    assert f"--out ({out}) is a file: give a folder" in err
    assert err.count("--out") == 1 and "Traceback" not in err
    assert out.read_bytes() == b"not a folder"


def test_out_under_a_file_is_refused(
    lora_run: dict[str, Path],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _forbid_instantiation(monkeypatch)
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file where a folder would have to be")
    out = blocker / "adapters" / "lora"
    err = _refused(lora_run, out, capfd)
    assert f"--out ({out}) cannot be created: {blocker} is a file" in err
    assert "Traceback" not in err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_out_where_no_folder_can_be_created_is_refused(
    lora_run: dict[str, Path], capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """/proc takes no new folder, whoever asks, though its permission bits let root write: found by
    trying, before the checkpoint is read, instead of a traceback naming the staging folder after it."""
    _forbid_instantiation(monkeypatch)
    out = Path("/proc/lit-flowgrpo-export")
    err = _refused(lora_run, out, capfd)
    assert f"--out ({out}) cannot be written: a folder cannot be created in /proc (" in err
    assert ".partial" not in err and ".probe" not in err and "Traceback" not in err


def test_out_holding_an_earlier_export_needs_overwrite(
    lora_run: dict[str, Path],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "lora"
    _export(lora_run, out)
    before = _entries(out)
    assert list(before) == [CARD_FILE, LORA_FILE]

    _forbid_instantiation(monkeypatch)
    err = _refused(lora_run, out, capfd)
    assert f"--out ({out}) is not empty (it holds {CARD_FILE}, {LORA_FILE}): pass --overwrite=true" in err
    assert _entries(out) == before


def test_an_empty_existing_folder_takes_the_export(lora_run: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "lora"
    out.mkdir()
    _export(lora_run, out)
    assert list(_entries(out)) == [CARD_FILE, LORA_FILE]


# --------------------------------------------------------------------------------------------------
# --overwrite: the new export replaces the old one wholly
# --------------------------------------------------------------------------------------------------


def test_overwrite_replaces_a_full_finetune_with_an_adapter_wholly(
    lora_run: dict[str, Path], full_run: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "exported"
    _export(full_run, out)
    assert "config.json" in _entries(out)

    fresh = tmp_path / "fresh"
    _export(lora_run, fresh)
    with caplog.at_level(logging.INFO):
        _export(lora_run, out, "--overwrite=true")
    assert f"the LoRA adapter to {out}" in caplog.text
    # Exactly what an export into a new folder writes: nothing of the full fine-tune is left.
    assert list(_entries(out)) == list(_entries(fresh)) == [CARD_FILE, LORA_FILE]
    assert load_file(out / LORA_FILE).keys() == load_file(fresh / LORA_FILE).keys()
    # No staging or previous folder is left beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "fresh"]


# --------------------------------------------------------------------------------------------------
# The Python API: the same checks; nothing reported written that was not
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def module(lora_run: dict[str, Path], tiny_sd3_path: str) -> Any:
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
    cli.model.load_trainable_checkpoint(str(lora_run["ckpt"]))
    return cli.model


def test_python_export_refuses_a_file(module: Any, tmp_path: Path) -> None:
    out = tmp_path / "adapter.safetensors"
    out.write_bytes(b"not a folder")
    with pytest.raises(ValueError, match=r"path \(.*adapter.safetensors\) is a file"):
        module.export(str(out))
    assert out.read_bytes() == b"not a folder"


def test_an_export_that_writes_nothing_fails_and_leaves_no_folder(
    module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What diffusers' save_lora_weights does when it declines a path: log a line and return.
    monkeypatch.setattr(type(module.policy), "save_lora", lambda self, path, state, metadata: None)
    out = tmp_path / "lora"
    with pytest.raises(RuntimeError, match=f"wrote no {LORA_FILE}"):
        module.export(str(out))
    assert list(tmp_path.iterdir()) == []


def test_a_crash_mid_export_leaves_the_earlier_export(
    module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "lora"
    module.export(str(out))
    before = _entries(out)

    def crash(self: Any, path: str, state: Any, metadata: Any) -> None:
        (Path(path) / LORA_FILE).write_bytes(b"half an adapter")
        raise OSError("disk full")

    monkeypatch.setattr(type(module.policy), "save_lora", crash)
    with pytest.raises(OSError, match="disk full"):
        module.export(str(out), overwrite=True)
    assert _entries(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["lora"]
