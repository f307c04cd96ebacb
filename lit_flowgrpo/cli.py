"""``lit-flowgrpo``: LightningCLI over any LightningModule / LightningDataModule, plus ``export``.

    lit-flowgrpo fit --config quickstart                      # a shipped recipe, from any folder
    lit-flowgrpo fit --config configs/quickstart.yaml         # the same file, from a clone's root
    lit-flowgrpo fit --config configs/tiny_sd3.yaml --ckpt_path last
    lit-flowgrpo validate --config configs/tiny_sd3.yaml --ckpt_path last
    lit-flowgrpo fit --config configs/tiny_sd3.yaml --print_config
    lit-flowgrpo export --config RUN/config.yaml --ckpt_path last --out exported/
    lit-flowgrpo serve-reward --config reward_server/shapes   # a reward over HTTP (lit_flowgrpo.rewards.server)

Model and data are chosen by ``class_path`` (``FlowGRPOModule`` for RL, the toy pretraining
module for the base model), and scale comes from the Trainer's own flags
(``--trainer.strategy=ddp|fsdp2``, ``--trainer.devices``, ``--trainer.num_nodes``; FSDP1,
``fsdp``, is refused: see :mod:`lit_flowgrpo.strategies`).

What this adds to LightningCLI (the checks run before any class is instantiated, so before any
weight is read):

- the recipes ship in the package (``lit_flowgrpo/configs``; a clone's ``configs/`` links there), and
  ``--config NAME`` names one from any folder; a prompt file a config names relatively is read from
  that config's folder (see :class:`lit_flowgrpo.data.PromptDataModule`);
- ``fit``, ``validate`` (which needs held-out prompts) and ``export``: Lightning's ``test`` and
  ``predict`` are not offered, since no module here has a test or predict step (a test set is
  ``validate`` with ``--data.init_args.val``; images come from the exported weights' pipeline);
- Lightning's automatic-optimization flags, which a manually optimized FlowGRPOModule cannot honour,
  are refused with the flag that does the job;
- ``--ckpt_path`` must name an existing checkpoint that torch reads without unpickling code, whole;
  ``last`` finds the run's newest ``last*.ckpt`` and is refused when there is none (a ModelCheckpoint
  without ``dirpath`` is kept in ``<trainer.default_root_dir>/checkpoints`` rather than in a new
  ``version_N`` folder per run, where ``last`` would never find it: Lightning #18524);
- a resumed run whose settings differ from the checkpoint's is refused, listing the differences,
  unless ``--override_checkpoint_settings=true`` (then the command line's values apply), which cannot
  change the settings that give the checkpoint's weights their shapes (the LoRA rank, targets, or LoRA
  against a full fine-tune);
- a constructor's own error is reported once, without jsonargparse's wrapping, and a ``SettingsError``
  from any later check before the first rollout (``setup``, the strategy) as one message too, printed
  once per machine (by its first process) however many ranks raise it;
- strategies FlowGRPOModule cannot run under are refused by name before Lightning's own checks;
- a command line that does not parse is searched for known mistakes (``cli_diagnosis``), which are
  reported with the valid choices instead of jsonargparse's report;
- the full resolved config goes to every logger and to ``config.yaml`` in the run's own log folder,
  with the files it names as absolute paths;
- the start is quiet: the model summary counts parameters only (Lightning's "modules in eval mode"
  and its FLOP count, 0 for a module whose forward is not the training computation, are left out:
  ``RLThroughputMonitor`` measures FLOPs and MFU), and Lightning's advertisement for its cloud
  logger is not shown.

The checks of a parsed command line live in :mod:`lit_flowgrpo.cli_checks`, those of ``--ckpt_path``
and of a resume's settings in :mod:`lit_flowgrpo.cli_resume`; this file wires them into LightningCLI.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import yaml
from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

import lit_flowgrpo.strategies  # noqa: F401  (registers --trainer.strategy=fsdp2)
from lit_flowgrpo.cli_checks import (
    callback_problems,
    export_problems,
    import_class,
    is_flowgrpo,
    manual_optimization_problems,
    out_problems,
    strategy_problems,
    validate_problems,
)
from lit_flowgrpo.cli_resume import (
    check_folder_strategy,
    optimizer_differences,
    pin_checkpoint_dirs,
    resolve_ckpt_path,
    setting_differences,
    shape_differences,
)
from lit_flowgrpo.errors import SettingsError

OVERRIDE_FLAG = "override_checkpoint_settings"
#: The recipes shipped with the package (package data, so a ``pip install`` has them); a clone's
#: ``configs/`` is a link to this folder, so ``--config configs/quickstart.yaml`` reads the same files.
CONFIG_DIR = Path(__file__).resolve().parent / "configs"


class FlowGRPOTrainer(L.Trainer):
    """Lightning's Trainer with one more method, ``export``.

    LightningCLI makes a subcommand of a Trainer method named in ``subcommands()``: the method's
    signature and docstring become the subcommand's flags and ``--help``, and it is called with the
    model the config describes. That is why ``export`` lives here rather than in a separate parser:
    it then reads a run's ``config.yaml`` and takes ``--model.…`` overrides exactly as ``fit`` does.
    """

    def export(
        self,
        model: L.LightningModule,
        datamodule: L.LightningDataModule | None = None,
        ckpt_path: str | None = None,
        out: str | None = None,
        overwrite: bool = False,
        use_ema: bool = True,
        weights_only: bool | None = None,
        license: str | None = None,
    ) -> None:
        """Write a checkpoint's trained weights for diffusers (a LoRA adapter or a transformer folder) and
        its run card (``README.md``, a Hugging Face Hub model card: :mod:`lit_flowgrpo.run_card`).

        Args:
            model: the run's module (from ``--config`` and ``--model.…`` overrides).
            datamodule: unused (export reads no data).
            ckpt_path: a checkpoint written by ``fit``, or ``last`` for the run's newest one.
            out: folder to write: a LoRA run's adapter (``pipeline.load_lora_weights(out)``), a full
                fine-tune's transformer (``from_pretrained(out)``). It must be new or empty unless
                ``overwrite``.
            overwrite: replace what ``out`` holds (an earlier export) with this export, wholly: the new
                export is written beside ``out`` and takes its place once complete.
            use_ema: export the EMA weights if the checkpoint has them.
            weights_only: unused; accepted so that the ``config.yaml`` a ``fit`` run saved loads as is.
            license: the exported weights' license for the card's metadata (a Hub license id, such as
                ``apache-2.0`` or ``other``); ``None`` leaves it out: a fine-tune's license follows its
                base model's, which the run does not record.
        """
        del datamodule, weights_only
        if ckpt_path is None or out is None:
            raise ValueError("export needs ckpt_path (a checkpoint written by `fit`) and out (a folder)")
        if not hasattr(model, "export"):
            raise ValueError(f"{type(model).__name__} has no export(): nothing to export")
        # Checked here too (the CLI checks before instantiating) for a Trainer called from Python:
        # before the checkpoint is read, not after.
        problems = out_problems(out, overwrite)
        if problems:
            raise SettingsError("; ".join(problems))
        model.load_trainable_checkpoint(ckpt_path, use_ema=use_ema)
        from lit_flowgrpo.run_card import write_export

        written = write_export(model, ckpt_path, out, overwrite=overwrite, use_ema=use_ema, license=license)
        rank_zero_info(f"exported {ckpt_path}: {written}")


class LogRunConfig(SaveConfigCallback):
    """The resolved config to every logger (flattened, one key per flag) and to ``config.yaml`` in the
    run's own log folder.

    Lightning's default writes to ``trainer.log_dir``, which for W&B (and without a logger) is a folder
    every run of the config shares, hence the ``overwrite`` it needed; and the loggers only ever saw the
    module's scalar arguments.
    """

    def __init__(self, parser: LightningArgumentParser, config: Namespace, **kwargs: Any) -> None:
        super().__init__(parser, config, save_to_log_dir=False, **kwargs)

    def save_config(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Rank zero only (Lightning calls this there): no collective calls below. skip_unset=False keeps
        # the None values (jsonargparse's name since 4.49 for skip_none, which 5.0 removes).
        dumped = yaml.safe_load(self.parser.dump(self.config, skip_unset=False))
        flat = _flatten(dumped)
        for logger in trainer.loggers:
            logger.log_hyperparams(flat)  # starts a W&B run, so its id (the folder name) is known below
        folder = Path(_run_dir(trainer))
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / self.config_filename
        stem, suffix = path.stem, path.suffix
        n = 0
        while path.exists():  # a resumed run logging into the same folder keeps the earlier config
            n += 1
            path = folder / f"{stem}-{n}{suffix}"
        self.parser.save(self.config, str(path), skip_unset=False, multifile=self.multifile)


class ParameterSummary(ModelSummary):
    """Lightning's model summary (the CLI's default one) without two of its lines that mislead here.

    "Modules in eval mode: N" reads like a mistake, yet the frozen networks are in eval mode on purpose
    (none may drop out); and "Total FLOPs: 0" sits beside the MFU that ``RLThroughputMonitor`` measures,
    because Lightning counts FLOPs only from an example forward, which a policy-gradient step is not.
    The table and the parameter counts are Lightning's, formatted here because Lightning's formatter
    always adds both lines.
    """

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        from lightning.pytorch.utilities.model_summary import (
            get_formatted_model_size,
            get_human_readable_count,
        )

        columns = [(name, values) for name, values in summary_data if name not in ("Mode", "FLOPs")]
        widths = [max([len(name), *(len(str(v)) for v in values)]) for name, values in columns]
        header = " | ".join(name.ljust(w) for (name, _), w in zip(columns, widths, strict=True))
        rows = [
            " | ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True))
            for row in zip(*(v for _, v in columns), strict=True)
        ]
        rule = "-" * len(header)
        totals = [
            (get_human_readable_count(trainable_parameters), "Trainable params"),
            (get_human_readable_count(total_parameters - trainable_parameters), "Non-trainable params"),
            (get_human_readable_count(total_parameters), "Total params"),
            (get_formatted_model_size(model_size), "Total estimated model params size (MB)"),
        ]
        lines = [header, rule, *rows, rule, *(f"{value:<10} {name}" for value, name in totals)]
        rank_zero_info("\n" + "\n".join(lines))


def _no_advertisement(record: logging.LogRecord) -> bool:
    """Lightning's "💡 Tip" lines, at every start, advertise its cloud logger and model registry."""
    return not str(record.msg).startswith("💡 Tip")


