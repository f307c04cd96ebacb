"""The run card: beside the weights, how they were made and how far to trust them.

A card has two halves, both plain data (str, int, float, bool, None, lists and dicts, so a checkpoint
that holds one still loads with ``torch.load(weights_only=True)``):

- ``trained``: the base model, the objective and its settings, the rewards and their weights, LoRA or a
  full fine-tune, the KL regulariser, the optimizer, rollouts, optimizer steps, samples generated and
  the seeds; ``sessions``: each start of the run (the first, and each resume: from which checkpoint, at
  which rollout) with the versions of the libraries and the hardware it ran on;
- ``trust``: what was measured along the run: the on-policy ratio error, the KL to the reference, the
  paired held-out gain with its standard error, the proxy-against-gold gap, diversity and drift, the
  validation before and after, the rollouts' rewards and the counts of what went wrong.

A fact with no source says so: its value is a sentence that begins with ``"not measured"`` and says why
(:func:`not_measured`), never a number made up to fill the slot.

Where each half comes from: during ``fit`` the callback
:class:`~lit_flowgrpo.callbacks.run_card.RunCardRecorder` (which the module adds to every fit)
reads the module, the trainer and the logged metrics, and writes the card into every checkpoint under
:data:`CHECKPOINT_KEY`. A callback that measures a held-out gain the core cannot (it needs per-sample
verdicts the base model was given) hands it over through the :class:`HeldOutSource` protocol, as the
shapes world's :class:`~lit_flowgrpo.toy.report.HeldOutReport` does. ``lit-flowgrpo export`` writes the
checkpoint's card as the export folder's ``README.md`` with the Hugging Face Hub's model-card metadata
(:func:`write_export`), so a folder pushed to the Hub shows it, and :func:`read_card` reads it back.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from lit_flowgrpo.export import write_folder

__all__ = [
    "CARD_FILE",
    "CHECKPOINT_KEY",
    "HeldOutGain",
    "HeldOutSource",
    "ProxyGap",
    "checkpoint_card",
    "class_path",
    "is_measured",
    "model_card",
    "not_measured",
    "plain",
    "read_card",
    "trained_facts",
    "versions",
    "write_export",
]

#: Where a checkpoint holds its card (a top-level key of the checkpoint dict, or of a sharded
#: checkpoint folder's ``meta.pt``).
CHECKPOINT_KEY = "run_card"
#: The card's file in an export folder: the Hub shows a repository's README.md as its model card.
CARD_FILE = "README.md"
#: The card's layout; a reader that finds a later one knows it may lack fields it expects.
FORMAT = 1
#: Where the whole card sits in the README's metadata (the Hub keeps keys it does not know).
METADATA_KEY = "run_card"
_NOT_MEASURED = "not measured"
#: The Hub's repository ids (``owner/name``): only such a base model goes into ``base_model``.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_LIBRARIES = ("torch", "lightning", "diffusers", "transformers", "peft", "lit-flowgrpo")


def not_measured(why: str) -> str:
    """The value of a fact the run has no source for: ``"not measured: <why>"``.

    >>> not_measured("validation did not run")
    'not measured: validation did not run'
    """
    return f"{_NOT_MEASURED}: {why}"


def is_measured(value: Any) -> bool:
    """Whether ``value`` is a measured fact, not :func:`not_measured`'s sentence.

    >>> is_measured(0.0), is_measured(not_measured("no rollout ran"))
    (True, False)
    """
    return not (isinstance(value, str) and value.startswith(_NOT_MEASURED))


# --------------------------------------------------------------------------------------------------
# What a callback hands over: a held-out gain on paired samples
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProxyGap:
    """The gap between the reward trained on (the proxy) and a gold score, on the same held-out samples.

    Args:
        proxy: the proxy's reward component (``shapes_color``).
        proxy_base: its validation mean for the base model.
        proxy_tuned: its validation mean for the tuned model.
        gap_base: the mean over the samples scored by both of proxy − gold, for the base model.
        gap_tuned: the same for the tuned model.
    """

    proxy: str
    proxy_base: float
    proxy_tuned: float
    gap_base: float
    gap_tuned: float


@dataclass(frozen=True)
class HeldOutGain:
    """A validation score of the base model and of the tuned one on the same prompts and seeds.

    The gain is paired: the mean over the samples scored in both evaluations of (tuned − base) per
    sample, and its standard error is that of those differences, s/√n (the sample standard deviation).

    Args:
        component: the reward component scored (``shapes/strict``).
        base: the base model's mean.
        base_samples: the samples behind it.
        tuned: the tuned model's mean.
        tuned_samples: the samples behind it.
        after_rollouts: the rollouts the tuned model had trained for when it was evaluated.
        gain: the paired difference, or ``None`` where the samples could not be paired (no per-sample
            ids, or fewer than two scored in both).
        standard_error: its standard error, or ``None`` with it.
        paired_samples: the samples it averages, or ``None`` with it.
        proxy: the proxy's gap to this component, where the run tracks one.
    """

    component: str
    base: float
    base_samples: int
    tuned: float
    tuned_samples: int
    after_rollouts: int
    gain: float | None = None
    standard_error: float | None = None
    paired_samples: int | None = None
    proxy: ProxyGap | None = None


@runtime_checkable
class HeldOutSource(Protocol):
    """A callback that measures held-out gains: the recorder asks it after each validation and at
    each checkpoint. ``None``: nothing measured yet (no base evaluation, or none after it)."""

    def held_out_gain(self) -> HeldOutGain | None: ...


# --------------------------------------------------------------------------------------------------
# Facts read from a module
# --------------------------------------------------------------------------------------------------


def plain(value: Any) -> Any:
    """``value`` as plain data that ``torch.load(weights_only=True)`` and YAML both read: dataclasses
    and mappings as dicts, tuples and sets as lists, tensors and numpy scalars as numbers, anything else
    as its ``repr``.

    >>> plain({"betas": (0.9, 0.999), "n": 3, "f": float("nan")})
    {'betas': [0.9, 0.999], 'n': 3, 'f': None}
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None  # NaN / inf: nothing measured, YAML-safe
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in (sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value)]
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a 0-d tensor or numpy scalar
        return plain(value.item())
    return repr(value)


