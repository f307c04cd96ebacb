"""Every checkpoint carries the run's card (:mod:`lit_flowgrpo.run_card`): :class:`RunCardRecorder`."""

from __future__ import annotations

import math
import os
import platform
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lit_flowgrpo.callbacks._module import as_mapping
from lit_flowgrpo.distributed import DataParallel
from lit_flowgrpo.run_card import (
    CHECKPOINT_KEY,
    FORMAT,
    HeldOutSource,
    class_path,
    is_measured,
    not_measured,
    plain,
    trained_facts,
    versions,
)

__all__ = ["RunCardRecorder", "run_card_callbacks"]

#: The logged keys of a validation (DESIGN.md: ``val-core/...``, ``val-aux/...``).
_VALIDATION = ("val-core/", "val-aux/")
#: ``HeldOutReport``'s proxy-against-gold gap, and any other callback's of the same name.
_GAP = re.compile(r"^val-aux/(?P<proxy>.+)_gap/mean@1$")
_COUNTERS = ("actor/dropped_samples", "actor/nonfinite_losses", "actor/skipped_optimizer_steps")
_REWARDS = re.compile(r"^critic/rewards/(.+/)?mean$")
#: Rollouts averaged at each end of the run for the card's rollout reward: one rollout scores one batch of
#: other prompts, so the first against the last is noise; a window's mean and the spread of its rollouts
#: say how far apart the two ends are.
REWARD_WINDOW = 5