class FlowGRPOArgumentParser(LightningArgumentParser):
    """Lightning's parser, whose dumps (``--print_config``, the run's ``config.yaml``, what the loggers
    get) name each file jsonargparse resolved (a prompt file named relative to its config file) by its
    absolute path.

    jsonargparse writes such a path back as it was given, relative to the config file it came from; a
    printed or saved config lies elsewhere and would name other files. Done by hand because jsonargparse's
    dump has no option for absolute paths.
    """

    def dump(self, cfg: Namespace, *args: Any, **kwargs: Any) -> str:
        from jsonargparse import Path as ResolvedPath

        cfg = cfg.clone()
        for key, value in cfg.items():
            if isinstance(value, ResolvedPath):
                cfg[key] = os.path.realpath(value)
        if "skip_none" in kwargs:  # Lightning still passes jsonargparse's old name (deprecated in 4.49)
            kwargs["skip_unset"] = kwargs.pop("skip_none")
        return super().dump(cfg, *args, **kwargs)


class FlowGRPOCLI(LightningCLI):
    """LightningCLI with subclass mode for model and data, the ``export`` subcommand, and the checks above."""

    def __init__(self, args: Sequence[str] | None = None, run: bool = True) -> None:
        logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_no_advertisement)
        super().__init__(
            L.LightningModule,
            L.LightningDataModule,
            save_config_callback=LogRunConfig,
            parser_class=FlowGRPOArgumentParser,
            trainer_class=FlowGRPOTrainer,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=list(args) if args is not None else None,
            run=run,
        )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        # Lightning's `test` and `predict` are left out: no module here has a test or predict step, so
        # they could only fail after loading the weights. Validation on a test set is `validate` with
        # --data.init_args.val; images come from the exported weights in the family's pipeline.
        lightning = LightningCLI.subcommands()
        return {"fit": lightning["fit"], "validate": lightning["validate"], "export": {"model", "datamodule"}}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            f"--{OVERRIDE_FLAG}",
            type=bool,
            default=False,
            help="With --ckpt_path: run with this command line's module settings where they differ from "
            "the checkpoint's. Without it such a run is refused, listing the differences (Lightning "
            "would otherwise silently take the checkpoint's values).",
        )

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        # main() always hands the words over as `args`, so LightningCLI's note about `args` and
        # `sys.argv` both being set would print on every run: parse without it.
        if isinstance(args, (dict, Namespace)):
            self.config = parser.parse_object(args)
        else:
            self.config = _parse_args(
                parser, _nested_nulls(_named_configs(sys.argv[1:] if args is None else args))
            )
        subcommand = self.config.get("subcommand")
        if subcommand:
            self._check_before_instantiation(subcommand, self.config[subcommand])

    # ----------------------------------------------------------------------------------------------
    # Checks on the parsed config, before any class is instantiated
    # ----------------------------------------------------------------------------------------------

    def _check_before_instantiation(self, subcommand: str, cfg: Namespace) -> None:
        model_class = import_class(cfg.model.class_path) if cfg.get("model") else None
        flowgrpo = model_class is not None and is_flowgrpo(model_class)
        problems = manual_optimization_problems(cfg) if flowgrpo else []
        if subcommand != "export":  # export builds no strategy, logger or callback
            problems += (strategy_problems(cfg) if flowgrpo else []) + callback_problems(cfg)
        if subcommand == "export":
            problems += export_problems(cfg, flowgrpo)
        if subcommand == "validate":
            problems += validate_problems(cfg, model_class)
        pin_checkpoint_dirs(cfg)
        if cfg.get("ckpt_path"):
            try:
                cfg.ckpt_path = resolve_ckpt_path(cfg.ckpt_path, cfg)
            except SettingsError as err:
                problems.append(str(err))
        if problems:
            raise SettingsError("\n  ".join(problems))

    def _parse_ckpt_path(self) -> None:
        # Lightning lays the checkpoint's hyper-parameters over the parsed config, so a setting changed
        # on the command line of a resumed run is silently replaced by the checkpoint's. Let it compute
        # that overlay, then keep the command line and report what the overlay would have changed.
        subcommand = self.config.get("subcommand")
        if not subcommand or not self.config[subcommand].get("ckpt_path"):
            return
        given = self.config.clone()
        self._overlay_checkpoint_settings(subcommand)
        settings = setting_differences(given[subcommand].get("model"), self.config[subcommand].get("model"))
        shapes = shape_differences(given[subcommand].get("model"), self.config[subcommand].get("model"))
        self.config = given
        cfg = given[subcommand]
        if subcommand != "export":  # export reads a folder itself, in one process
            check_folder_strategy(Path(str(cfg.ckpt_path)), cfg)
        optimizer = optimizer_differences(cfg)
        if not settings and not optimizer:
            return
        lines = "\n  ".join(
            [f"--model.{key}: command line {new!r}, checkpoint {old!r}" for key, new, old in settings]
            + [f"{key}: command line {new!r}, checkpoint {old!r}" for key, new, old in optimizer]
        )
        opted_in = bool(cfg.get(OVERRIDE_FLAG))
        if opted_in and shapes:
            raise SettingsError(
                f"--{OVERRIDE_FLAG} cannot change {shapes[0]}, which sets which weights the checkpoint holds "
                "and their shapes, so they would not load: resume with the checkpoint's value, or start a "
                "new run without --ckpt_path"
            )
        if optimizer or not opted_in:
            why = ""
            if settings and not opted_in:
                why += (
                    "\nResume with the checkpoint's values (drop these overrides, or use the run's config.yaml), "
                    f"or pass --{OVERRIDE_FLAG}=true to run with the command line's module settings."
                )
            if optimizer:
                why += (
                    "\nThe optimizer's settings come back with its state from the checkpoint whatever the "
                    f"command line says (--{OVERRIDE_FLAG} cannot change them): drop these overrides, or "
                    "start a new run."
                )
            raise SettingsError(
                f"--ckpt_path ({cfg.ckpt_path}) was written with other settings than this command line's:"
                f"\n  {lines}{why}"
            )
        rank_zero_warn(f"--{OVERRIDE_FLAG}: the command line's settings replace the checkpoint's:\n  {lines}")

    def _overlay_checkpoint_settings(self, subcommand: str) -> None:
        """Lightning's overlay of a checkpoint's hyper-parameters (``LightningCLI._parse_ckpt_path``),
        for a file and for a sharded checkpoint folder (whose are in its ``meta.pt``, which Lightning
        does not read), with the settings that moved to another group since the checkpoint was written
        moved first (:func:`~lit_flowgrpo.cli_diagnosis.move_old_settings`), so that it resumes.

        Written out because Lightning's reads folders not at all and files whole; here the file is
        memory-mapped, so only the small hyper-parameters are read (not the EMA's tensors).
        """
        path = Path(str(self.config[subcommand].ckpt_path))
        import torch
        from lightning.fabric.utilities.load import _METADATA_FILENAME

        from lit_flowgrpo.cli_diagnosis import move_old_settings

        file = path / _METADATA_FILENAME if path.is_dir() else path
        if not file.is_file():
            return
        meta = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        hparams = dict(meta.get("hyper_parameters") or {})
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        moved = move_old_settings(hparams)
        if moved:
            rank_zero_info(f"{path} was written before settings moved: " + "; ".join(moved))
        if "_class_path" in hparams:  # the form LightningCLI saves, read back as Lightning does
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except Exception as err:
            own = _own_error(err)
            if own is err or not isinstance(own, ValueError):
                raise
            # jsonargparse re-raises a constructor's error inside a "Does not validate against any of
            # the Union subtypes" error that repeats it and dumps the whole Namespace: keep ours only.
            raise SettingsError(str(own)) from own

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        if self.subcommand == "export":
            # Export reads a checkpoint and writes files: it needs none of the run's devices, so a run
            # trained on GPUs exports on any machine.
            kwargs = {"accelerator": "cpu", "devices": 1, "num_nodes": 1, "strategy": "auto", **kwargs}
        else:
            trainer = self.config_init.get(f"{self.subcommand}.trainer") if self.subcommand else None
            callbacks = list((trainer.get("callbacks") if trainer else None) or [])
            # Ours in place of Lightning's default summary; its own switched off, since Lightning would
            # otherwise note on every start that a summary callback is already configured.
            summary = trainer.get("enable_model_summary") if trainer else None
            if summary is not False and not any(isinstance(c, ModelSummary) for c in callbacks):
                kwargs = {
                    "callbacks": [*callbacks, ParameterSummary()],
                    "enable_model_summary": False,
                    **kwargs,
                }
        return super().instantiate_trainer(**kwargs)

    def before_instantiate_classes(self) -> None:
        if self.subcommand == "export":
            # Nothing of the run's data, logger or callbacks takes part in an export: don't build them
            # (the prompt files and the tracker need not exist on the exporting machine).
            cfg = self.config.export
            cfg.data = Namespace(class_path="lightning.pytorch.LightningDataModule", init_args=Namespace())
            cfg.trainer.logger = False
            cfg.trainer.callbacks = []
            cfg.trainer.enable_checkpointing = False