def class_path(obj: Any) -> str:
    """The import path of ``obj``'s class (of ``obj`` itself if it is a class).

    >>> class_path(dict)
    'builtins.dict'
    """
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def trained_facts(module: Any) -> dict[str, Any]:
    """What ``module`` trains, as plain data: the base model, the objective, the rewards and their
    weights, the trained weights, the KL regulariser, its other settings and its seed.

    Read from the module's own attributes where they exist (``policy``, ``objective``, ``reward``,
    ``kl``: ``FlowGRPOModule``'s) and from its saved hyper-parameters (Lightning's ``hparams``)
    otherwise, so another LightningModule gets what it declares and "not measured" for the rest.
    """
    hparams = {k: v for k, v in dict(getattr(module, "hparams", None) or {}).items() if not k.startswith("_")}
    policy = getattr(module, "policy", None)
    if policy is not None:
        base: Any = {
            "policy": class_path(policy),
            "pretrained": plain(policy.pretrained),
            "modality": plain(getattr(policy, "modality", None)),
        }
    else:
        base = not_measured(f"{class_path(module)} has no policy")
    objective = getattr(module, "objective", None)
    objective_facts = (
        objective.hparams() if callable(getattr(objective, "hparams", None)) else hparams.get("objective")
    )
    reward = getattr(module, "reward", None)
    reward_facts: Any = not_measured(f"{class_path(module)} has no reward")
    if reward is not None:
        reward_facts = {"reward": class_path(reward)}
        if isinstance(getattr(reward, "weights", None), Mapping):
            reward_facts["weights"] = plain(reward.weights)
        if isinstance(getattr(reward, "rewards", None), Mapping):
            reward_facts["models"] = {name: class_path(r) for name, r in reward.rewards.items()}
    kl = getattr(module, "kl", None)  # resolved (β the objective's where the config left it null)
    facts = {
        "module": class_path(module),
        "base_model": base,
        "objective": plain(objective_facts) if objective_facts is not None else not_measured("no objective"),
        "reward": reward_facts,
        "weights": plain(hparams.get("weights", not_measured("the module declares no weights setting"))),
        "kl": plain(kl if dataclasses.is_dataclass(kl) else hparams.get("kl", not_measured("no KL setting"))),
    }
    adapter = getattr(getattr(module, "weights", None), "peft_config", None)  # once the weights are attached
    if adapter is not None and isinstance(facts["weights"], dict):
        # The LoRA settings as peft applied them: the policy's defaults in place of the nulls.
        facts["weights"]["adapter"] = {
            "r": adapter.r,
            "lora_alpha": adapter.lora_alpha,
            "target_modules": plain(adapter.target_modules),
        }
    taken = {"objective", "weights", "kl", "seed"}
    facts["settings"] = plain({k: v for k, v in hparams.items() if k not in taken})
    facts["seed"] = plain(hparams.get("seed"))
    return facts