class RunCardRecorder(Callback):
    """Record the run card along ``fit`` and write it into every checkpoint (``checkpoint["run_card"]``).

    :class:`~lit_flowgrpo.module.FlowGRPOModule` adds one to every ``fit`` whose Trainer has none
    (:func:`run_card_callbacks`, through Lightning's ``configure_callbacks``), from the command line or a
    Trainer built by hand; give the Trainer your own (or a subclass) and that one is used. Every source is
    public: the module's settings
    (:func:`~lit_flowgrpo.run_card.trained_facts`), the trainer (steps, seeds, the optimizer, the
    hardware), the metrics the module and the callbacks log (``trainer.callback_metrics``), the steps'
    outputs (the samples generated) and the callbacks that implement
    :class:`~lit_flowgrpo.run_card.HeldOutSource`:

    - ``actor/on_policy_ratio_err`` (the update's first micro-batch, before any weight moves) and
      ``actor/kl_loss``: last, largest and mean over the rollouts. The ratio error counts only where the
      objective logs a ratio (``actor/ratio_mean``; DiffusionNFT has none), the KL only where the
      reference forward ran (``kl.coef`` > 0 or ``kl.measure``);
    - the validation keys (``val-core/*``, ``val-aux/*``: the rewards' means, ``val-aux/diversity``,
      ``val-aux/drift``, a proxy's gap) of the base model (Lightning's sanity check, when it covers the
      whole validation set: ``--trainer.num_sanity_val_steps=-1``) and of the last evaluation;
    - ``critic/rewards/mean`` and each component's, averaged over the first and over the last
      :data:`REWARD_WINDOW` rollouts that logged them (each rollout's value is kept, so the card shows
      the window's mean, its standard error over those rollouts and which rollouts they were), and the
      module's counters (``actor/dropped_samples``, ``actor/nonfinite_losses``, ``actor/skipped_optimizer_steps``).

    Keys the callbacks send straight to the loggers (``rollout/diversity``, ``perf/*``) do not pass
    through ``callback_metrics`` and are not on the card. A resumed run carries on from the card of its
    checkpoint and adds a session (where it resumed from, at which rollout, its versions and hardware);
    a checkpoint without a card starts the aggregates at the resume, and the card says from which rollout
    they count (``trained.measured_from_rollout``).
    """

    def __init__(self) -> None:
        self._samples = 0
        self._rollouts_seen = 0
        self._on_policy = _Series()
        self._ratio_logged = False
        self._kl = _Series()
        self._refreshes: int | None = None
        self._rewards = _RewardWindows()
        self._counters: dict[str, int] = {}
        self._validation: dict[str, dict[str, Any]] = {}
        self._held_out: dict[str, dict[str, Any]] = {}
        self._sessions: list[dict[str, Any]] = []
        self._measured_from = 0
        self._restored = False
        self._validated = False
        self._val_samples = 0

    # -- a session starts -------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After every restore (Lightning restores the loops after on_fit_start): the resumed counters.
        start = _rollouts_done(trainer)
        resumed = trainer.ckpt_path
        if resumed and not self._restored:
            self._measured_from = start  # the checkpoint had no card: nothing before it was seen
        self._sessions.append(
            {
                "resumed_from": None if not resumed else str(resumed),
                "at_rollout": start,
                "at_optimizer_step": trainer.global_step,
                "hardware": _hardware(trainer),
                "versions": versions(),
            }
        )

    # -- rollouts ---------------------------------------------------------------------------------

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        out = as_mapping(outputs)
        generated = torch.tensor(int(out.get("num_images") or 0), device=pl_module.device)
        self._samples += int(DataParallel.of(trainer).stack(generated).sum())  # a collective: every rank
        self._rollouts_seen += 1
        metrics = _floats(trainer.callback_metrics)
        rollout = _rollouts_done(trainer) + 1  # Lightning counts this batch after its batch-end hooks
        # callback_metrics keeps a key's last value: after a rollout whose update trained no sample (on
        # any rank) the on-policy error and the KL there are an earlier rollout's.
        updated = sum(out.get("kept_per_rank") or [1]) > 0
        self._ratio_logged |= "actor/ratio_mean" in metrics
        if updated and "actor/on_policy_ratio_err" in metrics and "actor/ratio_mean" in metrics:
            self._on_policy.add(metrics["actor/on_policy_ratio_err"])
        if updated and "actor/kl_loss" in metrics and _reference_runs(pl_module) is not False:
            self._kl.add(metrics["actor/kl_loss"])
        if "actor/reference_refreshes" in metrics:
            self._refreshes = int(metrics["actor/reference_refreshes"])
        rewards = {k: v for k, v in metrics.items() if _REWARDS.match(k)}
        if rewards:
            self._rewards.add(rollout, rewards)
        self._counters.update({k: int(metrics[k]) for k in _COUNTERS if k in metrics})

    # -- validation -------------------------------------------------------------------------------

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._val_samples = 0

    @override
    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        out = as_mapping(outputs)
        ids = out.get("sample_ids", getattr(batch, "sample_ids", None))
        samples = ids if ids is not None else out.get("images")
        self._val_samples += len(samples) if samples is not None else 0

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After the epoch-end hooks and Lightning's reduction of what they logged (callback_metrics),
        # and before ModelCheckpoint saves (Lightning runs checkpoint callbacks last).
        count = torch.tensor(self._val_samples, device=pl_module.device)
        samples = int(DataParallel.of(trainer).stack(count).sum())  # a collective: every rank
        values = {k: v for k, v in _floats(trainer.callback_metrics).items() if k.startswith(_VALIDATION)}
        snapshot = {"at_rollout": _rollouts_done(trainer), "samples": samples, "values": values}
        if not trainer.sanity_checking:
            self._validation["last"] = snapshot
            self._validated = True
        elif trainer.global_step == 0 and "base" not in self._validation and _whole_set(trainer):
            # Lightning drops what the sanity check logs, but callback_metrics holds it until the
            # check ends: the base model's validation, when it covered every validation batch.
            self._validation["base"] = snapshot
        self._ask_sources(trainer)

    def _ask_sources(self, trainer: Trainer) -> None:
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if callback is self or not isinstance(callback, HeldOutSource):
                continue
            gain = callback.held_out_gain()
            if gain is None:
                continue
            new, old = plain(gain), self._held_out.get(gain.component)
            # A resumed source may know the last evaluation but no longer its per-sample values: keep
            # the paired gain measured then.
            if old and old["after_rollouts"] == new["after_rollouts"] and new["gain"] is None:
                continue
            self._held_out[gain.component] = new

    # -- checkpoints ------------------------------------------------------------------------------

    @override
    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._ask_sources(trainer)
        checkpoint[CHECKPOINT_KEY] = self.card(trainer, pl_module)

    @override
    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        card = checkpoint.get(CHECKPOINT_KEY)
        if not isinstance(card, dict) or not isinstance(card.get("trust"), dict):
            return
        trained, trust = card["trained"], card["trust"]
        self._samples = int(trained.get("samples_generated") or 0)
        self._measured_from = int(trained.get("measured_from_rollout") or 0)
        self._on_policy = _Series.restore(trust.get("on_policy_ratio_error"))
        self._ratio_logged = self._on_policy.count > 0
        self._kl = _Series.restore(trust.get("kl_to_reference"))
        kl = trust.get("kl_to_reference")
        self._refreshes = kl.get("reference_refreshes") if isinstance(kl, dict) else None
        self._rewards = _RewardWindows.restore(trust.get("rewards"))
        self._counters = dict(trust["counters"]) if isinstance(trust.get("counters"), dict) else {}
        validation = trust.get("validation") or {}
        self._validation = {k: v for k, v in validation.items() if isinstance(v, dict)}
        self._validated = "last" in self._validation
        held = trust.get("held_out")
        self._held_out = {h["component"]: h for h in held} if isinstance(held, list) else {}
        self._sessions = list(card.get("sessions") or [])
        self._rollouts_seen = int(trained.get("rollouts") or 0) - self._measured_from
        self._restored = True

    def card(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        """The run card as of now (:mod:`lit_flowgrpo.run_card` describes its fields)."""
        trained = trained_facts(pl_module)
        trained["seeds"] = {
            "seed_everything": int(os.environ["PL_GLOBAL_SEED"])
            if "PL_GLOBAL_SEED" in os.environ
            else "not set",
            "module": trained.pop("seed"),
            "data": plain(getattr(trainer.datamodule, "seed", "not set")),
        }
        trained |= {
            "optimizer": _optimizer(trainer),
            "rollouts": _rollouts_done(trainer),
            "optimizer_steps": trainer.global_step,
            "samples_generated": self._samples,
            "measured_from_rollout": self._measured_from,
        }
        return {
            "format": FORMAT,
            "trained": trained,
            "sessions": plain(self._sessions),
            "trust": self._trust(pl_module),
        }

    def _trust(self, pl_module: LightningModule) -> dict[str, Any]:
        none_yet = "no rollout ran" if not self._rollouts_seen else None
        on_policy = (
            self._on_policy.facts()
            if self._on_policy.count
            else not_measured(
                none_yet
                or (
                    "the objective logs no importance ratio (actor/ratio_mean): it trains without one, so "
                    "actor/on_policy_ratio_err has nothing to measure"
                    if not self._ratio_logged
                    else "the module logs no actor/on_policy_ratio_err"
                )
            )
        )
        if self._kl.count:
            kl: Any = {"reference": _reference(pl_module), **self._kl.facts()}
            if self._refreshes is not None:
                kl["reference_refreshes"] = self._refreshes
        elif _reference_runs(pl_module) is False:
            kl = not_measured(
                "β is 0 and kl.measure is off, so the reference forward did not run "
                "(--model.init_args.kl.measure=true measures it at β 0)"
            )
        else:
            kl = not_measured(none_yet or "the module logs no actor/kl_loss")
        last = self._validation.get("last")
        return {
            "held_out": list(self._held_out.values()) or not_measured(self._held_out_why()),
            "on_policy_ratio_error": on_policy,
            "kl_to_reference": kl,
            "proxy_gap": self._proxy_gap(),
            "diversity": _validated(last, "val-aux/diversity", "OverOptimizationMonitor's diversity"),
            "drift": _validated(last, "val-aux/drift", "OverOptimizationMonitor's drift from the base model"),
            "validation": {
                "base": self._validation.get("base")
                or not_measured(
                    "the base model was not validated on the whole validation set before training "
                    "(--trainer.num_sanity_val_steps=-1 does it)"
                ),
                "last": last or not_measured("no validation ran after training began"),
            },
            "rewards": self._rewards.facts()
            or not_measured(none_yet or "the module logs no critic/rewards/mean"),
            "counters": dict(self._counters) or not_measured(none_yet or "the module logs no counters"),
        }

    def _held_out_why(self) -> str:
        if not self._validated:
            return "no validation ran after training began"
        return (
            "no callback of the run measured a paired gain: one that implements "
            "lit_flowgrpo.run_card.HeldOutSource (the shapes world's HeldOutReport does) needs the base "
            "model's evaluation (--trainer.num_sanity_val_steps=-1) and one after training"
        )

    def _proxy_gap(self) -> Any:
        gaps = [
            {
                "proxy": h["proxy"]["proxy"],
                "gold": h["component"],
                "base": h["proxy"]["gap_base"],
                "last": h["proxy"]["gap_tuned"],
                "at_rollout": h["after_rollouts"],
            }
            for h in self._held_out.values()
            if h.get("proxy")
        ]
        last = self._validation.get("last")
        named = {g["proxy"] for g in gaps}
        for key, value in (last["values"] if last else {}).items():
            match = _GAP.match(key)
            if match and match["proxy"] not in named:
                gaps.append(
                    {
                        "proxy": match["proxy"],
                        "gold": "the tracked score",
                        "last": value,
                        "at_rollout": last["at_rollout"],
                    }
                )
        return gaps or not_measured(
            "no proxy-against-gold gap was logged (val-aux/<proxy>_gap/mean@1: HeldOutReport's proxy "
            "setting, with the gold component in the reward at weight 0)"
        )


@dataclass
class _Series:
    """Last, largest and mean of a value logged once per rollout (non-finite values are counted apart)."""

    last: float = math.nan
    largest: float = -math.inf
    total: float = 0.0
    count: int = 0
    nonfinite: int = 0

    def add(self, value: float) -> None:
        if not math.isfinite(value):
            self.nonfinite += 1
            return
        self.last, self.largest = value, max(self.largest, value)
        self.total += value
        self.count += 1

    def facts(self) -> dict[str, Any]:
        out: dict[str, Any] = {"last": self.last, "max": self.largest, "mean": self.total / self.count}
        out |= {"rollouts": self.count, "nonfinite_rollouts": self.nonfinite}
        return out

    @classmethod
    def restore(cls, facts: Any) -> _Series:
        if not isinstance(facts, dict) or not is_measured(facts) or "rollouts" not in facts:
            return cls()
        n = int(facts["rollouts"])
        return cls(facts["last"], facts["max"], facts["mean"] * n, n, int(facts.get("nonfinite_rollouts", 0)))


def run_card_callbacks(trainer: Trainer) -> list[Callback]:
    """``[RunCardRecorder()]`` for a ``fit`` whose Trainer has no recorder, else ``[]``: what
    :meth:`~lit_flowgrpo.module.FlowGRPOModule.configure_callbacks` returns. A Trainer's own recorder is
    kept (Lightning lets a module's callback replace the Trainer's of the same type or a subclass of it,
    so returning one here would drop a user's subclass); validate, test and predict write no checkpoint
    and get none."""
    if trainer.state.fn != "fit" or any(isinstance(c, RunCardRecorder) for c in trainer.callbacks):
        return []
    return [RunCardRecorder()]


@dataclass
class _RewardWindows:
    """The rollouts' reward means (``critic/rewards/mean`` and each component's) of the first and of the
    last :data:`REWARD_WINDOW` rollouts that logged them, each rollout's values kept as logged."""

    first: list[dict[str, Any]] = field(default_factory=list)
    last: list[dict[str, Any]] = field(default_factory=list)

    def add(self, rollout: int, values: dict[str, float]) -> None:
        entry = {"at_rollout": rollout, "values": values}
        if len(self.first) < REWARD_WINDOW:
            self.first.append(entry)
        self.last = [*self.last, entry][-REWARD_WINDOW:]

    def facts(self) -> dict[str, Any]:
        if not self.first:
            return {}
        return {"window": REWARD_WINDOW, "first": _window(self.first), "last": _window(self.last)}

    @classmethod
    def restore(cls, facts: Any) -> _RewardWindows:
        if not isinstance(facts, dict) or not is_measured(facts) or "window" not in facts:
            return cls()  # none, or a card of the earlier format (one rollout at each end): start afresh
        return cls(list(facts["first"]["rollouts"]), list(facts["last"]["rollouts"]))


def _window(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """A window's mean and standard error (sample std over its rollouts / √n) per key, and its rollouts.
    The rollouts of a window are not independent draws (the policy moves between them): the standard
    error says how much one rollout's batch of prompts scatters, not a confidence interval."""
    keys = sorted({k for e in entries for k in e["values"]})
    mean, standard_error = {}, {}
    for key in keys:
        xs = [float(e["values"][key]) for e in entries if key in e["values"]]
        m = math.fsum(xs) / len(xs)
        mean[key] = m
        standard_error[key] = (
            math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs)) if len(xs) > 1 else None
        )
    return {
        "at_rollouts": [e["at_rollout"] for e in entries],
        "mean": mean,
        "standard_error": standard_error,
        "rollouts": entries,
    }


