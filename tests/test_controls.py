"""The reward-hacking controls on short real runs: GDPO through the command line on the shapes world
(two components, strict and partial) and, on the tiny SD3 pipeline, GDPO with failing components, and
a shared initial noise per group with validation at its own image size."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, ClassVar

import lightning as L
import pytest
import torch
import yaml
from cli_helpers import load_shipped, tiny_fit_args

from lit_flowgrpo.cli import FlowGRPOCLI

REPO = Path(__file__).resolve().parents[1]


class Record(L.Callback):
    """Keeps, per rollout batch, the batch and the step's output, the reward components recomputed
    from the step's images, and (with ``rollouts``) two rollouts drawn with the step's own weights just
    before it: one from the batch's initial seeds, one without them. Validation keeps its image sizes."""

    steps: ClassVar[list[dict[str, Any]]] = []
    validation_sizes: ClassVar[list[tuple[int, ...]]] = []

    def __init__(self, rollouts: bool = False) -> None:
        self.rollouts = rollouts
        self._before: dict[str, Any] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.rollouts:
            return
        embeds = pl_module.policy.encode_prompts(batch.prompts)
        with torch.no_grad(), pl_module.performance.sampling_weights(pl_module.policy.transformer):
            draw = dict(
                policy=pl_module.policy,
                embeds=embeds,
                seeds=batch.seeds,
                step=batch.step,
                seed=pl_module.seed,
            )
            self._before = {
                "shared": pl_module.sampler.rollout(**draw, initial_seeds=batch.initial_seeds),
                "own": pl_module.sampler.rollout(**draw),
            }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        scores = pl_module.reward(outputs["images"], list(batch.prompts), list(batch.metadata))
        Record.steps.append(
            {"batch": batch, "outputs": outputs, "components": scores.components, **self._before}
        )

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0
    ) -> None:
        Record.validation_sizes.append(tuple(outputs["images"].shape[-2:]))


def _gdpo_reference(components: list[list[float]], weights: list[float], ids: list[int]) -> list[float]:
    """GDPO in float64 with Python's arithmetic (std per group, eps 1e-4), no component missing."""
    per = []
    for values in components:
        out = [0.0] * len(ids)
        for g in set(ids):
            mine = [i for i in range(len(ids)) if ids[i] == g]
            vals = [values[i] for i in mine]
            mean, spread = math.fsum(vals) / len(vals), statistics.pstdev(vals)
            for i in mine:
                out[i] = (values[i] - mean) / (spread + 1e-4)
        per.append(out)
    combined = [math.fsum(w * a[i] for w, a in zip(weights, per, strict=True)) for i in range(len(ids))]
    mean, spread = math.fsum(combined) / len(combined), statistics.pstdev(combined)
    return [(c - mean) / (spread + 1e-4) for c in combined]


def test_gdpo_on_the_shapes_world(tmp_path: Path) -> None:
    """Two rollouts of 2 prompts x 4 samples (a few seconds each on 2 cores): every advantage the module
    trained with is the re-derivation's on the components its images score."""
    cfg = load_shipped("quickstart")
    trainer = cfg["trainer"]
    trainer.update(max_steps=2, default_root_dir=str(tmp_path), num_sanity_val_steps=0, limit_val_batches=0)
    trainer["logger"]["init_args"]["save_dir"] = str(tmp_path)
    trainer["callbacks"] = [
        {"class_path": "lit_flowgrpo.callbacks.RolloutProgressBar"},
        {"class_path": "test_controls.Record"},
    ]
    cfg["data"]["init_args"].update(prompts_per_step=2, group_size=4, max_val_prompts=2)
    model = cfg["model"]["init_args"]
    model["advantage"].update(aggregation="gdpo", std="group", filter_zero=False)
    model["update"]["micro_batch_size"] = 8
    model["sampler"].update(num_steps=4, eval_num_steps=2, sde_window_size=None, sde_window_range=None)
    path = tmp_path / "gdpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    Record.steps.clear()
    cli = FlowGRPOCLI(args=["fit", "--config", str(path)])
    assert cli.trainer.global_step == 2 and len(Record.steps) == 2
    weights = cli.model.reward.weights  # {shapes/strict: 1.0, shapes/partial: 0.5}
    for step in Record.steps:
        ids = step["batch"].group_ids.tolist()
        components = [step["components"][key].double().tolist() for key in weights]
        want = _gdpo_reference(components, list(weights.values()), ids)
        # fp64 inside, one rounding to fp32 at the end (2^-24 relative; 2^-23 for margin); the tied
        # groups' exact 0 (every sample of the prompt equally right) comes out exactly.
        assert step["outputs"]["advantages"].tolist() == pytest.approx(want, rel=2**-23, abs=1e-12)
        assert step["outputs"]["keep"].all()
    logged = {k: float(v) for k, v in cli.trainer.logged_metrics.items()}
    assert logged["reward/nan_groups/shapes/strict"] == logged["reward/nan_groups/shapes/partial"] == 0
    assert logged["reward/unscored_groups"] == 0


