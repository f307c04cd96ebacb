"""A full fine-tune keeps float32 master weights (``--model.init_args.weights.master_dtype``) over a bf16 policy:
one AdamW step moves them by what float32 AdamW arithmetic predicts, where bf16 weights lose most of
the step; the masters resume bit for bit, and the export is written in the policy's dtype (bf16).

The tiny SD3 pipeline is loaded in bf16 and computes under bf16 autocast, on the CPU.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_flowgrpo import (
    FlowGRPO,
    FlowGRPOModule,
    KLSettings,
    LoraSettings,
    PromptDataModule,
    ReferenceSettings,
    Sampler,
    UpdateSettings,
    WeightsSettings,
)
from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.policies import SD3Policy

EPS32 = torch.finfo(torch.float32).eps
LR = 1e-5  # the full fine-tune recipes' order of magnitude


def brightness(images, prompts, metadata):
    return images.mean(dim=(1, 2, 3))


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that keeps each parameter and its gradient as they were just before each step."""

    def step(self, closure=None):  # type: ignore[override]
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        self.before = [(p.detach().clone(), p.grad.detach().clone()) for p in params]
        self.params = params
        return super().step(closure)


def make_module(path: str, **settings) -> FlowGRPOModule:
    defaults = dict(
        policy=SD3Policy(path, dtype="bfloat16", max_sequence_length=16),
        reward=brightness,
        objective=FlowGRPO(clip_range=1e-2),
        sampler=Sampler(num_steps=3, guidance_scale=4.5, height=32, width=32),
        update=UpdateSettings(micro_batch_size=4, optimizer_steps_per_rollout=1, max_grad_norm=None),
        weights=WeightsSettings(lora=None),
        kl=KLSettings(coef=0.0),
        optimizer=lambda p: RecordingAdamW(p, lr=LR, weight_decay=0.0),
    )
    defaults.update(settings)
    return FlowGRPOModule(**defaults)


def fit(module: FlowGRPOModule, prompt_file: str, root: Path, max_steps: int = 1, **kwargs) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=str(root),
    )
    data = PromptDataModule(train=prompt_file, prompts_per_step=2, group_size=4, seed=3)
    trainer.fit(module, datamodule=data, **kwargs)
    return trainer


def bf16_half_ulp(w: torch.Tensor) -> torch.Tensor:
    """Half the spacing of bf16 numbers next to each value of ``w`` (8 significant bits): an addition
    smaller than this, either way, rounds back to ``w``. At a power of two the spacing below is half
    the one above."""
    mantissa, exponent = torch.frexp(w.float())  # w = m · 2^e, 0.5 <= |m| < 1
    exponent = exponent - (mantissa.abs() == 0.5).int()
    return torch.ldexp(torch.ones_like(w, dtype=torch.float32), exponent - 9)


def test_float32_masters_take_the_adamw_step_that_bf16_weights_lose(tiny_sd3_path, prompt_file, tmp_path):
    master = make_module(tiny_sd3_path)
    fit(master, prompt_file, tmp_path / "master")
    transformer = master.policy.transformer
    assert {p.dtype for p in transformer.parameters()} == {torch.float32}
    opt = master.optimizers().optimizer
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    moved = 0
    for p, (w0, g) in zip(opt.params, opt.before, strict=True):
        # AdamW's first step with decay 0: m̂ = g, v̂ = g², so w1 = w0 − lr·g / (|g| + eps), each
        # operation rounding once in float32: the update within a few roundings of lr, then one
        # rounding of the sum at the weight's size.
        predicted = w0 - LR * g / (g.abs() + 1e-8)
        tol = EPS32 * (w0.abs() + 16 * LR)
        assert bool(((p.detach() - predicted).abs() <= tol).all())
        moved += int(((p.detach() != w0) & (g.abs() > 1e-6)).sum())
    total = sum(int((g.abs() > 1e-6).sum()) for _, g in opt.before)
    assert moved == total > 1000  # every weight with a gradient moved

    plain = make_module(tiny_sd3_path, weights=WeightsSettings(lora=None, master_dtype="model"))
    with pytest.warns(UserWarning, match=r"master_dtype=model: .* updates smaller than half .* are lost"):
        fit(plain, prompt_file, tmp_path / "plain")
    opt = plain.optimizers().optimizer
    assert {p.dtype for p in opt.params} == {torch.bfloat16}
    lost = kept = 0
    for p, (w0, g) in zip(opt.params, opt.before, strict=True):
        # The bf16 step rounds its own arithmetic (about 1%); below 0.95 of half the weight's
        # spacing the update cannot survive the final rounding.
        below = (g.abs() > 1e-6) & (0.95 * bf16_half_ulp(w0) > LR)
        assert torch.equal(p.detach()[below], w0[below])  # the update rounded to nothing
        lost += int(below.sum())
        kept += int((g.abs() > 1e-6).sum())
    assert lost > 0.5 * kept  # most of the step is lost in bf16


