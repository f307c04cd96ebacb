"""The main job from a non-editable install, run outside the clone: the recipes and the files they name
ship with the package.

``pip install`` of the package (a copy of what a wheel is built from: ``pyproject.toml``, the README
and ``lit_flowgrpo/``) into a new virtual environment, without downloading anything: the dependencies
come from the environment running the tests, through a ``.pth`` line that adds its site-packages (a
plain path line, so that its editable install of this package is not picked up). Then
``lit-flowgrpo fit --config quickstart`` runs from an empty folder, shortened as the README's smoke
form is in ``tests/test_readme.py``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def _install(tmp_path: Path) -> Path:
    """A new environment holding a non-editable install of the package; returns its ``bin`` folder."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "lit_flowgrpo", src / "lit_flowgrpo", ignore=shutil.ignore_patterns("__pycache__"))
    env = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # This environment's packages (torch, Lightning, setuptools for the build), not its .pth files.
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
    subprocess.run([*pip, "--no-deps", "--no-build-isolation", "--no-index", str(src)], check=True)
    return env / "bin"


@pytest.mark.slow
def test_the_main_job_runs_from_a_pip_install_outside_the_clone(tmp_path: Path) -> None:
    bin_dir = _install(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed package, nothing else
    where = subprocess.run(
        [str(bin_dir / "python"), "-c", "import lit_flowgrpo; print(lit_flowgrpo.__file__)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    package = Path(where).parent
    assert package.is_relative_to(tmp_path / "venv"), where  # the installed copy, not the clone
    assert sorted(p.name for p in (package / "configs").glob("*.yaml")) == sorted(
        p.name for p in (REPO / "lit_flowgrpo" / "configs").glob("*.yaml")
    )

    done = subprocess.run(
        [
            str(bin_dir / "lit-flowgrpo"),
            "fit",
            "--config",
            "quickstart",
            # The README's smoke form (one rollout, evaluations before and after), shorter still.
            "--trainer.max_steps=1",
            "--trainer.val_check_interval=1",
            "--data.init_args.max_val_prompts=2",
            "--data.init_args.val_seeds=1",
            "--data.init_args.prompts_per_step=2",
            "--model.init_args.update.micro_batch_size=16",
            "--trainer.default_root_dir=runs/smoke",
            "--trainer.logger.init_args.name=smoke",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "held-out strict accuracy: " in done.stdout, done.stdout[-2000:]
    # The run is written where it was started, and its config names the installed package's prompts.
    (saved,) = (work / "runs" / "smoke").glob("version_*/config.yaml")
    data = yaml.safe_load(saved.read_text())["data"]["init_args"]
    assert data["train"] == os.path.realpath(package / "toy" / "assets" / "train.jsonl")
    assert list((work / "runs" / "smoke" / "checkpoints").glob("last*.ckpt"))