def _rollouts_done(trainer: Trainer) -> int:
    """Training batches (rollouts) completed over the whole run, resumed runs included: the fit loop's
    batch progress, which Lightning counts after a batch's ``on_train_batch_end`` hooks and before the
    validation and the checkpoint that follow the batch (``trainer.global_step`` counts optimizer
    steps, several a rollout under manual optimization; the loggers' step is one behind in validation)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.total.completed)


def _floats(metrics: Any) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def _validated(last: dict[str, Any] | None, key: str, what: str) -> Any:
    if last is None:
        return not_measured("no validation ran after training began")
    if key not in last["values"]:
        return not_measured(
            f"{key} was not logged ({what}: add lit_flowgrpo.callbacks.OverOptimizationMonitor to the callbacks)"
        )
    return {"value": last["values"][key], "at_rollout": last["at_rollout"]}


def _reference_runs(pl_module: LightningModule) -> bool | None:
    """Whether the module's KL reference forward runs (``kl.runs_reference``); None: it does not say."""
    value = getattr(getattr(pl_module, "kl", None), "runs_reference", None)
    return value if isinstance(value, bool) else None


def _reference(pl_module: LightningModule) -> str:
    """What the KL is measured against, from the module's ``kl.reference`` settings."""
    reference = getattr(getattr(pl_module, "kl", None), "reference", None)
    mode = getattr(reference, "mode", None)
    if mode == "initial":
        return "the base model (the initial weights)"
    if mode == "refreshed":
        return "the trained weights at the last refresh (kl.reference.mode=refreshed)"
    if mode == "ema":
        return f"an EMA of the trained weights (kl.reference.ema_decay={reference.ema_decay})"
    return "the module's reference"


