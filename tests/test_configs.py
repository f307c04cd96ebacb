"""Every shipped YAML parses through the real CLI, the recipes hold the published numbers, and each recipe
runs one rollout (two optimizer steps) on CPU on a tiny pipeline of its family.

The published numbers below are the reference: flow_grpo's ``config/grpo.py`` knobs (GPU count,
per-GPU sample batch, images per prompt, unique prompts per epoch) pushed through flow_grpo's own
batch arithmetic, and verl-omni's GRPO-Guard Qwen-Image script. They are written here independently
of the YAML files, so a recipe that drifts from its source fails.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lit_flowgrpo.cli import FlowGRPOCLI

REPO = Path(__file__).resolve().parents[1]
# The recipes ship in the package; a clone's configs/ is a link to this folder (checked below).
CONFIG_DIR = REPO / "lit_flowgrpo" / "configs"
SHIPPED = sorted(CONFIG_DIR.glob("*.yaml"))


def _flow_grpo_layout(gpus: int, train_batch_size: int, group: int, unique_prompts: int) -> dict[str, int]:
    """flow_grpo ``config/grpo.py``: the batch of one epoch (= one rollout here) from the raw knobs.

    ``num_batches_per_epoch = int(unique / (gpus · train_batch_size / group))``; each GPU samples that
    many batches of ``train_batch_size``; ``train.batch_size = train_batch_size``;
    ``gradient_accumulation_steps = num_batches_per_epoch // 2`` (so 2 optimizer steps per epoch).
    """
    batches = int(unique_prompts / (gpus * train_batch_size / group))
    images = gpus * train_batch_size * batches
    accumulation = batches // 2
    return {
        "gpus": gpus,
        "prompts_per_step": images // group,
        "group_size": group,
        "micro_batch_size": train_batch_size,
        "optimizer_steps_per_rollout": batches // accumulation,
    }


# Published settings, per recipe (flow_grpo config/grpo.py function, or the verl-omni script).
_SD3 = {"num_steps": 10, "eval_num_steps": 40, "height": 512, "lora_rank": 32, "lora_alpha": 64, "lr": 3e-4}
PUBLISHED: dict[str, dict[str, Any]] = {
    # geneval_sd3 / general_ocr_sd3 / pickscore_sd3: 32 GPUs, train_batch_size 9, 24 per prompt, 48 prompts.
    "sd35m_geneval_flowgrpo": {
        **_flow_grpo_layout(32, 9, 24, 48),
        **_SD3,
        "loss": "flow_grpo",
        "clip_range": 1e-4,
        "kl_coef": 0.04,
        "noise_level": 0.7,
        "guidance_scale": 4.5,
        "advantage_std": "global",
        "reward": "geneval",
    },
    "sd35m_ocr_flowgrpo": {
        **_flow_grpo_layout(32, 9, 24, 48),
        **_SD3,
        "loss": "flow_grpo",
        "clip_range": 1e-4,
        "kl_coef": 0.04,
        "noise_level": 0.7,
        "guidance_scale": 4.5,
        "advantage_std": "global",
        "reward": "ocr",
    },
    "sd35m_pickscore_flowgrpo": {
        **_flow_grpo_layout(32, 9, 24, 48),
        **_SD3,
        "loss": "flow_grpo",
        "clip_range": 1e-4,
        "kl_coef": 0.01,
        "noise_level": 0.7,
        "guidance_scale": 4.5,
        "advantage_std": "global",
        "reward": "pickscore",
    },
    # GRPO-Guard (arXiv 2510.22319) on Flow-GRPO's SD3.5-M setup: clip 2e-6, lr 1e-4, beta 0, group std.
    "sd35m_ocr_grpoguard": {
        **_flow_grpo_layout(32, 9, 24, 48),
        **_SD3,
        "lr": 1e-4,
        "loss": "grpo_guard",
        "clip_range": 2e-6,
        "kl_coef": 0.0,
        "noise_level": 0.7,
        "guidance_scale": 4.5,
        "advantage_std": "group",
        "reward": "ocr",
    },
    "sd35m_geneval_grpoguard": {
        **_flow_grpo_layout(32, 9, 24, 48),
        **_SD3,
        "lr": 1e-4,
        "loss": "grpo_guard",
        "clip_range": 2e-6,
        "kl_coef": 0.0,
        "noise_level": 0.7,
        "guidance_scale": 4.5,
        "advantage_std": "group",
        "reward": "geneval",
    },
    # pickscore_sd3_fast_nocfg: 32 GPUs, train_batch_size 9, 18 per prompt, 64 prompts; CPS window 3 in (0, 5).
    "sd35m_pickscore_fast": {
        **_flow_grpo_layout(32, 9, 18, 64),
        **_SD3,
        "loss": "flow_grpo",
        "clip_range": 1e-5,
        "kl_coef": 0.0,
        "noise_level": 0.8,
        "guidance_scale": 1.0,
        "advantage_std": "global",
        "reward": "pickscore",
        "sde_type": "cps",
        "sde_window_size": 3,
        "sde_window_range": [0, 5],
        "train_cfg": False,
    },
    # pickscore_flux: 32 GPUs, train_batch_size 3, 24 per prompt, 48 prompts; scripts/train_flux.py LoRA 64/128.
    "flux_pickscore_flowgrpo": {
        **_flow_grpo_layout(32, 3, 24, 48),
        "num_steps": 6,
        "eval_num_steps": 28,
        "height": 512,
        "lora_rank": 64,
        "lora_alpha": 128,
        "lr": 3e-4,
        "loss": "flow_grpo",
        "clip_range": 1e-4,
        "kl_coef": 0.0,
        "noise_level": 0.9,
        "policy_guidance_scale": 3.5,
        "advantage_std": "global",
        "reward": "pickscore",
    },
    # verl-omni examples/grpoguard_trainer/qwen_image/run_qwen_image_ocr_lora.sh: 4 GPUs, 32 prompts x 16,
    # micro-batch 16 per GPU, mini-batch 16 prompts (2 optimizer steps), rollout defaults 10 steps at 512.
    "qwenimage_ocr_grpoguard": {
        "gpus": 4,
        "prompts_per_step": 32,
        "group_size": 16,
        "micro_batch_size": 16,
        "optimizer_steps_per_rollout": (32 * 16) // (16 * 16),
        "num_steps": 10,
        "eval_num_steps": 50,
        "height": 512,
        "lora_rank": 64,
        "lora_alpha": 128,
        "lr": 3e-4,
        "loss": "grpo_guard",
        "clip_range": 2e-6,
        "kl_coef": 0.0,
        "noise_level": 1.2,
        "guidance_scale": 4.0,
        "policy_true_cfg_scale": 4.0,
        "advantage_std": "group",
        "reward": "ocr",
        "sde_type": "sde",
        "sde_window_size": 2,
        "sde_window_range": [0, 5],
    },
    # general_ocr_wan2_1 on 1 GPU: train_batch_size 8 x num_batches_per_epoch 2 = 16 videos = 4 prompts x 4;
    # gradient_accumulation_steps 2 // 2 = 1 -> 2 optimizer steps; scripts/train_wan2_1.py LoRA 32/64.
    "wan21_1p3b_flowgrpo": {
        "gpus": 1,
        "prompts_per_step": 4,
        "group_size": 4,
        "micro_batch_size": 8,
        "optimizer_steps_per_rollout": 2,
        "num_steps": 20,
        "eval_num_steps": 50,
        "height": 240,
        "width": 416,
        "frames": 33,
        "lora_rank": 32,
        "lora_alpha": 64,
        "lr": 1e-4,
        "loss": "flow_grpo",
        "clip_range": 1e-3,
        "kl_coef": 0.004,
        "noise_level": 0.7,
        "guidance_scale": 4.5,
        "advantage_std": "group",
        "reward": "ocr",
    },
}
# Wan 2.2 A14B: no published Flow-GRPO run; the Wan 2.1 recipe's RL settings, Wan 2.2's own guidance.
PUBLISHED["wan22_a14b_flowgrpo"] = {
    **PUBLISHED["wan21_1p3b_flowgrpo"],
    "guidance_scale": 4.0,
    "policy_guidance_scale_2": 3.0,
}
# HunyuanVideo 1.5 480p: no published Flow-GRPO run; the Wan 2.1 recipe's RL settings and batch layout, the
# model's own guidance (its 480p guider, 6.0), its 16:9 size at 480p and its pipeline's 50 evaluation steps.
PUBLISHED["hunyuanvideo15_480p_flowgrpo"] = {
    **PUBLISHED["wan21_1p3b_flowgrpo"],
    "guidance_scale": 6.0,
    "height": 480,
    "width": 848,
    "eval_num_steps": 50,
    "performance": {"activation_checkpointing": True},  # compiled blocks not measured for this family
}
# SD3.5-Large: no published run; flow_grpo's pickscore_sd3 with its one model line set to the Large.
PUBLISHED["sd35l_pickscore_flowgrpo"] = dict(PUBLISHED["sd35m_pickscore_flowgrpo"])

FAMILY_FIXTURE = {
    "lit_flowgrpo.policies.SD3Policy": "tiny_sd3_path",
    "lit_flowgrpo.policies.sd3.SD3Policy": "tiny_sd3_path",
    "lit_flowgrpo.policies.flux.FluxPolicy": "tiny_flux_path",
    "lit_flowgrpo.policies.qwenimage.QwenImagePolicy": "tiny_qwenimage_path",
    "lit_flowgrpo.policies.wan.WanPolicy": "tiny_wan_path",
    "lit_flowgrpo.policies.hunyuanvideo15.HunyuanVideo15Policy": "tiny_hunyuanvideo15_path",
    "lit_flowgrpo.policies.flux2.Flux2KleinPolicy": "tiny_flux2_path",
    "lit_flowgrpo.policies.zimage.ZImagePolicy": "tiny_zimage_path",
}
#: The tiny pipeline of each Wan recipe (the A14B recipe runs the two-expert tiny).
TINY_VARIANT = {"wan22_a14b_flowgrpo": "tiny_wan_a14b_path"}


def _load(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def _leaves(tree: Any, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
    if isinstance(tree, dict):
        return [leaf for k, v in tree.items() for leaf in _leaves(v, (*prefix, k))]
    if isinstance(tree, list) and tree and all(isinstance(v, dict) for v in tree):
        return [leaf for i, v in enumerate(tree) for leaf in _leaves(v, (*prefix, i))]
    return [(prefix, tree)]


def _get(tree: Any, keys: tuple) -> Any:
    for k in keys:
        tree = tree[k]
    return tree


# --------------------------------------------------------------------------------------------------
# Every shipped YAML parses (no weights, no server, no W&B needed)
# --------------------------------------------------------------------------------------------------


def test_every_recipe_is_shipped() -> None:
    names = {p.stem for p in SHIPPED}
    assert set(PUBLISHED) <= names, f"missing recipes: {sorted(set(PUBLISHED) - names)}"
    # The clone's configs/ is the package's folder, so the README's `--config configs/X.yaml` reads the
    # files this module checks, and nothing is kept in two places.
    assert (REPO / "configs").resolve() == CONFIG_DIR.resolve()
    assert sorted((REPO / "configs").glob("*.yaml")) == [REPO / "configs" / p.name for p in SHIPPED]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_parses_through_the_cli(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``fit --config X --print_config`` exits 0 and the resolved config keeps every value the file sets."""
    with pytest.raises(SystemExit) as exit_info:
        FlowGRPOCLI(args=["fit", "--config", str(path), "--print_config"])
    assert exit_info.value.code == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    raw = _load(path)
    for keys, value in _leaves(raw):
        got = _get(resolved, keys)
        if keys[0] == "data" and isinstance(value, str) and (path.parent / value).is_file():
            # A prompt file named relative to the recipe's folder, printed as the absolute path of
            # that file (wherever the command runs: this test runs from the clone's root).
            assert got == os.path.realpath(path.parent / value), keys
        elif isinstance(value, float) or isinstance(got, float):
            assert got == pytest.approx(value, rel=1e-12), keys
        else:
            assert got == value, keys


