"""Every command in the README and the documentation pages runs as written from a fresh clone.

The test command is the one CI runs; each ``lit-flowgrpo`` command parses through the CLI (its config
and every flag, ``--print_config``), launched alone or under ``torchrun`` / ``srun``; every module or
script a command names exists; and the commands that fit a CPU in a test's time run as written, in the
order the pages give them, in a folder that holds only what a clone holds (``slow``). Install lines are
not run (no network here). The other code blocks (Python, YAML, JSON) and the site's own build are
``tests/test_docs.py``'s.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from lit_flowgrpo.cli import main

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# The README first, then every page of the documentation site, in a fixed order.
PAGES = [README, *sorted((REPO / "docs").rglob("*.md"))]
# Placeholders the pages ask the reader to fill in, and what this test fills in.
PLACEHOLDERS = {
    "runs/X/<name>/version_0/config.yaml": "configs/tiny_sd3.yaml",
    "--config run.yaml": "--config configs/tiny_sd3.yaml",
}
SEED = re.compile(r"=S(?=\s|$)")  # a seed the reader picks: --seed_everything=S
# The config a run saved (`lit-flowgrpo export --config runs/<recipe>/version_0/config.yaml`, after the
# page's fit of configs/<recipe>.yaml): parsed here as that recipe, which the saved one repeats.
SAVED_CONFIG = re.compile(r"runs/(\w+)/version_\d+/config\.yaml")
SETUP = ("python3 -m venv", ". .venv/bin/activate", "pip install", "pytest")
# Launchers that start `lit-flowgrpo` on every rank: the rest of the line is the CLI's.
LAUNCHERS = ("torchrun", "srun")


def _bash_blocks(page: Path = README) -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", page.read_text(), flags=re.S)


def _commands() -> list[str]:
    """Every command of every bash block of every page, once, in page order: continuation lines
    joined, comments dropped, ``&&`` split, setup steps (venv, installs, the test run) left out,
    placeholders filled in."""
    commands: dict[str, None] = {}
    for page in PAGES:
        for block in _bash_blocks(page):
            for line in block.replace("\\\n", " ").splitlines():
                for command in line.split("#", 1)[0].split("&&"):
                    command = " ".join(command.split())
                    if command and not command.startswith(SETUP):
                        for placeholder, value in PLACEHOLDERS.items():
                            command = command.replace(placeholder, value)
                        commands[SEED.sub("=0", command)] = None
    return list(commands)


def _cli_words(words: list[str]) -> list[str]:
    """The CLI's arguments of a command line: after ``lit-flowgrpo`` (or a launcher's
    ``$(which lit-flowgrpo)``)."""
    at = next(i for i, word in enumerate(words) if "lit-flowgrpo" in word)
    return words[at + 1 :]


def test_ci_runs_the_readme_test_command():
    test_command = _bash_blocks()[1]
    after_venv = test_command.split("&& ", 2)[2]  # drop `python3 -m venv .venv && . .venv/bin/activate`
    ci = (REPO / ".ci" / "run").read_text()
    assert after_venv in ci, f"the README's test command ({after_venv!r}) is not what .ci/run runs"


def test_main_job_config_exists():
    main_job = _bash_blocks()[0]
    config = re.search(r"--config (\S+)", main_job).group(1)
    assert (REPO / config).is_file()


def test_every_documented_command_parses(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(REPO)
    commands = _commands()
    kinds = {c.split()[0] for c in commands}
    # A new kind of command needs a check here.
    assert kinds <= {"lit-flowgrpo", "python", "bash", "mkdocs", *LAUNCHERS}, kinds
    assert {"lit-flowgrpo", "python", "mkdocs"} <= kinds, kinds
    for command in commands:
        words = shlex.split(command)
        if words[-1] == "&":  # started in the background (a server): a shell operator, not an argument
            words = words[:-1]
        if words[0] == "python":  # a module of the package or a script of the repo
            target = words[2] if words[1] == "-m" else words[1]
            path = REPO / (target.replace(".", "/") + ".py" if words[1] == "-m" else target)
            assert path.is_file(), command
            continue
        if words[0] == "bash":  # a script of the repo
            assert (REPO / words[1]).is_file(), command
            continue
        if words[0] == "mkdocs":  # the site's build: tests/test_docs.py runs it
            assert words[1:] == ["build", "--strict"] and (REPO / "mkdocs.yml").is_file(), command
            continue
        saved = [SAVED_CONFIG.fullmatch(w) for w in words]
        words = [
            f"configs/{m.group(1)}.yaml" if m and (REPO / "configs" / f"{m.group(1)}.yaml").is_file() else w
            for w, m in zip(words, saved, strict=True)
        ]
        with pytest.raises(SystemExit) as stop:
            main([*_cli_words(words), "--print_config"])
        assert stop.value.code in (0, None), f"{command}\n{capsys.readouterr().err[-2000:]}"


def test_the_readme_keeps_its_two_commands_first() -> None:
    """The README opens with the main job and the test command, each a block of its own."""
    run, test = _bash_blocks()[:2]
    assert run.endswith("lit-flowgrpo fit --config configs/quickstart.yaml"), run
    assert test.endswith("pytest -q && pytest -q -m slow"), test
    text = README.read_text()
    assert text.index(run) < text.index(test) < text.index("\n## ")


def _clone(tmp_path: Path) -> Path:
    """A folder with what a fresh clone has that the commands read (configs and package data)."""
    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / "lit_flowgrpo").symlink_to(REPO / "lit_flowgrpo")
    return tmp_path


@pytest.mark.slow
def test_tiny_sd3_commands_run_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import runpy
    import sys

    monkeypatch.chdir(_clone(tmp_path))
    tiny = [c for c in _commands() if "tiny_sd3" in c or "lit_flowgrpo.tiny" in c]
    assert tiny[0] == "python -m lit_flowgrpo.tiny.sd3 .tiny_models/sd3", tiny  # built before its first use
    assert any("--ckpt_path last" in c for c in tiny), tiny
    ran = 0
    for command in tiny:
        words = shlex.split(command)
        if words[:2] == ["python", "-m"]:
            monkeypatch.setattr(sys, "argv", words[2:])
            runpy.run_module(words[2], run_name="__main__")
        elif words[1] == "fit":
            main(words[1:])
        else:
            continue  # export with the filled-in placeholder: parsed above
        ran += 1
    assert ran >= 3
    assert os.path.isfile(tmp_path / ".tiny_models" / "sd3" / "model_index.json")
    assert list((tmp_path / "runs" / "tiny_sd3" / "checkpoints").glob("last*.ckpt"))


def test_a_missing_tiny_model_names_the_command_that_builds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.chdir(_clone(tmp_path))
    with pytest.raises(SystemExit):
        main(["fit", "--config", "configs/tiny_sd3.yaml"])
    err = capsys.readouterr().err
    assert (
        "build the tiny random sd3 pipeline there first with `python -m lit_flowgrpo.tiny.sd3 .tiny_models/sd3`"
        in err
    )


@pytest.mark.slow
def test_the_quickstart_smoke_command_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.chdir(_clone(tmp_path))
    (smoke,) = [
        c
        for c in _commands()
        if c.startswith("lit-flowgrpo fit --config configs/quickstart.yaml --trainer.max_steps=1 ")
    ]
    # Run in a short form, as the other README commands are: a quarter of the rollout (2 prompts x 8,
    # one micro-batch of 16); every flag of the command as written is kept and parsed.
    main(
        [
            *shlex.split(smoke)[1:],
            "--data.init_args.prompts_per_step=2",
            "--model.init_args.update.micro_batch_size=16",
        ]
    )
    out = capsys.readouterr().out
    assert re.search(
        r"held-out strict accuracy: \d\.\d{3} -> \d\.\d{3} \([+-]\d\.\d{3} ± \d\.\d{3}, \d+ paired samples; "
        r"the base model -> after 1 rollout\)",
        out,
    )
