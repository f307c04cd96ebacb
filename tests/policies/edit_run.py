"""What the editing families' tests (FLUX.1 Kontext, Qwen-Image-Edit) share: source PNGs, the data module over
their records, the objectives, and the runs whose checks do not depend on the family (an exact resume, the
recipe on two processes)."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import yaml
from PIL import Image
from test_module import logged, lora_state, make_trainer

from lit_flowgrpo import FlowGRPOModule, PromptDataModule, UpdateSettings
from lit_flowgrpo.conditioning import Condition, read_rgb
from lit_flowgrpo.objective import DiffusionNFT, FlowDPPO, FlowGRPO, GRPOGuard, GRPOGuardRatioNorm
from lit_flowgrpo.policies.base import FlowPolicy
from lit_flowgrpo.rollout import per_sample_generators, sample_trajectory

CONFIGS = Path(__file__).resolve().parents[2] / "lit_flowgrpo" / "configs"

OBJECTIVES = {
    "flow_grpo": lambda: FlowGRPO(clip_range=1e-2),
    "grpo_guard": lambda: GRPOGuard(clip_range=2e-6),
    "grpo_guard_ratio_norm": lambda: GRPOGuardRatioNorm(clip_range=1e-3),
    "flow_dppo": lambda: FlowDPPO(),
    "diffusion_nft": lambda: DiffusionNFT(),
}


def write_source(path: Path, width: int, height: int, seed: int) -> str:
    """A smooth random RGB PNG (a 4x4 grid of colours, resized with bilinear filtering)."""
    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8))
    small.resize((width, height), Image.Resampling.BILINEAR).save(path)
    return str(path)


def write_sources(root: Path, sizes: dict[str, tuple[int, int]]) -> dict[str, str]:
    """One PNG per name, of its (width, height), seeded by its place in ``sizes``."""
    return {
        name: write_source(root / f"{name}.png", *wh, seed=i) for i, (name, wh) in enumerate(sizes.items())
    }


def condition(*paths: str) -> Condition:
    """A record's conditioning as the data module builds it: the files decoded, keyed by their paths."""
    return Condition([read_rgb(p) for p in paths], "|".join(paths))


def sample_at_noise_level_zero(
    policy: FlowPolicy,
    prompts: list[str],
    x1: torch.Tensor,
    conditions: list[Condition],
    size: int,
    steps: int,
    guidance_scale: float,
) -> torch.Tensor:
    """The package's sampling loop at noise level 0 (every step through the SDE step, η = 0): the final
    latents of ``prompts`` with their ``conditions`` from the noise ``x1``, at ``size`` x ``size``."""
    embeds = policy.encode(prompts, conditions, size, size)
    traj = sample_trajectory(
        policy,
        embeds,
        x1,
        policy.sigmas(steps, size, size),
        guidance_scale=guidance_scale,
        noise_level=0.0,
        sde_type="sde",
        sde_steps=range(steps),
        train_steps=[],
        generators=per_sample_generators(torch.arange(len(prompts)), "cpu"),
    )
    return traj.final


def edit_data(records: str, **overrides) -> PromptDataModule:
    settings = dict(
        train=records,
        val=records,
        prompts_per_step=2,
        group_size=4,
        val_batch_size=4,
        max_val_prompts=2,
        seed=3,
    )
    settings.update(overrides)
    return PromptDataModule(**settings)


def trainable(module: FlowGRPOModule) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.policy.transformer.named_parameters() if p.requires_grad}


def fit_moving_the_adapter(module: FlowGRPOModule, trainer: L.Trainer, data: PromptDataModule) -> None:
    """Fit, and check that the trained weights moved from where training started."""
    before = None

    class Before(L.Callback):
        def on_train_start(self, trainer, pl_module):
            nonlocal before
            before = trainable(pl_module)

    trainer.callbacks.append(Before())
    trainer.fit(module, datamodule=data)
    after = trainable(module)
    assert any(not torch.equal(after[k], before[k]) for k in before), "the adapter did not move"


