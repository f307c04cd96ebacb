"""What is wrong with a command line that jsonargparse could not parse, said in one line per mistake.

jsonargparse reports a mistyped choice inside every ``Union`` it tried (``Does not validate against
any of the Union subtypes``, the value, its type, sixty lines in all) and names neither the valid
choices nor the fix. After such a failure the CLI reads the same words again, naively (the
``--config`` files as YAML, each ``--key=value``), and looks for the mistakes users make:

- a class path that does not import: the module that is missing, or the classes the module has,
  with the closest one first (``lit_flowgrpo.policies.SD3Polcy``);
- an objective by its registered name where a class path is expected (``--model.objective=grpo_guard``);
- a setting that was removed (``--model.loss``), renamed (DiffusionNFT's ``timestep_fraction``) or is
  misspelt (``--model.sampler.num_stpes``): the flag that replaced it, or the closest settings of that
  class;
- a value outside a setting's fixed choices (a ``Literal``, ``--model.advantage.aggregation=gpdo``):
  the choices, the closest first.

Only the failure path runs this, and only what it can name replaces jsonargparse's message: a
valid config never depends on it, and a mistake it does not know still gets jsonargparse's report.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import inspect
import math
import os
import pkgutil
import re
import types
import typing
from collections.abc import Iterator, Sequence
from typing import Any

import yaml

#: Flags that were removed, and what to use instead (the flag as the user types it, without init_args).
REMOVED_FLAGS = {
    "model.loss": "the loss is chosen by --model.init_args.objective, a class path "
    "(e.g. --model.init_args.objective=lit_flowgrpo.objective.GRPOGuard)",
}

#: Settings that were renamed or moved, by (class path, old name), a class's subclasses included: the
#: new name (a flag, ``--...``, where the setting moved to another group) and what sets it apart.
RENAMED_SETTINGS = {
    ("lit_flowgrpo.objective.DiffusionNFT", "timestep_fraction"): (
        "visit_fraction",
        "the share of the T rollout sigmas each sample visits; --model.init_args.sampler.timestep_fraction, "
        "the trained steps of the ratio objectives, is another setting",
    ),
    **{
        (owner, old): (new, why)
        for why, moves in {
            "what is trained is one group, --model.init_args.weights": {
                ("lit_flowgrpo.module.FlowGRPOModule", "lora"): "--model.init_args.weights.lora",
                (
                    "lit_flowgrpo.module.FlowGRPOModule",
                    "master_dtype",
                ): "--model.init_args.weights.master_dtype",
            },
            "the KL regulariser (β, its form, the reference, the gate) is one group, --model.init_args.kl": {
                ("lit_flowgrpo.module.FlowGRPOModule", "reference"): "--model.init_args.kl.reference",
                (
                    "lit_flowgrpo.module.FlowGRPOModule",
                    "reference_copy",
                ): "--model.init_args.kl.reference.copy",
                ("lit_flowgrpo.objective.Objective", "kl_coef"): "--model.init_args.kl.coef",
                ("lit_flowgrpo.objective.Objective", "kl_with_dt"): "--model.init_args.kl.with_dt",
                ("lit_flowgrpo.advantages.stage.AdvantageSettings", "kl_gate"): "--model.init_args.kl.gate",
                (
                    "lit_flowgrpo.metrics.policy.DiagnosticsSettings",
                    "reference_kl",
                ): "--model.init_args.kl.measure",
            },
        }.items()
        for (owner, old), new in moves.items()
    },
}

#: The same moves in the hyper-parameters a checkpoint saved (FlowGRPOModule's arguments, as paths),
#: so that a checkpoint written before them resumes with the values it was trained with.
MOVED_IN_CHECKPOINTS = {
    ("reference",): ("kl", "reference"),  # before reference_copy, which lands inside it
    ("reference_copy",): ("kl", "reference", "copy"),
    ("lora",): ("weights", "lora"),
    ("master_dtype",): ("weights", "master_dtype"),
    ("objective", "init_args", "kl_coef"): ("kl", "coef"),
    ("objective", "init_args", "kl_with_dt"): ("kl", "with_dt"),
    ("advantage", "kl_gate"): ("kl", "gate"),
    ("diagnostics", "reference_kl"): ("kl", "measure"),
}

_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
_ROOTS = {"trainer": "lightning.pytorch.Trainer"}  # roots whose class is not named by a class_path


def diagnose(words: Sequence[str]) -> list[str]:
    """One message per mistake found in ``words`` (a ``lit-flowgrpo`` command line), each naming the
    flag and the fix; empty when none of the known mistakes is there."""
    try:
        pairs = list(_pairs(words))
    except Exception:  # a config this naive reader cannot read: leave the report to jsonargparse
        return []
    class_paths = {
        _path(key): value
        for key, value in pairs
        if isinstance(value, str) and (key.endswith("class_path") or _is_class(value))
    }
    problems: list[str] = []
    for key, value in pairs:
        flag = _flag(key)
        for check in (_removed, _objective_name, _class_path, _reward_weight):
            found = check(key, flag, value)
            if found:
                problems.append(found)
                break
        else:
            found = _unknown_setting(key, class_paths, value)
            if found:
                problems.append(found)
    return list(dict.fromkeys(problems))


def move_old_settings(hparams: dict[str, Any]) -> list[str]:
    """Move, in place, the settings of a checkpoint's saved module arguments ``hparams`` that now live in
    another group (:data:`MOVED_IN_CHECKPOINTS`), and rename the renamed ones
    (:func:`rename_old_settings`). Returns one line per change (empty: nothing was old). A setting
    present under both its old and its new path is left alone, for the parser to refuse."""
    done = rename_old_settings(hparams)
    for old, new in MOVED_IN_CHECKPOINTS.items():
        parent = hparams
        for part in old[:-1]:
            parent = parent.get(part) if isinstance(parent, dict) else None
        if not isinstance(parent, dict) or old[-1] not in parent:
            continue
        value = parent.pop(old[-1])
        target = hparams
        for part in new[:-1]:
            target = target.setdefault(part, {})
        if isinstance(target.get(new[-1]), dict) and isinstance(value, dict):
            target[new[-1]] = {**value, **target[new[-1]]}
        elif new[-1] in target:
            parent[old[-1]] = value  # given twice: leave it for the parser to name
            continue
        else:
            target[new[-1]] = value
        done.append(f"{'.'.join(p for p in old if p != 'init_args')} is now {'.'.join(new)}")
    return done


def rename_old_settings(tree: Any) -> list[str]:
    """Rename, in place, the :data:`RENAMED_SETTINGS` that a saved config or a checkpoint's
    hyper-parameters still hold under their old name: in every ``{"class_path": ..., "init_args": {...}}``
    of ``tree`` (dicts and lists, nested). Returns one line per renamed key (empty: nothing was old).

    A checkpoint is a record that cannot be edited the way a YAML can: this lets one written before a
    rename resume, with the value it was trained with. A key given under both names is left alone, for
    the parser to refuse."""
    done: list[str] = []
    if isinstance(tree, list):
        for item in tree:
            done += rename_old_settings(item)
    if not isinstance(tree, dict):
        return done
    path, init_args = tree.get("class_path"), tree.get("init_args")
    if isinstance(path, str) and isinstance(init_args, dict):
        for (owner, old), (new, _) in RENAMED_SETTINGS.items():
            if path == owner and old in init_args and new not in init_args:
                init_args[new] = init_args.pop(old)
                done.append(f"{path}: {old} is now {new}")
    for value in tree.values():
        done += rename_old_settings(value)
    return done


# -- reading the words naively ----------------------------------------------------------------------


def _pairs(words: Sequence[str]) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) for every leaf the ``--config`` files and the ``--key=value`` words give."""
    words = list(words)
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("-"):
            continue  # the subcommand
        key, eq, value = word.lstrip("-").partition("=")
        if not eq:
            if i >= len(words) or words[i].startswith("--"):
                continue  # a switch such as --print_config
            value = words[i]
            i += 1
        key = key.rstrip("+")  # --trainer.callbacks+=X appends
        if key in ("c", "config"):
            yield from _leaves("", _load_yaml(value))
        elif value.endswith((".yaml", ".yml")) and os.path.isfile(value):
            yield from _leaves(key + ".", _load_yaml(value))
        else:
            yield from _leaves(key + ".", yaml.safe_load(value) if value else value)


