"""What the command line is checked for before any class is instantiated, so before any weight is
read: Lightning's automatic-optimization flags that a manually optimized FlowGRPOModule cannot honour,
strategies it cannot run under, callbacks the Trainer's own flags rule out, and what ``export`` and
``validate`` need. Each check returns its problems (empty when fine); :class:`lit_flowgrpo.cli.FlowGRPOCLI`
collects them into one :class:`~lit_flowgrpo.errors.SettingsError`.
"""

from __future__ import annotations

import importlib
from typing import Any

import lightning as L
from jsonargparse import Namespace

__all__ = [
    "LR_SCHEDULER_FLAG",
    "MAX_GRAD_NORM_FLAG",
    "OPTIMIZER_FLAG",
    "OPTIMIZER_STEPS_FLAG",
    "callback_problems",
    "export_problems",
    "import_class",
    "is_flowgrpo",
    "manual_optimization_problems",
    "out_problems",
    "strategy_problems",
    "validate_problems",
]

# The FlowGRPOModule flags that do what Lightning's automatic-optimization flags would do: the module
# optimizes manually (one rollout feeds several optimizer steps), so the Trainer's versions cannot apply.
MAX_GRAD_NORM_FLAG = "--model.init_args.update.max_grad_norm"
OPTIMIZER_STEPS_FLAG = "--model.init_args.update.optimizer_steps_per_rollout"
OPTIMIZER_FLAG = "--model.init_args.optimizer"
LR_SCHEDULER_FLAG = "--model.init_args.lr_scheduler"


def is_flowgrpo(model_class: type) -> bool:
    """Whether ``model_class`` is FlowGRPOModule or a subclass (the checks that follow apply to it only)."""
    from lit_flowgrpo.module import FlowGRPOModule

    return isinstance(model_class, type) and issubclass(model_class, FlowGRPOModule)


def import_class(class_path: str) -> Any:
    """The object a ``class_path`` (``package.module.Name``) names, imported."""
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def manual_optimization_problems(cfg: Namespace) -> list[str]:
    """Lightning's automatic-optimization flags set on a FlowGRPOModule run, each with the module's flag
    that does the job."""
    trainer = cfg.get("trainer") or Namespace()
    problems = []
    if trainer.get("gradient_clip_val") not in (None, 0, 0.0):
        problems.append(
            f"--trainer.gradient_clip_val ({trainer.gradient_clip_val}) does not apply to FlowGRPOModule, "
            f"which steps its optimizer itself: set {MAX_GRAD_NORM_FLAG} instead"
        )
    if trainer.get("accumulate_grad_batches", 1) != 1:
        problems.append(
            f"--trainer.accumulate_grad_batches ({trainer.accumulate_grad_batches}) does not apply to "
            "FlowGRPOModule: one rollout batch feeds several optimizer steps, with gradients accumulated "
            f"in between; set {OPTIMIZER_STEPS_FLAG} instead"
        )
    if cfg.get("optimizer") is not None:
        problems.append(
            f"--optimizer does not apply to FlowGRPOModule, which builds its optimizer over its trainable "
            f"weights only: set {OPTIMIZER_FLAG} instead (e.g. {OPTIMIZER_FLAG}=torch.optim.SGD "
            f"{OPTIMIZER_FLAG}.init_args.lr=1e-4)"
        )
    if cfg.get("lr_scheduler") is not None:
        problems.append(f"--lr_scheduler does not apply to FlowGRPOModule: set {LR_SCHEDULER_FLAG} instead")
    return problems