def _parse_args(parser: LightningArgumentParser, args: Sequence[str] | None) -> Namespace:
    """``parser.parse_args``, with the mistakes :mod:`lit_flowgrpo.cli_diagnosis` can name said in one
    message each (the valid choices, the flag that replaced a removed one) instead of jsonargparse's
    report; any other parse error keeps jsonargparse's usage and message, as before."""
    from jsonargparse import ArgumentError

    from lit_flowgrpo.cli_diagnosis import diagnose

    parsers = _with_subcommand_parsers(parser)  # each subcommand's parser reports its own errors
    for each in parsers:
        each.exit_on_error = False
    try:
        return parser.parse_args(args)
    except ArgumentError as err:
        problems = diagnose(sys.argv[1:] if args is None else args)
        if problems:
            raise SettingsError("\n  ".join(problems)) from None
        for each in parsers:
            each.exit_on_error = True
        parser.error(str(err), err.__cause__ if isinstance(err.__cause__, Exception) else None)
    finally:
        for each in parsers:
            each.exit_on_error = True


def shipped_configs() -> list[str]:
    """The names of the recipes shipped with the package, for ``--config NAME``."""
    return sorted(path.stem for path in CONFIG_DIR.glob("*.yaml"))


def _named_configs(words: Sequence[str]) -> list[str]:
    """``words`` with each ``--config NAME`` (``-c NAME``, ``--config=NAME``) of a shipped recipe replaced
    by its file, ``lit_flowgrpo/configs/NAME.yaml``.

    Written here because jsonargparse reads a ``--config`` value as a path or a YAML string and has no
    search path: this is what lets ``lit-flowgrpo fit --config quickstart`` run from any folder after a
    ``pip install``. A value that is a file is left alone (a config of the user's own wins), and so is
    anything else jsonargparse reads (a path it reports missing, an inline YAML mapping).
    """
    out = list(words)
    for i, word in enumerate(out):
        flag, eq, value = word.partition("=")
        if flag not in ("-c", "--config") or (flag == "-c" and eq):
            continue
        if eq:
            out[i] = f"{flag}={_config_path(value)}"
        elif i + 1 < len(out):
            out[i + 1] = _config_path(out[i + 1])
    return out