def _load_yaml(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def _leaves(prefix: str, tree: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        if prefix.endswith(("reward.weights.", "reward.init_args.weights.")) and all(
            not isinstance(v, (dict, list)) for v in tree.values()
        ):
            yield prefix[:-1], tree  # a {name: weight} mapping is one value
            return
        for key, value in tree.items():
            yield from _leaves(f"{prefix}{key}.", value)
    elif isinstance(tree, list) and tree and all(isinstance(v, dict) for v in tree):
        for n, value in enumerate(tree):
            yield from _leaves(f"{prefix}{n}.", value)
    else:
        yield prefix[:-1], tree


def _flag(key: str) -> str:
    """The flag as a user types it: ``model.init_args.policy.class_path`` → ``--model.policy``."""
    return "--" + ".".join(p for p in _path(key).split(".") if not p.isdigit())


def _path(key: str) -> str:
    """``key`` without ``init_args`` and ``class_path``; list positions kept (``trainer.callbacks.3``)."""
    return ".".join(p for p in key.split(".") if p not in ("init_args", "class_path"))


# -- the mistakes -----------------------------------------------------------------------------------


def _removed(key: str, flag: str, value: Any) -> str | None:
    for removed, instead in REMOVED_FLAGS.items():
        if flag == f"--{removed}" or flag.startswith(f"--{removed}."):
            return f"{flag} was removed: {instead}"
    return None


def _objective_name(key: str, flag: str, value: Any) -> str | None:
    """A registered objective name (``grpo_guard``) given where its class path is expected."""
    if flag != "--model.objective" or not isinstance(value, str) or "." in value:
        return None
    from lit_flowgrpo import objective

    by_name = {cls.name: f"{cls.__module__}.{cls.__qualname__}" for cls in objective._REGISTRY.values()}
    listed = ", ".join(f"{path} ({name})" for name, path in sorted(by_name.items()))
    if value in by_name:
        return (
            f"--model.init_args.objective ({value}) takes a class path: "
            f"--model.init_args.objective={by_name[value]}; objectives: {listed}"
        )
    names = list(by_name) + [path.rsplit(".", 1)[1] for path in by_name.values()]
    close = difflib.get_close_matches(value, names, n=1, cutoff=0.6)
    hint = ""
    if close:
        path = by_name.get(close[0]) or next(p for p in by_name.values() if p.endswith("." + close[0]))
        hint = f"did you mean --model.init_args.objective={path}? "
    return f"--model.init_args.objective ({value}) is not an objective: {hint}objectives: {listed}"


def _class_path(key: str, flag: str, value: Any) -> str | None:
    """A dotted path that does not import: what is missing and the closest names that exist."""
    if not isinstance(value, str) or not _DOTTED.match(value):
        return None
    top = value.split(".", 1)[0]
    if not key.endswith("class_path"):
        try:
            if importlib.util.find_spec(top) is None:
                return None  # a dotted value that is no class path (a file name, a hub id)
        except (ImportError, ValueError):
            return None
    parts = value.split(".")
    module: Any = None
    depth = 0
    for depth in range(len(parts) - 1, 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:depth]))
            break
        except ImportError:
            continue
    if module is None:
        return f"{flag} ({value}): no module {top} is installed"
    found = module
    for n in range(depth, len(parts)):
        nxt = getattr(found, parts[n], None)
        if nxt is None and inspect.ismodule(found):
            try:
                nxt = importlib.import_module(".".join(parts[: n + 1]))
            except ImportError:
                nxt = None
        if nxt is None:
            return _missing(flag, value, ".".join(parts[:n]), found, parts[n])
        found = nxt
    return None