# --------------------------------------------------------------------------------------------------
# The recipes run from any folder: named by --config NAME, their prompt files found from their folder
# --------------------------------------------------------------------------------------------------


def _printed_data(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    with pytest.raises(SystemExit) as exit_info:
        FlowGRPOCLI(args=[*args, "--print_config"])
    assert exit_info.value.code == 0
    return yaml.safe_load(capsys.readouterr().out)["data"]["init_args"]


def test_a_shipped_recipe_is_named_from_any_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a user of a pip install types, from a folder of theirs: the recipe and the prompt files it
    names (relative to its own folder) are the package's; the printed config names them absolutely,
    so that it can be saved anywhere and read back."""
    monkeypatch.chdir(tmp_path)
    assets = REPO / "lit_flowgrpo" / "toy" / "assets"
    for name in ("quickstart", "quickstart.yaml"):
        data = _printed_data(["fit", "--config", name], capsys)
        assert data["train"] == os.path.realpath(assets / "train.jsonl")
        assert data["val"] == os.path.realpath(assets / "val.jsonl")
    data = _printed_data(["fit", "--config=tiny_sd3"], capsys)
    assert data["train"] == os.path.realpath(CONFIG_DIR / "data" / "tiny_prompts.txt")


@pytest.mark.parametrize(
    ("given", "says"),
    [
        (
            "quickstrat",
            "--config (quickstrat) is neither a file nor a shipped recipe: give a config file, or one of ",
        ),
        (
            "configs/quickstart.yaml",
            "--config (configs/quickstart.yaml) does not exist in {cwd}: the recipe of that name ships with the "
            "package, --config quickstart reads it from any folder",
        ),
    ],
)
def test_a_config_that_is_neither_a_file_nor_a_recipe_is_one_message(
    given: str, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lit_flowgrpo.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", given])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("lit-flowgrpo: error: " + says.format(cwd=tmp_path)), err
    assert len(err.strip().splitlines()) == 1


def test_prompt_files_of_a_config_of_ones_own(
    tiny_sd3_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A relative path in a config file is read from the file's folder when the file is there, else from
    the working folder (as before, and as a path on the command line is)."""
    recipe, work = tmp_path / "recipe", tmp_path / "work"
    recipe.mkdir()
    work.mkdir()
    (recipe / "mine.txt").write_text("a red square\na blue circle\n")
    (work / "theirs.txt").write_text("a green triangle\na red circle\n")
    cfg = _load(CONFIG_DIR / "tiny_sd3.yaml")
    cfg["data"]["init_args"].update(train="mine.txt", val="theirs.txt")
    cfg["model"]["init_args"]["policy"]["init_args"]["pretrained"] = tiny_sd3_path
    (recipe / "run.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(work)
    data = _printed_data(["fit", "--config", str(recipe / "run.yaml")], capsys)
    assert data["train"] == os.path.realpath(recipe / "mine.txt")
    assert data["val"] == os.path.realpath(work / "theirs.txt")  # not beside the config: the working folder's
    cli = FlowGRPOCLI(args=["--config", str(recipe / "run.yaml")], run=False)
    assert [r["prompt"] for r in cli.datamodule.train_records] == ["a red square", "a blue circle"]
    assert [r["prompt"] for r in cli.datamodule.val_records] == ["a green triangle", "a red circle"]


# --------------------------------------------------------------------------------------------------
# The recipes hold the published numbers
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_recipe_matches_its_source(name: str) -> None:
    want = PUBLISHED[name]
    cfg = _load(CONFIG_DIR / f"{name}.yaml")
    trainer, model, data = cfg["trainer"], cfg["model"]["init_args"], cfg["data"]["init_args"]
    policy = model["policy"]["init_args"]

    gpus = trainer["devices"] * trainer["num_nodes"]
    objective = model["objective"]
    sampler, update, advantage = model["sampler"], model["update"], model.get("advantage", {})
    assert gpus == want["gpus"]
    assert data["prompts_per_step"] == want["prompts_per_step"]
    assert data["group_size"] == want["group_size"]
    assert update["micro_batch_size"] == want["micro_batch_size"]
    assert update["optimizer_steps_per_rollout"] == want["optimizer_steps_per_rollout"] == 2
    # The per-GPU batch divides into micro-batches on the stated GPU count (what setup() checks).
    per_gpu = data["prompts_per_step"] * data["group_size"] / gpus
    assert per_gpu == int(per_gpu) and per_gpu % update["micro_batch_size"] == 0

    assert (
        objective["class_path"].rsplit(".", 1)[-1]
        == {"flow_grpo": "FlowGRPO", "grpo_guard": "GRPOGuard"}[want["loss"]]
    )
    for key in ("num_steps", "eval_num_steps"):
        assert sampler[key] == want[key], key
    assert advantage.get("std", "global") == want["advantage_std"]
    assert objective["init_args"]["clip_range"] == pytest.approx(want["clip_range"], rel=1e-12)
    assert model["kl"]["coef"] == pytest.approx(want["kl_coef"], rel=1e-12)
    assert sampler["noise_level"] == pytest.approx(want["noise_level"], rel=1e-12)
    assert sampler["height"] == want["height"] and sampler["width"] == want.get("width", want["height"])
    assert sampler.get("frames", 1) == want.get("frames", 1)
    assert model["optimizer"]["init_args"]["lr"] == pytest.approx(want["lr"], rel=1e-12)
    lora = model["weights"]["lora"]
    assert lora["rank"] == want["lora_rank"] and lora["alpha"] == want["lora_alpha"]
    assert objective["init_args"]["adv_clip_max"] == 5.0 and update["max_grad_norm"] == 1.0
    if "guidance_scale" in want:
        assert sampler["guidance_scale"] == want["guidance_scale"]
    if "policy_guidance_scale" in want:
        assert policy["guidance_scale"] == want["policy_guidance_scale"]
    if "policy_guidance_scale_2" in want:
        assert policy["guidance_scale_2"] == want["policy_guidance_scale_2"]
    if "policy_true_cfg_scale" in want:
        assert policy["true_cfg_scale"] == want["policy_true_cfg_scale"] == sampler["guidance_scale"]
    for key in ("sde_type", "sde_window_size", "sde_window_range"):
        if key in want:
            assert sampler[key] == want[key], key
    if "train_cfg" in want:
        assert update["train_cfg"] == want["train_cfg"]
    if "sde_window_size" not in want:
        assert sampler["timestep_fraction"] == 0.99
    weights = model["reward"]["init_args"]["weights"]
    if "frames" in want:  # a video recipe scores its frames with the image reward
        assert list(weights) == ["per_frame"]
        assert model["reward"]["init_args"]["config"]["per_frame"]["reward"] == want["reward"]
    else:
        assert list(weights) == [want["reward"]]
    # the measured fast path on GPUs; Qwen-Image's causal video decoder was not measured compiled
    # (nor Wan's causal video decoder)
    fast = (
        {"compile_blocks": True}
        if "qwen" in name or "wan" in name
        else {"compile_blocks": True, "compile_decoder": True}
    )
    if "wan" in name:  # video updates do not fit without recomputing the blocks (the recipe's comment)
        fast["activation_checkpointing"] = True
    fast = want.get("performance", fast)
    assert model["performance"] == fast
    assert policy["dtype"] == "bfloat16" and trainer["precision"] == "32-true"

    callbacks = {c["class_path"].rsplit(".", 1)[-1]: c.get("init_args", {}) for c in trainer["callbacks"]}
    assert callbacks["TrainableEMA"] == {"decay": 0.9, "update_every": 8}
    assert callbacks["LearningRateMonitor"] == {"logging_interval": "step"}
    assert callbacks["ModelCheckpoint"]["save_last"] is True
    # Video recipes log their samples as videos through the same callback.
    assert {"RLThroughputMonitor", "SampleImageLogger"} <= set(callbacks)
    # Checkpoints land on whole rollouts: every_n_train_steps counts optimizer steps.
    assert callbacks["ModelCheckpoint"]["every_n_train_steps"] % update["optimizer_steps_per_rollout"] == 0
    assert trainer["logger"]["class_path"] == "lightning.pytorch.loggers.WandbLogger"
    assert trainer["logger"]["init_args"]["project"] == "lit_flowgrpo"


# --------------------------------------------------------------------------------------------------
# One rollout of each recipe on CPU, on a tiny pipeline of its family (the image families' pipelines are
# tests/conftest.py's, shared with tests/policies)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_wan_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from lit_flowgrpo.tiny.wan import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("cfg_tiny_wan"))


@pytest.fixture(scope="session")
def tiny_wan_a14b_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from lit_flowgrpo.tiny.wan import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("cfg_tiny_wan_a14b"), "a14b")


@pytest.fixture(scope="session")
def tiny_hunyuanvideo15_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from lit_flowgrpo.tiny.hunyuanvideo15 import build_tiny_hunyuanvideo15

    return build_tiny_hunyuanvideo15(tmp_path_factory.mktemp("cfg_tiny_hunyuanvideo15"))


def _assert_batch_layout(raw: dict[str, Any], want: dict[str, Any]) -> None:
    """The recipe's GPUs, prompts x group per step, micro-batch and optimizer steps per rollout are the
    source's (``want``)."""
    trainer, data = raw["trainer"], raw["data"]["init_args"]
    update = raw["model"]["init_args"]["update"]
    assert trainer["devices"] * trainer["num_nodes"] == want["gpus"]
    assert (data["prompts_per_step"], data["group_size"]) == (want["prompts_per_step"], want["group_size"])
    assert (update["micro_batch_size"], update["optimizer_steps_per_rollout"]) == (
        want["micro_batch_size"],
        want["optimizer_steps_per_rollout"],
    )


def _fit_tiny(
    raw: dict[str, Any],
    name: str,
    request: pytest.FixtureRequest,
    prompt_file: str,
    tmp_path: Path,
    num_steps: int | None = None,
) -> FlowGRPOCLI:
    """``fit`` of the recipe ``raw`` shrunk by :func:`_tiny_run_config` on the tiny pipeline of its family
    (:data:`TINY_VARIANT` where it names one), with ``num_steps`` sampling steps where given."""
    fixture = TINY_VARIANT.get(name) or FAMILY_FIXTURE[raw["model"]["init_args"]["policy"]["class_path"]]
    cfg = _tiny_run_config(raw, request.getfixturevalue(fixture), prompt_file, tmp_path)
    if num_steps is not None:
        cfg["model"]["init_args"]["sampler"]["num_steps"] = num_steps
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return FlowGRPOCLI(args=["fit", "--config", str(path)])


def _tiny_run_config(cfg: dict[str, Any], pretrained: str, prompts: str, root: Path) -> dict[str, Any]:
    """The recipe, shrunk to one CPU rollout: 2 prompts x 4 samples at 32 px, tiny step counts,
    JPEG compressibility in place of rewards that need weights or a server, a CSV logger for W&B."""
    cfg = copy.deepcopy(cfg)
    trainer, model, data = cfg["trainer"], cfg["model"]["init_args"], cfg["data"]["init_args"]
    trainer.update(
        accelerator="cpu",
        devices=1,
        num_nodes=1,
        strategy="auto",
        max_steps=2,
        max_epochs=-1,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        logger={"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(root)}},
    )
    for callback in trainer["callbacks"]:
        name = callback["class_path"].rsplit(".", 1)[-1]
        if name == "ModelCheckpoint":
            callback["init_args"].update(every_n_train_steps=2, dirpath=str(root / "checkpoints"))
        elif name == "SampleImageLogger":
            callback["init_args"].update(every_n_steps=1, max_images=4)
        elif name == "RLThroughputMonitor":
            callback["init_args"] = {"measure_flops": False}
    policy = model["policy"]["init_args"]
    policy.update(pretrained=pretrained, max_sequence_length=16)
    video = model["sampler"].get("frames", 1) > 1
    model["reward"]["init_args"] = {"weights": {"jpeg_compressibility": 1.0}}
    if video:  # the recipe's own wrapper, around a reward that needs no weights
        model["reward"]["init_args"] = {
            "weights": {"per_frame": 1.0},
            "config": {"per_frame": {"reward": "jpeg_compressibility", "reduce": "mean"}},
        }
    window = model["sampler"].get("sde_window_range")
    model["sampler"].update(height=32, width=32, num_steps=window[1] if window else 3, eval_num_steps=2)
    if video:
        model["sampler"].update(frames=5)  # 2 latent frames
    model["update"]["micro_batch_size"] = 4
    model["performance"] = {}  # compiling for a CPU rollout costs minutes
    data.update(train=prompts, val=None, prompts_per_step=2, group_size=4)
    return cfg


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_recipe_runs_one_rollout_on_cpu(
    name: str, request: pytest.FixtureRequest, prompt_file: str, tmp_path: Path
) -> None:
    raw = _load(CONFIG_DIR / f"{name}.yaml")
    cli = _fit_tiny(raw, name, request, prompt_file, tmp_path)

    module, trainer = cli.model, cli.trainer
    want = PUBLISHED[name]
    assert trainer.global_step == 2  # one rollout, the recipe's 2 optimizer steps
    # The recipe's algorithm settings reached the module untouched.
    assert module.objective.name == want["loss"]
    assert module.objective.clip_range == pytest.approx(want["clip_range"], rel=1e-12)
    assert module.kl.coef == pytest.approx(want["kl_coef"], rel=1e-12)
    assert module.sampler.noise_level == pytest.approx(want["noise_level"], rel=1e-12)
    assert module.advantage.std == want["advantage_std"]
    assert module.policy.transformer.dtype == torch.bfloat16  # bf16 weights as published
    lora = [p for n, p in module.named_parameters() if "lora_" in n]
    assert lora and all(p.dtype == torch.float32 and p.requires_grad for p in lora)
    assert sum(p.numel() for p in lora) == sum(p.numel() for p in module.parameters() if p.requires_grad)

    logged = {k: float(v) for k, v in trainer.logged_metrics.items()}
    assert math.isfinite(logged["actor/loss"]) and math.isfinite(logged["actor/grad_norm"])
    # JPEG compressibility of 32 px images is a finite number per sample; every sample was scored.
    assert logged["reward/failure_rate"] == 0.0
    assert math.isfinite(logged["critic/rewards/mean"])
    # bf16 weights: the update recomputes the rollout's log-probs within the module's bf16 tolerance.
    assert logged["actor/on_policy_ratio_err"] <= 1e-3
    assert logged["actor/kl_coef"] == pytest.approx(want["kl_coef"], rel=1e-6)

    # The recipe's callbacks did their work: a checkpoint (last.ckpt too) and a sample grid.
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").glob("*.ckpt"))
    assert "last.ckpt" in checkpoints and len(checkpoints) >= 2
    if "frames" in want:  # a video recipe: every trained network holds an adapter
        networks = module.policy.trainable_networks
        assert len(networks) == (2 if "a14b" in name else 1)
        assert all(any(p.requires_grad for p in n.parameters()) for n in networks)
        # No video logger is configured here (CSV): the samples land on disk as captioned GIFs.
        gifs = list(tmp_path.rglob("train*_step*.gif"))
        assert gifs, f"no sample GIF under {tmp_path}: {[p.name for p in tmp_path.rglob('*')]}"
        return
    grids = list(tmp_path.rglob("train*_step*.png"))
    assert grids, f"no sample grid under {tmp_path}: {[p.name for p in tmp_path.rglob('*')]}"
    captions = list(tmp_path.rglob("train*_step*.json"))
    assert captions and len(json.loads(captions[0].read_text())["captions"]) == 4


def test_tiny_a14b_recipe_exports_both_experts_and_resumes(
    tiny_wan_a14b_path: str, prompt_file: str, tmp_path: Path
) -> None:
    """The A14B recipe end to end on the two-expert tiny: fit (rollout, reward, update, checkpoint), export
    (one adapter per expert, each loaded back by WanPipeline into its own transformer), then resume."""
    from diffusers import WanPipeline
    from safetensors.torch import load_file

    from lit_flowgrpo.cli import main

    cfg = _tiny_run_config(
        _load(CONFIG_DIR / "wan22_a14b_flowgrpo.yaml"), tiny_wan_a14b_path, prompt_file, tmp_path
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli = FlowGRPOCLI(args=["fit", "--config", str(path)])
    module = cli.model
    high, _ = module.policy.trainable_networks
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    saved = set(state["state_dict"])
    assert any(k.startswith("policy._transformer.") for k in saved)
    assert any(k.startswith("policy._transformer_2.") for k in saved)
    assert cli.trainer.global_step == 2

    out = tmp_path / "lora"
    main(
        [
            "export",
            "--config",
            str(path),
            "--ckpt_path",
            str(tmp_path / "checkpoints" / "last.ckpt"),
            "--out",
            str(out),
        ]
    )
    first = load_file(out / "pytorch_lora_weights.safetensors")
    second = load_file(out / "transformer_2" / "pytorch_lora_weights.safetensors")
    assert len(first) == len(second) == sum(1 for n, p in high.named_parameters() if p.requires_grad)
    pipe = WanPipeline.from_pretrained(tiny_wan_a14b_path)
    pipe.load_lora_weights(str(out), adapter_name="high")
    pipe.load_lora_weights(str(out / "transformer_2"), adapter_name="low", load_into_transformer_2=True)
    loaded_high = {n for n, _ in pipe.transformer.named_parameters() if "lora_" in n}
    loaded_low = {n for n, _ in pipe.transformer_2.named_parameters() if "lora_" in n}
    assert len(loaded_high) == len(loaded_low) == len(first)

    # Resume: the checkpoint's adapters (both experts) and step, one more rollout.
    resumed = FlowGRPOCLI(
        args=[
            "fit",
            "--config",
            str(path),
            "--trainer.max_steps=4",
            f"--ckpt_path={tmp_path / 'checkpoints' / 'last.ckpt'}",
        ]
    )
    assert resumed.trainer.global_step == 4
    assert math.isfinite(float(resumed.trainer.logged_metrics["actor/loss"]))


# --------------------------------------------------------------------------------------------------
# Recipes from sources other than flow_grpo (their own batch arithmetic, no EMA): the source's numbers,
# and one rollout on the tiny pipeline of their family
# --------------------------------------------------------------------------------------------------

#: DanceGRPO scripts/finetune/finetune_flux_grpo_8gpus_lora.sh: 8 GPUs x 2 prompts x 12 generations,
#: one image per backward, an optimizer step every 12 of a GPU's 24 images; HPS v2.1 the reward.
OTHER_SOURCES: dict[str, dict[str, Any]] = {
    "flux_hpsv2_dancegrpo": {
        "gpus": 8,
        "prompts_per_step": 16,
        "group_size": 12,
        "micro_batch_size": 1,
        "optimizer_steps_per_rollout": 2,
        "num_steps": 12,
        "timestep_fraction": 0.6,
        "noise_level": 0.3,
        "sde_type": "dance",
        "clip_range": 1e-4,
        "lr": 3e-4,
        "lora_rank": 128,
        "lora_alpha": 256,
        "height": 720,
        "reward": "hpsv2",
    },
}


@pytest.mark.parametrize("name", sorted(OTHER_SOURCES))
def test_other_source_recipe_matches_and_runs_one_rollout(
    name: str, request: pytest.FixtureRequest, prompt_file: str, tmp_path: Path
) -> None:
    want = OTHER_SOURCES[name]
    raw = _load(CONFIG_DIR / f"{name}.yaml")
    model, data = raw["model"]["init_args"], raw["data"]["init_args"]
    sampler, update = model["sampler"], model["update"]
    _assert_batch_layout(raw, want)
    per_gpu = data["prompts_per_step"] * data["group_size"] // want["gpus"]
    micro_batches = per_gpu // update["micro_batch_size"]
    assert micro_batches // update["optimizer_steps_per_rollout"] == 12  # gradient_accumulation_steps
    for key in ("num_steps", "timestep_fraction", "noise_level", "sde_type", "height"):
        assert sampler[key] == want[key], key
    assert model["objective"]["init_args"]["clip_range"] == want["clip_range"]
    assert model["optimizer"]["init_args"]["lr"] == want["lr"]
    lora = model["weights"]["lora"]
    assert (lora["rank"], lora["alpha"]) == (want["lora_rank"], want["lora_alpha"])
    assert list(model["reward"]["init_args"]["weights"]) == [want["reward"]]

    cli = _fit_tiny(raw, name, request, prompt_file, tmp_path, num_steps=5)  # 0.6 x 5: 3 trained steps
    assert cli.trainer.global_step == 2  # one rollout, the recipe's 2 optimizer steps
    assert cli.model.sampler.sde_type == want["sde_type"]
    logged = {k: float(v) for k, v in cli.trainer.logged_metrics.items()}
    assert math.isfinite(logged["actor/loss"]) and logged["reward/failure_rate"] == 0.0


# --------------------------------------------------------------------------------------------------
# Flow-Factory's recipes (examples/grpo/lora/<model>/default.yaml): its batch arithmetic (8 processes, one
# image per device batch, `unique_sample_num_per_epoch` prompts x `group_size`, `gradient_step_per_epoch`
# optimizer steps), a one-step SDE window drawn from its `sde_steps`, and one rollout on the tiny pipeline
# --------------------------------------------------------------------------------------------------

_FLOW_FACTORY = {
    "gpus": 8,
    "prompts_per_step": 48,
    "group_size": 16,
    "micro_batch_size": 1,
    "optimizer_steps_per_rollout": 2,
    "sde_type": "sde",
    "sde_window_size": 1,
    "clip_range": 1e-4,
    "kl_coef": 0.0,
    "lr": 3e-4,
    "lora_rank": 64,
    "lora_alpha": 128,
    "advantage_std": "group",
    "ema": {"decay": 0.9, "update_every": 8},  # ema_update_interval 4 epochs x 2 optimizer steps
    "reward": "pickscore",
}
FLOW_FACTORY: dict[str, dict[str, Any]] = {
    # flux2_klein_base/default.yaml: FLUX.2-klein-base-9B, 8 steps at 384 px, CFG 4.0, sde_steps [1, 2, 3]
    "flux2_klein_pickscore_flowgrpo": {
        **_FLOW_FACTORY,
        "pretrained": "black-forest-labs/FLUX.2-klein-base-9B",
        "num_steps": 8,
        "eval_num_steps": 28,
        "height": 384,
        "guidance_scale": 4.0,
        "noise_level": 0.7,
        "sde_window_range": [1, 4],
    },
    # z_image_turbo/default.yaml: Z-Image-Turbo, 6 steps at 512 px, guidance 0 (the sampler's 1), sde_steps
    # [1, 2, 3]
    "zimage_turbo_pickscore_flowgrpo": {
        **_FLOW_FACTORY,
        "pretrained": "Tongyi-MAI/Z-Image-Turbo",
        "num_steps": 6,
        "eval_num_steps": 10,
        "height": 512,
        "guidance_scale": 1.0,
        "noise_level": 0.7,
        "sde_window_range": [1, 4],
    },
}


@pytest.mark.parametrize("name", sorted(FLOW_FACTORY))
def test_flow_factory_recipe_matches_and_runs_one_rollout(
    name: str, request: pytest.FixtureRequest, prompt_file: str, tmp_path: Path
) -> None:
    want = FLOW_FACTORY[name]
    raw = _load(CONFIG_DIR / f"{name}.yaml")
    trainer, model = raw["trainer"], raw["model"]["init_args"]
    sampler, update = model["sampler"], model["update"]
    _assert_batch_layout(raw, want)
    assert model["policy"]["init_args"]["pretrained"] == want["pretrained"]
    for key in ("num_steps", "eval_num_steps", "height", "guidance_scale", "noise_level", "sde_type"):
        assert sampler[key] == want[key], key
    assert (sampler["sde_window_size"], sampler["sde_window_range"]) == (
        want["sde_window_size"],
        want["sde_window_range"],
    )
    assert update["train_cfg"] == (want["guidance_scale"] > 1)
    assert model["objective"]["init_args"]["clip_range"] == want["clip_range"]
    assert model["kl"]["coef"] == want["kl_coef"] and model["advantage"]["std"] == want["advantage_std"]
    assert model["optimizer"]["init_args"]["lr"] == want["lr"]
    lora = model["weights"]["lora"]
    assert (lora["rank"], lora["alpha"]) == (want["lora_rank"], want["lora_alpha"])
    callbacks = {c["class_path"].rsplit(".", 1)[-1]: c.get("init_args", {}) for c in trainer["callbacks"]}
    assert callbacks["TrainableEMA"] == want["ema"]
    assert list(model["reward"]["init_args"]["weights"]) == [want["reward"]]

    cli = _fit_tiny(raw, name, request, prompt_file, tmp_path)
    assert cli.trainer.global_step == 2  # one rollout, the recipe's 2 optimizer steps
    assert cli.model.sampler.sde_window_size == 1 and cli.model.policy.transformer.dtype == torch.bfloat16
    logged = {k: float(v) for k, v in cli.trainer.logged_metrics.items()}
    assert math.isfinite(logged["actor/loss"]) and logged["reward/failure_rate"] == 0.0
    # bf16 weights: the update recomputes the rollout's log-probs within the module's bf16 tolerance.
    assert logged["actor/on_policy_ratio_err"] <= 1e-3


# --------------------------------------------------------------------------------------------------
# DanceGRPO's HunyuanVideo run (scripts/finetune/finetune_hunyuan_grpo.sh, fastvideo/train_grpo_hunyuan.py)
# on HunyuanVideo 1.5: a full fine-tune with VideoAlign's VQ, its batch arithmetic, one rollout on the tiny
# pipeline
# --------------------------------------------------------------------------------------------------

#: 4 nodes x 8 GPUs, 1 prompt per GPU x 24 generations; bestofn 8 of them trained, an optimizer step every
#: gradient_accumulation_steps 4: 2 optimizer steps per rollout; vq_coef 1.0, mq_coef 0.0.
DANCEGRPO_VIDEO: dict[str, dict[str, Any]] = {
    "hunyuanvideo15_videoalign_dancegrpo": {
        "gpus": 4 * 8,
        "prompts_per_step": 4 * 8 * 1,
        "group_size": 24,
        "micro_batch_size": 1,
        "optimizer_steps_per_rollout": 8 // 4,
        "num_steps": 16,
        "timestep_fraction": 0.6,
        "noise_level": 0.25,
        "sde_type": "dance",
        "clip_range": 1e-4,
        "adv_clip_max": 5.0,
        "lr": 1e-5,
        "weight_decay": 1e-4,
        "max_grad_norm": 1.0,
        "height": 480,
        "width": 480,
        "frames": 53,
        "guidance_scale": 6.0,  # HunyuanVideo 1.5's guider, in place of HunyuanVideo 1's embedded 6.018
        "reward_weights": {"video_align/VQ": 1.0, "video_align/MQ": 0.0, "video_align/TA": 0.0},
        "source_fps": 8.0,
    },
}


@pytest.mark.parametrize("name", sorted(DANCEGRPO_VIDEO))
def test_dancegrpo_video_recipe_matches_and_runs_one_rollout(
    name: str, request: pytest.FixtureRequest, prompt_file: str, tmp_path: Path
) -> None:
    from lit_flowgrpo.rewards import MultiReward

    want = DANCEGRPO_VIDEO[name]
    raw = _load(CONFIG_DIR / f"{name}.yaml")
    trainer, model, data = raw["trainer"], raw["model"]["init_args"], raw["data"]["init_args"]
    sampler, update = model["sampler"], model["update"]
    _assert_batch_layout(raw, want)
    assert trainer["strategy"] == "fsdp2"
    assert data["same_initial_noise"] is True  # --use_same_noise
    for key in ("num_steps", "timestep_fraction", "noise_level", "sde_type", "height", "width", "frames"):
        assert sampler[key] == want[key], key
    assert sampler["frames"] % 4 == 1  # the 1.5 VAE's 4k + 1
    assert sampler["guidance_scale"] == want["guidance_scale"] and update["train_cfg"] is True
    objective = model["objective"]["init_args"]
    assert (objective["clip_range"], objective["adv_clip_max"]) == (want["clip_range"], want["adv_clip_max"])
    assert model["kl"]["coef"] == 0.0 and update["max_grad_norm"] == want["max_grad_norm"]
    optimizer = model["optimizer"]["init_args"]
    assert (optimizer["lr"], optimizer["weight_decay"]) == (want["lr"], want["weight_decay"])
    assert model["weights"] == {"lora": None, "master_dtype": "float32"}  # full, fp32 masters
    reward = model["reward"]["init_args"]
    assert reward["weights"] == want["reward_weights"]
    assert reward["config"]["video_align"]["source_fps"] == want["source_fps"]
    callbacks = {c["class_path"].rsplit(".", 1)[-1] for c in trainer["callbacks"]}
    assert "TrainableEMA" not in callbacks  # the script parses --ema_decay but applies no EMA

    # The recipe's weights train on VQ alone (DanceGRPO's vq_coef·A_VQ + 0·A_MQ), MQ and TA logged.
    scores = {
        "VQ": torch.tensor([0.5, -1.25]),
        "MQ": torch.tensor([3.0, 7.0]),
        "TA": torch.tensor([2.0, -4.0]),
    }

    class Qualities:  # VideoAlign's output layout (video only), without its 2B model
        modalities = frozenset({"video"})
        primary = "Overall"

        def __call__(self, videos: torch.Tensor, prompts: list[str], metadata: list[dict]) -> dict:
            return {**scores, "Overall": scores["VQ"] + scores["MQ"] + scores["TA"]}

    combined = MultiReward(weights=reward["weights"], rewards={"video_align": Qualities()})
    out = combined(torch.zeros(2, 5, 3, 8, 8), ["a", "b"], [{}, {}])
    assert torch.equal(out.total, scores["VQ"])
    logged = {f"video_align/{k}" for k in ("VQ", "MQ", "TA")}
    assert logged <= set(out.components) and all(
        torch.equal(out.components[f"video_align/{k}"], v) for k, v in scores.items()
    )

    # The tiny run's 3 steps (0.6 x 3: 1 trained step), CFG 6.0 kept, the reward swapped for per-frame JPEG.
    cli = _fit_tiny(raw, name, request, prompt_file, tmp_path)
    assert cli.trainer.global_step == 2  # one rollout, the recipe's 2 optimizer steps
    assert cli.model.sampler.sde_type == want["sde_type"] and cli.datamodule.same_initial_noise
    # A full fine-tune: every transformer weight trained, in float32 masters; no adapter.
    transformer = cli.model.policy.transformer
    assert not any("lora_" in n for n, _ in cli.model.named_parameters())
    assert all(p.requires_grad and p.dtype == torch.float32 for p in transformer.parameters())
    logged = {k: float(v) for k, v in cli.trainer.logged_metrics.items()}
    assert math.isfinite(logged["actor/loss"]) and logged["reward/failure_rate"] == 0.0
    assert math.isfinite(logged["actor/grad_norm"]) and logged["actor/grad_norm"] > 0