def test_shared_initial_noise_and_validation_at_its_own_size(tiny_sd3_path: str, tmp_path: Path) -> None:
    """One rollout of configs/tiny_sd3.yaml (2 prompts x 4 samples at 32x32) with one initial noise per
    group, and its validation at 48x64."""
    Record.steps.clear()
    Record.validation_sizes.clear()
    cli = FlowGRPOCLI(
        args=tiny_fit_args(
            tiny_sd3_path,
            tmp_path,
            "--data.init_args.same_initial_noise=true",
            "--model.init_args.sampler.eval_height=48",
            "--model.init_args.sampler.eval_width=64",
            "--trainer.callbacks+=test_controls.Record",
            "--trainer.callbacks.rollouts=true",
        )
    )
    assert cli.trainer.global_step == 2
    (step,) = Record.steps
    batch, outputs = step["batch"], step["outputs"]
    shared, _ = step["shared"]
    # The module's rollout is the one drawn from the initial seeds (same weights, same seeds)...
    assert torch.equal(outputs["images"], step["shared"][1])
    assert not torch.equal(outputs["images"], step["own"][1])
    # ...whose x at σ = 1 (step 0 is trained, so recorded) is one per group, and whose stochastic steps
    # still part the samples of a group.
    start = shared.latents[:, 0]
    for g in set(batch.group_ids.tolist()):
        rows = (batch.group_ids == g).nonzero().flatten().tolist()
        assert all(torch.equal(start[rows[0]], start[r]) for r in rows)
        assert all(not torch.equal(shared.final[rows[0]], shared.final[r]) for r in rows[1:])
    assert not torch.equal(start[batch.group_ids == 0][0], start[batch.group_ids == 1][0])
    assert outputs["images"].shape[-2:] == (32, 32)
    assert Record.validation_sizes and set(Record.validation_sizes) == {(48, 64)}