def _missing(flag: str, value: str, where: str, owner: Any, name: str) -> str:
    classes = _public_classes(owner)
    modules = [m.name for m in pkgutil.iter_modules(getattr(owner, "__path__", []))]
    close = difflib.get_close_matches(name, classes + modules, n=1, cutoff=0.6)
    hint = f"did you mean {where}.{close[0]}? " if close else ""
    if classes and not (close and close[0] in modules):
        listed = f"its classes: {', '.join(classes)}"
    else:
        listed = f"its modules: {', '.join(modules)}"
    return f"{flag} ({value}): {where} has no {name}; {hint}{listed}"


def _public_classes(owner: Any) -> list[str]:
    names = getattr(owner, "__all__", None) or [n for n in dir(owner) if not n.startswith("_")]
    return sorted(n for n in names if inspect.isclass(getattr(owner, n, None)))


def _reward_weight(key: str, flag: str, value: Any) -> str | None:
    """A non-finite weight typed on the command line (jsonargparse rejects ``.nan`` there as no float)."""
    if not flag.endswith("reward.weights") or not isinstance(value, dict):
        return None
    bad = {k: w for k, w in value.items() if isinstance(w, float) and not math.isfinite(w)}
    if not bad:
        return None
    return (
        f"--model.init_args.reward.init_args.weights gives {', '.join(f'{k!r} the weight {w!r}' for k, w in bad.items())}: each "
        "weight must be a finite number (0 computes and logs a reward without training on it)"
    )


