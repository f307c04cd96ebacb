"""Where an export may go, and how it gets there: whole or not at all.

diffusers' ``save_pretrained`` / ``save_lora_weights`` log one line and return when handed a file, and
write into an existing folder over whatever it holds, so an export could report success having written
nothing, or leave one export's files mixed with another's. Here the destination is checked before any
weight is read, the export is written into a new sibling folder, checked, and only then moved into
place: a crash or a failed check leaves the destination as it was.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

__all__ = ["destination_problems", "write_folder"]


def destination_problems(
    path: str, overwrite: bool, *, path_name: str = "path", overwrite_name: str = "overwrite"
) -> list[str]:
    """What stops an export from being written to the folder ``path`` (empty: nothing does).

    Args:
        path: the folder to write.
        overwrite: replace what the folder holds (the previous export) with the new export.
        path_name, overwrite_name: how the caller names the two settings (``--out``, ``--overwrite``
            on the command line), for the messages.
    """
    target = Path(path)
    if target.exists() and not target.is_dir():
        return [f"{path_name} ({path}) is a file: give a folder to write the export into"]
    if target.is_dir():
        entries = sorted(os.listdir(target))
        if entries and not overwrite:
            shown = ", ".join(entries[:3]) + (", …" if len(entries) > 3 else "")
            return [
                f"{path_name} ({path}) is not empty (it holds {shown}): pass {overwrite_name}=true to replace "
                "its contents with this export, or give a new or empty folder"
            ]
    # The export is written into a new folder beside `path` and moved into place, so the folder that
    # holds `path` (or the nearest one that exists, under which the rest is created) must take entries.
    parent = target.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return [f"{path_name} ({path}) cannot be created: {parent} is a file, not a folder"]
    # Tried, not judged from the permission bits: os.access answers yes to root on a read-only folder,
    # and to anyone on a filesystem that takes no new entries (/proc); the probe is removed at once.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{target.name}.probe-", dir=parent))
    except OSError as err:
        return [
            f"{path_name} ({path}) cannot be written: a folder cannot be created in {parent} ({err.strerror})"
        ]
    return []


def write_folder(
    path: str, overwrite: bool, write: Callable[[str], None], check: Callable[[str], None]
) -> None:
    """Make ``path`` hold exactly what ``write(folder)`` writes, or leave it as it was.

    ``write`` fills a new folder beside ``path``; ``check`` raises if what it wrote is incomplete; then
    the previous ``path`` (if any) is moved aside, the new folder takes its name, and the previous one
    is deleted. POSIX renames a folder atomically but cannot swap two, so a crash between the two
    renames leaves ``path`` absent and both folders beside it (hidden, named after it), never a
    half-written or mixed ``path``.

    Raises:
        ValueError: ``destination_problems`` found one.
    """
    problems = destination_problems(path, overwrite)
    if problems:
        raise ValueError("; ".join(problems))
    target = Path(path).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    staging = target.parent / f".{target.name}.partial-{tag}"
    previous = target.parent / f".{target.name}.previous-{tag}"
    staging.mkdir()  # a plain mkdir: the folder gets the usual permissions (mkdtemp's are 0700)
    try:
        write(str(staging))
        check(str(staging))
        if target.exists():
            os.rename(target, previous)
        try:
            os.rename(staging, target)
        except BaseException:
            if previous.exists() and not target.exists():
                os.rename(previous, target)
            raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(staging)
    shutil.rmtree(previous, ignore_errors=True)