def _nested_nulls(words: Sequence[str]) -> list[str]:
    """``words`` with each ``--<class>.init_args.<group>.<field>=null`` (``--model.init_args.weights.lora=null``)
    given as ``--<class>.init_args.<group>={<field>: null}``, which means the same: jsonargparse merges a
    mapping into the group's other settings.

    Written here because jsonargparse (4.53) refuses null for a field two levels inside a class given by
    ``class_path`` ("Expected a <class 'NoneType'>, given NestedArg"), while it takes the mapping; one
    level down (``--model.init_args.sampler=...``) and inside a ``--config`` file, null works already.
    """
    out = []
    for word in words:
        flag, eq, value = word.partition("=")
        head, sep, rest = flag.partition(".init_args.")
        group, dot, field = rest.rpartition(".")
        # YAML's null only: "none" is a value of its own for some settings (diagnostics.clip_gate=none).
        if eq and sep and dot and "." not in group and value.strip() in ("null", "Null", "NULL", "~"):
            word = f"{head}{sep}{group}={{{field}: null}}"
        out.append(word)
    return out


def _config_path(value: str) -> str:
    if not value or os.path.exists(value) or value.lstrip().startswith(("{", "[")) or "\n" in value:
        return value
    stem = value.removesuffix(".yaml")
    shipped = shipped_configs()
    if os.sep not in value and "/" not in value:
        if stem in shipped:
            return str(CONFIG_DIR / f"{stem}.yaml")
        raise SettingsError(
            f"--config ({value}) is neither a file nor a shipped recipe: give a config file, or one of "
            f"{', '.join(shipped)}"
        )
    name = Path(value).stem
    if name in shipped:  # the README's `configs/X.yaml` typed outside a clone: say the form that works
        raise SettingsError(
            f"--config ({value}) does not exist in {os.getcwd()}: the recipe of that name ships with the "
            f"package, --config {name} reads it from any folder"
        )
    return value


