"""The documentation site builds in strict mode, and every code block of the README and its pages parses.

The site (``mkdocs.yml``, ``docs/``) is built as ``mkdocs build --strict`` builds it, into a temporary
folder; strict mode fails on a link to a missing page or heading, a missing image, a cross-reference to
an object the API reference does not document, and a ``[[config ...]]`` line naming nothing (a bad page
of each kind is built too, to show that it fails). The configuration reference that the build generates
lists every argument of each class it names, with the docstring text ``--help`` prints, and every
``--model.init_args...`` flag a page names is one of them. Python blocks compile and their
``lit_flowgrpo`` imports resolve, YAML blocks load (a config fragment also parses through the CLI over
the main job's config), JSON blocks load. The bash blocks' commands are ``tests/test_readme.py``'s.
"""

from __future__ import annotations

import ast
import collections.abc
import html
import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_readme import PAGES, README, REPO

from lit_flowgrpo.cli import main

DOCS = REPO / "docs"
BLOCK = re.compile(r"^```(?P<lang>[^\n`]*)\n(?P<body>.*?)^```$", flags=re.S | re.M)
LANGUAGES = {"bash", "python", "yaml", "json"}
CONFIG_KEYS = {"model", "data", "trainer", "seed_everything"}  # a YAML block with these is a config


