"""The package's import structure: the core loads no toy module, and no module imports itself back."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lit_flowgrpo"


def test_core_imports_no_toy_module() -> None:
    # A fresh interpreter: this test process has imported the toy world already.
    code = (
        "import json, pkgutil, sys, importlib\n"
        "import lit_flowgrpo.policies as policies, lit_flowgrpo.rewards as rewards\n"
        "for package in (policies, rewards):\n"
        "    for info in pkgutil.iter_modules(package.__path__, package.__name__ + '.'):\n"
        "        importlib.import_module(info.name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('lit_flowgrpo'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert (
        "lit_flowgrpo.policies.sd3" in loaded and "lit_flowgrpo.rewards.ocr" in loaded
    )  # it did import them
    toy = [m for m in loaded if m == "lit_flowgrpo.toy" or m.startswith("lit_flowgrpo.toy.")]
    assert not toy, f"the core loaded toy modules: {toy}"


def test_loading_a_policy_prints_no_notice_about_image_processors(tiny_sd3_path: str) -> None:
    # A fresh interpreter: transformers notes a missing image backend once per process.
    code = (
        "import sys\n"
        "from lit_flowgrpo.policies import SD3Policy\n"
        "SD3Policy(sys.argv[1], dtype='float32', max_sequence_length=16).load()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, tiny_sd3_path], capture_output=True, text=True, check=True
    )
    assert "ImageProcessor" not in done.stderr, done.stderr


def test_toy_import_registers_shapes_and_exports_its_policy() -> None:
    import lit_flowgrpo.toy
    from lit_flowgrpo.policies import FlowPolicy
    from lit_flowgrpo.rewards import available_rewards

    assert "shapes" in available_rewards()
    assert issubclass(lit_flowgrpo.toy.ToyPolicy, FlowPolicy)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules that ``path`` imports when it is loaded.

    ``from pkg import sub`` is an edge to the submodule ``pkg.sub``; ``from pkg import name`` an edge
    to ``pkg`` itself. The parent packages that importing ``a.b.c`` also initialises are not edges:
    Python binds a package before running its ``__init__``, so a sibling import through a parent
    that is still initialising works, while a name taken from it does not (and is an edge here).
    """
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for stmt in _load_time_imports(ast.parse(path.read_text(encoding="utf-8")).body):
        if isinstance(stmt, ast.Import):
            found |= {alias.name for alias in stmt.names}
            continue
        if stmt.level:  # relative: `from . import x` in a.b.c (package a.b) means `from a.b import x`
            parts = package.split(".")
            parts = parts[: len(parts) - (stmt.level - 1)]
            source = ".".join([*parts, stmt.module] if stmt.module else parts)
        else:
            source = stmt.module or ""
        subs = {f"{source}.{alias.name}" for alias in stmt.names} & modules
        found |= subs or {source}
    return {m for m in found if m in modules and m != name}


def _load_time_imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements that run when the module loads: not in functions, not under TYPE_CHECKING."""
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            yield stmt
        elif isinstance(stmt, ast.If):
            if not _is_type_checking(stmt.test):
                yield from _load_time_imports(stmt.body)
            yield from _load_time_imports(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, *(h.body for h in stmt.handlers), stmt.orelse, stmt.finalbody):
                yield from _load_time_imports(block)
        elif isinstance(stmt, (ast.With, ast.ClassDef)):  # class bodies run at load time too
            yield from _load_time_imports(stmt.body)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    return {name: _imports(path, modules) for name, path in files.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_find_cycle_finds_one() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles() -> None:
    graph = _import_graph()
    assert graph["lit_flowgrpo.policies.qwenimage"] >= {"lit_flowgrpo.policies.packed"}  # edges are found
    assert "lit_flowgrpo.policies.flux" not in graph["lit_flowgrpo.policies.qwenimage"]
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


#: The stages FlowGRPOModule orchestrates, and what they stand on: none may import the module above them.
STAGES = (
    "advantages",
    "algorithms",
    "data",
    "distributed",
    "errors",
    "export",
    "copies",
    "parts",
    "weights",
    "metrics",
    "objective",
    "performance",
    "rollout",
    "sde",
    "step_output",
    "strategies",
    "update",
    "policies",
    "rewards",
)


def _every_import(path: Path) -> set[str]:
    """Every module ``path`` names in an import, at load time or inside a function; ``from pkg import
    name`` counts as ``pkg.name`` too (``from lit_flowgrpo import FlowGRPOModule``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_no_stage_imports_the_module() -> None:
    from lit_flowgrpo import _EXPORTS

    above = {"lit_flowgrpo.module", "lit_flowgrpo.cli", "lit_flowgrpo.FlowGRPOModule"}
    above |= {f"lit_flowgrpo.{name}" for name, where in _EXPORTS.items() if where == "lit_flowgrpo.module"}
    checked = 0
    for stage in STAGES:
        target = PACKAGE / stage
        for path in sorted(target.rglob("*.py")) if target.is_dir() else [target.with_suffix(".py")]:
            bad = _every_import(path) & above
            assert not bad, f"{_module_name(path)} imports {sorted(bad)}, which stand above it"
            checked += 1
    assert checked > len(STAGES)  # the packages' files were found too
