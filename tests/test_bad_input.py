"""Bad input, by class: every member gets one message (``lit-flowgrpo: error: ...``, exit status 2) that
names the flag and the fix, before any weight is read.

Each class is walked through several of its members through the real CLI (``main([...])``, in
process), on the tiny SD3 pipeline. Its ``load`` fails the test if called: every refusal here must
come before a weight is read.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, StrategyRegistry

from lit_flowgrpo.cli import main
from lit_flowgrpo.data import PromptDataModule, read_prompts
from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.rewards.base import MultiReward

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "tiny_sd3.yaml")


@pytest.fixture()
def run(
    tiny_sd3_path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    """``main`` on the tiny SD3 config with ``extra`` flags; returns its stderr, asserting the one-message form."""
    from lit_flowgrpo.policies import SD3Policy

    def load(self) -> None:
        pytest.fail("the policy's weights were loaded before the refusal")

    monkeypatch.setattr(SD3Policy, "load", load)

    def call(*extra: str, config: str = CONFIG) -> str:
        prompts = tmp_path / "prompts.txt"
        if not prompts.exists():
            prompts.write_text("".join(f"prompt number {i}\n" for i in range(8)))
        words = [
            "fit",
            "--config",
            config,
            f"--model.init_args.policy.init_args.pretrained={tiny_sd3_path}",
            f"--trainer.default_root_dir={tmp_path / 'run'}",
            f"--data.init_args.train={prompts}",
            f"--data.init_args.val={prompts}",
            *extra,
        ]
        with pytest.raises(SystemExit) as raised:
            main(words)
        err = capsys.readouterr().err
        assert raised.value.code == 2, err
        assert "Traceback" not in err and "Given value" not in err, err
        ours = err[err.index("lit-flowgrpo: error: ") :]  # Lightning's start-up lines may come first
        assert len(ours.strip().splitlines()) <= 6, ours
        return ours

    return call


# -- class 1: errors raised after the Trainer starts (setup, the strategy, a reward's check) ---------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        # FlowGRPOModule.setup: the micro-batch against the per-rank batch
        (
            ["--model.init_args.update.micro_batch_size=3"],
            r"--model\.init_args\.update\.micro_batch_size \(3\) must divide",
        ),
        # FlowGRPOModule.setup: the prompts against the reward's metadata
        (
            ["--model.init_args.reward.init_args.weights={geneval: 1.0}"],
            r"reward 'geneval' needs metadata field 'tag'",
        ),
        # FSDP2Strategy.setup_environment
        (
            [
                "--trainer.strategy=lit_flowgrpo.strategies.FSDP2Strategy",
                "--trainer.strategy.cpu_offload=true",
            ],
            r"--trainer\.strategy\.cpu_offload=true needs GPUs",
        ),
    ],
    ids=["micro_batch", "reward_metadata", "fsdp2_cpu_offload"],
)
def test_errors_after_the_trainer_starts_are_one_message(run, flags, expected) -> None:
    import re

    assert re.search(expected, run(*flags))


def test_unreachable_remote_reward_is_one_message(run) -> None:
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    err = run(
        "--model.init_args.reward.init_args.weights={vlm_judge: 1.0}",
        f"--model.init_args.reward.init_args.config={{vlm_judge: {{base_url: '{url}'}}}}",
    )
    assert "--model.init_args.reward.init_args.config.vlm_judge.base_url" in err and "unreachable" in err


@pytest.mark.slow
def test_an_error_every_rank_raises_is_printed_once(tiny_sd3_path: str, tmp_path: Path) -> None:
    """Two DDP processes on the CPU: both raise the same setup check (9 samples a step do not split
    over 2 ranks), and the one line is printed once, by the first process of the machine."""
    import subprocess
    import sys

    from cli_helpers import tiny_fit_args

    words = tiny_fit_args(tiny_sd3_path, tmp_path / "run", "--trainer.strategy=ddp", "--trainer.devices=2")
    words += ["--data.init_args.prompts_per_step=3", "--data.init_args.group_size=3"]
    done = subprocess.run(
        [sys.executable, "-m", "lit_flowgrpo.cli", *words], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "All distributed processes registered. Starting with 2 processes" in done.stdout + done.stderr
    message = "--data.init_args.prompts_per_step × --data.init_args.group_size (9) must be a multiple"
    assert (done.stdout + done.stderr).count(message) == 1, done.stderr[-3000:]
    assert done.stderr.count("lit-flowgrpo: error:") == 1


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch, run) -> None:
    """Only our own refusals become one line: anything else raised in setup is a bug to see whole."""
    from lit_flowgrpo.module import FlowGRPOModule

    def broken(self, stage):
        raise KeyError("a bug")

    monkeypatch.setattr(FlowGRPOModule, "setup", broken)
    with pytest.raises(KeyError, match="a bug"):
        run()


# -- class 2: an input file that cannot be read as prompts ------------------------------------------


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("utf16.txt", "a cat\na dog\n".encode("utf-16"), "is UTF-16 text: save it as UTF-8"),
        ("binary.txt", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "is a binary file"),
        ("latin1.txt", "a caf\xe9\n".encode("latin-1"), r"is not UTF-8 text \(byte 0xe9 on line 1\)"),
        ("empty.txt", b"\n  \n", "holds no prompts"),
        ("bad.jsonl", b'{"prompt": "a cat"}\n{"prompt": "a dog",}\n', r"line 2 is not valid JSON"),
        ("list.jsonl", b'["a cat"]\n', r'line 1 has no string "prompt" field'),
        ("prompts.csv", b"a cat\n", r"must end in \.txt .* or \.jsonl"),
    ],
)
@pytest.mark.parametrize("flag", ["--data.init_args.train", "--data.init_args.val"])
def test_bad_prompt_files_name_the_flag_the_file_and_the_fault(
    run, tmp_path: Path, flag: str, name: str, content: bytes, expected: str
) -> None:
    import re

    path = tmp_path / name
    path.write_bytes(content)
    err = run(f"{flag}={path}")
    assert f"{flag} ({path})" in err and re.search(expected, err), err


@pytest.mark.parametrize("kind", ["missing", "folder"])
def test_prompt_path_that_is_no_file(run, tmp_path: Path, kind: str) -> None:
    path = tmp_path / "absent.txt" if kind == "missing" else tmp_path
    err = run(f"--data.init_args.train={path}")
    assert (
        f"--data.init_args.train ({path}) {'does not exist' if kind == 'missing' else 'is a folder'}" in err
    )


def test_utf8_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path: Path) -> None:
    path = tmp_path / "bom.txt"
    path.write_bytes("a cat\na dog\n".encode("utf-8-sig"))
    assert read_prompts(str(path), "--data.init_args.train")[0] == {"prompt": "a cat"}


# -- class 3: a strategy FlowGRPOModule cannot run under, refused before Lightning's own checks ------


def _unsupported_aliases() -> list[str]:
    return sorted(
        name
        for name, entry in StrategyRegistry.items()
        if issubclass(entry["strategy"], (FSDPStrategy, DeepSpeedStrategy))
    )


def test_every_unsupported_alias_is_walked() -> None:
    aliases = _unsupported_aliases()
    assert {"fsdp", "fsdp_cpu_offload", "deepspeed", "deepspeed_stage_3_offload"} <= set(aliases)


@pytest.mark.parametrize(
    "strategy",
    [*_unsupported_aliases(), "lightning.pytorch.strategies.ModelParallelStrategy"],
)
def test_unsupported_strategies_point_to_fsdp2_before_lightning_speaks(run, strategy: str) -> None:
    err = run(f"--trainer.strategy={strategy}")
    assert f"--trainer.strategy={strategy}" in err and "--trainer.strategy=fsdp2" in err, err
    assert "GPU" not in err and "pip install" not in err


# -- class 4: what the config alone tells, checked before any weight is read ------------------------


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            [
                "--model.init_args.performance.fp8_base_matmuls=true",
                "--model.init_args.weights.lora=null",
                "--model.init_args.kl.reference.copy=true",
            ],
            r"--model\.init_args\.performance\.fp8_base_matmuls with a full fine-tune "
            r"\(--model\.init_args\.weights\.lora=null\)",
        ),
        (
            [
                "--model.init_args.performance.rollout_merged_lora=true",
                "--model.init_args.weights.lora=null",
                "--model.init_args.kl.reference.copy=true",
            ],
            r"--model\.init_args\.performance\.rollout_merged_lora with a full fine-tune",
        ),
        (
            ["--data.init_args.max_val_prompts=0"],
            r"--data\.init_args\.max_val_prompts \(0\) must be at least 1",
        ),
        (
            ["--data.init_args.max_val_prompts=-1"],
            r"--data\.init_args\.max_val_prompts \(-1\) must be at least 1",
        ),
        (
            ["--trainer.logger=false"],
            r"--trainer\.logger=false with lightning\.pytorch\.callbacks\.LearningRateMonitor",
        ),
        (
            ["--trainer.enable_progress_bar=false"],
            r"--trainer\.enable_progress_bar=false with lit_flowgrpo\.callbacks\.RolloutProgressBar",
        ),
    ],
    ids=[
        "fp8_full_finetune",
        "merged_lora_full_finetune",
        "max_val_prompts_0",
        "max_val_prompts_neg",
        "lr_monitor",
        "progress_bar_off",
    ],
)
def test_config_checks_come_before_loading(run, flags, expected) -> None:
    import re

    assert re.search(expected, run(*flags))


# -- class 5: a mistyped choice gets the valid ones -------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        (
            "--model.init_args.objective=grpo_guard",
            "--model.init_args.objective (grpo_guard) takes a class path: --model.init_args.objective=lit_flowgrpo.objective.GRPOGuard",
        ),
        (
            "--model.init_args.objective=grpo_gaurd",
            "did you mean --model.init_args.objective=lit_flowgrpo.objective.GRPOGuard?",
        ),
        (
            "--model.loss=grpo_guard",
            "--model.loss was removed: the loss is chosen by --model.init_args.objective",
        ),
        (
            "--model.init_args.policy=lit_flowgrpo.policies.SD3Polcy",
            "lit_flowgrpo.policies has no SD3Polcy; did you mean lit_flowgrpo.policies.SD3Policy?",
        ),
        (
            "--model.init_args.policy.class_path=lit_flowgrpo.polices.SD3Policy",
            "lit_flowgrpo has no polices; did you mean lit_flowgrpo.policies?",
        ),
        (
            "--trainer.callbacks+=lit_flowgrpo.callbacks.TrainableEMAA",
            "did you mean lit_flowgrpo.callbacks.TrainableEMA?",
        ),
        (
            "--model.init_args.sampler.num_stpes=3",
            "Sampler has no setting 'num_stpes'; did you mean --model.init_args.sampler.num_steps",
        ),
        ("--data.init_args.prompt_per_step=3", "did you mean --data.init_args.prompts_per_step"),
        (
            "--model.init_args.reward.init_args.weights={jpeg_compressibility: .inf}",
            "'jpeg_compressibility' the weight inf: each weight must be a finite number",
        ),
    ],
    ids=[
        "objective_name",
        "objective_typo",
        "removed_loss",
        "policy_class",
        "policy_module",
        "callback",
        "dataclass_field",
        "data_argument",
        "weight_on_command_line",
    ],
)
def test_mistyped_choices_get_the_valid_ones(run, flag: str, expected: str) -> None:
    assert expected in run(flag)


def test_an_unknown_parse_error_keeps_jsonargparse_message(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as raised:
        main(["fit", "--config", CONFIG, "--trainer.max_steps=many"])
    err = capsys.readouterr().err
    assert raised.value.code == 2 and "max_steps" in err and "lit-flowgrpo: error:" not in err


# -- found items ------------------------------------------------------------------------------------


def test_more_prompts_per_step_than_distinct_prompts_is_refused(run, tmp_path: Path) -> None:
    two = tmp_path / "two.txt"
    two.write_text("a cat\na dog\na cat\n")  # 3 lines, 2 distinct prompts
    err = run(
        f"--data.init_args.train={two}",
        "--data.init_args.prompts_per_step=3",
        "--data.init_args.group_size=2",
    )
    assert (
        f"--data.init_args.prompts_per_step (3) is more than the 2 distinct prompts in --data.init_args.train ({two})"
        in err
    )
    assert "Set --data.init_args.prompts_per_step to at most 2" in err


def test_repeated_prompt_lines_warn(tmp_path: Path) -> None:
    path = tmp_path / "dups.txt"
    path.write_text("a cat\na cat\na dog\n")
    with pytest.warns(UserWarning, match=r"lists 1 prompts more than once"):
        PromptDataModule(str(path), prompts_per_step=2, group_size=2)


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_reward_weight_is_refused_at_construction(weight: float) -> None:
    with pytest.raises(
        SettingsError,
        match=r"--model\.init_args\.reward\.init_args\.weights gives 'jpeg_compressibility' the weight",
    ):
        MultiReward({"jpeg_compressibility": weight})


def test_nan_reward_weight_in_yaml(run, tmp_path: Path) -> None:
    override = tmp_path / "nan.yaml"
    override.write_text(
        "model:\n  init_args:\n    reward:\n      init_args:\n        weights: {jpeg_compressibility: .nan}\n"
    )
    err = run("--config", str(override))
    assert "--model.init_args.reward.init_args.weights gives 'jpeg_compressibility' the weight nan" in err


# -- the reward-hacking controls: advantage aggregation, evaluation size ----------------------------


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        # the tiny config's MultiReward weights one reward: GDPO has nothing to decouple
        (
            ["--model.init_args.advantage.aggregation=gdpo"],
            r"--model\.init_args\.advantage\.aggregation=gdpo normalises each weighted reward component on "
            r"its own and needs at least two, but --model\.init_args\.reward\.init_args\.weights gives 1",
        ),
        (
            [
                "--model.init_args.reward.init_args.weights={jpeg_compressibility: 1.0, jpeg_incompressibility: 0}",
                "--model.init_args.advantage.aggregation=gdpo",
            ],
            r"--model\.init_args\.reward\.init_args\.weights gives 1 a non-zero weight",
        ),
        (
            [
                "--model.init_args.reward=lit_flowgrpo.rewards.jpeg.JpegCompressibility",
                "--model.init_args.advantage.aggregation=gdpo",
            ],
            r"--model\.init_args\.reward is a plain callable \(one total\): give a MultiReward",
        ),
        (
            ["--model.init_args.advantage.aggregation=gpdo"],
            r"--model\.init_args\.advantage\.aggregation \(gpdo\) must be one of sum, gdpo; did you mean "
            r"--model\.init_args\.advantage\.aggregation=gdpo\?",
        ),
        (
            ["--model.init_args.advantage.aggregation=mean"],
            r"--model\.init_args\.advantage\.aggregation \(mean\) must be one of sum, gdpo$",
        ),
        (
            ["--model.init_args.sampler.eval_height=40"],
            r"--model\.init_args\.sampler\.eval_height \(40\) must be a positive multiple of 16 for SD3Policy",
        ),
        (
            ["--model.init_args.sampler.eval_width=24", "--model.init_args.sampler.eval_height=64"],
            r"--model\.init_args\.sampler\.eval_width \(24\) must be a positive multiple of 16",
        ),
        (
            ["--model.init_args.sampler.eval_width=0"],
            r"--model\.init_args\.sampler\.eval_width \(0\) must be at least 1, or null to use width",
        ),
    ],
    ids=[
        "gdpo_one_weight",
        "gdpo_one_nonzero_weight",
        "gdpo_plain_reward",
        "aggregation_typo",
        "aggregation_unknown",
        "eval_height",
        "eval_width",
        "eval_width_0",
    ],
)
def test_reward_hacking_controls_are_checked_before_loading(run, flags, expected) -> None:
    import re

    err = run(*flags)
    assert re.search(expected, err, flags=re.M), err
    assert "eval_height (64)" not in err  # a good size is not named