def _hook():
    """The site's hook that writes the configuration reference (``docs/hooks/config_reference.py``)."""
    spec = importlib.util.spec_from_file_location("config_reference", DOCS / "hooks" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(config),
            "--site-dir",
            str(site),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _blocks(page: Path) -> list[tuple[str, str]]:
    return [(m["lang"].strip(), m["body"]) for m in BLOCK.finditer(page.read_text())]


def _directives() -> list[tuple[str, str, str]]:
    """Every ``[[config CLASS FLAG]]`` line of the pages: (page, class path, flag)."""
    hook = _hook()
    return [
        (page.name, m["target"], m["flag"])
        for page in sorted(DOCS.rglob("*.md"))
        for m in hook.DIRECTIVE.finditer(page.read_text())
    ]


def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    """`mkdocs build --strict`, as the README and the development page give it, into a temp folder
    (about 10 s on 2 CPU cores, so in the quick set)."""
    site = tmp_path / "site"
    done = _build(REPO / "mkdocs.yml", site)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    pages = {p: p.read_text() for p in site.rglob("*.html")}
    text = "\n".join(pages.values())
    assert not re.search(r"<p>\[\[config", text)  # every reference line became its table
    # Every figure of docs/ is shown on a page.
    for png in sorted(DOCS.glob("*.png")):
        assert f'src="../{png.name}"' in text or f'src="{png.name}"' in text, f"{png.name} is on no page"
    # The README's links into docs/ reach a page, and its headings where they name one.
    for target in re.findall(r"\]\((docs/[^)\s]+)\)", README.read_text()):
        path, _, anchor = target.partition("#")
        page = Path(path).relative_to("docs")
        assert (DOCS / page).is_file(), target
        built = site / page.parent / ("" if page.stem == "index" else page.stem) / "index.html"
        if anchor:
            assert f'id="{anchor}"' in built.read_text(), f"README links to {target}: no such heading"


BAD_PAGES = {
    "a link to a page that is not there": "[the missing page](missing.md)",
    "a link to a heading that is not there": "[nowhere](#nowhere)",
    "an object the API reference does not document": "[a missing class][lit_flowgrpo.module.NoSuchModule]",
    "a settings class that does not exist": "[[config lit_flowgrpo.rollout.NoSuchSettings --model.init_args.sampler]]",
    "a reference line that is not one": "[[config lit_flowgrpo.rollout.Sampler]]",
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", [None, *BAD_PAGES], ids=["a good page", *BAD_PAGES])
def test_a_broken_link_or_reference_fails_the_build(kind: str | None, tmp_path: Path) -> None:
    """The site's own settings (hooks, plugins, strict validation) on one page: it builds, and each kind
    of breakage fails it."""
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    (plugin,) = [p for p in config["plugins"] if isinstance(p, dict) and "mkdocstrings" in p]
    handler = plugin["mkdocstrings"]["handlers"]["python"]
    handler["paths"] = [str(REPO)]
    handler["options"]["extensions"] = [str(DOCS / "hooks" / "griffe_examples.py") + ":ExampleSections"]
    config.update(docs_dir=str(tmp_path / "docs"), hooks=[str(DOCS / "hooks" / "config_reference.py")])
    config.pop("nav")
    config.pop("exclude_docs")
    (tmp_path / "docs").mkdir()
    good = "# A page\n\n## Data\n\n[the heading](#data)\n\n::: lit_flowgrpo.data.PromptDataModule\n\n### Settings\n\n"
    good += "[[config lit_flowgrpo.data.PromptDataModule --data.init_args]]\n"
    (tmp_path / "docs" / "index.md").write_text(good + ("" if kind is None else f"\n{BAD_PAGES[kind]}\n"))
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    done = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    if kind is None:
        assert done.returncode == 0, done.stderr[-5000:]
        assert "--data.init_args.group_size" in (tmp_path / "site" / "index.html").read_text()
    else:
        assert done.returncode != 0, f"{kind}: the strict build passed\n{done.stderr[-3000:]}"


def test_every_code_block_is_labelled_and_parses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(REPO)
    seen = set()
    for page in PAGES:
        for n, (lang, body) in enumerate(_blocks(page)):
            where = f"{page.relative_to(REPO)}, block {n + 1} ({lang or 'no language'})"
            assert lang in LANGUAGES, f"{where}: a block says its language, one of {sorted(LANGUAGES)}"
            seen.add(lang)
            if lang == "python":
                _check_python(body, where)
            elif lang == "json":
                json.loads(body)
            elif lang == "yaml":
                _check_yaml(body, where, tmp_path / f"block{len(seen)}_{n}.yaml", capsys)
    assert seen == LANGUAGES, seen


def _check_python(source: str, where: str) -> None:
    tree = ast.parse(source, filename=where)
    compile(tree, where, "exec")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lit_flowgrpo"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{where}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("lit_flowgrpo"):
                    importlib.import_module(alias.name)


def _check_yaml(body: str, where: str, path: Path, capsys: pytest.CaptureFixture) -> None:
    data = yaml.safe_load(body)
    if isinstance(data, dict) and set(data) <= CONFIG_KEYS:
        # A fragment of a config: the CLI reads it over the main job's config, as a second --config.
        path.write_text(body)
        with pytest.raises(SystemExit) as stop:
            main(["fit", "--config", "configs/quickstart.yaml", "--config", str(path), "--print_config"])
        assert stop.value.code in (0, None), f"{where}\n{capsys.readouterr().err[-2000:]}"


def test_the_configuration_reference_lists_every_argument() -> None:
    """Each generated table has a row per constructor argument, each with its docstring text (a
    docstring that docstring_parser cannot read leaves ``--help`` and the table without it)."""
    hook = _hook()
    directives = _directives()
    assert len(directives) >= 20, directives
    for page, target, _flag in directives:
        cls = hook.import_target(target)
        rows = hook.settings_rows(cls)
        init = cls.__init__
        parameters = [
            name
            for name, p in inspect.signature(init).parameters.items()
            if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        assert [row["key"] for row in rows] == parameters, f"{page}: {target}"
        undocumented = [row["key"] for row in rows if not row["help"].strip()]
        assert not undocumented, f"{page}: {target} has no docstring text for {undocumented}"


def test_every_settings_class_has_its_reference() -> None:
    """The classes ``lit_flowgrpo`` exports whose constructors are configured from YAML each have a table."""
    import lit_flowgrpo

    referenced = {target.rpartition(".")[2] for _, target, _ in _directives()}
    not_settings = {"GroupSampler", "PromptBatch", "Objective"}  # a sampler, a batch, an abstract base
    exported = {name for name in lit_flowgrpo.__all__ if name not in not_settings}
    assert all(inspect.isclass(getattr(lit_flowgrpo, name)) for name in exported)
    assert exported <= referenced, sorted(exported - referenced)
    assert {"DiffusionNFT", "SD3Policy", "FluxPolicy", "QwenImagePolicy", "WanPolicy"} <= referenced


def _known_flags() -> tuple[set[str], set[str]]:
    """Every flag of the generated reference, and those that take a class whose own settings follow
    under them (``--model.init_args.optimizer.init_args.lr``)."""
    hook = _hook()
    flags, open_ended = set(), set()
    for _, target, flag in _directives():
        for row in hook.settings_rows(hook.import_target(target)):
            key = f"{flag}.{row['key']}"
            flags.add(key)
            if row["group"] is None and _takes_a_class(row["type"]):
                open_ended.add(key)
    return flags, open_ended


def _takes_a_class(hint: Any) -> bool:
    """Whether a type hint admits an object with settings of its own (a class, a callable)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is collections.abc.Callable:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_takes_a_class(arg) for arg in args)
    return origin is None and isinstance(hint, type) and hint.__module__ != "builtins"


def test_every_flag_the_pages_name_is_a_setting() -> None:
    """A ``--model.init_args...``, ``--data.init_args...`` or ``--trainer.strategy...`` flag on a page is
    one the configuration reference lists (or a group of them), so a renamed setting cannot linger."""
    flags, open_ended = _known_flags()
    prefixes = {flag.rsplit(".", n)[0] for flag in flags for n in range(1, flag.count(".") + 1)}
    pattern = re.compile(r"--(?:model|data)\.init_args\.[\w.]*\w|--trainer\.strategy\.[\w.]*\w")
    wrong = []
    for page in PAGES:
        text = html.unescape(page.read_text())
        for flag in sorted(set(pattern.findall(text))):
            if flag.startswith("--trainer.strategy.") and not flag.startswith("--trainer.strategy.init_args"):
                flag = flag.replace("--trainer.strategy.", "--trainer.strategy.init_args.", 1)
            if flag in flags or flag in prefixes or any(flag.startswith(f + ".") for f in open_ended):
                continue
            wrong.append(f"{page.relative_to(REPO)}: {flag}")
    assert not wrong, "flags that are no setting:\n" + "\n".join(wrong)


def test_every_registered_reward_is_on_the_rewards_page() -> None:
    # What the package itself registers, read in a fresh interpreter: other tests register rewards of
    # their own into this process's registry.
    code = (
        "import json, lit_flowgrpo.rewards, lit_flowgrpo.toy; "  # toy: the shapes world's rewards
        "print(json.dumps(lit_flowgrpo.rewards.available_rewards()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    page = (DOCS / "rewards.md").read_text()
    missing = [name for name in json.loads(out.splitlines()[-1]) if f"`{name}`" not in page]
    assert not missing, f"registered rewards that docs/rewards.md does not name: {missing}"
