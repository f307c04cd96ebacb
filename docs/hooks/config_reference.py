"""MkDocs hook: the configuration reference, made from the parser that ``lit-flowgrpo fit --help`` prints.

A line of a page that reads ``[[config CLASS FLAG]]`` becomes a table of the settings of ``CLASS`` (a
dotted import path) as the command line spells them under ``FLAG``: one row per constructor argument,
with its type, its default and its docstring text. The rows come from jsonargparse's
``add_class_arguments``, the call LightningCLI makes for ``--model`` and ``--data``, so the table is the
signature and the Google-style docstring of the code being documented, read the way ``--help`` reads
them; nothing is written by hand, and nothing can drift. An argument that is itself a settings group
(``sampler``, ``kl.reference``) is one row pointing at its own table where the page has one.

The hook also turns the docstrings' Sphinx roles (``:class:`~lit_flowgrpo.kl.KLSettings```), which
Python's tools read but Markdown does not, into code spans that link to the API reference where the
object is documented there.

A directive that names nothing importable, a flag that does not start with ``--``, or a directive left
in a page fails the build.
"""

from __future__ import annotations

import collections.abc
import datetime
import html
import importlib
import json
import re
import types
import typing
from typing import Any

import yaml
from mkdocs.exceptions import PluginError

DIRECTIVE = re.compile(r"^\[\[config (?P<target>[\w.]+) (?P<flag>--[\w.]+)\]\]$", flags=re.M)
ANY_DIRECTIVE = re.compile(r"^\[\[config\b", flags=re.M)
# A Sphinx role as Python docstrings write it; in Markdown ``x`` is already a code span.
_ROLES = r":(?:class|meth|func|attr|data|mod|obj|exc|const):"
ROLE = re.compile(
    _ROLES + r"`(?:(?P<title>[^`<]+?) <(?P<titled>[\w.]+)>|(?P<tilde>~?)(?P<target>[\w.]+)(?:\(\))?)`"
)
# The same role after Markdown has rendered the docstring: ``:class:<code>~a.b.C</code>``.
ROLE_HTML = re.compile(
    _ROLES
    + r"<code>(?:(?P<title>[^<&]+?) &lt;(?P<titled>[\w.]+)&gt;|(?P<tilde>~?)(?P<target>[\w.]+)(?:\(\))?)</code>"
)


def import_target(path: str) -> Any:
    """The object at ``path`` (``package.module.Name``)."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise PluginError(f"[[config {path} ...]]: {path} cannot be imported ({err})") from err


def settings_rows(cls: type) -> list[dict[str, Any]]:
    """One dict per argument of ``cls``'s constructor as jsonargparse parses it: ``key`` (dotted, relative
    to the class), ``type``, ``default``, ``required``, ``help`` and ``group`` (the settings class of an
    argument that is a group of its own, else ``None``)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(cls, "x", sub_configs=True)
    groups = {key[2:]: group for key, group in parser.groups.items() if key.startswith("x.")}
    rows: list[dict[str, Any]] = []
    seen_groups: set[str] = set()
    for action in parser._actions:
        dest = action.dest
        if not dest.startswith("x.") or dest.endswith(".help"):
            continue
        key = dest[2:]
        group_key = key.rpartition(".")[0]
        if group_key and group_key.split(".")[0] in groups:
            continue  # a member of a nested group: that group's own table lists it
        if key in groups:  # a settings group (a dataclass argument): one row, its own table
            if key not in seen_groups:
                seen_groups.add(key)
                rows.append(
                    {
                        "key": key,
                        "type": None,
                        "default": None,
                        "required": False,
                        "help": groups[key].title or "",
                        "group": _group_class(cls, key),
                    }
                )
            continue
        hint = getattr(action, "_typehint", None)
        required = bool(getattr(action, "required", False))
        rows.append(
            {
                "key": key,
                "type": hint,
                "default": action.default,
                "required": required,
                "help": action.help or "",
                "group": None,
            }
        )
    return rows


def _group_class(cls: type, key: str) -> type | None:
    """The annotated class of the constructor argument ``key`` of ``cls``."""
    try:
        hints = typing.get_type_hints(cls if _is_dataclass(cls) else cls.__init__)
    except (NameError, TypeError):  # an annotation only a type checker imports
        return None
    hint = hints.get(key)
    return hint if isinstance(hint, type) else None


def _is_dataclass(cls: type) -> bool:
    import dataclasses

    return dataclasses.is_dataclass(cls)


