"""FlowGRPOModule end to end on a tiny SD3 pipeline: training, on-policy check, resume, export, errors."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lit_flowgrpo import (
    AdvantageSettings,
    DiagnosticsSettings,
    FlowDPPO,
    FlowGRPO,
    FlowGRPOModule,
    GRPOGuard,
    GRPOGuardRatioNorm,
    KLSettings,
    LoraSettings,
    PromptDataModule,
    Sampler,
    UpdateSettings,
    WeightsSettings,
)
from lit_flowgrpo.kl import ReferenceSettings
from lit_flowgrpo.policies import SD3Policy


def brightness(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
    return images.mean(dim=(1, 2, 3))


# The run's own on-policy check (1e-6 for fp32): the update's micro-batches recompute the rollout's
# log-probs in other batch shapes; measured 3e-8 to 6e-8 (an ulp or two of the ratio) on the AVX-512,
# AVX2 and default kernels.
FP32_ON_POLICY = UpdateSettings().on_policy_tolerance(fp32=True)


def make_module(path: str, reward=brightness, **overrides) -> FlowGRPOModule:
    """The tiny SD3 run; ``overrides`` replace top-level arguments, or fields of ``sampler``,
    ``update``, ``advantage`` and the objective by name, and, as short names, the weights' and the KL
    regulariser's: ``lora``, ``master_dtype``; ``kl_coef`` (β: 0.04 unless the ``objective`` is given,
    which then brings its own), ``kl_with_dt``, ``reference_kl`` (``kl.measure``), ``kl_gate``,
    ``reference`` and ``reference_copy`` (``kl.reference.copy``)."""
    sampler = dict(num_steps=4, eval_num_steps=3, guidance_scale=4.5, height=32, width=32)
    update = dict(micro_batch_size=4, optimizer_steps_per_rollout=2)
    advantage: dict = {}
    objective = dict(clip_range=1e-2)
    objective_class = overrides.pop("objective_class", FlowGRPO)
    kl = dict(coef=None if "objective" in overrides else 0.04)
    for short, name in (
        ("kl_coef", "coef"),
        ("kl_with_dt", "with_dt"),
        ("reference_kl", "measure"),
        ("kl_gate", "gate"),
    ):
        if short in overrides:
            kl[name] = overrides.pop(short)
    reference = overrides.pop("reference", ReferenceSettings())
    if "reference_copy" in overrides:
        reference = dataclasses.replace(reference, copy=overrides.pop("reference_copy"))
    weights = dict(lora=overrides.pop("lora", LoraSettings(rank=4, alpha=8)))
    if "master_dtype" in overrides:
        weights["master_dtype"] = overrides.pop("master_dtype")
    for group in (sampler, update, objective):
        for key in list(overrides):
            if key in group:
                group[key] = overrides.pop(key)
    for key in [k for k in overrides if k in AdvantageSettings.__dataclass_fields__]:
        advantage[key] = overrides.pop(key)
    for key in [k for k in overrides if k in Sampler.__dataclass_fields__]:
        sampler[key] = overrides.pop(key)
    for key in [k for k in overrides if k in UpdateSettings.__dataclass_fields__]:
        update[key] = overrides.pop(key)
    settings = dict(
        objective=objective_class(**objective),
        sampler=Sampler(**sampler),
        update=UpdateSettings(**update),
        advantage=AdvantageSettings(**advantage),
        weights=WeightsSettings(**weights),
        kl=KLSettings(reference=reference, **kl),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    settings.update(overrides)
    return FlowGRPOModule(
        policy=SD3Policy(path, dtype="float32", max_sequence_length=16), reward=reward, **settings
    )


def make_data(prompt_file: str, **overrides) -> PromptDataModule:
    settings = dict(
        train=prompt_file,
        val=prompt_file,
        prompts_per_step=2,
        group_size=4,
        val_batch_size=4,
        max_val_prompts=2,
        seed=3,
    )
    settings.update(overrides)
    return PromptDataModule(**settings)


def make_trainer(root: Path, max_steps: int, **overrides) -> L.Trainer:
    settings = dict(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=CSVLogger(str(root)),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=str(root),
    )
    settings.update(overrides)
    return L.Trainer(**settings)


def logged(trainer: L.Trainer) -> list[dict[str, float]]:
    import csv

    path = os.path.join(trainer.logger.log_dir, "metrics.csv")
    with open(path) as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def lora_state(module: FlowGRPOModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters() if v.requires_grad}


def test_training_changes_only_lora_and_holds_on_policy(tiny_sd3_path, prompt_file, tmp_path):
    module = make_module(tiny_sd3_path)
    trainer = make_trainer(tmp_path, max_steps=4)
    module.configure_model()
    frozen_before = {k: v.detach().clone() for k, v in module.named_parameters() if not v.requires_grad}
    lora_before = lora_state(module)
    assert lora_before and all("lora_" in k for k in lora_before)
    trainer.fit(module, datamodule=make_data(prompt_file))

    for key, value in module.named_parameters():
        if value.requires_grad:
            continue
        assert torch.equal(value, frozen_before[key]), f"frozen weight {key} changed"
    changed = [k for k, v in lora_state(module).items() if not torch.equal(v, lora_before[k])]
    assert changed, "no LoRA weight changed"

    rows = logged(trainer)
    steps = [r for r in rows if "actor/loss" in r]
    assert len(steps) == 2  # 4 optimizer steps = 2 rollouts × 2
    for row in steps:
        assert row["actor/on_policy_ratio_err"] <= FP32_ON_POLICY
        for key in (
            "actor/pg_loss",
            "actor/kl_loss",
            "actor/grad_norm",
            "critic/rewards/mean",
            "actor/ratio_mean",
        ):
            assert math.isfinite(row[key]), key
    assert steps[1]["actor/kl_loss"] > 0  # the adapter moved away from the reference
    # One rank, no filtering: the update's load is every sample at each of int(4 · 0.99) = 3 steps.
    for row in steps:
        assert row["global_load/min"] == row["global_load/max"] == row["global_load/mean"] == 8 * 3
        assert row["global_load/minmax_diff"] == 0


def test_rollout_is_deterministic_and_reference_is_adapter_off(tiny_sd3_path, prompt_file):
    module = make_module(tiny_sd3_path)
    module.configure_model()
    data = make_data(prompt_file)
    batch = next(iter(data.train_dataloader()))
    embeds = module.policy.encode_prompts(batch.prompts)
    a, images_a = module.sampler.rollout(module.policy, embeds, batch.seeds, step=batch.step, seed=0)
    b, images_b = module.sampler.rollout(module.policy, embeds, batch.seeds, step=batch.step, seed=0)
    assert torch.equal(images_a, images_b) and torch.equal(a.log_probs, b.log_probs)
    assert a.latents.shape == (8, 3, 4, 16, 16)  # int(4 · 0.99) = 3 trained steps
    # LoRA B starts at 0 (peft's gaussian init too), so move it: then the adapter-off reference must
    # differ from the tuned model, and switching back must restore it exactly.
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    x = torch.randn(2, 4, 16, 16)
    emb = module.policy.encode_prompts(["a", "b"])
    sigma = torch.full((2,), 0.5)
    with_lora = module.policy.velocity(x, sigma, emb, 1.0)
    with module.copies.reference():
        without = module.policy.velocity(x, sigma, emb, 1.0)
    again = module.policy.velocity(x, sigma, emb, 1.0)
    assert not torch.allclose(with_lora, without)
    assert torch.equal(with_lora, again)


def check_exact_resume(
    tiny_sd3_path: str, tmp_path: Path, accelerator: str, deterministic: bool = False
) -> None:
    """With validation on and the prompt cache on, as the shipped configs run. 2 of 3 prompts a
    rollout: the uninterrupted run's second rollout finds one of its prompts cached and encodes the
    other alone; the resumed run, whose cache starts empty, encodes both together."""
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("".join(f"prompt number {i} with a few more words\n" for i in range(3)))
    data = dict(prompts_per_step=2, group_size=4, max_val_prompts=3, val_batch_size=3)
    validating = dict(limit_val_batches=1, val_check_interval=2, check_val_every_n_epoch=None)
    validating.update(accelerator=accelerator, deterministic=deterministic)

    def run(root: str, max_steps: int, **fit) -> tuple[FlowGRPOModule, L.Trainer]:
        module = make_module(tiny_sd3_path)
        trainer = make_trainer(tmp_path / root, max_steps=max_steps, **validating)
        trainer.fit(module, datamodule=make_data(str(prompt_file), **data), **fit)
        return module, trainer

    straight, _ = run("a", 4)
    _, trainer = run("b", 2)
    ckpt = tmp_path / "half.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)
    assert saved["state_dict"] and all("lora_" in k for k in saved["state_dict"])  # adapter only
    assert saved["PromptDataModule"]["next_step"] == 1  # the sampler's position: one rollout consumed
    resumed, _ = run("c", 4, ckpt_path=ckpt)

    # Bit for bit: the same arithmetic on the same inputs, prompt conditioning included.
    a, b = lora_state(straight), lora_state(resumed)
    assert a.keys() == b.keys()
    differ = [key for key in a if not torch.equal(a[key], b[key])]
    assert not differ, f"{len(differ)} of {len(a)} LoRA tensors differ after the resume, e.g. {differ[:3]}"


def test_resume_is_exact(tiny_sd3_path, tmp_path):
    check_exact_resume(tiny_sd3_path, tmp_path, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_resume_is_exact_on_a_gpu(tiny_sd3_path, tmp_path):
    """On a GPU, bit-exact under ``--trainer.deterministic=true``. Without it two uninterrupted runs
    already differ (by 2.8e-6 on an H200: atomics in the backward kernels), and a resume by as much."""
    try:
        check_exact_resume(tiny_sd3_path, tmp_path, "cuda", deterministic=True)
    finally:
        torch.use_deterministic_algorithms(False)  # the Trainer set it for the whole process


def test_export_lora_loads_into_diffusers(tiny_sd3_path, prompt_file, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    module = make_module(tiny_sd3_path)
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.fit(module, datamodule=make_data(prompt_file))
    out = tmp_path / "lora"
    module.export_lora(str(out))
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_path)
    x = torch.randn(1, 4, 16, 16)
    kwargs = dict(
        hidden_states=x,
        timestep=torch.tensor([500.0]),
        encoder_hidden_states=torch.randn(1, 5, 64),
        pooled_projections=torch.randn(1, 64),
        return_dict=False,
    )
    base = pipe.transformer(**kwargs)[0]
    pipe.load_lora_weights(str(out))
    tuned = pipe.transformer(**kwargs)[0]
    with torch.no_grad():
        ours = module.policy.transformer(**kwargs)[0]
    assert not torch.allclose(base, tuned)
    # The exported fp32 adapter in diffusers' peft layers computes what ours does, op for op: exactly.
    torch.testing.assert_close(tuned, ours, rtol=0, atol=0)


def test_nonfinite_reward_is_dropped_and_counted(tiny_sd3_path, prompt_file, tmp_path):
    def half_broken(images, prompts, metadata):
        r = images.mean(dim=(1, 2, 3))
        r[::4] = float("nan")
        return r

    module = make_module(tiny_sd3_path, reward=half_broken)
    trainer = make_trainer(tmp_path, max_steps=2)
    with pytest.warns(UserWarning, match="no finite reward"):
        trainer.fit(module, datamodule=make_data(prompt_file))
    row = next(r for r in logged(trainer) if "actor/loss" in r)
    assert row["actor/dropped_samples"] == 2
    assert row["reward/failure_rate"] == pytest.approx(0.25)
    assert row["critic/rewards/count"] == 6
    assert row["critic/rewards/nonfinite_count"] == 2
    assert math.isfinite(row["actor/loss"])


def test_unscorable_batches_stop_the_run_instead_of_spinning(tiny_sd3_path, prompt_file, tmp_path):
    def broken(images, prompts, metadata):
        return torch.full((len(prompts),), float("nan"))

    module = make_module(tiny_sd3_path, reward=broken, max_idle_rollouts=3)
    trainer = make_trainer(tmp_path, max_steps=4)
    with (
        pytest.warns(UserWarning, match="no optimizer step"),
        pytest.raises(
            RuntimeError, match=r"3 rollouts in a row made no optimizer step .*max_idle_rollouts=3"
        ),
    ):
        trainer.fit(module, datamodule=make_data(prompt_file))
    assert trainer.global_step == 0


def test_bad_image_size_fails_before_loading(tiny_sd3_path):
    with pytest.raises(
        ValueError, match=r"--model.init_args.sampler.height \(33\) must be a positive multiple of 16"
    ):
        make_module(tiny_sd3_path, height=33)


def test_all_zero_reward_weights_are_refused(tiny_sd3_path):
    with pytest.raises(ValueError, match=r"--model\.init_args\.reward\.init_args\.weights are all 0"):
        make_module(tiny_sd3_path, reward={"jpeg_compressibility": 0.0})


def test_wrong_reward_shape_names_the_reward(tiny_sd3_path, prompt_file, tmp_path):
    def one_number(images, prompts, metadata):
        return images.mean()

    module = make_module(tiny_sd3_path, reward=one_number)
    trainer = make_trainer(tmp_path, max_steps=2)
    with pytest.raises(
        ValueError, match=r"reward '.*one_number' returned shape \(\) for 8 images; expected \(B,\) = \(8,\)"
    ):
        trainer.fit(module, datamodule=make_data(prompt_file))


def test_nonfinite_gradient_skips_the_step(tiny_sd3_path, prompt_file, tmp_path):
    module = make_module(tiny_sd3_path, kl_coef=0.0)
    module.configure_model()
    original = module.policy.velocity

    def poisoned(*args, **kwargs):
        v = original(*args, **kwargs)
        return v * float("nan") if torch.is_grad_enabled() else v  # only the update, not the rollout

    module.policy.velocity = poisoned
    before = lora_state(module)
    trainer = make_trainer(tmp_path, max_steps=2, max_epochs=1, limit_train_batches=1)
    with pytest.warns(UserWarning, match="optimizer step skipped"):
        trainer.fit(module, datamodule=make_data(prompt_file))
    after = lora_state(module)
    assert all(torch.equal(before[k], after[k]) for k in before)
    row = next(r for r in logged(trainer) if "actor/skipped_optimizer_steps" in r)
    assert row["actor/skipped_optimizer_steps"] == 2


@pytest.mark.parametrize(("objective_class", "clip_range"), [(GRPOGuard, 2e-6), (GRPOGuardRatioNorm, 1e-3)])
def test_grpo_guard_and_window_run(objective_class, clip_range, tiny_sd3_path, prompt_file, tmp_path):
    module = make_module(
        tiny_sd3_path,
        objective_class=objective_class,
        clip_range=clip_range,
        sde_window_size=2,
        sde_window_range=(0, 3),
        kl_coef=0.0,
    )
    trainer = make_trainer(tmp_path, max_steps=2)
    data = make_data(prompt_file)
    trainer.fit(module, datamodule=data)
    row = next(r for r in logged(trainer) if "actor/loss" in r)
    assert math.isfinite(row["actor/loss"]) and row["actor/on_policy_ratio_err"] <= FP32_ON_POLICY
    # The window is a pure function of (seed, step): exactly its two steps are trained and logged.
    sde_steps, trained = module.sampler.plan(step=0, seed=module.seed)
    assert sde_steps == trained and len(trained) == 2 and trained[0] in (0, 1)
    logged_steps = sorted(int(k.rsplit("_", 1)[1]) for k in row if k.startswith("actor_by_step/ratio_mean/"))
    assert logged_steps == trained


def test_flow_dppo_on_policy_masks_nothing_then_its_trust_region_acts(tiny_sd3_path, prompt_file, tmp_path):
    # One optimizer step per rollout: every visit is on-policy, so the step KL is rounding and no
    # sample is masked (δ = 1e-5); Flow-DPPO's loss is then the unclipped Flow-GRPO surrogate.
    module = make_module(tiny_sd3_path, objective_class=FlowDPPO, kl_coef=0.0, optimizer_steps_per_rollout=1)
    trainer = make_trainer(tmp_path / "on", max_steps=1)
    trainer.fit(module, datamodule=make_data(prompt_file))
    row = next(r for r in logged(trainer) if "actor/loss" in r)
    assert math.isfinite(row["actor/loss"]) and row["actor/on_policy_ratio_err"] <= FP32_ON_POLICY
    assert (
        0.0 <= row["actor/kl_new_old_max"] < 1e-10
        and row["actor/kl_new_old_mean"] <= row["actor/kl_new_old_max"]
    )
    assert row["actor/masked_fraction"] == row["actor/kl_mask_fraction"] == 0.0
    assert "actor/clip_ratio" not in row and "actor/pg_clipfrac" in row
    assert module.objective_stats.__class__.__name__ == "FlowDPPOStats"
    # Two steps per rollout at a large lr: the second half of the visits sees a moved policy, far
    # outside δ = 1e-5 in this unit, and the mask drops the non-corrective ones.
    module = make_module(tiny_sd3_path, objective_class=FlowDPPO, kl_coef=0.0)
    trainer = make_trainer(tmp_path / "off", max_steps=2)
    trainer.fit(module, datamodule=make_data(prompt_file))
    row = next(r for r in logged(trainer) if "actor/loss" in r)
    assert row["actor/kl_new_old_max"] > 1e-5 and row["actor/kl_mask_fraction"] > 0.0
    assert row["actor/masked_fraction"] == pytest.approx(
        row["actor/pos_rm_fraction"] + row["actor/neg_rm_fraction"]
    )
    assert any(k.startswith("actor_by_step/masked_fraction/step_") for k in row)


def test_step_kl_is_logged_for_flow_grpo_unless_turned_off(tiny_sd3_path, prompt_file, tmp_path):
    module = make_module(tiny_sd3_path, kl_coef=0.0)
    trainer = make_trainer(tmp_path / "on", max_steps=2)
    trainer.fit(module, datamodule=make_data(prompt_file))
    row = next(r for r in logged(trainer) if "actor/loss" in r)
    # the second optimizer step's visits see a moved policy: the step KL is positive
    assert row["actor/kl_new_old_max"] > 0.0 and row["actor/kl_new_old_mean"] > 0.0
    assert "actor_by_step/kl_new_old_mean/step_0" in row
    module = make_module(tiny_sd3_path, kl_coef=0.0, diagnostics=DiagnosticsSettings(step_kl=False))
    trainer = make_trainer(tmp_path / "off", max_steps=2)
    trainer.fit(module, datamodule=make_data(prompt_file))
    row = next(r for r in logged(trainer) if "actor/loss" in r)
    assert not any("kl_new_old" in k for k in row) and math.isfinite(row["actor/loss"])


def test_validation_logs_reward_components(tiny_sd3_path, prompt_file, tmp_path):
    module = make_module(tiny_sd3_path)
    trainer = make_trainer(tmp_path, max_steps=1, limit_val_batches=None)
    data = make_data(prompt_file)
    trainer.validate(module, datamodule=data)
    row = next(r for r in logged(trainer) if "val-aux/reward/mean@1" in r)
    # The same deterministic ODE samples, scored again: the logged mean is their brightness.
    batches = list(data.val_dataloader())
    with torch.no_grad():
        want = torch.cat(
            [brightness(module.sampler.evaluate(module.policy, b.prompts, b.seeds), [], []) for b in batches]
        )
    # A plain callable declares no core component: its score is auxiliary.
    assert row["val-aux/reward/mean@1"] == pytest.approx(float(want.double().mean()), rel=1e-6)
    assert row["val-aux/reward/unscored_count"] == 0
    assert not any(k.startswith(("val/", "val-core/")) for k in row)


# ---------------------------------------------------------------------------------------------------
# Bad input: clear errors naming the flag, before any weight is read
# ---------------------------------------------------------------------------------------------------


def test_empty_prompt_file(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match=r"--data.init_args.train .* holds no prompts"):
        PromptDataModule(train=str(empty))


def test_group_size_below_two(prompt_file):
    with pytest.raises(ValueError, match=r"--data.init_args.group_size \(1\) must be at least 2"):
        PromptDataModule(train=prompt_file, group_size=1)


def test_micro_batch_must_divide(tiny_sd3_path, prompt_file, tmp_path):
    module = make_module(tiny_sd3_path, micro_batch_size=3)
    trainer = make_trainer(tmp_path, max_steps=1)
    with pytest.raises(
        ValueError, match=r"--model\.init_args\.update\.micro_batch_size \(3\) must divide the per-rank batch"
    ):
        trainer.fit(module, datamodule=make_data(prompt_file))
    assert module.policy.pipe is None  # failed before loading


def test_unknown_reward_name(tiny_sd3_path):
    with pytest.raises(
        ValueError,
        match=r"--model\.init_args\.reward\.init_args\.weights names unregistered rewards \['no_such_reward'\]",
    ):
        make_module(tiny_sd3_path, reward={"no_such_reward": 1.0})


def test_bad_core_components_declaration_is_a_settings_problem(tiny_sd3_path):
    class Strict:
        core_components = "strict"  # a string, not a tuple of names

        def __call__(self, images, prompts, metadata):
            return {"strict": torch.zeros(len(prompts))}

    with pytest.raises(ValueError, match=r"invalid FlowGRPOModule settings:\n .*core_components is 'strict'"):
        make_module(tiny_sd3_path, reward=Strict())


def test_missing_model_path(tmp_path):
    with pytest.raises(ValueError, match=r"--model.init_args.policy.init_args.pretrained .* does not exist"):
        make_module(str(tmp_path / "nope" / "sd3"))


def test_grpo_guard_needs_sde(tiny_sd3_path):
    # Refused before any weight loads, naming both flags in the spelling the CLI accepts.
    with pytest.raises(
        ValueError,
        match=r"--model\.init_args\.objective=lit_flowgrpo\.objective\.GRPOGuard needs "
        r"--model\.init_args\.sampler\.sde_type in \['sde'\] \(got 'cps'\)",
    ):
        make_module(tiny_sd3_path, objective_class=GRPOGuard, sde_type="cps")


def test_full_finetune_with_frozen_reference_copy(tiny_sd3_path, prompt_file, tmp_path):
    module = make_module(
        tiny_sd3_path,
        lora=None,
        reference_copy=True,
        kl_coef=0.1,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
    )
    module.configure_model()
    initial = {k: v.detach().clone() for k, v in module.policy.transformer.named_parameters()}
    trainer = make_trainer(tmp_path, max_steps=4)
    trainer.fit(module, datamodule=make_data(prompt_file))
    rows = [r for r in logged(trainer) if "actor/kl_loss" in r]
    assert all(r["actor/kl_loss"] > 0 for r in rows)  # the policy left the frozen reference
    moved = any(not torch.equal(v, initial[k]) for k, v in module.policy.transformer.named_parameters())
    assert moved, "the full fine-tune changed nothing"
    for key, value in module.copies.kl_reference.network.named_parameters():  # the reference never trains
        assert torch.equal(value, initial[key]), key
    saved = tmp_path / "full.ckpt"
    trainer.save_checkpoint(saved)
    state = torch.load(saved, weights_only=True)["state_dict"]
    assert state and all(k.startswith("policy._transformer.") for k in state)  # no text encoders, no VAE


def test_module_trains_with_a_float8_base_and_holds_on_policy(tiny_sd3_path, prompt_file, tmp_path):
    from lit_flowgrpo.fp8 import Float8FrozenLinear
    from lit_flowgrpo.performance import PerformanceSettings

    # the rollout samples all 8 images in one forward, the update 4 per micro-batch: each token's
    # float8 operand must not depend on the rows batched with it
    module = make_module(tiny_sd3_path, performance=PerformanceSettings(fp8_base_matmuls=True), batch_size=8)
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.fit(module, datamodule=make_data(prompt_file))
    assert any(isinstance(m, Float8FrozenLinear) for m in module.policy.transformer.modules())
    (row,) = [r for r in logged(trainer) if "actor/loss" in r]
    # fp32 on the CPU, as the plain run above: the update recomputes the rollout's log-probs
    assert row["actor/on_policy_ratio_err"] <= FP32_ON_POLICY
    assert row["actor/grad_norm"] > 0


def test_each_stage_of_a_step_is_a_profiler_range(tiny_sd3_path, prompt_file, tmp_path):
    # The stage clock opens lit_flowgrpo.<stage> (the update as lit_flowgrpo.update, the range the
    # profiling benchmark summarises), so a profile shows the stages without a subclass to mark them.
    module = make_module(tiny_sd3_path)
    trainer = make_trainer(tmp_path, max_steps=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        trainer.fit(module, datamodule=make_data(prompt_file))
    names = {event.name for event in profile.events()}
    assert {f"lit_flowgrpo.{s}" for s in ("gen", "reward", "adv", "update")} <= names