def test_masters_resume_bit_exactly_and_export_in_bf16(tiny_sd3_path, prompt_file, tmp_path):
    module = make_module(tiny_sd3_path, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    trainer = fit(module, prompt_file, tmp_path / "run")
    ckpt = tmp_path / "step1.ckpt"
    trainer.save_checkpoint(ckpt)
    trained = {k: v.detach().clone() for k, v in module.named_parameters() if v.requires_grad}
    assert all(v.dtype == torch.float32 for v in trained.values())
    # Not bf16 values: what a checkpoint of bf16-rounded weights would lose.
    assert any(not torch.equal(v, v.bfloat16().float()) for v in trained.values())

    resumed = make_module(tiny_sd3_path, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    again = fit(resumed, prompt_file, tmp_path / "resumed", max_steps=1, ckpt_path=str(ckpt))
    assert again.global_step == 1  # restored at step 1: nothing more to train
    restored = {k: v.detach() for k, v in resumed.named_parameters() if v.requires_grad}
    assert sorted(restored) == sorted(trained)
    for key, value in trained.items():
        assert restored[key].dtype == torch.float32 and torch.equal(restored[key], value), key
    a = module.optimizers().optimizer.state_dict()["state"]
    b = resumed.optimizers().optimizer.state_dict()["state"]
    for i in a:
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a[i][name], b[i][name])

    out = tmp_path / "export"
    module.export(str(out))
    from safetensors import safe_open

    files = sorted(out.glob("*.safetensors"))
    with safe_open(str(files[0]), framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118  (a safetensors handle, not a dict)
    assert dtypes == {"BF16"}
    from diffusers import SD3Transformer2DModel

    loaded = SD3Transformer2DModel.from_pretrained(str(out)).state_dict()
    prefix = "policy._transformer."
    for key, value in trained.items():
        assert torch.equal(loaded[key.removeprefix(prefix)].to(torch.bfloat16), value.bfloat16()), key
    # The export cast a copy: the run's masters are untouched.
    assert all(p.dtype == torch.float32 for p in module.policy.transformer.parameters())


def test_settings_that_cannot_apply_fail_naming_the_flag(tiny_sd3_path, prompt_file):
    with pytest.raises(
        SettingsError,
        match=r"--model.init_args.weights.master_dtype=model with --model.init_args.weights.lora",
    ):
        make_module(tiny_sd3_path, weights=WeightsSettings(lora=LoraSettings(rank=2), master_dtype="model"))
    with pytest.raises(SettingsError, match=r"--model.init_args.kl.reference.offload=true .* has none"):
        make_module(
            tiny_sd3_path,
            weights=WeightsSettings(lora=LoraSettings(rank=2)),
            kl=KLSettings(coef=0.0, reference=ReferenceSettings(offload=True)),
        )
    # One device: no strategy streams the copy in; refused in setup, before any weight is read.
    module = make_module(
        tiny_sd3_path, kl=KLSettings(coef=0.04, reference=ReferenceSettings(copy=True, offload=True))
    )
    refused = r"--model.init_args.kl.reference.offload=true needs --trainer.strategy=fsdp2"
    with pytest.raises(SettingsError, match=refused), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(module, prompt_file, Path(prompt_file).parent)
    assert module.policy.pipe is None


def test_the_bf16_reference_copy_computes_what_the_masters_compute_before_any_update(
    tiny_sd3_path, prompt_file, tmp_path
):
    """The frozen reference stays bf16 while the trained network holds float32 masters: with one
    optimizer step per rollout every KL of the first update is taken at the initial weights, where the
    two networks hold the same values (masters cast from bf16) and compute alike (autocast rounds the
    masters to the reference's values), so the KL is exactly 0. (On this CPU model the reference's own
    autocast makes no difference; on GPUs autocast also runs norms and softmax in float32.)"""
    module = make_module(tiny_sd3_path, kl=KLSettings(coef=0.1, reference=ReferenceSettings(copy=True)))
    trainer = fit(module, prompt_file, tmp_path)
    assert {p.dtype for p in module.copies.kl_reference.network.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in module.policy.transformer.parameters()} == {torch.float32}
    assert float(trainer.callback_metrics["actor/kl_loss"]) == 0.0
    assert float(trainer.callback_metrics["actor/on_policy_ratio_err"]) == 0.0


@pytest.mark.parametrize("use_ema", [False, True])
def test_an_export_reads_the_checkpoint_into_the_module_holding_the_masters_once(
    tiny_sd3_path, tmp_path, monkeypatch, use_ema
):
    """``lit-flowgrpo export`` of a full fine-tune: the checkpoint's float32 masters are read into the
    module's own tensors, not into a second whole copy beside them (a folder of shards straight into
    the parameters, and the tensors the EMA replaces not at all; a file, and a folder's metadata,
    memory-mapped), and the module ends with the checkpoint's values: the EMA's where asked.

    The folder is the one a sharded run writes (``torch.distributed.checkpoint`` shards of the state
    dict beside ``meta.pt``), written here by one process."""
    import torch.distributed.checkpoint as dcp

    source = make_module(tiny_sd3_path)
    source.configure_model()
    trainable = {n: p for n, p in source.named_parameters() if p.requires_grad}
    torch.manual_seed(0)
    raw = {n: (p.detach() + 1e-3 * torch.randn_like(p)).float() for n, p in trainable.items()}
    ema = {n: (v + 1e-3 * torch.randn_like(v)) for n, v in raw.items()}
    meta = {"callbacks": {"TrainableEMA": {"ema_state_dict": ema}}}
    folder, file = tmp_path / "sharded.ckpt", tmp_path / "gathered.ckpt"
    dcp.save({"state_dict": raw}, checkpoint_id=str(folder), no_dist=True)
    torch.save(meta, folder / "meta.pt")
    torch.save({"state_dict": raw, **meta}, file)
    expected = ema if use_ema else raw

    reads: list[dict[str, torch.Tensor]] = []
    loads: list[dict[str, object]] = []
    dcp_load, torch_load = dcp.load, torch.load
    monkeypatch.setattr(
        dcp, "load", lambda state, **kw: (reads.append(dict(state["state_dict"])), dcp_load(state, **kw))[1]
    )

    def spied_load(f, *args, **kwargs):
        if isinstance(f, (str, Path)):  # the checkpoint's files (the shard reader loads from buffers)
            loads.append(kwargs)
        return torch_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", spied_load)
    for ckpt in (folder, file):
        module = make_module(tiny_sd3_path)
        reads.clear()
        loads.clear()
        module.load_trainable_checkpoint(str(ckpt), use_ema=use_ema)
        params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        assert sorted(params) == sorted(expected)
        for name, p in params.items():
            assert p.dtype == torch.float32 and torch.equal(p.detach(), expected[name]), (ckpt.name, name)
        assert loads and all(kw.get("mmap") for kw in loads)  # mapped, not read whole
        if ckpt == folder:
            read = reads[0] if reads else {}
            # the shards went straight into the parameters; with the EMA, none was read at all
            assert sorted(read) == ([] if use_ema else sorted(params))
            assert all(t.data_ptr() == params[n].data_ptr() for n, t in read.items())
