"""The package's shape, as DESIGN.md agrees it: imports run downward only, no private name is used
across files, and no file or class outgrows one reading.

Every module has a layer below. A module may import (at load time or inside a function) only modules
of its own layer or a lower one; a new module takes its place in :data:`LAYERS` when it is added, so
the table is the architecture, read top to bottom in reverse.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lit_flowgrpo"

#: Layer of each module (by its path under the package, a folder standing for every file in it,
#: the longest match winning). Lower layers know nothing of higher ones.
LAYERS: dict[str, int] = {
    # 0: pure math, errors, the data-parallel view, metrics, the lifecycle protocol
    "errors": 0,
    "export": 0,
    "sde": 0,
    "algorithms": 0,
    "attention": 0,
    "fp8": 0,
    "step_output": 0,
    "distributed": 0,
    "metrics": 0,
    "parts": 0,
    # 1: the model families, rewards, data, how networks compute
    "policies": 1,
    "rewards": 1,
    "tiny": 1,
    "performance": 1,
    "data": 1,
    "conditioning": 1,
    "image_data": 1,
    "diversity": 1,
    "kl": 1,
    "sequence_parallel": 1,
    # 2: sampling, sharding
    "rollout": 2,
    "strategies": 2,
    "placement": 2,
    "data_batch": 2,
    # 3: the copies of the weights, below the weights
    "copies": 3,
    # 4: the trained weights; from rewards to advantages
    "weights": 4,
    "advantages": 4,
    # 5: objectives and the update loop
    "objective": 5,
    "data_objective": 5,
    "visit": 5,
    "update": 5,
    # 6: the LightningModule
    "module": 6,
    # 7: what stands on the module: callbacks, the command line
    "callbacks": 7,
    # the run card's recorder: the module adds it to every fit (configure_callbacks); it reads the module
    # through its public attributes only, and imports nothing above the module
    "callbacks/run_card": 6,
    "callbacks/_module": 6,
    "run_card": 6,
    "cli_diagnosis": 7,
    "cli_checks": 7,
    "cli_resume": 7,
    "cli": 7,
    "__init__": 8,
    # the embedded shapes world: a plug-in above the core
    "toy": 9,
}


def _files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _relative(path: Path) -> str:
    return path.relative_to(PACKAGE).with_suffix("").as_posix()


def _layer(relative: str) -> int:
    """The layer of a module given as its path under the package (``callbacks/ema``, ``__init__``)."""
    parts = relative.split("/")
    for n in range(len(parts), 0, -1):
        key = "/".join(parts[:n])
        if key in LAYERS:
            return LAYERS[key]
    raise KeyError(relative)


def _module_to_relative(module: str) -> str | None:
    """``lit_flowgrpo.a.b`` → ``a/b`` when that is a file (or ``a/b/__init__``), else None."""
    if module == "lit_flowgrpo":
        return "__init__"
    if not module.startswith("lit_flowgrpo."):
        return None
    rel = module.removeprefix("lit_flowgrpo.").replace(".", "/")
    if (PACKAGE / f"{rel}.py").is_file():
        return rel
    if (PACKAGE / rel / "__init__.py").is_file():
        return f"{rel}/__init__"
    return None


def _imports(path: Path) -> list[tuple[str, str, int]]:
    """(module, name, line) of every import of a package module in ``path``, lazy ones included;
    ``from a import b`` where ``a.b`` is a module gives (``a.b``, ``""``)."""
    rel = _relative(path)
    package = rel.split("/")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                source = ".".join(["lit_flowgrpo", *base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if _module_to_relative(sub) is not None:
                    out.append((sub, "", node.lineno))
                else:
                    out.append((source, alias.name, node.lineno))
    return [(m, n, line) for m, n, line in out if _module_to_relative(m) is not None]


def test_every_module_has_a_layer() -> None:
    missing = []
    for path in _files():
        try:
            _layer(_relative(path))
        except KeyError:
            missing.append(_relative(path))
    assert not missing, f"give these modules a layer in tests/test_architecture.py LAYERS: {missing}"


def test_imports_run_downward() -> None:
    upward = []
    for path in _files():
        rel = _relative(path)
        own = _layer(rel)
        for module, _, line in _imports(path):
            target = _module_to_relative(module)
            assert target is not None
            if target == rel:
                continue
            # A package's own __init__ re-exports its files: a file importing its package's registry is
            # the same layer as the package.
            if _layer(target) > own:
                upward.append(f"{rel}.py:{line} imports {module} (layer {_layer(target)} > {own})")
    assert not upward, "imports from a lower layer to a higher one:\n  " + "\n  ".join(upward)


def test_no_private_name_is_imported_across_files() -> None:
    private = []
    for path in _files():
        for module, name, line in _imports(path):
            if name.startswith("_") and not name.startswith("__"):
                private.append(f"{_relative(path)}.py:{line} imports {module}.{name}")
    assert not private, "private names imported across files:\n  " + "\n  ".join(private)


def _core_files() -> list[Path]:
    return [p for p in _files() if _relative(p).split("/")[0] not in ("toy", "tiny")]


@pytest.mark.parametrize("limit", [700])
def test_no_core_file_is_over_the_limit(limit: int) -> None:
    long = {_relative(p): n for p in _core_files() if (n := len(p.read_text().splitlines())) > limit}
    assert not long, f"files over {limit} lines (split them by concern): {long}"


def test_the_module_stays_an_orchestrator() -> None:
    lines = len((PACKAGE / "module.py").read_text().splitlines())
    assert lines <= 450, (
        f"module.py has {lines} lines (at most 450: it orchestrates, its parts hold the work)"
    )


def test_no_class_is_over_400_lines() -> None:
    long = []
    for path in _core_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > 400:
                    long.append(f"{_relative(path)}.{node.name}: {n}")
    assert not long, f"classes over 400 lines: {long}"


def test_the_checks_find_what_they_look_for() -> None:
    # The walker sees lazy imports and private names, so the tests above can fail.
    found = {(m, n) for m, n, _ in _imports(PACKAGE / "export.py")} | {
        (m, n) for p in _files() for m, n, _ in _imports(p)
    }
    assert ("lit_flowgrpo.errors", "SettingsError") in found
    assert _layer("callbacks/ema") == LAYERS["callbacks"] and _layer("policies/sd3") == LAYERS["policies"]