def _unknown_setting(key: str, class_paths: dict[str, str], value: Any = None) -> str | None:
    """A key that is no argument of its class: the closest arguments that are; or a value that is not
    among the fixed choices of the argument it names."""
    parts = _path(key).split(".")
    root = parts[0]
    path = class_paths.get(root) or _ROOTS.get(root)
    if path is None or len(parts) < 2:
        return None
    try:
        cls: Any = _import(path)
    except Exception:
        return None  # reported by _class_path
    for depth, name in enumerate(parts[1:], 1):
        nested = class_paths.get(".".join(parts[: depth + 1]))
        if name.isdigit():  # an item of a list of classes (callbacks): judged by its own class
            if not nested:
                return None
            try:
                cls = _import(nested)
            except Exception:
                return None
            continue
        names, hints = _arguments(cls)
        if not names:
            return None
        if name not in names:
            owner = _spelled([*parts[:depth], "_"], class_paths)[:-2]  # the owner's own settings' prefix
            renamed = _renamed(cls, name)
            if renamed and renamed[0].startswith("--"):
                new, meaning = renamed
                return f"{_spelled(parts[: depth + 1], class_paths)} moved: it is now {new} ({meaning})"
            if renamed:
                new, meaning = renamed
                return (
                    f"{_spelled(parts, class_paths)} was renamed: {cls.__name__} calls it {owner}.{new} "
                    f"({meaning})"
                )
            close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
            hint = f"did you mean {', '.join(f'{owner}.{c}' for c in close)}? " if close else ""
            listed = (
                f"its settings: {', '.join(names)}" if len(names) <= 20 else "see --help for its settings"
            )
            return f"{_spelled(parts, class_paths)}: {cls.__name__} has no setting {name!r}; {hint}{listed}"
        if depth == len(parts) - 1:
            return _choice(parts, hints.get(name), value)
        # Descend into the argument's own class: a dataclass field or a class the config names.
        nxt = hints.get(name)
        if nested:
            try:
                nxt = _import(nested)
            except Exception:
                return None
        if not (inspect.isclass(nxt) and dataclasses.is_dataclass(nxt)) and not nested:
            return None
        cls = nxt
    return None


def _renamed(cls: Any, name: str) -> tuple[str, str] | None:
    """The :data:`RENAMED_SETTINGS` entry of ``cls``'s setting ``name``, or of a class it derives from."""
    for klass in getattr(cls, "__mro__", (cls,)):
        found = RENAMED_SETTINGS.get((f"{klass.__module__}.{klass.__qualname__}", name))
        if found:
            return found
    return None


def _spelled(parts: list[str], class_paths: dict[str, str]) -> str:
    """``parts`` as a flag in the CLI's full spelling, the one the error messages use: ``init_args``
    after each part the config gives a class for (``--data.init_args.group_size``,
    ``--model.init_args.objective.init_args.clip_range``); list positions dropped, as in :func:`_flag`."""
    out = []
    for i, part in enumerate(parts):
        if part.isdigit():
            continue
        out.append(part)
        if i < len(parts) - 1 and ".".join(parts[: i + 1]) in class_paths:
            out.append("init_args")
    return "--" + ".".join(out)


def _choice(parts: list[str], hint: Any, value: Any) -> str | None:
    """A value that is none of a ``Literal`` setting's choices: the choices, the closest first."""
    choices = _literal_choices(hint)
    if choices is None or value in choices:
        return None
    flag = _canonical_flag(parts)
    shown = [c for c in choices if c is not None]
    close = difflib.get_close_matches(str(value), [str(c) for c in shown], n=1, cutoff=0.6)
    listed = ", ".join(str(c) for c in shown) + (", or null" if None in choices else "")
    hint_text = f"; did you mean {flag}={close[0]}?" if close else ""
    return f"{flag} ({value}) must be one of {listed}{hint_text}"


def _literal_choices(hint: Any) -> list[Any] | None:
    """The values a ``Literal`` (or an optional one) allows; ``None`` for any other type."""
    if typing.get_origin(hint) is typing.Literal:
        return list(typing.get_args(hint))
    members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else ()
    if not members or not all(m is type(None) or typing.get_origin(m) is typing.Literal for m in members):
        return None
    return [c for m in members for c in (typing.get_args(m) if m is not type(None) else (None,))]


def _canonical_flag(parts: list[str]) -> str:
    """A module setting in the spelling the error messages use (:func:`lit_flowgrpo.errors.flag`):
    ``model.advantage.aggregation`` → ``--model.init_args.advantage.aggregation``."""
    if parts[0] == "data":
        return "--data.init_args." + ".".join(parts[1:])
    if parts[0] != "model" or len(parts) < 3:
        return "--" + ".".join(parts)
    from lit_flowgrpo.errors import flag

    return ".".join([flag(parts[1]), *parts[2:]])


def _arguments(cls: Any) -> tuple[list[str], dict[str, Any]]:
    """The argument names a class takes (its ``__init__``'s, or a dataclass's fields) and their types."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return [], {}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return [], {}  # takes anything: nothing to judge
    names = [n for n in params if n != "self"]
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:
        hints = {}
    return names, hints


def _is_class(value: str) -> bool:
    if not _DOTTED.match(value):
        return False
    try:
        if importlib.util.find_spec(value.split(".", 1)[0]) is None:
            return False
        return inspect.isclass(_import(value))
    except Exception:
        return False


def _import(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)
