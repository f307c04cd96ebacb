"""SFT and Diffusion-DPO through the module on the tiny SD3 (its VAE encodes the images): a visit's loss
is the pure function's on the same tensors, bad settings are refused before weights load, resume is
bit-exact for each objective, and two DDP ranks train what one process does."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import lightning as L
import pytest
import torch
from ddp_helpers import CloseProcessGroup
from test_datasets_images import write_images
from test_module import lora_state, make_data, make_module, make_trainer
from tolerances import EPS32

from lit_flowgrpo.data_objective import SFT, DiffusionDPO, WithSFT
from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.image_data import ImageDataModule
from lit_flowgrpo.kl import ReferenceSettings
from lit_flowgrpo.objective import FlowGRPO, build_objective

SIZE = 32


def data_module(index: str, pairs: bool, **overrides) -> ImageDataModule:
    settings = dict(train=index, prompts_per_step=4, height=SIZE, width=SIZE, pairs=pairs, seed=2)
    settings.update(overrides)
    return ImageDataModule(**settings)


def learner(path: str, objective, **overrides):
    overrides.setdefault("guidance_scale", 1.0)
    overrides.setdefault("optimizer_steps_per_rollout", 1)
    return make_module(path, objective=objective, kl_coef=0.0, **overrides)


def test_registered_with_their_sources_defaults():
    sft, dpo = build_objective("sft"), build_objective("diffusion_dpo")
    assert isinstance(sft, SFT) and isinstance(dpo, DiffusionDPO)
    # diffusers' SD3 scripts: logit-normal (0, 1), mode scale 1.29, SD3.5's shift 3, the velocity loss
    # (flow_grpo's SFT; the scripts at --precondition_outputs 0); β of flow_grpo's and Flow-Factory's
    # SD3.5 Diffusion-DPO recipes.
    assert (sft.weighting_scheme, sft.logit_mean, sft.logit_std, sft.mode_scale, sft.shift) == (
        "logit_normal",
        0.0,
        1.0,
        1.29,
        3.0,
    )
    assert dpo.beta == 100.0 and sft.precondition_outputs is False
    assert (sft.learns_from, dpo.learns_from, DiffusionDPO(pairs="rollout").learns_from) == (
        "data",
        "data_pairs",
        "rollout_pairs",
    )


@pytest.mark.parametrize(
    ("objective", "data_kw", "module_kw", "fragment"),
    [
        (DiffusionDPO(), {"pairs": False}, {}, "--data.init_args.pairs must be true"),
        (SFT(), {"height": 16, "width": 16}, {}, "must be the sampler's"),
        (SFT(), {}, {"kl_coef": 0.1}, "must be 0 or null with SFT"),
        (DiffusionDPO(beta=0.0), {"pairs": True}, {}, "beta (0.0) must be a finite number > 0"),
        (DiffusionDPO(), {"pairs": True}, {"lora": None}, "needs --model.init_args.kl.reference.copy=true"),
        (SFT(), {}, {"reference_kl": True}, "kl.measure must be false with SFT"),
    ],
    ids=["dpo_without_pairs", "image_size", "kl_coef", "beta", "full_without_copy", "sft_kl_measure"],
)
def test_bad_settings_are_refused_before_weights_load(
    tiny_sd3_path, tmp_path, objective, data_kw, module_kw, fragment
):
    index = write_images(tmp_path, 4, size=SIZE, pairs=True)
    kw = {"guidance_scale": 1.0, "optimizer_steps_per_rollout": 1, "kl_coef": 0.0, **module_kw}
    with pytest.raises(SettingsError, match=None) as err:
        module = make_module(tiny_sd3_path, objective=objective, **kw)
        trainer = make_trainer(tmp_path / "run", max_steps=1)
        trainer.fit(module, datamodule=data_module(index, **{"pairs": True, **data_kw}))
    assert fragment in str(err.value)
    # No weight was read: refused in the constructor (no module), or before configure_model and the
    # policy's from_pretrained (its pipeline is still None).
    assert "module" not in locals() or (not module._configured and module.policy.pipe is None)


def test_dpo_with_kl_measure_logs_the_drift_from_its_reference(tiny_sd3_path, tmp_path):
    index = write_images(tmp_path, 4, size=SIZE, pairs=True)

    def kl_after(steps: int) -> float:
        module = learner(tiny_sd3_path, DiffusionDPO(beta=50.0), reference_kl=True)
        trainer = make_trainer(tmp_path / f"run{steps}", max_steps=steps, logger=False)
        trainer.fit(module, datamodule=data_module(index, pairs=True))
        return float(trainer.logged_metrics["actor/kl_loss"])

    # The first step is taken at the reference (LoRA's B is 0): exactly 0. After one optimizer step the
    # adapter has moved and the drift is positive (it was logged 0 whatever the drift).
    assert kl_after(1) == 0.0
    assert kl_after(2) > 0.0


def test_a_dpo_visit_is_the_loss_of_the_pure_function(tiny_sd3_path, tmp_path):
    from lit_flowgrpo.algorithms import diffusion_dpo_loss, flow_matching_errors

    index = write_images(tmp_path, 4, size=SIZE, pairs=True)
    module = learner(tiny_sd3_path, DiffusionDPO(beta=50.0, sft_coef=0.5), lora=None, reference_copy=True)
    trainer = make_trainer(tmp_path / "run", max_steps=1, logger=False)
    trainer.fit(module, datamodule=data_module(index, pairs=True))
    out = trainer.logged_metrics
    # One optimizer step from θ = reference: the first visit's margin is 0 and its loss log 2 + sft term.
    assert float(out["actor/dpo_pairs"]) == 4
    assert float(out["actor/dpo_reward_margin"]) == 0.0 and float(out["actor/dpo_reward_accuracy"]) == 0.0
    want = torch.log(torch.tensor(2.0)) + 0.5 * out["actor/dpo_chosen_error"]
    torch.testing.assert_close(out["actor/loss"].float(), want.float(), rtol=4 * EPS32, atol=0)
    # The pure functions agree on tensors built here (e_w < e_l lowers the loss below log 2).
    ew, el = flow_matching_errors(torch.zeros(1, 4), torch.zeros(1, 4), torch.zeros(1, 4)), torch.ones(1)
    loss, _ = diffusion_dpo_loss(ew, el, el, el, beta=1.0)
    assert float(loss) < float(torch.log(torch.tensor(2.0)))


def _fit(path, index, pairs, objective, root, max_steps, module_kw=None, **fit):
    module = learner(path, objective, **(module_kw or {}))
    trainer = make_trainer(root, max_steps=max_steps)
    trainer.fit(module, datamodule=data_module(index, pairs), **fit)
    return module, trainer


# An EMA reference: the KL settings refuse a moving reference unless the KL is on or measured, so the
# run measures it (kl.measure) with β = 0; the DPO loss then uses the moving reference.
EMA = {"reference": ReferenceSettings(mode="ema", ema_decay=0.5), "reference_kl": True}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("objective", "pairs", "module_kw"),
    [
        (SFT(visits_per_sample=2), False, {}),
        (DiffusionDPO(beta=50.0), True, {}),
        (DiffusionDPO(beta=50.0), True, EMA),
    ],
    ids=["sft", "dpo_offline", "dpo_ema_reference"],
)
def test_resume_is_exact(tiny_sd3_path, tmp_path, objective, pairs, module_kw):
    index = write_images(tmp_path / "data", 8, size=SIZE, pairs=pairs)
    straight, straight_trainer = _fit(tiny_sd3_path, index, pairs, objective, tmp_path / "a", 4, module_kw)
    _, trainer = _fit(tiny_sd3_path, index, pairs, objective, tmp_path / "b", 2, module_kw)
    ckpt = tmp_path / "half.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed, resumed_trainer = _fit(
        tiny_sd3_path, index, pairs, objective, tmp_path / "c", 4, module_kw, ckpt_path=ckpt
    )
    _assert_same_optimizer_state(straight_trainer, resumed_trainer)
    if module_kw:  # the EMA reference moved, and resumed to the same bits
        ref_a, ref_b = straight.copies.kl_reference.tensors(), resumed.copies.kl_reference.tensors()
        assert [k for k in ref_a if not torch.equal(ref_a[k], ref_b[k])] == []
        assert any(v.abs().max() > 0 for k, v in ref_a.items() if "lora_B" in k)
    a, b = lora_state(straight), lora_state(resumed)
    assert a and [k for k in a if not torch.equal(a[k], b[k])] == []
    assert any(a[k].abs().max() > 0 for k in a if "lora_B" in k)  # it trained: LoRA's B starts at 0


def _assert_same_optimizer_state(a: L.Trainer, b: L.Trainer) -> None:
    """The optimizers' states bit for bit (Adam's step counts and both moments of every parameter)."""
    sa, sb = a.optimizers[0].state_dict()["state"], b.optimizers[0].state_dict()["state"]
    assert sa and sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        assert all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i]), i
    assert a.global_step == b.global_step


@pytest.mark.slow
def test_online_dpo_resumes_exactly_and_pairs_each_group(tiny_sd3_path, prompt_file, tmp_path):
    objective = DiffusionDPO(beta=50.0, pairs="rollout")

    def run(root, max_steps, **fit):
        module = learner(tiny_sd3_path, objective, num_steps=3)
        trainer = make_trainer(tmp_path / root, max_steps=max_steps)
        trainer.fit(module, datamodule=make_data(prompt_file), **fit)
        return module, trainer

    straight, trainer = run("a", 2)
    # brightness differs within every group of 4: one pair per prompt, 2 prompts a step.
    assert float(trainer.logged_metrics["actor/dpo_online_pairs"]) == 2.0
    _, half = run("b", 1)
    ckpt = tmp_path / "half.ckpt"
    half.save_checkpoint(ckpt)
    resumed, resumed_trainer = run("c", 2, ckpt_path=ckpt)
    a, b = lora_state(straight), lora_state(resumed)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    _assert_same_optimizer_state(trainer, resumed_trainer)


class _Recorder(L.Callback):
    def __init__(self, out: str) -> None:
        self.out = out
        self.sample_ids: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.sample_ids += [(batch_idx, i) for i in batch.sample_ids.tolist()]  # ids count within a step

    def on_train_end(self, trainer, pl_module) -> None:
        # Every rank: which records it trained, and how many ranks there were.
        ids = {"world_size": trainer.world_size, "sample_ids": self.sample_ids}
        torch.save(ids, Path(self.out) / f"ids_{trainer.global_rank}.pt")
        if trainer.global_rank == 0:
            state = {k: v.detach().cpu().clone() for k, v in pl_module.named_parameters() if v.requires_grad}
            torch.save(state, Path(self.out) / "weights.pt")


def _ddp_run(path: str, index: str, out: Path, devices: int) -> None:
    out.mkdir()
    module = make_module(
        path,
        objective=DiffusionDPO(beta=50.0),
        kl_coef=0.0,
        guidance_scale=1.0,
        optimizer_steps_per_rollout=1,
        micro_batch_size=2,
        # SGD: ranks that agree on the gradient agree on the weights (tests/test_ddp.py says why not Adam)
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp_spawn" if devices > 1 else "auto",
        callbacks=[CloseProcessGroup(), _Recorder(str(out))],
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, datamodule=data_module(index, True))


@pytest.mark.slow
def test_ddp_two_processes_equal_single_process(tiny_sd3_path, tmp_path):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    index = write_images(tmp_path / "data", 8, size=SIZE, pairs=True)
    _ddp_run(tiny_sd3_path, index, tmp_path / "one", 1)
    _ddp_run(tiny_sd3_path, index, tmp_path / "two", 2)
    # Two ranks ran, each trained half of the records, and together the one process's.
    one = torch.load(tmp_path / "one" / "ids_0.pt")
    two = [torch.load(tmp_path / "two" / f"ids_{r}.pt") for r in (0, 1)]
    assert one["world_size"] == 1 and [t["world_size"] for t in two] == [2, 2]
    r0, r1 = (t["sample_ids"] for t in two)
    assert len(r0) == len(r1) == len(one["sample_ids"]) // 2 and not set(r0) & set(r1)
    assert sorted(r0 + r1) == sorted(one["sample_ids"])
    a, b = torch.load(tmp_path / "one" / "weights.pt"), torch.load(tmp_path / "two" / "weights.pt")
    init = {k: torch.zeros_like(v) if "lora_B" in k else v for k, v in a.items()}  # B starts at 0
    moved = max(float((a[k] - init[k]).abs().max()) for k in a if "lora_B" in k)
    assert moved > 0
    # The same pairs, σ and ε on either side (seeded per sample id); two micro-batches summed by DDP's
    # all-reduce instead of one process's accumulation: each gradient element reorders its sum over the
    # 8 pairs × 2 images × 349 tokens of the tiny SD3 (tests/tolerances.py, Higham §4.2).
    atol = moved * 8 * 2 * 349 * EPS32
    assert all(torch.allclose(b[k], v, rtol=2 * EPS32, atol=atol) for k, v in a.items())
    halved = {k: v / 2 for k, v in a.items() if "lora_B" in k}  # the check sees a halved step
    assert not all(torch.allclose(b[k], v, rtol=0, atol=atol) for k, v in halved.items())


def _with_sft_run(path: str, index: str, root: Path, objective) -> dict[str, torch.Tensor]:
    module = make_module(
        path,
        objective=objective,
        kl_coef=0.0,
        guidance_scale=1.0,
        num_steps=3,
        optimizer_steps_per_rollout=1,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
    )
    trainer = make_trainer(root, max_steps=1, logger=False)
    trainer.fit(module, datamodule=data_module(index, False, prompts_per_step=2, group_size=4))
    assert torch.isfinite(trainer.logged_metrics["actor/loss"])
    return lora_state(module)


def test_rl_with_sft_beside_is_the_rl_loss_plus_the_weighted_sft_loss(tiny_sd3_path, tmp_path):
    index = write_images(tmp_path / "data", 4, size=SIZE)
    plain = _with_sft_run(tiny_sd3_path, index, tmp_path / "a", FlowGRPO(clip_range=1e-2))
    rl = {"clip_range": 1e-2}
    zero = _with_sft_run(
        tiny_sd3_path, index, tmp_path / "b", WithSFT(rl="flow_grpo", rl_settings=rl, coef=0.0)
    )
    beside = _with_sft_run(
        tiny_sd3_path, index, tmp_path / "c", WithSFT(rl="flow_grpo", rl_settings=rl, coef=1.0)
    )
    # coef 0: the RL visits scaled by (n + 1)/n and averaged over n + 1 visits are the plain run's mean
    # over n, up to the rounding of that scale (a few ulps of each gradient term); SGD moves the weights
    # by lr × gradient, so the weights agree to that over the LoRA step.
    moved = max(float(v.abs().max()) for k, v in plain.items() if "lora_B" in k)
    assert moved > 0
    assert all(torch.allclose(zero[k], v, rtol=0, atol=16 * EPS32 * moved) for k, v in plain.items())
    # coef 1: the SFT term moves the weights elsewhere.
    assert not all(torch.allclose(beside[k], v, rtol=0, atol=1e-3 * moved) for k, v in plain.items())


class _CountEncodes(L.Callback):
    def __init__(self) -> None:
        self.images = 0

    def on_train_start(self, trainer, pl_module) -> None:
        vae = pl_module.policy.vae
        encode = vae.encode

        def counted(x, *args, **kwargs):
            self.images += len(x)
            return encode(x, *args, **kwargs)

        vae.encode = counted


def test_the_latent_cache_encodes_each_image_once(tiny_sd3_path, tmp_path):
    index = write_images(tmp_path / "data", 4, size=SIZE)
    data = data_module(index, False, cache_latents=True)
    counter = _CountEncodes()
    module = learner(tiny_sd3_path, SFT())
    trainer = make_trainer(tmp_path / "run", max_steps=3, logger=False, callbacks=[counter])
    trainer.fit(module, datamodule=data)
    # 3 steps of the 4 records: the first encodes each image, the next two read the cache.
    assert counter.images == 4 and len(data.latent_cache) == 4
    assert torch.isfinite(trainer.logged_metrics["actor/sft_loss"])