def _whole_set(trainer: Trainer) -> bool:
    """Whether this sanity check runs every validation batch (``num_sanity_val_steps=-1``, or as many)."""
    checked, total = trainer.num_sanity_val_batches, trainer.num_val_batches
    return bool(total) and all(c >= t for c, t in zip(checked, total, strict=False))


def _optimizer(trainer: Trainer) -> Any:
    if not trainer.optimizers:
        return not_measured("the run has no optimizer")
    optimizer = trainer.optimizers[0]
    facts: dict[str, Any] = {"class": class_path(optimizer)}
    for key in ("lr", "betas", "eps", "weight_decay", "momentum"):
        if key in optimizer.defaults:
            facts[key] = plain(optimizer.defaults[key])
    if trainer.lr_scheduler_configs:
        facts["lr_scheduler"] = class_path(trainer.lr_scheduler_configs[0].scheduler)
    return facts


def _hardware(trainer: Trainer) -> dict[str, Any]:
    device = trainer.strategy.root_device
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine()
    )
    return {
        "accelerator": device.type,
        "device": name,
        "devices_per_node": trainer.num_devices,
        "nodes": trainer.num_nodes,
        "world_size": trainer.world_size,
        "strategy": class_path(trainer.strategy),
        "precision": str(trainer.precision),
        "cpu_count": os.cpu_count(),
    }