def _with_subcommand_parsers(parser: Any) -> list[Any]:
    action = getattr(parser, "_subcommands_action", None)
    children = list(getattr(action, "_name_parser_map", {}).values()) if action is not None else []
    return [parser] + [p for child in children for p in _with_subcommand_parsers(child)]


def _own_error(err: BaseException) -> BaseException:
    """The first exception in ``err``'s chain that was raised outside jsonargparse."""
    seen: BaseException | None = err
    while seen is not None:
        tb = seen.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        module = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
        if not module.startswith("jsonargparse"):
            return seen
        seen = seen.__cause__ or seen.__context__
    return err


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested config → ``{"model.init_args.optimizer.init_args.lr": 3e-4, ...}`` (keys read as flags)."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    if isinstance(tree, list) and tree and all(isinstance(v, dict) for v in tree):
        out = {}
        for i, value in enumerate(tree):
            out.update(_flatten(value, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: tree}


def _run_dir(trainer: L.Trainer) -> str:
    """This run's own log folder: the logger's versioned folder, as ModelCheckpoint derives it."""
    if not trainer.loggers:
        return str(trainer.default_root_dir)
    logger = trainer.loggers[0]
    log_dir = getattr(logger, "log_dir", None)  # CSV, TensorBoard: <save_dir>/<name>/version_N
    if log_dir:
        return str(log_dir)
    # W&B, MLflow, ...: <save_dir>/<name>/<run id>
    version = logger.version
    version = version if isinstance(version, str) else f"version_{version}"
    return os.path.join(str(logger.save_dir or trainer.default_root_dir), str(logger.name), version)


def main(argv: Sequence[str] | None = None) -> None:
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        if words[:1] == ["serve-reward"]:  # a server, not a Trainer method: its own parser
            from lit_flowgrpo.rewards.server import main as serve_reward

            return serve_reward(words[1:])
        FlowGRPOCLI(args=words)
    except SettingsError as err:
        # Every rank of a multi-process run raises the same check's error: the first process of each
        # machine (local rank 0, Lightning's launcher or torchrun's or SLURM's) reports it for all.
        if os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) == "0":
            print(f"lit-flowgrpo: error: {err}", file=sys.stderr)
        from lit_flowgrpo.strategies import end_distributed_process

        end_distributed_process(2)  # an open process group: exit 2, not gloo's teardown's abort (-6)
        raise SystemExit(2) from None
    from lit_flowgrpo.strategies import end_distributed_process

    end_distributed_process()  # a distributed run that finished exits 0, whatever gloo's teardown does


if __name__ == "__main__":
    main()
