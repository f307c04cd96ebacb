"""What ``--ckpt_path`` must be, checked before any class is instantiated: ``last`` resolved to the run's
newest ``last*.ckpt``; the file (or sharded folder) existing, complete and readable by torch without
unpickling code; a sharded folder only under a strategy that reads one; and the command line's settings
compared with those the checkpoint was written with.
"""

from __future__ import annotations

import os
import re
import zipfile
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_flowgrpo.cli_checks import OPTIMIZER_FLAG, import_class
from lit_flowgrpo.errors import SettingsError

__all__ = [
    "check_folder_strategy",
    "optimizer_differences",
    "pin_checkpoint_dirs",
    "resolve_ckpt_path",
    "setting_differences",
    "shape_differences",
]

# Module settings that give the checkpoint's trainable tensors their names and shapes: a resumed run
# cannot take other values, --override_checkpoint_settings or not (the weights would not load).
_SHAPE_SETTINGS = {"rank": "the LoRA rank", "target_modules": "the layers LoRA adapts"}
# `--ckpt_path` values Lightning resolves itself (checkpoint_connector); "last" is resolved here first.
_SPECIAL_CKPT_PATHS = ("best", "hpc")
_ZIP_MAGIC = b"PK\x03\x04"


def pin_checkpoint_dirs(cfg: Namespace) -> None:
    """Give each configured ModelCheckpoint without ``dirpath`` the run's fixed checkpoint folder.

    Without ``dirpath``, Lightning writes into the logger's new ``version_N`` folder of every run, so
    ``--ckpt_path last`` looks only where the new run will write and finds nothing (Lightning #18524).
    """
    root = (cfg.get("trainer") or Namespace()).get("default_root_dir")
    if not root:
        return  # no run folder given: leave Lightning's layout (and `last` says what to set)
    for callback in _checkpoint_callbacks(cfg):
        if callback.get("init_args") is None:
            callback.init_args = Namespace()
        if not _dirpath(callback):
            callback.init_args.dirpath = os.path.join(str(root), "checkpoints")


def _checkpoint_callbacks(cfg: Namespace) -> list[Namespace]:
    callbacks = (cfg.get("trainer") or Namespace()).get("callbacks") or []
    if not isinstance(callbacks, list):
        callbacks = [callbacks]
    out = []
    for callback in callbacks:
        if isinstance(callback, Namespace) and callback.get("class_path"):
            cls = import_class(callback.class_path)
            if isinstance(cls, type) and issubclass(cls, ModelCheckpoint):
                out.append(callback)
    return out


def _dirpath(callback: Namespace) -> str | None:
    init_args = callback.get("init_args")
    return init_args.get("dirpath") if isinstance(init_args, Namespace) else None


def resolve_ckpt_path(ckpt_path: str, cfg: Namespace) -> str:
    """The checkpoint ``--ckpt_path`` names (a file, or a sharded folder), checked to exist and be complete."""
    ckpt_path = str(ckpt_path)
    if ckpt_path in _SPECIAL_CKPT_PATHS or "://" in ckpt_path or ckpt_path.startswith("registry"):
        return ckpt_path  # resolved by Lightning
    if ckpt_path == "last":
        dirs = [d for d in map(_dirpath, _checkpoint_callbacks(cfg)) if d]
        if not dirs:
            raise SettingsError(
                "--ckpt_path last: no ModelCheckpoint in trainer.callbacks has a fixed folder, so the "
                "previous run's last checkpoint cannot be found. Add a ModelCheckpoint with save_last: true "
                "and set --trainer.default_root_dir (or its dirpath), or pass the checkpoint file"
            )
        found = _last_checkpoints(dirs)
        if not found:
            # Lightning would start from scratch with a warning that suggests save_last, which is set:
            # a resume that trains a new run instead is refused (a first launch has no --ckpt_path).
            raise SettingsError(
                f"--ckpt_path last: no last*.ckpt in {' or '.join(dirs)}, so there is no earlier run to "
                "resume there: drop --ckpt_path to start a new run, or set --trainer.default_root_dir to "
                "the run folder you mean to resume"
            )
        ckpt_path = max(found, key=os.path.getmtime)
    path = Path(ckpt_path)
    if not path.exists():
        raise SettingsError(
            f"--ckpt_path ({ckpt_path}) does not exist: give a checkpoint written by `fit`, or `last`"
        )
    _check_complete(path)
    return ckpt_path


def _last_checkpoints(dirs: list[str]) -> list[str]:
    # ModelCheckpoint's own naming: last.ckpt, or last-v1.ckpt when a new run finds one already there.
    pattern = re.compile(rf"^{re.escape(ModelCheckpoint.CHECKPOINT_NAME_LAST)}(-v?\d+)?$")
    found = []
    for d in dirs:
        if os.path.isdir(d):
            found += [
                os.path.join(d, name)
                for name in os.listdir(d)
                if name.endswith(ModelCheckpoint.FILE_EXTENSION)
                and pattern.match(name[: -len(ModelCheckpoint.FILE_EXTENSION)])
            ]
    return found