def versions() -> dict[str, str]:
    """The versions of Python and of the libraries a run's numbers depend on (and CUDA's, if any)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch

    found = {"python": platform.python_version()}
    for name in _LIBRARIES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = not_measured(f"{name} is not installed as a distribution")
    if torch.version.cuda:
        found["cuda"] = str(torch.version.cuda)
    return found


# --------------------------------------------------------------------------------------------------
# A checkpoint's card
# --------------------------------------------------------------------------------------------------


def _read_checkpoint(path: str) -> dict[str, Any]:
    """The checkpoint at ``path`` (a file, or a sharded folder's ``meta.pt``) without its tensors read:
    memory-mapped, and loaded without unpickling code."""
    import torch

    from lit_flowgrpo.strategies import METADATA_FILENAME

    file = os.path.join(path, METADATA_FILENAME) if os.path.isdir(path) else path
    return torch.load(file, map_location="cpu", mmap=True, weights_only=True)


def checkpoint_card(path: str, module: Any = None, *, use_ema: bool = True) -> dict[str, Any]:
    """The run card of the checkpoint at ``path``, with what an export of it writes (``export``:
    the checkpoint, its optimizer steps, and whether the EMA weights stand in for the trained ones).

    A checkpoint written without :class:`~lit_flowgrpo.callbacks.run_card.RunCardRecorder` (by an
    earlier version, or by a module other than :class:`~lit_flowgrpo.module.FlowGRPOModule`) has no card: then ``trained`` comes from ``module`` (the export's, built
    from the run's config) and every measured fact is "not measured", saying why.
    """
    ckpt = _read_checkpoint(path)
    card = ckpt.get(CHECKPOINT_KEY)
    if not isinstance(card, Mapping):
        why = "the checkpoint holds no run card (it was written without RunCardRecorder)"
        card = {
            "format": FORMAT,
            "trained": {
                **(trained_facts(module) if module is not None else {}),
                "rollouts": not_measured(why),
            },
            "sessions": not_measured(why),
            "trust": not_measured(why),
        }
    card = plain(card)
    ema = any(
        "TrainableEMA" in key and isinstance(state, Mapping) and bool(state.get("ema_state_dict"))
        for key, state in (ckpt.get("callbacks") or {}).items()
    )
    card["export"] = {
        "checkpoint": os.path.abspath(path),
        "optimizer_steps": plain(ckpt.get("global_step")),
        "weights": "the EMA of the trained weights" if ema and use_ema else "the trained weights",
    }
    return card


# --------------------------------------------------------------------------------------------------
# The card as a Hub model card
# --------------------------------------------------------------------------------------------------


def model_card(card: Mapping[str, Any], *, license: str | None = None) -> Any:
    """``card`` as a ``huggingface_hub.ModelCard``: the Hub's metadata (``library_name``, ``tags``,
    ``pipeline_tag`` from the policy's modality, ``base_model`` when the base is a Hub id, ``license``
    when given) with the whole card under ``run_card``, and a Markdown page of it.

    ``license``: the exported weights' license (a Hub license id); ``None`` leaves the field out, since a
    fine-tune's license follows its base model's, which the run does not know.
    """
    from huggingface_hub import ModelCard, ModelCardData

    trained = card.get("trained") or {}
    base = trained.get("base_model")
    pretrained = base.get("pretrained") if isinstance(base, Mapping) else None
    on_hub = (
        isinstance(pretrained, str) and bool(_HUB_ID.match(pretrained)) and not os.path.exists(pretrained)
    )
    tags = ["lit-flowgrpo", "reinforcement-learning"]
    objective = _objective_name(trained.get("objective"))
    if objective:
        tags.append(objective.lower())
    weights = trained.get("weights")
    if isinstance(weights, Mapping):
        tags.append("lora" if weights.get("lora") is not None else "full-fine-tune")
    task = None
    if isinstance(base, Mapping) and base.get("modality") in ("image", "video"):
        task = f"text-to-{base['modality']}"  # the Hub's task of a text-conditioned generator
        tags.append(task)
    data = ModelCardData(
        base_model=pretrained if on_hub else None,
        library_name="diffusers",
        pipeline_tag=task,
        license=license,
        tags=tags,
        **{METADATA_KEY: dict(card)},
    )
    # The metadata block as the Hub writes it (ModelCard's own `content`: the data's YAML between two
    # `---` lines, then the page); built from the data here because ModelCard(page) without a block
    # warns that it has none, and from_template needs jinja2, which is no core dependency.
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{_markdown(card)}")


def write_export(
    module: Any,
    ckpt_path: str,
    out: str,
    *,
    overwrite: bool = False,
    use_ema: bool = True,
    license: str | None = None,
) -> str:
    """Export ``module``'s trained weights (loaded from ``ckpt_path`` already) to ``out`` with the
    checkpoint's run card as ``out/README.md``; returns what was written.

    The weights and the card are one export: both are written into a new folder beside ``out`` and
    take its place together (:func:`lit_flowgrpo.export.write_folder`), or neither does.
    """
    card = model_card(checkpoint_card(ckpt_path, module, use_ema=use_ema), license=license)
    said: list[str] = []

    def write(folder: str) -> None:
        # The new, empty folder beside `out`: the module's export writes into it as into any empty one.
        said.append(module.export(folder, overwrite=True).replace(folder, out))
        card.save(os.path.join(folder, CARD_FILE))

    write_folder(out, overwrite, write, lambda folder: read_card(folder))
    return f"{said[0]}, with its run card ({CARD_FILE})"


def read_card(folder: str) -> dict[str, Any]:
    """The run card an export folder's ``README.md`` holds, and the Hub metadata beside it
    (``card["metadata"]``: ``library_name``, ``tags``, ...).

    Raises:
        ValueError: the folder has no card, or its README holds none.
    """
    from huggingface_hub import ModelCard

    path = Path(folder) / CARD_FILE
    if not path.is_file():
        raise ValueError(f"{folder} has no {CARD_FILE}: it was not written by `lit-flowgrpo export`")
    metadata = ModelCard.load(path).data.to_dict()
    card = metadata.pop(METADATA_KEY, None)
    if not isinstance(card, dict):
        raise ValueError(f"{path} holds no run card (no {METADATA_KEY!r} in its metadata)")
    return {**card, "metadata": metadata}


# --------------------------------------------------------------------------------------------------
# The Markdown page
# --------------------------------------------------------------------------------------------------


def _objective_name(objective: Any) -> str | None:
    if isinstance(objective, Mapping) and isinstance(objective.get("class_path"), str):
        return objective["class_path"].rsplit(".", 1)[-1]
    return None


def _number(x: Any) -> str:
    """A measured number as the page shows it: 4 significant digits."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    return str(x) if isinstance(x, int) else f"{x:.4g}"


def _signed(x: float) -> str:
    return f"{x:+.3f}"


def _settings(values: Any) -> str:
    """``{"beta": 1.0, "decay": "linear_to_0_5"}`` → ``beta 1, decay linear_to_0_5``."""
    if not isinstance(values, Mapping):
        return str(values)
    return ", ".join(f"{k} {_number(v) if not isinstance(v, (dict, list)) else v}" for k, v in values.items())


def _row(name: str, value: Any) -> str:
    return f"| {name} | {str(value).replace('|', '/')} |"


def _markdown(card: Mapping[str, Any]) -> str:
    trained = card.get("trained") or {}
    objective = trained.get("objective")
    name = _objective_name(objective) or "RL"
    base = trained.get("base_model")
    if isinstance(base, Mapping):
        policy = str(base.get("policy"))
        pretrained = base.get("pretrained")
        where = f"`{pretrained}`" if pretrained else f"the default weights of {policy.rsplit('.', 1)[-1]}"
        base_text = f"{where} ({policy})"
    else:
        base_text = str(base)
    lines = [
        f"# {name} fine-tune of {base_text}",
        "",
        "Written by `lit-flowgrpo export` from the run's checkpoint. Every value below is what the run",
        "recorded; one it had no source for says *not measured*, and why. The same card, as data, is this",
        f"file's `{METADATA_KEY}` metadata.",
        "",
        "## What was trained",
        "",
        "| | |",
        "| --- | --- |",
        _row("base model", base_text),
        _row(
            "objective",
            f"{name} ({_settings(objective.get('init_args'))})"
            if isinstance(objective, Mapping)
            else objective,
        ),
    ]
    reward = trained.get("reward")
    if isinstance(reward, Mapping) and isinstance(reward.get("weights"), Mapping):
        weights = ", ".join(f"{k} × {_number(w)}" for k, w in reward["weights"].items())
        lines.append(_row("rewards (component × weight)", weights))
    else:
        lines.append(_row("rewards", reward))
    lines.append(_row("trained weights", _weights_text(trained.get("weights"))))
    lines.append(_row("KL regulariser", _kl_text(trained.get("kl"))))
    if "optimizer" in trained:
        lines.append(_row("optimizer", _settings(trained["optimizer"])))
    lines.append(
        _row(
            "trained for",
            f"{_number(trained.get('rollouts'))} rollout(s), {_number(trained.get('optimizer_steps', 'not measured'))} "
            f"optimizer steps, {_number(trained.get('samples_generated', 'not measured'))} samples generated",
        )
    )
    lines.append(_row("seeds", _settings(trained.get("seeds", {"module": trained.get("seed")}))))
    export = card.get("export")
    if isinstance(export, Mapping):
        lines.append(
            _row(
                "exported",
                f"{export['weights']}, from `{export['checkpoint']}` (optimizer step {export['optimizer_steps']})",
            )
        )
    sessions = card.get("sessions")
    lines.append(_row("resumed", _resumed_text(sessions)))
    if isinstance(sessions, list) and sessions:
        last = sessions[-1]
        lines.append(_row("hardware (last session)", _settings(last.get("hardware"))))
        lines.append(_row("versions (last session)", _settings(last.get("versions"))))
    lines += ["", "## How far to trust it", ""]
    lines += _trust_lines(card.get("trust"))
    return "\n".join(lines) + "\n"


def _weights_text(weights: Any) -> str:
    if not isinstance(weights, Mapping):
        return str(weights)
    lora = weights.get("lora")
    if lora is None:
        return f"full fine-tune of the transformer (master dtype {weights.get('master_dtype')})"
    adapter = weights.get("adapter")
    applied = f"; as applied: {_settings(adapter)}" if isinstance(adapter, Mapping) else ""
    return f"LoRA adapter ({_settings(lora)}{applied})"


def _kl_text(kl: Any) -> str:
    if not isinstance(kl, Mapping):
        return str(kl)
    reference = kl.get("reference") or {}
    return f"β {_number(kl.get('coef'))} to the {reference.get('mode', '?')} reference" + (
        " (measured at β 0)" if kl.get("measure") and not kl.get("coef") else ""
    )


def _resumed_text(sessions: Any) -> str:
    if not isinstance(sessions, list):
        return str(sessions)
    resumes = [s for s in sessions if s.get("resumed_from")]
    if not resumes:
        return "no: one session from the base model"
    return "; ".join(
        f"from `{s['resumed_from']}` at rollout {s.get('at_rollout')} (optimizer step {s.get('at_optimizer_step')})"
        for s in resumes
    )


def _trust_lines(trust: Any) -> list[str]:
    if not isinstance(trust, Mapping):
        return [str(trust)]
    lines = ["| measure | value |", "| --- | --- |"]
    held = trust.get("held_out")
    if isinstance(held, list):
        for h in held:
            lines.append(_row(f"held-out {h['component']} (paired gain)", _held_out_text(h)))
    else:
        lines.append(_row("held-out gain", held))
    for key, label in (
        ("on_policy_ratio_error", "on-policy ratio error, mean abs(ratio − 1) before any update"),
        ("kl_to_reference", "KL term to the reference, in the objective's form (actor/kl_loss)"),
    ):
        value = trust.get(key)
        if isinstance(value, Mapping):
            text = ", ".join(f"{k} {_number(v)}" for k, v in value.items())
        else:
            text = value
        lines.append(_row(label, text))
    gap = trust.get("proxy_gap")
    if isinstance(gap, list):
        for g in gap:
            lines.append(_row(f"proxy {g['proxy']} − gold {g['gold']}", _gap_text(g)))
    else:
        lines.append(_row("proxy − gold gap", gap))
    for key in ("diversity", "drift"):
        value = trust.get(key)
        text = (
            f"{_number(value['value'])} (validation after {value['at_rollout']} rollout(s))"
            if isinstance(value, Mapping)
            else value
        )
        lines.append(_row(f"{key} (val-aux/{key})", text))
    rewards = trust.get("rewards")
    if isinstance(rewards, Mapping) and "window" not in rewards and isinstance(rewards.get("first"), Mapping):
        # A card of the earlier format: one rollout at each end, shown as what it is.
        lines.append(
            _row("rollout reward", "one rollout at each end (other prompts): not a trend, not shown")
        )
    elif isinstance(rewards, Mapping) and isinstance(rewards.get("first"), Mapping):
        first, last = rewards["first"], rewards["last"]
        text = f"{_window_text(first)} -> {_window_text(last)}"
        if set(first["at_rollouts"]) & set(last["at_rollouts"]):
            text += f" (the two windows share rollouts: fewer than {2 * rewards['window']} rollouts ran)"
        lines.append(
            _row(
                f"rollout reward (critic/rewards/mean; mean ± standard error over the first and the last "
                f"{rewards['window']} rollouts: each rollout scores other prompts, so this is the training "
                "reward's trend, not a held-out gain)",
                text,
            )
        )
    else:
        lines.append(_row("rollout reward", rewards))
    counters = trust.get("counters")
    lines.append(
        _row("counted along the run", _settings(counters) if isinstance(counters, Mapping) else counters)
    )
    validation = trust.get("validation")
    if isinstance(validation, Mapping):
        lines += ["", "Validation means, the base model and the last evaluation:", ""]
        lines += _validation_table(validation)
    return lines


def _window_text(window: Mapping[str, Any]) -> str:
    """``1.02 ± 0.031 over rollouts 1–5 (5)``: a reward window of the card (its total reward)."""
    key, at = "critic/rewards/mean", window["at_rollouts"]
    if key not in window["mean"]:
        return "no critic/rewards/mean logged"
    se = window["standard_error"][key]
    spread = f" ± {se:.3g}" if se is not None else " (one rollout: no spread)"
    return f"{_number(window['mean'][key])}{spread} over rollouts {at[0]}–{at[-1]} ({len(at)})"


def _held_out_text(h: Mapping[str, Any]) -> str:
    text = f"{h['base']:.3f} -> {h['tuned']:.3f}"
    if h.get("gain") is not None:
        text += f" ({_signed(h['gain'])} ± {h['standard_error']:.3f}, {h['paired_samples']} paired samples"
    else:
        text += " (not paired: the evaluations' samples could not be matched"
    return text + f"; the base model -> after {h['after_rollouts']} rollout(s))"


def _gap_text(g: Mapping[str, Any]) -> str:
    if "base" in g:
        return f"{_signed(g['base'])} -> {_signed(g['last'])} (the base model -> after {g['at_rollout']} rollout(s))"
    return f"{_signed(g['last'])} (after {g['at_rollout']} rollout(s))"


def _validation_table(validation: Mapping[str, Any]) -> list[str]:
    base, last = validation.get("base"), validation.get("last")
    lines: list[str] = []
    for label, value in (("base model", base), ("last evaluation", last)):
        if not isinstance(value, Mapping):
            lines.append(f"- {label}: {value}")
    if not isinstance(last, Mapping):
        return lines
    if lines:
        lines.append("")
    base_values = base.get("values", {}) if isinstance(base, Mapping) else {}
    header = f"after {last['at_rollout']} rollout(s) ({last.get('samples')} samples)"
    if isinstance(base, Mapping):
        lines += [f"| key | base model ({base.get('samples')} samples) | {header} |", "| --- | --- | --- |"]
    else:
        lines += [f"| key | {header} |", "| --- | --- |"]
    for key, value in last["values"].items():
        cells = (
            [key]
            + ([_number(base_values.get(key, "—"))] if isinstance(base, Mapping) else [])
            + [_number(value)]
        )
        lines.append("| " + " | ".join(cells) + " |")
    return lines