def type_text(hint: Any) -> str:
    """A type as a reader writes it: ``int | None``, ``"sde" | "cps"``, ``Sampler``."""
    if hint is None:
        return ""
    if hint is type(None):
        return "None"
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is collections.abc.Callable:
        return "callable"
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_text(a) for a in args)}]" if args else name
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "")


def default_text(value: Any, limit: int = 60) -> str:
    """A default as YAML writes it (``null``, ``true``, ``{rank: null}``), on one line, cut at ``limit``
    characters (the API reference has the whole signature)."""
    if isinstance(value, datetime.timedelta):
        text = str(value)
    elif isinstance(value, str):
        if re.fullmatch(r"[\w.+-]+", value):
            text = value
        elif "\n" in value:
            text = json.dumps(value, ensure_ascii=False)
        else:  # YAML's single-quoted form: a regex reads as written
            text = "'" + value.replace("'", "''") + "'"
    elif value is None or isinstance(value, (bool, int, float, list, tuple, dict)):
        plain = list(value) if isinstance(value, tuple) else value
        text = (
            yaml.safe_dump(plain, default_flow_style=True, width=10_000, sort_keys=False)
            .strip()
            .removesuffix("...")
            .strip()
        )
    else:
        text = repr(value)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def code(text: str) -> str:
    """``text`` as a Markdown code span, whatever backticks it holds."""
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def roles_to_markdown(text: str) -> str:
    """Docstring text as a Markdown table cell: roles to code spans, ````x```` to ``x``, one line."""
    text = ROLE.sub(lambda m: f"`{_short(m)}`", text)
    text = text.replace("``", "`")
    return escape_pipes(" ".join(text.split()))


def escape_pipes(text: str) -> str:
    """``|`` escaped where it would end a table cell: outside code spans (inside them Python-Markdown's
    tables leave it alone, and an escape would show)."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else p.replace("|", "\\|") for p in parts)


def _short(match: re.Match) -> str:
    """What a role shows: its explicit title, the last name after ``~``, else the whole target."""
    if match["titled"]:
        return match["title"]
    target = match["target"]
    return target.rpartition(".")[2] if match["tilde"] else target


def _autoref(identifier: str, title: str) -> str:
    """A link to ``identifier``'s entry in the API reference, or plain ``title`` where it has none."""
    return f'<autoref identifier="{html.escape(identifier)}" optional>{title}</autoref>'


def table(cls: type, flag: str, anchors: dict[type, str]) -> str:
    """The Markdown table of ``cls``'s settings under ``flag``."""
    qualname = f"{cls.__module__}.{cls.__qualname__}"
    lines = [
        f'<span id="{anchors[cls]}"></span>',
        "",
        f"Settings of [`{cls.__name__}`][{qualname}] (`{flag}.<key>` on the command line):",
        "",
        "| key | type | default | meaning |",
        "| --- | --- | --- | --- |",
    ]
    rows = settings_rows(cls)
    if not rows:
        return "\n".join(lines[:3]) + " none.\n"
    for row in rows:
        group = row["group"]
        if group is not None:  # a settings group of its own: its table has the keys and defaults
            kind = f"[`{group.__name__}`](#{anchors[group]})" if group in anchors else code(group.__name__)
            default = f"[its table](#{anchors[group]})" if group in anchors else "its own settings"
        else:
            kind = code(type_text(row["type"]))
            default = "required" if row["required"] else code(default_text(row["default"]))
        lines.append(f"| `{flag}.{row['key']}` | {kind} | {default} | {roles_to_markdown(row['help'])} |")
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    directives = list(DIRECTIVE.finditer(markdown))
    if not directives:
        if ANY_DIRECTIVE.search(markdown):
            raise PluginError(f"{page.file.src_uri}: a [[config ...]] line is not `[[config CLASS --FLAG]]`")
        return markdown
    classes = [import_target(m["target"]) for m in directives]
    anchors = {cls: "config-" + cls.__name__.lower() for cls in classes}
    out = DIRECTIVE.sub(lambda m: table(import_target(m["target"]), m["flag"], anchors), markdown)
    if ANY_DIRECTIVE.search(out):
        raise PluginError(f"{page.file.src_uri}: a [[config ...]] line is not `[[config CLASS --FLAG]]`")
    return out


def on_page_content(html_text: str, page: Any, config: Any, files: Any) -> str:
    """Docstrings' roles, rendered by mkdocstrings as ``:class:<code>…</code>``, as links or code."""

    def link(match: re.Match) -> str:
        target = match["titled"] or match["target"]
        title = f"<code>{_short(match)}</code>"
        return _autoref(target, title) if "." in target else title

    return ROLE_HTML.sub(link, html_text)
