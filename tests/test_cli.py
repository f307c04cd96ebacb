"""The `lit-flowgrpo` command line as a user meets it: export, resume from `last`, refused flags and
settings, early and single error messages, the tracked config, and a quiet plain run.

Every run here is the tiny SD3 config (`configs/tiny_sd3.yaml`) on the tiny pipeline, in-process.
"""

from __future__ import annotations

import csv
import shutil
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import yaml
from cli_helpers import PROMPTS, TINY, tiny_fit_args
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from safetensors.torch import load_file

from lit_flowgrpo.cli import FlowGRPOCLI, LogRunConfig, SettingsError, main

# A module setting the checkpoint records (LightningCLI stores the module's arguments in it).
KL_FLAG, KL_SAVED = "--model.init_args.kl.coef", 0.04


_fit_args = tiny_fit_args


@pytest.fixture(scope="module")
def lora_run(tiny_sd3_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora_run")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = FlowGRPOCLI(args=_fit_args(tiny_sd3_path, root))
    assert cli.trainer.global_step == 2
    return {
        "root": root,
        "pretrained": tiny_sd3_path,
        "log_dir": Path(cli.trainer.logger.log_dir),
        "ckpt": root / "checkpoints" / "last.ckpt",
        "warnings": [str(w.message) for w in caught],
    }


def _forbid_instantiation(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Any) -> None:
        raise AssertionError("the CLI instantiated classes before refusing the input")

    monkeypatch.setattr(FlowGRPOCLI, "instantiate_classes", refuse)


def _main_error(argv: list[str], capfd: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    out, err = capfd.readouterr()
    return out + err


# --------------------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------------------


def test_help_lists_the_subcommands_that_work(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    # Lightning's test and predict need a step no module here has: not offered, rather than failing
    # with a traceback after the weights load.
    assert "{fit,validate,export}" in capsys.readouterr().out


@pytest.mark.parametrize("subcommand", ["test", "predict"])
def test_test_and_predict_are_refused_as_unknown_subcommands(
    subcommand: str, tiny_sd3_path: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    args = [subcommand, *_fit_args(tiny_sd3_path, tmp_path)[1:]]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capfd.readouterr().err
    assert f"invalid choice: '{subcommand}'" in err and "Traceback" not in err


def _lora_key(key: str) -> str:
    """The checkpoint's and diffusers' names of one LoRA tensor, made equal."""
    return key[key.index("transformer_blocks") :].replace(".default", "")


@pytest.mark.parametrize("use_ema", [True, False])
def test_export_reads_the_saved_config_as_is(
    lora_run: dict[str, Any], tmp_path: Path, capfd: pytest.CaptureFixture[str], use_ema: bool
) -> None:
    """`export --config <run>/config.yaml --ckpt_path <ckpt> --out …` with a `--model.…` override writes
    the checkpoint's (EMA) adapter, which diffusers loads."""
    from diffusers import StableDiffusion3Pipeline

    saved = lora_run["log_dir"] / "config.yaml"
    assert {"ckpt_path", "weights_only", "seed_everything", "trainer"} <= set(
        yaml.safe_load(saved.read_text())
    )
    out = tmp_path / "lora"
    main(
        [
            "export",
            "--config",
            str(saved),
            "--ckpt_path",
            str(lora_run["ckpt"]),
            "--out",
            str(out),
            f"--use_ema={str(use_ema).lower()}",
            "--model.init_args.policy.init_args.prompt_cache_size=8",  # an override, as with fit
        ]
    )
    assert "args parameter is intended" not in "".join(capfd.readouterr())

    ckpt = torch.load(lora_run["ckpt"], map_location="cpu", weights_only=False)
    (ema,) = [v["ema_state_dict"] for k, v in ckpt["callbacks"].items() if "TrainableEMA" in k]
    want = {_lora_key(k): v for k, v in (ema if use_ema else ckpt["state_dict"]).items()}
    other = {_lora_key(k): v for k, v in (ckpt["state_dict"] if use_ema else ema).items()}
    got = {_lora_key(k): v for k, v in load_file(out / "pytorch_lora_weights.safetensors").items()}
    assert got.keys() == want.keys()
    for key in got:
        assert torch.equal(got[key], want[key]), key
    assert any(not torch.equal(got[k], other[k]) for k in got)  # EMA and raw weights differ here

    pipe = StableDiffusion3Pipeline.from_pretrained(lora_run["pretrained"])
    pipe.load_lora_weights(str(out))


def test_export_full_finetune_as_a_diffusers_transformer(tiny_sd3_path: str, tmp_path: Path) -> None:
    from diffusers import SD3Transformer2DModel

    root = tmp_path / "run"
    # A full fine-tune needs a KL reference copy unless β = 0.
    FlowGRPOCLI(args=_fit_args(tiny_sd3_path, root, "--model.init_args.weights.lora=null", f"{KL_FLAG}=0.0"))
    ckpt_path = root / "checkpoints" / "last.ckpt"
    out = tmp_path / "transformer"
    main(
        [
            "export",
            "--config",
            str(next(root.rglob("config.yaml"))),
            "--ckpt_path",
            str(ckpt_path),
            "--out",
            str(out),
        ]
    )

    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    (ema,) = [v["ema_state_dict"] for k, v in ckpt["callbacks"].items() if "TrainableEMA" in k]
    exported = dict(SD3Transformer2DModel.from_pretrained(str(out)).named_parameters())
    # Every parameter is a trained one (buffers such as the fixed sin-cos position table are not).
    assert len(exported) == len(ema)
    for key, value in exported.items():
        (match,) = [v for k, v in ema.items() if k.endswith("." + key)]
        assert torch.equal(value, match.to(value.dtype)), key


# --------------------------------------------------------------------------------------------------
# resume
# --------------------------------------------------------------------------------------------------


def test_ckpt_path_last_resumes_the_run(lora_run: dict[str, Any], tmp_path: Path) -> None:
    """fit → stop → `fit --ckpt_path last` continues at step 2 and runs only the missing rollout; each
    run keeps its own config.yaml."""
    root = tmp_path / "run"
    shutil.copytree(lora_run["root"], root)
    cli = FlowGRPOCLI(
        args=_fit_args(lora_run["pretrained"], root, "--trainer.max_steps=4", "--ckpt_path=last")
    )

    assert Path(cli.trainer.ckpt_path) == root / "checkpoints" / "last.ckpt"
    assert cli.trainer.global_step == 4
    resumed = Path(cli.trainer.logger.log_dir)
    assert resumed.name == "version_1"
    with open(resumed / "metrics.csv") as f:
        rollouts = [r for r in csv.DictReader(f) if r.get("actor/loss")]
    assert len(rollouts) == 1  # one rollout batch = 2 optimizer steps, from step 2 to 4
    first = yaml.safe_load((root / "lightning_logs" / "version_0" / "config.yaml").read_text())
    second = yaml.safe_load((resumed / "config.yaml").read_text())
    assert first["ckpt_path"] is None and first["trainer"]["max_steps"] == 2
    assert (
        second["ckpt_path"] == str(root / "checkpoints" / "last.ckpt") and second["trainer"]["max_steps"] == 4
    )


def test_setting_changed_on_resume_is_refused_or_applied(
    lora_run: dict[str, Any], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    shutil.copytree(lora_run["root"], root)
    args = _fit_args(
        lora_run["pretrained"], root, f"--ckpt_path={root / 'checkpoints' / 'last.ckpt'}", f"{KL_FLAG}=0.5"
    )

    text = _main_error(args, capfd)
    assert f"{KL_FLAG}: command line 0.5, checkpoint {KL_SAVED}" in text
    assert "--override_checkpoint_settings" in text

    # Opted in: the command line's value is the one the run uses (max_steps is already reached, so the
    # run restores the checkpoint and stops).
    cli = FlowGRPOCLI(args=[*args, "--override_checkpoint_settings=true"])
    assert cli.model.kl.coef == 0.5
    assert cli.trainer.global_step == 2

    # The optimizer's state (lr included) is restored whatever the flags: refused even when opted in.
    lr = "--model.init_args.optimizer.init_args.lr"
    text = _main_error([*args, "--override_checkpoint_settings=true", f"{lr}=0.001"], capfd)
    assert f"{lr}: command line 0.001, checkpoint 0.0003" in text


def test_override_cannot_change_the_lora_rank(
    lora_run: dict[str, Any],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rank gives the checkpoint's tensors their shapes: refused before the model is built, even
    opted in, instead of Lightning's size mismatch, one line per tensor, after the weights load."""
    _forbid_instantiation(monkeypatch)
    ckpt = lora_run["ckpt"]
    args = _fit_args(
        lora_run["pretrained"], tmp_path, f"--ckpt_path={ckpt}", "--model.init_args.weights.lora.rank=8"
    )
    text = _main_error([*args, "--override_checkpoint_settings=true"], capfd)
    assert text.startswith("lit-flowgrpo: error: --override_checkpoint_settings cannot change ")
    assert "--model.init_args.weights.lora.rank (command line 8, checkpoint 4)" in text
    assert len(text.strip().splitlines()) == 1 and "size mismatch" not in text
    # LoRA against a full fine-tune: other tensors altogether.
    args = _fit_args(
        lora_run["pretrained"], tmp_path, f"--ckpt_path={ckpt}", "--model.init_args.weights.lora=null"
    )
    text = _main_error([*args, "--override_checkpoint_settings=true"], capfd)
    assert (
        "--override_checkpoint_settings cannot change --model.init_args.weights.lora (command line null, a full "
        "fine-tune, checkpoint a LoRA adapter)" in text
    )


def test_a_checkpoint_of_other_shapes_is_refused_before_it_loads(lora_run: dict[str, Any]) -> None:
    """The module's own check, for what the command line cannot see (another policy, a rank that the
    policy's default fills in): one message, before Lightning's load_state_dict lists every tensor."""
    cli = FlowGRPOCLI(
        args=_fit_args(lora_run["pretrained"], lora_run["root"], "--model.init_args.weights.lora.rank=8")[1:],
        run=False,
    )
    cli.model.configure_model()
    checkpoint = torch.load(lora_run["ckpt"], map_location="cpu", weights_only=True)
    with pytest.raises(
        SettingsError,
        match=r"other shapes than this run's \(30 of 30, e\.g\. .*lora_A.*checkpoint \[4, 32\], this run \[8, 32\]\)",
    ):
        cli.model.on_load_checkpoint(checkpoint)


# --------------------------------------------------------------------------------------------------
# Refused before anything is instantiated, with one short message
# --------------------------------------------------------------------------------------------------


def test_ckpt_path_last_without_an_earlier_run_is_refused(
    tiny_sd3_path: str, tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning would train a new run from scratch, with a hint to set save_last (which is set)."""
    _forbid_instantiation(monkeypatch)
    text = _main_error(_fit_args(tiny_sd3_path, tmp_path, "--ckpt_path=last"), capfd)
    assert f"--ckpt_path last: no last*.ckpt in {tmp_path / 'checkpoints'}" in text
    assert "drop --ckpt_path to start a new run" in text and "save_last" not in text


def _unpicklable_state() -> dict[str, Any]:
    return {"state_dict": {}, "callback": Path("anything")}  # a class torch's safe loader refuses


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("random", "is not a checkpoint (a checkpoint is a zip archive"),
        ("zip", "is a zip archive but not a torch checkpoint"),
        ("code", "cannot be read as a checkpoint (it holds objects other than tensors and plain data)"),
        ("tensor", "is a torch file but not a Lightning checkpoint (no state_dict)"),
    ],
)
def test_a_file_that_is_no_checkpoint_is_refused_in_one_line(
    content: str,
    says: str,
    tiny_sd3_path: str,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not torch's weights_only traceback, which suggests loading the file unsafely."""
    import zipfile

    path = tmp_path / "bad.ckpt"
    if content == "random":
        path.write_bytes(bytes(range(256)) * 16)  # as good as random: neither a zip nor a pickle
    elif content == "zip":
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("notes.txt", "not a checkpoint")
    elif content == "code":
        torch.save(_unpicklable_state(), path)
    else:
        torch.save(torch.zeros(3), path)
    _forbid_instantiation(monkeypatch)
    text = _main_error(_fit_args(tiny_sd3_path, tmp_path, f"--ckpt_path={path}"), capfd)
    assert f"--ckpt_path ({path}) {says}" in text
    assert len(text.strip().splitlines()) == 1
    assert "weights_only" not in text and "Traceback" not in text


def test_validate_without_held_out_prompts_is_refused(
    tiny_sd3_path: str, tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It would load the weights, run no batch and exit 0 without printing a metric."""
    _forbid_instantiation(monkeypatch)
    args = ["validate", *_fit_args(tiny_sd3_path, tmp_path, "--data.init_args.val=null")[1:]]
    text = _main_error(args, capfd)
    assert "validate: --data.init_args.val is null, so there is nothing to validate on" in text
    # A module without a validation step (the toy pretraining) has nothing to validate either.
    text = _main_error(["validate", "--config", str(TINY.parent / "toy_pretrain.yaml")], capfd)
    assert "validate: ToyPretrainModule has no validation step: nothing to validate" in text


def test_automatic_optimization_flags_name_the_module_flags(
    tiny_sd3_path: str, tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lit_flowgrpo import cli_checks as cli

    _forbid_instantiation(monkeypatch)
    flags = [
        "--trainer.gradient_clip_val=1.0",
        "--trainer.accumulate_grad_batches=2",
        "--optimizer=SGD",
        "--optimizer.lr=0.1",
    ]
    text = _main_error(_fit_args(tiny_sd3_path, tmp_path, *flags), capfd)
    for given, instead in (
        ("--trainer.gradient_clip_val", cli.MAX_GRAD_NORM_FLAG),
        ("--trainer.accumulate_grad_batches", cli.OPTIMIZER_STEPS_FLAG),
        ("--optimizer", cli.OPTIMIZER_FLAG),
    ):
        (line,) = [
            line for line in text.splitlines() if line.lstrip().startswith(given) or f"error: {given}" in line
        ]
        assert instead in line


def test_missing_and_truncated_checkpoints_fail_first(
    lora_run: dict[str, Any],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _forbid_instantiation(monkeypatch)
    missing = tmp_path / "nope.ckpt"
    text = _main_error(_fit_args(lora_run["pretrained"], tmp_path, f"--ckpt_path={missing}"), capfd)
    assert f"--ckpt_path ({missing}) does not exist" in text

    data = lora_run["ckpt"].read_bytes()
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(data[: len(data) // 2])
    text = _main_error(_fit_args(lora_run["pretrained"], tmp_path, f"--ckpt_path={cut}"), capfd)
    assert f"--ckpt_path ({cut}) is truncated" in text


def test_ckpt_path_last_without_a_fixed_checkpoint_folder_is_refused(
    tiny_sd3_path: str, tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _forbid_instantiation(monkeypatch)
    config = yaml.safe_load(TINY.read_text())
    config["trainer"]["callbacks"] = [
        c for c in config["trainer"]["callbacks"] if "ModelCheckpoint" not in c["class_path"]
    ]
    path = tmp_path / "no_checkpoint.yaml"
    path.write_text(yaml.safe_dump(config))
    args = _fit_args(tiny_sd3_path, tmp_path, "--ckpt_path=last")
    args[2] = str(path)
    assert "--ckpt_path last: no ModelCheckpoint" in _main_error(args, capfd)


def test_constructor_error_is_reported_once(
    tiny_sd3_path: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    message = "--data.init_args.group_size (1) must be at least 2"
    args = _fit_args(tiny_sd3_path, tmp_path, "--data.init_args.group_size=1")
    text = _main_error(args, capfd)
    assert text.count(message) == 1
    assert "Traceback" not in text and "Union subtypes" not in text and "Namespace(" not in text
    assert text.rstrip().endswith("GRPO needs a group to compare within")

    with pytest.raises(SettingsError, match=r"--data\.init_args\.group_size \(1\)") as raised:
        FlowGRPOCLI(args=args)
    assert isinstance(raised.value, ValueError)


# --------------------------------------------------------------------------------------------------
# The tracked config
# --------------------------------------------------------------------------------------------------


def test_fit_logs_the_full_config_and_saves_it_in_its_version_folder(lora_run: dict[str, Any]) -> None:
    log_dir = lora_run["log_dir"]
    assert log_dir.name == "version_0"
    hparams = yaml.safe_load((log_dir / "hparams.yaml").read_text())
    assert hparams["model.init_args.optimizer.init_args.lr"] == 3e-4
    assert hparams["model.init_args.policy.init_args.pretrained"] == lora_run["pretrained"]
    assert hparams["model.init_args.reward.init_args.weights.jpeg_compressibility"] == 1.0
    assert hparams["data.init_args.prompts_per_step"] == 2 and hparams["data.init_args.group_size"] == 4
    assert hparams["trainer.max_steps"] == 2
    saved = yaml.safe_load((log_dir / "config.yaml").read_text())
    assert saved["model"]["init_args"]["policy"]["init_args"]["pretrained"] == lora_run["pretrained"]


class _RunIdLogger(Logger):
    """A logger with no ``log_dir`` of its own (as W&B): runs share ``save_dir`` and differ by id."""

    def __init__(self, save_dir: str, run_id: str) -> None:
        super().__init__()
        self._save_dir, self._run_id = save_dir, run_id
        self.logged: dict[str, Any] = {}

    @property
    def name(self) -> str:
        return "project"

    @property
    def version(self) -> str:
        return self._run_id

    @property
    def save_dir(self) -> str:
        return self._save_dir

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self.logged.update(params)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass


def test_every_logger_gets_the_config_and_no_run_overwrites_another(
    tiny_sd3_path: str, tmp_path: Path
) -> None:
    cli = FlowGRPOCLI(
        args=[
            "--config",
            str(TINY),
            f"--model.init_args.policy.init_args.pretrained={tiny_sd3_path}",
            f"--data.init_args.train={PROMPTS}",
            f"--data.init_args.val={PROMPTS}",
        ],
        run=False,
    )
    runs = []
    for run_id in ("run_a", "run_b"):
        loggers = [
            TensorBoardLogger(str(tmp_path / "tb"), name="tiny"),
            CSVLogger(str(tmp_path / "csv"), name="tiny"),
            _RunIdLogger(str(tmp_path / "shared"), run_id),
        ]
        trainer = L.Trainer(logger=loggers, default_root_dir=str(tmp_path), enable_progress_bar=False)
        LogRunConfig(cli.parser, cli.config).setup(trainer, cli.model, "fit")
        for logger in loggers:
            logger.save()
        runs.append(loggers)

    for tb, csv_logger, run_id_logger in runs:
        # The first logger names the run's folder (here TensorBoard's version_N).
        assert (Path(tb.log_dir) / "config.yaml").is_file()
        for hparams in (
            yaml.safe_load((Path(tb.log_dir) / "hparams.yaml").read_text()),
            yaml.safe_load((Path(csv_logger.log_dir) / "hparams.yaml").read_text()),
            run_id_logger.logged,
        ):
            assert hparams["model.init_args.optimizer.init_args.lr"] == 3e-4
            assert hparams["model.init_args.weights.lora.rank"] == 4
            assert hparams["data.init_args.group_size"] == 4
    assert [Path(r[0].log_dir).name for r in runs] == ["version_0", "version_1"]

    # Without a log_dir (as W&B) the run's folder is <save_dir>/<name>/<run id>, as for checkpoints.
    for run_id in ("run_a", "run_b"):
        trainer = L.Trainer(
            logger=_RunIdLogger(str(tmp_path / "shared"), run_id), default_root_dir=str(tmp_path)
        )
        LogRunConfig(cli.parser, cli.config).setup(trainer, cli.model, "fit")
        assert (tmp_path / "shared" / "project" / run_id / "config.yaml").is_file()


# --------------------------------------------------------------------------------------------------
# A plain run is quiet
# --------------------------------------------------------------------------------------------------


def test_plain_run_has_no_noise_of_ours(lora_run: dict[str, Any]) -> None:
    caught = "\n".join(lora_run["warnings"])
    assert "`IterableDataset` has `__len__` defined" not in caught
    assert "args parameter is intended to run from within Python" not in caught
    assert "module(s) in eval mode" not in caught  # the frozen parts are in eval mode on purpose


def test_a_start_shows_no_misleading_summary_lines_nor_advertisement(lora_run: dict[str, Any]) -> None:
    """The model summary keeps the parameter counts, without "Modules in eval mode" (on purpose here) and
    a FLOP count of 0 (Lightning counts none without an example forward) beside our MFU; Lightning's
    tip advertising its cloud logger is not shown."""
    import logging

    from lightning.pytorch.callbacks import ModelSummary

    from lit_flowgrpo.cli import ParameterSummary

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # where rank_zero_info writes
    logger.addHandler(handler)
    try:
        args = _fit_args(lora_run["pretrained"], lora_run["root"], "--trainer.enable_model_summary=true")
        cli = FlowGRPOCLI(args=args[1:], run=False)  # builds the Trainer, where the tip is written
        summaries = [c for c in cli.trainer.callbacks if isinstance(c, ModelSummary)]
        assert [type(c) for c in summaries] == [ParameterSummary]
        summaries[0].on_fit_start(cli.trainer, cli.model)
    finally:
        logger.removeHandler(handler)
    text = "\n".join(records)
    assert "Trainable params" in text and "policy" in text
    assert "eval mode" not in text and "FLOPs" not in text and "Flops" not in text
    assert "Tip" not in text and "litlogger" not in text
    assert "already configured with model summary" not in text


def test_clip_range_from_yaml_reaches_its_one_owner(tiny_sd3_path: str, tmp_path: Path, capfd) -> None:
    """A bad clip range set in YAML is refused by the objective (its only validating owner), named by
    its flag, before the data or any weight is loaded."""
    text = _main_error(
        _fit_args(tiny_sd3_path, tmp_path / "run", "--model.init_args.objective.init_args.clip_range=0"),
        capfd,
    )
    assert "--model.init_args.objective.init_args.clip_range (0.0) must lie in (0, 1)" in text
    assert text.count("clip_range (0.0)") == 1


@pytest.mark.parametrize("where", ["yaml", "command_line"])
def test_nft_timestep_fraction_is_refused_with_its_new_name(
    where: str, tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DiffusionNFT's ``timestep_fraction`` is ``visit_fraction`` now (the sampler's keeps its name and
    meaning): an old YAML or command line fails before anything is built, naming the new key."""
    from cli_helpers import load_shipped

    _forbid_instantiation(monkeypatch)
    config = load_shipped("quickstart")  # DiffusionNFT
    objective = config["model"]["init_args"]["objective"]["init_args"]
    flags = []
    if where == "yaml":
        objective["timestep_fraction"] = objective.pop("visit_fraction")
    else:
        flags = ["--model.init_args.objective.init_args.timestep_fraction=0.3"]
    path = tmp_path / "old_nft.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    text = _main_error(["fit", "--config", str(path), *flags], capfd)
    assert (
        "--model.init_args.objective.init_args.timestep_fraction was renamed: DiffusionNFT calls it "
        "--model.init_args.objective.init_args.visit_fraction (the share of the T rollout sigmas each "
        "sample visits" in text
    )
    assert "Does not validate against any of the Union subtypes" not in text


def test_a_checkpoint_written_before_the_rename_gets_the_new_key() -> None:
    """The module's hyper-parameters as a checkpoint written before the rename holds them: the old key is
    renamed with its value, once, and nothing else moves."""
    from lit_flowgrpo.cli_diagnosis import rename_old_settings
    from lit_flowgrpo.objective import DiffusionNFT

    saved = DiffusionNFT(visit_fraction=0.5, beta=0.5).hparams()
    saved["init_args"]["timestep_fraction"] = saved["init_args"].pop("visit_fraction")
    hparams = {
        "_class_path": "lit_flowgrpo.FlowGRPOModule",
        "sampler": {"num_steps": 10, "timestep_fraction": 0.99},  # the sampler's own: left alone
        "objective": saved,
        "callbacks": [{"class_path": "lit_flowgrpo.objective.DiffusionNFT", "init_args": {"beta": 0.1}}],
    }
    assert rename_old_settings(hparams) == [
        "lit_flowgrpo.objective.DiffusionNFT: timestep_fraction is now visit_fraction"
    ]
    assert DiffusionNFT(**hparams["objective"]["init_args"]) == DiffusionNFT(visit_fraction=0.5, beta=0.5)
    assert hparams["sampler"] == {"num_steps": 10, "timestep_fraction": 0.99}
    assert rename_old_settings(hparams) == []  # already new


_WEIGHTS_MOVED = "(what is trained is one group, --model.init_args.weights)"
_KL_MOVED = "(the KL regulariser (β, its form, the reference, the gate) is one group, --model.init_args.kl)"


@pytest.mark.parametrize(
    ("where", "says"),
    [
        (
            "command_line",
            f"--model.init_args.lora moved: it is now --model.init_args.weights.lora {_WEIGHTS_MOVED}",
        ),
        (
            "yaml",
            f"--model.init_args.objective.init_args.kl_coef moved: it is now --model.init_args.kl.coef {_KL_MOVED}",
        ),
    ],
)
def test_a_setting_that_moved_group_is_refused_with_its_new_flag(
    where: str,
    says: str,
    tiny_sd3_path: str,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trained weights (``weights``) and the KL regulariser (``kl``) are one group each now: an old
    command line or YAML fails before anything is built, naming the flag that replaced the old key."""
    from cli_helpers import load_shipped

    _forbid_instantiation(monkeypatch)
    config = load_shipped("tiny_sd3")
    model = config["model"]["init_args"]
    flags = []
    if where == "yaml":
        model["objective"]["init_args"]["kl_coef"] = model.pop("kl")["coef"]
    else:
        flags = ["--model.init_args.lora.rank=8"]
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    text = _main_error(
        [
            "fit",
            "--config",
            str(path),
            f"--model.init_args.policy.init_args.pretrained={tiny_sd3_path}",
            *flags,
        ],
        capfd,
    )
    assert says in text
    assert "Does not validate against any of the Union subtypes" not in text and "Traceback" not in text


def _old_layout(hparams: dict[str, Any]) -> None:
    """The module's saved hyper-parameters, in place, as a checkpoint written before the ``weights`` and
    ``kl`` groups holds them."""
    weights, kl = hparams.pop("weights"), hparams.pop("kl")
    hparams["lora"], hparams["master_dtype"] = weights["lora"], weights["master_dtype"]
    reference = dict(kl["reference"])
    hparams["reference_copy"] = reference.pop("copy")
    hparams["reference"] = reference
    hparams["objective"]["init_args"].update(kl_coef=kl["coef"], kl_with_dt=kl["with_dt"])
    hparams["advantage"]["kl_gate"] = kl["gate"]
    hparams["diagnostics"]["reference_kl"] = kl["measure"]


def test_a_checkpoint_written_before_the_settings_moved_resumes(
    lora_run: dict[str, Any], tmp_path: Path
) -> None:
    """A checkpoint whose hyper-parameters hold ``lora``, ``reference``, ``reference_copy``, the objective's
    ``kl_coef`` and the advantage's ``kl_gate`` resumes through ``fit --ckpt_path``: its settings are moved
    into their groups, where they equal this command line's (else the resume would name them)."""
    import logging

    root = tmp_path / "run"
    shutil.copytree(lora_run["root"], root)
    ckpt = root / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    _old_layout(checkpoint["hyper_parameters"])
    torch.save(checkpoint, ckpt)
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)["hyper_parameters"]
    assert {"lora", "reference", "reference_copy"} <= saved.keys() and not {"weights", "kl"} & saved.keys()
    assert saved["objective"]["init_args"]["kl_coef"] == KL_SAVED and "kl_gate" in saved["advantage"]

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # where rank_zero_info writes
    logger.addHandler(handler)
    try:
        cli = FlowGRPOCLI(
            args=_fit_args(lora_run["pretrained"], root, "--trainer.max_steps=4", f"--ckpt_path={ckpt}")
        )
    finally:
        logger.removeHandler(handler)
    assert cli.trainer.global_step == 4  # restored at step 2, then one more rollout
    assert cli.model.kl.coef == KL_SAVED and cli.model.kl.reference.copy is False
    assert cli.model.weights.lora.rank == 4 and cli.model.weights.lora.alpha == 8
    (moved,) = [r for r in records if "was written before settings moved" in r]
    for line in (
        "lora is now weights.lora",
        "objective.kl_coef is now kl.coef",
        "advantage.kl_gate is now kl.gate",
    ):
        assert line in moved


def test_a_null_two_levels_inside_the_module_reaches_the_parser_as_a_mapping() -> None:
    # jsonargparse refuses `--model.init_args.weights.lora=null` (a NestedArg it cannot set to None) but
    # takes the mapping, which it merges into the group; "none" is a value of its own and stays.
    from lit_flowgrpo.cli import _nested_nulls

    words = [
        "--model.init_args.weights.lora=null",
        "--model.init_args.kl.gate=~",
        "--model.init_args.diagnostics.clip_gate=none",
        "--data.init_args.val=null",
        "--model.init_args.lora=null",
    ]
    assert _nested_nulls(words) == [
        "--model.init_args.weights={lora: null}",
        "--model.init_args.kl={gate: null}",
        "--model.init_args.diagnostics.clip_gate=none",
        "--data.init_args.val=null",
        "--model.init_args.lora=null",
    ]


def test_a_run_that_leaves_beta_to_the_objective_resumes(tiny_sd3_path: str, tmp_path: Path) -> None:
    # kl.coef null takes the objective's published β (Flow-GRPO: 0). The checkpoint keeps the setting
    # as given, so the resume's command line (null again) is not refused as a change to 0.0.
    args = ("--model.init_args.kl.coef=null",)
    first = FlowGRPOCLI(args=_fit_args(tiny_sd3_path, tmp_path, *args))
    assert first.model.kl.coef == 0.0 and first.trainer.global_step == 2
    assert (
        torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["hyper_parameters"]["kl"][
            "coef"
        ]
        is None
    )
    resumed = FlowGRPOCLI(
        args=_fit_args(tiny_sd3_path, tmp_path, *args, "--trainer.max_steps=4", "--ckpt_path=last")
    )
    assert resumed.trainer.global_step == 4 and resumed.model.kl.coef == 0.0