def step_with_the_conditioning(
    module: FlowGRPOModule, records: str, tmp_path: Path, wanted: set[str], lora: bool, max_steps: int
) -> None:
    """One rollout (its 2 optimizer steps) of ``module`` on ``records``, checking that every forward (the
    rollout's and the update's visits) was given the ``wanted`` conditioning keys, that the loss is finite and
    that what was trained is fp32 (without adapter tensors for a full fine-tune, ``lora`` False)."""
    seen: list[set[str]] = []
    velocity = module.policy.velocity

    def recording(latents, sigma, embeds, guidance_scale):  # what every forward (rollout, visits) is given
        seen.append(set(embeds))
        return velocity(latents, sigma, embeds, guidance_scale)

    module.policy.velocity = recording
    trainer = make_trainer(tmp_path, max_steps=max_steps)
    trainer.fit(module, datamodule=edit_data(records, val=None))
    assert trainer.global_step == 2  # one rollout: its two optimizer steps
    row = next(r for r in logged(trainer) if "actor/loss" in r)
    assert math.isfinite(row["actor/loss"])
    assert seen and all(wanted <= keys for keys in seen)
    moved = [p for p in module.policy.transformer.parameters() if p.requires_grad]
    assert moved and all(p.dtype == torch.float32 for p in moved)
    if not lora:
        assert not any("lora_" in n for n, _ in module.policy.transformer.named_parameters())


def assert_resume_is_exact(make_module: Callable[[], FlowGRPOModule], records: str, tmp_path: Path) -> None:
    """4 steps straight against 2 steps, a checkpoint and 2 more, with validation on and the policy's caches
    on: the uninterrupted run's second rollout finds records cached that the resumed run, whose caches start
    empty, encodes afresh. Every LoRA tensor must be equal."""
    data = dict(max_val_prompts=3, val_batch_size=3)
    validating = dict(limit_val_batches=1, val_check_interval=2, check_val_every_n_epoch=None)

    def run(root: str, max_steps: int, **fit):
        module = make_module()
        trainer = make_trainer(tmp_path / root, max_steps=max_steps, **validating)
        trainer.fit(module, datamodule=edit_data(records, **data), **fit)
        return module, trainer

    straight, _ = run("a", 4)
    _, trainer = run("b", 2)
    ckpt = tmp_path / "half.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed, _ = run("c", 4, ckpt_path=ckpt)
    a, b = lora_state(straight), lora_state(resumed)
    assert a.keys() == b.keys() and a
    differ = [key for key in a if not torch.equal(a[key], b[key])]
    assert not differ, f"{len(differ)} of {len(a)} LoRA tensors differ after the resume, e.g. {differ[:3]}"


def recipe_on_two_processes(
    recipe: str,
    strategy: str,
    records: str,
    tmp_path: Path,
    policy: dict[str, Any],
    sampler: dict[str, Any],
) -> dict[str, float]:
    """The shipped ``recipe`` on 2 CPU processes (gloo) launched by torchrun under ``strategy``, one node, with
    ``policy`` and ``sampler`` settings over the recipe's, a reward that needs no weights, micro-batches of 2
    and 2 records x 4 a rollout, for 2 optimizer steps; the logged row of the update."""
    cfg = yaml.safe_load((CONFIGS / recipe).read_text())
    cfg["trainer"].update(
        accelerator="cpu",
        devices=2,
        num_nodes=1,  # a recipe of several nodes would wait in the rendezvous for the others
        strategy=strategy,
        max_steps=2,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path / "run"),
        logger={
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(tmp_path / "run")},
        },
        callbacks=[],
    )
    model = cfg["model"]["init_args"]
    model["policy"]["init_args"].update(policy)
    model["reward"]["init_args"] = {"weights": {"jpeg_compressibility": 1.0}}
    model["sampler"].update(sampler)
    model["update"]["micro_batch_size"] = 2
    cfg["data"]["init_args"].update(train=records, val=None, prompts_per_step=2, group_size=4)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    script = tmp_path / "cli.py"
    script.write_text("from lit_flowgrpo.cli import main\n\nmain()\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    done = subprocess.run([*cmd, "fit", "--config", str(config)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    (metrics,) = (tmp_path / "run").rglob("metrics.csv")
    rows = [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(metrics.open())]
    row = next(r for r in rows if "actor/loss" in r)
    assert math.isfinite(row["actor/loss"]) and row["reward/failure_rate"] == 0.0
    assert row["actor/on_policy_ratio_err"] <= UpdateSettings().on_policy_tolerance(fp32=True)
    return row