def test_gdpo_trains_around_failed_components(tiny_sd3_path: str, tmp_path: Path) -> None:
    """Two prompts, two components: 'contrast' fails on every sample, 'brightness' on every sample of
    one prompt. The other prompt's group trains on its brightness alone; the failed group is kept out
    of the update, and the run says so in its warnings and metrics."""
    from lit_flowgrpo import (
        AdvantageSettings,
        FlowGRPOModule,
        LoraSettings,
        PromptDataModule,
        Sampler,
        WeightsSettings,
    )
    from lit_flowgrpo.policies import SD3Policy
    from lit_flowgrpo.rewards import MultiReward
    from lit_flowgrpo.update import UpdateSettings

    def contrast_fails(images, prompts, metadata):
        circle = torch.tensor([p == "a blue circle" for p in prompts])
        return {
            "brightness": torch.where(circle, math.nan, images.mean(dim=(1, 2, 3)).cpu()),
            "contrast": torch.full((len(prompts),), math.nan),
        }

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cube\na blue circle\n")
    module = FlowGRPOModule(
        policy=SD3Policy(tiny_sd3_path, dtype="float32", max_sequence_length=16),
        reward=MultiReward(
            {"probe/brightness": 1.0, "probe/contrast": 0.5}, rewards={"probe": contrast_fails}
        ),
        sampler=Sampler(num_steps=3, eval_num_steps=2, height=32, width=32),
        advantage=AdvantageSettings(aggregation="gdpo", std="group"),
        update=UpdateSettings(micro_batch_size=4, optimizer_steps_per_rollout=1),
        weights=WeightsSettings(lora=LoraSettings(rank=2, alpha=4)),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        callbacks=[Record()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    Record.steps.clear()
    with pytest.warns(UserWarning) as said:
        trainer.fit(
            module, datamodule=PromptDataModule(str(prompts), prompts_per_step=2, group_size=4, seed=1)
        )
    messages = "\n".join(str(w.message) for w in said)
    assert "reward component 'probe/contrast' scored no sample of 2 of 2 groups" in messages
    assert "reward component 'probe/brightness' scored no sample of 1 of 2 groups" in messages
    assert (
        "1 of 2 groups have no scored sample" in messages
        and "4 of 8 samples have no finite reward" in messages
    )
    (step,) = Record.steps
    batch, outputs = step["batch"], step["outputs"]
    circle = torch.tensor([p == "a blue circle" for p in batch.prompts])
    # The failed group is kept out of the update, with advantage 0; the other trains on its brightness
    # alone: normalised within the group, then over the batch's scored samples (those four).
    assert torch.equal(outputs["keep"], ~circle) and torch.equal(
        outputs["advantages"][circle], torch.zeros(4)
    )
    bright = step["components"]["probe/brightness"][~circle].double().tolist()
    mean, spread = math.fsum(bright) / 4, statistics.pstdev(bright)
    normalised = [(b - mean) / (spread + 1e-4) for b in bright]
    want = [a / (statistics.pstdev(normalised) + 1e-4) for a in normalised]
    assert outputs["advantages"][~circle].tolist() == pytest.approx(want, rel=2**-23, abs=1e-12)
    assert sorted(outputs["trained_sample_ids"].tolist()) == sorted(batch.sample_ids[~circle].tolist())
    logged = {k: float(v) for k, v in trainer.logged_metrics.items()}
    assert (
        logged["reward/nan_groups/probe/contrast"] == 2 and logged["reward/nan_groups/probe/brightness"] == 1
    )
    assert logged["reward/unscored_groups"] == 1 and logged["reward/failure_rate"] == 0.5
    assert logged["actor/dropped_samples"] == 4 and math.isfinite(logged["actor/loss"])


def test_an_ema_reference_on_the_tiny_pipeline_is_checkpointed_and_resumed(
    tiny_sd3_path: str, tmp_path: Path
) -> None:
    """One rollout of configs/tiny_sd3.yaml (LoRA, 2 optimizer steps) with the KL on and an EMA reference:
    the checkpoint holds the reference, between the adapter as it started and as it ended, and a run
    resumed from it starts from that reference."""
    ema = [
        "--model.init_args.kl.coef=0.1",
        "--model.init_args.kl.reference.mode=ema",
        "--model.init_args.kl.reference.ema_decay=0.5",
    ]
    cli = FlowGRPOCLI(args=tiny_fit_args(tiny_sd3_path, tmp_path, *ema))
    assert cli.trainer.global_step == 2
    (last,) = [p for p in (tmp_path / "checkpoints").glob("*.ckpt") if p.name == "last.ckpt"] or sorted(
        (tmp_path / "checkpoints").glob("*.ckpt")
    )[-1:]
    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    reference = ckpt["lit_flowgrpo"]["reference"]["tensors"]
    adapter = {k[k.index("transformer.") + len("transformer.") :]: v for k, v in ckpt["state_dict"].items()}
    assert set(reference) == set(adapter)
    # LoRA's B starts at 0: after one update the EMA is half the adapter's B (decay 0.5), and A moved
    # half-way from its start, so it equals neither the start nor the end.
    # Exactly: 0.5·0 + 0.5·B rounds nowhere (halving is exact in binary floating point).
    b = [k for k in reference if "lora_B" in k]
    assert b and all(torch.equal(reference[k], 0.5 * adapter[k]) for k in b)
    assert any(not torch.equal(reference[k], adapter[k]) for k in reference if "lora_A" in k)
    resumed = FlowGRPOCLI(
        args=tiny_fit_args(
            tiny_sd3_path, tmp_path / "resumed", *ema, "--trainer.max_steps=4", f"--ckpt_path={last}"
        )
    )
    assert resumed.trainer.global_step == 4


@pytest.mark.slow
def test_gardo_on_the_shapes_world(tmp_path: Path) -> None:
    """configs/hacking_gardo.yaml, two rollouts of 2 prompts x 8 samples, the reference refreshed every
    2 steps: the gate carries the KL on the share of samples the re-derivation gates, from the components
    of the step's own images, and the reference was refreshed after the second step."""
    Record.steps.clear()
    cli = FlowGRPOCLI(
        args=[
            "fit",
            "--config",
            str(REPO / "configs" / "hacking_gardo.yaml"),
            "--trainer.max_steps=2",
            "--trainer.limit_val_batches=0",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.callbacks=[]",
            "--trainer.callbacks+=test_controls.Record",
            f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--data.init_args.prompts_per_step=2",
            "--data.init_args.group_size=8",
            "--model.init_args.update.micro_batch_size=16",
            "--model.init_args.kl.reference.refresh_every=2",
            "--model.init_args.kl.gate.adaptive=false",
            "--model.init_args.kl.gate.fraction=0.5",
        ]
    )
    assert cli.trainer.global_step == 2 and len(Record.steps) == 2
    from lit_flowgrpo.algorithms import gardo_uncertainty, gated_kl_weights

    (metrics,) = tmp_path.glob("*/version_0/metrics.csv")
    import csv

    rows = [r for r in csv.DictReader(metrics.read_text().splitlines()) if r.get("actor/kl_gated_fraction")]
    assert len(rows) == 2
    for step, row in zip(Record.steps, rows, strict=True):
        c = step["components"]
        weights = gated_kl_weights(gardo_uncertainty(c["shapes_color"], c["shapes/partial"][None]), 0.5)
        assert float(row["actor/kl_gated_fraction"]) == pytest.approx(
            float((weights > 0).float().mean()), abs=1e-7
        )
        assert float(row["actor/kl_gate_target"]) == pytest.approx(0.5)
        assert float(row["critic/advantages/diversity_scale_max"]) >= 1.0
    assert [float(r["actor/reference_refreshes"]) for r in rows] == [0.0, 1.0]
    # One optimizer step per rollout, after its visits: the first update's KL is to the policy itself (0),
    # the second's to the initial one after one step (small, not 0).
    assert float(rows[0]["actor/kl_loss"]) == 0 and 0 < float(rows[1]["actor/kl_loss"]) < 1