def strategy_problems(cfg: Namespace) -> list[str]:
    """A strategy FlowGRPOModule cannot run under, refused by its name or class path before the Trainer
    builds it: Lightning's own checks at that point ("FSDP needs a GPU", "install deepspeed") would
    otherwise speak first and send the user to fix the wrong thing."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lit_flowgrpo.strategies import unsupported_strategy

    strategy = (cfg.get("trainer") or Namespace()).get("strategy")
    if isinstance(strategy, Namespace):
        strategy = strategy.get("class_path")
    if not isinstance(strategy, str):
        return []  # an instance (Python use) is judged in FlowGRPOModule.setup
    if strategy in StrategyRegistry:
        cls = StrategyRegistry[strategy]["strategy"]
    elif "." in strategy:
        try:
            cls = import_class(strategy)
        except (ImportError, AttributeError, ValueError):
            return []  # jsonargparse or Lightning names an unknown class
    else:
        return []  # "auto" and unknown names are Lightning's to judge
    why = unsupported_strategy(cls, strategy) if isinstance(cls, type) else None
    return [why] if why else []


def callback_problems(cfg: Namespace) -> list[str]:
    """Callbacks the Trainer's own flags rule out, refused before any weight is read: Lightning says
    so only once the Trainer is built (a progress bar) or at ``on_train_start`` (a LearningRateMonitor
    without a logger), as a traceback."""
    from lightning.pytorch.callbacks import LearningRateMonitor, ProgressBar

    trainer = cfg.get("trainer") or Namespace()
    callbacks = trainer.get("callbacks") or []
    problems = []
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        path = callback.get("class_path") if isinstance(callback, Namespace) else None
        try:
            cls = import_class(path) if path else None
        except (ImportError, AttributeError, ValueError):
            continue
        if not isinstance(cls, type):
            continue
        if issubclass(cls, LearningRateMonitor) and trainer.get("logger") is False:
            problems.append(
                f"--trainer.logger=false with {path} in --trainer.callbacks: it logs through a logger; "
                "keep a logger, or drop the callback"
            )
        if issubclass(cls, ProgressBar) and trainer.get("enable_progress_bar") is False:
            problems.append(
                f"--trainer.enable_progress_bar=false with {path} in --trainer.callbacks: drop the "
                "callback from the config to run without a progress bar, or keep the bar"
            )
    return problems


def export_problems(cfg: Namespace, flowgrpo: bool) -> list[str]:
    """What ``export`` lacks: a FlowGRPOModule, ``--ckpt_path``, and an ``--out`` it may write."""
    problems = []
    if not flowgrpo:
        problems.append(
            "export: --model must be a FlowGRPOModule (the config of an RL run): nothing to export"
        )
    if not cfg.get("ckpt_path"):
        problems.append("export: --ckpt_path is required: a checkpoint written by `fit`, or `last`")
    if not cfg.get("out"):
        problems.append("export: --out is required: the folder to write the weights to")
    else:
        problems += out_problems(cfg.out, bool(cfg.get("overwrite")))
    return problems


def validate_problems(cfg: Namespace, model_class: Any) -> list[str]:
    """``validate`` with nothing to validate would load the weights, run no batch and exit 0 without a
    metric: refused first."""
    if isinstance(model_class, type) and model_class.validation_step is L.LightningModule.validation_step:
        return [f"validate: {model_class.__name__} has no validation step: nothing to validate"]
    from lit_flowgrpo.data import PromptDataModule

    data = cfg.get("data")
    data_class = (
        import_class(data.class_path) if isinstance(data, Namespace) and data.get("class_path") else None
    )
    if (
        isinstance(data_class, type)
        and issubclass(data_class, PromptDataModule)
        and not data.init_args.get("val")
    ):
        return [
            "validate: --data.init_args.val is null, so there is nothing to validate on: give held-out "
            "prompts (a .txt or .jsonl file), e.g. --data.init_args.val=prompts.txt"
        ]
    return []


def out_problems(out: str, overwrite: bool) -> list[str]:
    """Why ``export`` may not write to ``out`` (see :func:`lit_flowgrpo.export.destination_problems`)."""
    from lit_flowgrpo.export import destination_problems

    return [
        f"export: {p}"
        for p in destination_problems(str(out), overwrite, path_name="--out", overwrite_name="--overwrite")
    ]