def _check_complete(path: Path, *, holds_weights: bool = True) -> None:
    """A torch checkpoint is a zip archive whose central directory is written last: reading it is
    cheap and fails on a file cut short, where ``torch.load`` would only say ``OSError: [Errno 22]``.
    A sharded checkpoint is a folder: see :func:`_check_complete_folder`."""
    if path.is_dir():
        _check_complete_folder(path)
        return
    if path.stat().st_size == 0:
        raise SettingsError(
            f"--ckpt_path ({path}) is empty: the save was interrupted; use an earlier checkpoint"
        )
    with open(path, "rb") as f:
        magic = f.read(len(_ZIP_MAGIC))
    if magic != _ZIP_MAGIC:
        # torch.save has written zip archives since torch 1.6, and Lightning always does; anything else
        # would reach torch.load, whose refusal suggests loading the file unsafely.
        raise SettingsError(
            f"--ckpt_path ({path}) is not a checkpoint (a checkpoint is a zip archive written by torch.save; "
            "this file is not one): give a checkpoint written by `fit`, or `last`"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except zipfile.BadZipFile:
        raise SettingsError(
            f"--ckpt_path ({path}) is truncated or corrupt (its zip directory is unreadable): the save was "
            "probably interrupted; use an earlier checkpoint"
        ) from None
    if not any(name.endswith("/data.pkl") for name in names):
        raise SettingsError(
            f"--ckpt_path ({path}) is a zip archive but not a torch checkpoint (it has no data.pkl): give a "
            "checkpoint written by `fit`, or `last`"
        )
    _check_loadable(path, holds_weights)


def _check_loadable(path: Path, holds_weights: bool) -> None:
    """A checkpoint that torch reads with ``weights_only=True``, as Lightning will, and that holds a
    Lightning state dict (``holds_weights``; a sharded folder's ``meta.pt`` holds the rest). Memory-mapped:
    only the small pickled structure is read here."""
    import pickle

    import torch

    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as err:
        # torch's own message for a refused object suggests weights_only=False, i.e. running the pickled
        # code of a file of unknown origin: not a fix to offer.
        reason = str(err).strip().splitlines()[-1] if "Weights only load failed" not in str(err) else ""
        raise SettingsError(
            f"--ckpt_path ({path}) cannot be read as a checkpoint"
            + (f" ({reason})" if reason else " (it holds objects other than tensors and plain data)")
            + ": give a checkpoint written by `fit`, or `last`"
        ) from None
    if not isinstance(checkpoint, dict) or (holds_weights and "state_dict" not in checkpoint):
        raise SettingsError(
            f"--ckpt_path ({path}) is a torch file but not a Lightning checkpoint (no state_dict): give a "
            "checkpoint written by `fit`, or `last`"
        )


# torch.distributed.checkpoint's index of a sharded checkpoint folder (which entry is in which file).
_DCP_INDEX = ".metadata"


def _check_complete_folder(path: Path) -> None:
    """A sharded checkpoint folder (``--trainer.strategy=fsdp2``): ``meta.pt`` (everything but the
    tensors), torch.distributed.checkpoint's index ``.metadata``, and every shard file the index names,
    at least as long as the entries it places in it. Checked here because a missing shard otherwise
    surfaces mid-load, on every rank, as a bare ``FileNotFoundError`` or a short read."""
    import torch.distributed.checkpoint as dcp
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    fix = "copy the whole folder, or use an earlier checkpoint"
    meta = path / _METADATA_FILENAME
    if not meta.is_file():
        raise SettingsError(
            f"--ckpt_path ({path}) is a folder without {_METADATA_FILENAME} (the run's state besides the "
            f"weights), so not a complete sharded checkpoint: {fix}"
        )
    _check_complete(meta, holds_weights=False)
    if not (path / _DCP_INDEX).is_file():
        raise SettingsError(
            f"--ckpt_path ({path}) has no {_DCP_INDEX} (the index of its weight shards): the save was "
            f"interrupted or the folder is incomplete; {fix}"
        )
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # a pickle cut short or damaged: whatever unpickling raises
        raise SettingsError(
            f"--ckpt_path ({path}): its {_DCP_INDEX} is unreadable ({type(err).__name__}): {fix}"
        ) from None
    needed: dict[str, int] = {}  # shard file -> the bytes its entries reach
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    missing = sorted(name for name in needed if not (path / name).is_file())
    if missing:
        raise SettingsError(
            f"--ckpt_path ({path}) is missing {', '.join(missing)}, listed in its {_DCP_INDEX} "
            f"({len(needed)} shard files in all): {fix}"
        )
    short = sorted(name for name, size in needed.items() if (path / name).stat().st_size < size)
    if short:
        raise SettingsError(
            f"--ckpt_path ({path}): {', '.join(short)} is shorter than its {_DCP_INDEX} says (truncated): {fix}"
        )


def check_folder_strategy(path: Path, cfg: Namespace) -> None:
    """A sharded checkpoint folder loads only under a strategy that reads one (FSDP2 here); the others
    would fail in Lightning's loader after the model is built, with a message about files."""
    if not path.is_dir():
        return
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, StrategyRegistry

    strategy = (cfg.get("trainer") or Namespace()).get("strategy") or "auto"
    if isinstance(strategy, Namespace) and strategy.get("class_path"):
        cls, name = import_class(strategy.class_path), strategy.class_path
    else:
        name = str(strategy)
        cls = StrategyRegistry[name]["strategy"] if name in StrategyRegistry else None
    if isinstance(cls, type) and issubclass(cls, (ModelParallelStrategy, FSDPStrategy)):
        return
    raise SettingsError(
        f"--ckpt_path ({path}) is a sharded checkpoint folder, which --trainer.strategy={name} cannot "
        "load: resume with --trainer.strategy=fsdp2 (on any number of devices), or from a checkpoint file "
        "(saved with --trainer.strategy.save_distributed_checkpoint=false)"
    )


def setting_differences(given: Any, overlaid: Any) -> list[tuple[str, Any, Any]]:
    """(key under ``model``, command-line value, checkpoint value) for every leaf the overlay changed."""
    if not isinstance(given, Namespace) or not isinstance(overlaid, Namespace):
        return [] if given == overlaid else [("", given, overlaid)]
    before, after = dict(given.items()), dict(overlaid.items())
    return [
        (key, before.get(key), after.get(key))
        for key in sorted(set(before) | set(after))
        if before.get(key) != after.get(key)
    ]


def shape_differences(given: Any, saved: Any) -> list[str]:
    """The shape-defining module settings (LoRA or not, its rank, its targets) in which the command line
    differs from the checkpoint, each said as ``flag (command line X, checkpoint Y)``."""
    if not isinstance(given, Namespace) or not isinstance(saved, Namespace):
        return []
    new, old = given.get("init_args.weights.lora"), saved.get("init_args.weights.lora")
    if (new is None) != (old is None):

        def kind(lora: Any) -> str:
            return "null, a full fine-tune" if lora is None else "a LoRA adapter"

        return [f"--model.init_args.weights.lora (command line {kind(new)}, checkpoint {kind(old)})"]
    if new is None:
        return []
    return [
        f"--model.init_args.weights.lora.{key} (command line {new.get(key)!r}, checkpoint {old.get(key)!r}): {what}"
        for key, what in _SHAPE_SETTINGS.items()
        if new.get(key) != old.get(key)
    ]


def optimizer_differences(cfg: Namespace) -> list[tuple[str, Any, Any]]:
    """(flag, command-line value, checkpoint value) of the optimizer settings the checkpoint's optimizer
    state will restore over the command line's (Lightning loads its ``param_groups``, lr included)."""
    optimizer = cfg.get("model.init_args.optimizer") if cfg.get("model") else None
    path = Path(str(cfg.ckpt_path))
    if not isinstance(optimizer, Namespace):
        return []
    group = _saved_param_group(path)
    if group is None:
        return []
    out = []
    for key, value in (optimizer.get("init_args") or Namespace()).items():
        # With a scheduler the group's lr is the scheduled one; `initial_lr` is the configured one.
        saved = group.get("initial_lr", group.get("lr")) if key == "lr" else group.get(key, value)
        if isinstance(saved, (list, tuple)):
            saved, value = tuple(saved), tuple(value) if isinstance(value, (list, tuple)) else value
        if saved != value:
            out.append((f"{OPTIMIZER_FLAG}.init_args.{key}", value, saved))
    return out


def _saved_param_group(path: Path) -> dict[str, Any] | None:
    """The first optimizer's first parameter group as the checkpoint (file or sharded folder) saved it,
    without its tensors; None when there is none to compare."""
    import torch

    if path.is_file():
        try:  # memory-mapped: only the small param_groups are read
            states = torch.load(path, map_location="cpu", mmap=True, weights_only=True).get(
                "optimizer_states"
            )
        except Exception:  # not a checkpoint torch can map (legacy format): nothing to compare
            return None
        return dict(states[0]["param_groups"][0]) if states and states[0].get("param_groups") else None
    if not path.is_dir():
        return None
    # A folder's meta.pt has no optimizer state: torch.distributed.checkpoint keeps each param-group
    # setting as its own small pickled entry, which its index locates; only those bytes are read.
    import warnings

    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(path))
    prefix = "optimizer_0.param_groups.0."
    wanted = {
        key: None
        for key in reader.read_metadata().state_dict_metadata
        if key.startswith(prefix) and key != f"{prefix}params"  # params: the parameters' names
    }
    if not wanted:
        return None
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(wanted, storage_reader=reader, no_dist=True)
    return {key.removeprefix(prefix): value for key, value in wanted.items()}
