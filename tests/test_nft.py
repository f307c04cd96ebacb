"""DiffusionNFT through the objective seam, on the tiny SD3: what the rollout records, the old policy
(start, refresh, checkpoint), the loss of a visit, full fine-tunes, and the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_module import lora_state, make_data, make_module, make_trainer

from lit_flowgrpo.algorithms import nft_loss, nft_old_policy_decay, nft_reward_probability
from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.kl import KLSettings
from lit_flowgrpo.metrics import DiagnosticsSettings
from lit_flowgrpo.objective import DiffusionNFT, FlowGRPO, Objective, VisitContext, build_objective


def nft_module(path: str, **overrides):
    overrides.setdefault("guidance_scale", 1.0)
    objective = overrides.pop("objective", DiffusionNFT())
    return make_module(path, objective=objective, **overrides)


def test_registered_with_published_defaults():
    nft = build_objective("diffusion_nft")
    assert isinstance(nft, DiffusionNFT)
    assert (nft.beta, nft.adv_clip_max, nft.visit_fraction, nft.default_kl_coef) == (1.0, 5.0, 0.99, 1e-4)
    assert KLSettings().resolved(nft.default_kl_coef).coef == 1e-4  # β left null takes the published one
    assert nft.schedule == (0, 1e-3, 0.5)  # the reference's decay_type 1
    assert nft.records == () and nft.old_policy


def test_one_step_trains_the_adapter_and_refreshes_the_old_policy(tiny_sd3_path, prompt_file, tmp_path):
    module = nft_module(tiny_sd3_path)
    module.configure_model()
    frozen = {k: v.detach().clone() for k, v in module.named_parameters() if not v.requires_grad}
    before = lora_state(module)
    seen = {}
    original = module.sampler.rollout

    def rollout(*args, **kwargs):  # what the rollout is asked to record, and the old policy at the start
        seen["record"] = kwargs["record"]
        seen["old"] = module.copies.old_policy.state_dict()
        traj, images = original(*args, **kwargs)
        seen["traj"] = traj
        return traj, images

    module.sampler.rollout = rollout
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.fit(module, datamodule=make_data(prompt_file))
    assert trainer.global_step == 2

    assert tuple(seen["record"]) == ()
    traj = seen["traj"]
    assert traj.num_trained == 0 and traj.prev_sample_means is None and traj.schedule is not None
    # Before any refresh the old policy is θ as it started.
    start = {
        n: before[k] for n, k in zip(seen["old"], before, strict=True)
    }  # the same tensors, the same order
    assert len(start) == len(before) == len(seen["old"])
    assert all(torch.equal(seen["old"][n], start[n]) for n in start)
    for key, value in module.named_parameters():
        if not value.requires_grad:
            assert torch.equal(value, frozen[key]), key
    after = lora_state(module)
    assert any(not torch.equal(after[k], before[k]) for k in before), "the adapter did not move"
    # After the update: θ_old = η·θ_old + (1 − η)·θ with η of the 2 optimizer steps taken.
    eta = nft_old_policy_decay(2, delay=0, rate=1e-3, cap=0.5)
    old = module.copies.old_policy.state_dict()
    for n, k in zip(start, before, strict=True):
        want = before[k] * eta + after[k] * (1 - eta)  # the update's own order of operations: exact
        assert torch.equal(old[n], want), n
    logged = {k: float(v) for k, v in trainer.logged_metrics.items()}
    for key in ("actor/nft_r_mean", "actor/nft_positive_loss", "actor/nft_old_deviation", "actor/loss"):
        assert key in logged and torch.isfinite(torch.tensor(logged[key])), key
    assert logged["actor/nft_old_decay"] == pytest.approx(eta)


def test_visit_loss_is_nft_loss_on_the_same_tensors(tiny_sd3_path):
    module = nft_module(tiny_sd3_path, kl_coef=0.0)
    assert not module.kl.runs_reference
    module.configure_model()
    policy, nft = module.policy, module.objective
    embeds = policy.encode_prompts(["a", "b"])
    traj, _ = module.sampler.rollout(policy, embeds, torch.tensor([1, 2]), step=0, seed=0, record=())
    from lit_flowgrpo.rollout import RolloutBatch

    batch = RolloutBatch(
        traj, embeds, torch.tensor([1.5, -0.5]), torch.tensor([0, 1]), torch.ones(2, dtype=torch.bool)
    )
    ctx = VisitContext(policy, module.copies, 1.0, kl=module.kl, seed=11)
    idx = torch.tensor([0, 1])
    out = nft.visit(ctx, batch, idx, 2, 1)
    again = nft.visit(ctx, batch, idx.flip(0), 2, 1)  # a row's draws do not depend on its place
    torch.testing.assert_close(out.loss, again.loss, rtol=1e-6, atol=0)

    sigma, noise = nft._draws(ctx, batch, idx, 1)
    x0 = traj.final
    t = sigma.view(-1, 1, 1, 1)
    x = (1 - t) * x0 + t * noise
    with torch.no_grad():
        v = policy.velocity(x, sigma, embeds, 1.0)
    want, _ = nft_loss(v, v, x0, noise, sigma, nft_reward_probability(batch.advantages))
    torch.testing.assert_close(out.loss.detach(), want, rtol=1e-6, atol=0)  # θ = θ_old on-policy
    assert out.diagnostics["old_deviation"].abs().max() == 0


def test_resume_is_exact(tiny_sd3_path, prompt_file, tmp_path):
    def run(root, max_steps, **fit):
        module = nft_module(tiny_sd3_path)
        trainer = make_trainer(tmp_path / root, max_steps=max_steps)
        trainer.fit(module, datamodule=make_data(prompt_file), **fit)
        return module, trainer

    straight, _ = run("a", 4)
    _, trainer = run("b", 2)
    ckpt = tmp_path / "half.ckpt"
    trainer.save_checkpoint(ckpt)
    assert torch.load(ckpt, weights_only=False)["lit_flowgrpo"]["old_policy"]
    resumed, _ = run("c", 4, ckpt_path=ckpt)
    a, b = lora_state(straight), lora_state(resumed)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    old_a = straight.copies.old_policy.state_dict()
    old_b = resumed.copies.old_policy.state_dict()
    assert [k for k in old_a if not torch.equal(old_a[k], old_b[k])] == []


def test_full_finetune(tiny_sd3_path, prompt_file, tmp_path):
    module = nft_module(tiny_sd3_path, lora=None, reference_copy=True)
    module.configure_model()
    before = {k: v.detach().clone() for k, v in module.policy.transformer.named_parameters()}
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.fit(module, datamodule=make_data(prompt_file))
    after = dict(module.policy.transformer.named_parameters())
    assert any(not torch.equal(after[k], before[k]) for k in before)
    old = module.copies.old_policy.network.state_dict()
    eta = nft_old_policy_decay(2, rate=1e-3, cap=0.5)
    for k in before:  # the update's own order of operations (one blend): exact
        assert torch.equal(old[k], before[k] * eta + after[k].detach() * (1 - eta)), k
    ckpt = tmp_path / "full.ckpt"
    trainer.save_checkpoint(ckpt)
    assert len(torch.load(ckpt, weights_only=False)["lit_flowgrpo"]["old_policy"]) == len(old)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (dict(guidance_scale=4.5), "sampler.guidance_scale (4.5) must be 1"),
        (dict(objective=DiffusionNFT(decay_schedule=(0, 1e-3, 1.0))), "objective.init_args.decay_schedule"),
        (dict(objective=DiffusionNFT(beta=0.0)), "objective.init_args.beta (0.0) must be > 0"),
        (
            dict(objective=DiffusionNFT(visit_fraction=0.0)),
            "objective.init_args.visit_fraction (0.0) must lie in (0, 1]",
        ),
        (dict(objective=DiffusionNFT(), lora=None), "--model.init_args.kl.reference.copy=true"),
    ],
)
def test_bad_settings_are_refused_before_weights_load(tiny_sd3_path, overrides, fragment):
    with pytest.raises(SettingsError) as err:
        nft_module(tiny_sd3_path, **overrides)
    assert fragment in str(err.value)
    if "guidance" in fragment:
        assert "--model.init_args.objective=" in str(err.value)


def test_settings_round_trip():
    nft = DiffusionNFT(decay_schedule=[75, 7.5e-3, 0.999])
    assert nft.schedule == (75, 7.5e-3, 0.999)
    assert DiffusionNFT(**dataclasses.asdict(nft)).schedule == nft.schedule


@pytest.mark.parametrize(
    "decay", [dict(), dict(decay="delayed_linear_to_0_999"), dict(decay_schedule=(3, 0.1, 0.9))]
)
def test_old_policy_decay_is_a_function_of_the_steps(decay):
    """η comes from the optimizer steps alone: the objective keeps no run state, and logging recomputes
    the η that the refresh used instead of remembering it."""
    nft = DiffusionNFT(**decay)
    delay, rate, cap = nft.schedule
    before = dataclasses.asdict(nft), dict(vars(nft))
    for steps in (0, 2, 5, 80, 10_000):
        want = nft_old_policy_decay(steps, delay=delay, rate=rate, cap=cap)
        assert nft.old_policy_decay(steps) == want
        metric = nft.diagnostics(3, DiagnosticsSettings())
        one = torch.ones(2)
        metric.update(**{name: one for name in metric.STATS})
        values = nft.diagnostics_values(metric, steps)
        assert values["actor/nft_old_decay"] == want and values["actor/nft_r_mean"] == 1.0
        assert nft.diagnostics_values(metric, steps) == values  # asking twice changes nothing
    assert (dataclasses.asdict(nft), dict(vars(nft))) == before
    assert not hasattr(Objective, "after_update") and not hasattr(nft, "_last_decay")
    assert FlowGRPO().old_policy_decay(5) is None and not FlowGRPO.old_policy


def test_nft_diagnostics_live_beside_the_other_metrics():
    from lit_flowgrpo.metrics import NFTDiagnostics

    assert isinstance(DiffusionNFT().diagnostics(3, DiagnosticsSettings()), NFTDiagnostics)


def test_the_main_job_runs_shortened(tmp_path):
    """configs/quickstart.yaml (DiffusionNFT) through the CLI on the shapes world: one short rollout and
    update."""
    import yaml
    from cli_helpers import load_shipped

    from lit_flowgrpo.cli import FlowGRPOCLI

    cfg = load_shipped("quickstart")
    trainer = cfg["trainer"]
    trainer.update(max_steps=1, default_root_dir=str(tmp_path), num_sanity_val_steps=0, limit_val_batches=1)
    trainer["logger"]["init_args"]["save_dir"] = str(tmp_path)
    trainer["callbacks"] = [c for c in trainer["callbacks"] if "HeldOut" not in c["class_path"]]
    for callback in trainer["callbacks"]:
        if callback["class_path"].endswith("ModelCheckpoint"):
            callback["init_args"]["dirpath"] = str(tmp_path / "checkpoints")
    cfg["data"]["init_args"].update(prompts_per_step=2, group_size=4, val_batch_size=8, max_val_prompts=2)
    model = cfg["model"]["init_args"]
    model["update"]["micro_batch_size"] = 8
    model["sampler"].update(num_steps=3, eval_num_steps=2)
    path = tmp_path / "quickstart.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli = FlowGRPOCLI(args=["fit", "--config", str(path)])
    assert cli.trainer.global_step == 1
    assert cli.model.objective.name == "diffusion_nft" and cli.model.sampler.guidance_scale == 1.0
    logged = {k: float(v) for k, v in cli.trainer.logged_metrics.items()}
    assert (
        logged["actor/nft_r_mean"] == pytest.approx(0.5, abs=0.5) and logged["actor/nft_old_deviation"] == 0.0
    )
