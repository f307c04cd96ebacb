"""lit_flowgrpo/objective.py: objectives as dataclasses, what they declare, their settings and problems."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lit_flowgrpo.cli_diagnosis import move_old_settings
from lit_flowgrpo.kl import KLSettings
from lit_flowgrpo.metrics import DiagnosticsSettings, FlowDPPOStats, PolicyRatioStats
from lit_flowgrpo.objective import (
    FlowDPPO,
    FlowGRPO,
    GRPOGuard,
    GRPOGuardRatioNorm,
    RatioObjective,
    available_objectives,
    build_objective,
)


def test_settings_are_the_dataclass_fields() -> None:
    assert FlowGRPO().settings() == {
        "name": "flow_grpo",
        "clip_range": 1e-4,
        "clip_range_high": None,
        "adv_clip_max": 5.0,
    }
    assert GRPOGuard().clip_range == 2e-6  # a subclass changes a default in one line
    assert GRPOGuard(1e-5).clip_range == 1e-5  # positional order unchanged
    assert [f.name for f in dataclasses.fields(GRPOGuardRatioNorm)][-1] == "target_std"
    assert repr(FlowGRPO(adv_clip_max=2.0)).startswith("FlowGRPO(clip_range=0.0001, clip_range_high=None")
    # β lives in the KL group now, not among the objective's settings.
    assert repr(KLSettings(coef=0.5)).startswith("KLSettings(coef=0.5, with_dt=False")
    with pytest.raises(TypeError, match="kl_coef"):
        FlowGRPO(kl_coef=0.5)  # type: ignore[call-arg]


def test_hparams_round_trip_through_the_class_path() -> None:
    objective = GRPOGuardRatioNorm(clip_range=1e-3, target_std=1e-4)
    saved = objective.hparams()
    assert saved["class_path"] == "lit_flowgrpo.objective.GRPOGuardRatioNorm"
    module, _, name = saved["class_path"].rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    assert cls(**saved["init_args"]) == objective
    # An older checkpoint's init_args (the keys it held then, written by hand) build the same objective
    # once its KL settings are moved to the kl group.
    old = {
        "clip_range": 2e-6,
        "clip_range_high": None,
        "adv_clip_max": 5.0,
        "kl_coef": 0.0,
        "kl_with_dt": False,
    }
    hparams = {"objective": {"class_path": "lit_flowgrpo.objective.GRPOGuard", "init_args": old}}
    assert move_old_settings(hparams)
    assert GRPOGuard(**hparams["objective"]["init_args"]) == GRPOGuard()
    assert KLSettings(**hparams["kl"]) == KLSettings(coef=0.0, with_dt=False)


def test_declarations() -> None:
    assert FlowGRPO.records == ("transitions",) and FlowGRPO.sde_types == ()
    assert GRPOGuard.records == ("transitions", "means") and GRPOGuard.sde_types == ("sde",)
    assert GRPOGuardRatioNorm.records == ("transitions",)
    assert all(issubclass(c, RatioObjective) for c in (FlowGRPO, GRPOGuard, GRPOGuardRatioNorm))
    assert FlowGRPO.default_kl_coef == 0.0 and GRPOGuard.default_kl_coef == 0.0
    assert not KLSettings().resolved(FlowGRPO.default_kl_coef).runs_reference
    assert KLSettings(coef=0.1).resolved(FlowGRPO.default_kl_coef).runs_reference
    assert isinstance(build_objective("grpo_guard"), GRPOGuard)


def test_clip_range_high_is_resolved_once_by_the_objective() -> None:
    assert FlowGRPO(clip_range=0.2).clip_high == 0.2
    assert FlowGRPO(clip_range=0.2, clip_range_high=0.3).clip_high == 0.3
    metric = FlowGRPO(clip_range=0.2).diagnostics(3, DiagnosticsSettings())
    assert isinstance(metric, PolicyRatioStats) and metric.clip_range_high == 0.2


@pytest.mark.parametrize(
    ("objective", "message"),
    [
        (
            FlowGRPO(clip_range=0.0),
            "--model.init_args.objective.init_args.clip_range (0.0) must lie in (0, 1)",
        ),
        (
            FlowGRPO(clip_range_high=float("inf")),
            "--model.init_args.objective.init_args.clip_range_high (inf) must be a finite number > 0",
        ),
        (FlowGRPO(adv_clip_max=0.0), "--model.init_args.objective.init_args.adv_clip_max (0.0) must be > 0"),
        (
            GRPOGuardRatioNorm(target_std=0.5),
            "--model.init_args.objective.init_args.target_std (0.5) must lie in (0, 0.1)",
        ),
    ],
)
def test_problems_name_the_flag_the_cli_accepts(objective, message) -> None:
    assert any(p.startswith(message) for p in objective.problems("sde")), objective.problems("sde")


def test_a_negative_kl_coef_is_refused_with_its_flag() -> None:
    said = KLSettings(coef=-1.0).problems(full_fine_tune=False)
    assert any(p.startswith("--model.init_args.kl.coef (-1.0) must be >= 0") for p in said), said


def test_clip_range_has_one_rule_for_the_objective_and_the_metric() -> None:
    with pytest.raises(ValueError, match=r"clip_range_high \(inf\) must be a finite number > 0"):
        PolicyRatioStats(clip_range=0.1, clip_range_high=float("inf"))


@pytest.mark.parametrize(
    ("cls", "loss"),
    [(FlowGRPO, "flow_grpo_loss"), (GRPOGuard, "grpo_guard_loss"), (GRPOGuardRatioNorm, "ratio_norm_loss")],
)
@pytest.mark.parametrize(("high", "want"), [(None, 0.2), (0.3, 0.3)])
def test_the_losses_get_the_resolved_clip_range_high(cls, loss, high, want, monkeypatch) -> None:
    """ε_high is resolved once, by the objective: the loss is handed a number, never ``None``."""
    import lit_flowgrpo.objective as objective_module
    from lit_flowgrpo.objective import ScoredStep

    seen = {}
    real = getattr(objective_module, loss)

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(objective_module, loss, spy)
    zero, one, means = torch.zeros(3), torch.ones(3), torch.zeros(3, 2)
    scored = ScoredStep(zero, zero, one, means, means, one, one)
    cls(clip_range=0.2, clip_range_high=high).policy_loss(scored)
    assert seen["clip_range_high"] == want and isinstance(seen["clip_range_high"], float)
    metric = cls(clip_range=0.2, clip_range_high=high).diagnostics(2, DiagnosticsSettings())
    assert (metric.clip_range, metric.clip_range_high) == (0.2, want)
    assert PolicyRatioStats(clip_range=0.2, clip_range_high=high).clip_range_high == want  # the same rule


def test_logged_values_carry_the_top_kl_records() -> None:
    objective = FlowGRPO(clip_range=0.1)
    metric = objective.diagnostics(2, DiagnosticsSettings(top_k_kl=2))
    new = torch.log(torch.tensor([1.2, 0.9, 1.0]))
    metric.update(new, torch.zeros(3), torch.ones(3), step=torch.tensor([0, 1, 1]), sample_id=torch.arange(3))
    values = objective.diagnostics_values(metric, 7)
    assert values["actor/top_kl/0/kl"] == values["actor/kl_max"] >= values["actor/top_kl/1/kl"]
    assert values["actor/top_kl/0/sample_id"] == 0.0 and "actor/top_kl/2/kl" not in values
    assert all(isinstance(v, float) for v in values.values())


def test_guard_refuses_a_step_it_cannot_score() -> None:
    (problem,) = GRPOGuard().problems("cps")
    assert problem.startswith(
        "--model.init_args.objective=lit_flowgrpo.objective.GRPOGuard needs "
        "--model.init_args.sampler.sde_type in ['sde'] (got 'cps')"
    )
    assert GRPOGuard().problems("sde") == [] and FlowGRPO().problems("cps") == []


def test_policy_loss_is_unchanged_by_the_dataclass_form() -> None:
    from lit_flowgrpo.algorithms import flow_grpo_loss
    from lit_flowgrpo.objective import ScoredStep

    gen = torch.Generator().manual_seed(0)
    new, old, adv = (torch.randn(5, generator=gen) * 1e-3 for _ in range(3))
    scored = ScoredStep(new, old, adv, torch.zeros(5, 2), None, torch.ones(5), torch.ones(5))
    loss, _ = FlowGRPO(clip_range=1e-3).policy_loss(scored)
    expected, _ = flow_grpo_loss(new, old, adv, clip_range=1e-3)
    assert torch.equal(loss, expected)


# ---------------------------------------------------------------- Flow-DPPO, and μ_old for the step KL


def test_flow_dppo_settings_and_declarations() -> None:
    assert "flow_dppo" in available_objectives() and isinstance(build_objective("flow_dppo"), FlowDPPO)
    assert FlowDPPO().settings() == {
        "name": "flow_dppo",
        "clip_range": 1e-4,
        "clip_range_high": None,
        "adv_clip_max": None,  # the references clip nothing
        "kl_mask_threshold": 1e-5,
        "add_kl_coefficient": True,
    }
    assert FlowDPPO.records == ("transitions", "means") and FlowDPPO.sde_types == ("sde", "dance")
    saved = FlowDPPO(kl_mask_threshold=3e-5).hparams()
    assert saved["class_path"] == "lit_flowgrpo.objective.FlowDPPO"
    assert FlowDPPO(**saved["init_args"]) == FlowDPPO(kl_mask_threshold=3e-5)
    metric = FlowDPPO(clip_range=1e-3).diagnostics(4, DiagnosticsSettings())
    assert isinstance(metric, FlowDPPOStats) and metric.clip_range == 1e-3 and metric.by_step


@pytest.mark.parametrize("threshold", [-1e-5, float("inf"), float("nan")])
def test_flow_dppo_threshold_problem_names_the_flag(threshold: float) -> None:
    (problem,) = FlowDPPO(kl_mask_threshold=threshold).problems("sde")
    assert problem.startswith(
        f"--model.init_args.objective.init_args.kl_mask_threshold ({threshold}) must be a finite number >= 0"
    )
    assert FlowDPPO(kl_mask_threshold=0.0).problems("dance") == []


def test_flow_dppo_refuses_cps_naming_both_flags() -> None:
    problems = FlowDPPO(clip_range=0.0).problems("cps")  # every problem at once
    assert any(p.startswith("--model.init_args.objective.init_args.clip_range (0.0)") for p in problems)
    assert any(
        p.startswith(
            "--model.init_args.objective=lit_flowgrpo.objective.FlowDPPO needs "
            "--model.init_args.sampler.sde_type in ['sde', 'dance'] (got 'cps')"
        )
        for p in problems
    )


def test_flow_dppo_policy_loss_is_flow_dppo_loss() -> None:
    from lit_flowgrpo.algorithms import flow_dppo_loss
    from lit_flowgrpo.objective import ScoredStep

    gen = torch.Generator().manual_seed(0)
    new, old, adv = (torch.randn(6, generator=gen) * 1e-2 for _ in range(3))
    mu_old = torch.randn(6, 3, 2, generator=gen)
    mu = mu_old + 1e-2 * torch.randn(6, 3, 2, generator=gen)
    std, root = torch.full((6,), 0.5), torch.full((6,), 0.3)
    scored = ScoredStep(new, old, adv, mu, mu_old, std, root)
    objective = FlowDPPO(kl_mask_threshold=1e-3, add_kl_coefficient=False)
    loss, stats = objective.policy_loss(scored)
    expected, want = flow_dppo_loss(
        new, old, adv, mu, mu_old, std, root, kl_mask_threshold=1e-3, add_kl_coefficient=False
    )
    assert torch.equal(loss, expected) and torch.equal(stats.high_kl, want.high_kl)
    inputs = objective.diagnostics_inputs(stats)
    assert set(inputs) == {"high_kl", "pos_rm", "neg_rm"} and torch.equal(
        inputs["pos_rm"], want.clip_active_high
    )


def test_rollout_records_add_means_for_the_step_kl_of_every_ratio_objective() -> None:
    on, off = DiagnosticsSettings(), DiagnosticsSettings(step_kl=False)
    assert on.step_kl  # on by default: the cost is one latent per trained step (DiagnosticsSettings)
    for objective in (FlowGRPO(), GRPOGuardRatioNorm()):
        assert objective.rollout_records(on) == ("transitions", "means")
        assert objective.rollout_records(off) == ("transitions",)
    for objective in (GRPOGuard(), FlowDPPO()):  # their loss needs μ_old either way
        assert objective.rollout_records(on) == objective.rollout_records(off) == ("transitions", "means")
    # The option only asks the rollout; the metric logs the step KL it is given.
    assert isinstance(FlowGRPO().diagnostics(3, off), PolicyRatioStats)


def test_flow_dppo_takes_the_advantages_as_the_references_do() -> None:
    """One success in a group of 64: |A| ≈ 7.9 with the group's std. UniRL and verl-omni weigh the
    surrogate with it as it is (neither clips in the loss nor in the advantage step), so on-policy that
    sample's gradient is −A/N; clipped to 5 it was −5/N, 0.63 of the references'."""
    from lit_flowgrpo.algorithms import group_advantages
    from lit_flowgrpo.objective import ScoredStep

    rewards = torch.zeros(64)
    rewards[17] = 1.0
    adv = group_advantages(rewards, torch.zeros(64, dtype=torch.long), std="group")
    assert adv[17] > 7  # (1 − 1/64) / (√63/64 + 1e-4)
    log_prob = torch.zeros(64, requires_grad=True)
    mu = torch.zeros(64, 2, 2)
    scored = ScoredStep(log_prob, torch.zeros(64), adv, mu, mu.clone(), torch.ones(64), torch.ones(64))
    loss, stats = FlowDPPO().policy_loss(scored)
    (grad,) = torch.autograd.grad(loss, log_prob)
    # On-policy r = 1 exactly and nothing is masked: the gradient is −A/N, one fp32 division.
    assert grad[17].item() == pytest.approx(-adv[17].item() / 64, rel=2**-23)
    assert torch.equal(stats.advantages, adv)
    # Set, adv_clip_max clips as the other ratio losses do.
    loss, stats = FlowDPPO(adv_clip_max=5.0).policy_loss(scored)
    assert stats.advantages[17] == 5.0
    assert (
        FlowDPPO(adv_clip_max=0.0)
        .problems("sde")[0]
        .startswith("--model.init_args.objective.init_args.adv_clip_max (0.0) must be > 0")
    )


class _Field:
    """A deterministic velocity field (the policy the rollout and the update call)."""

    uses_cfg_batch = False

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, embeds: dict, guidance: float) -> torch.Tensor:
        return torch.tanh(x * embeds["scale"].view(-1, 1, 1, 1)) - 0.5 * x + sigma.view(-1, 1, 1, 1)


def test_bf16_records_keep_mu_old_exact_so_flow_dppo_starts_inside_its_trust_region() -> None:
    """With record_dtype bfloat16, x and x_next are stored rounded (the chain continues from them), but
    μ_old is kept in fp32: rounded, it alone gave an on-policy step KL of up to 4.2e-5 here, above
    Flow-DPPO's δ = 1e-5, so steps were masked before any update. Kept, the re-scored μ_θ equals it
    exactly and the step KL is 0."""
    from lit_flowgrpo.algorithms import gaussian_step_kl
    from lit_flowgrpo.rollout import sample_trajectory
    from lit_flowgrpo.sde import sd3_sigmas

    field, b = _Field(), 8
    embeds = {"scale": torch.linspace(0.5, 2.0, b)}
    noise = torch.randn(b, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    traj = sample_trajectory(
        field,
        embeds,
        noise,
        sd3_sigmas(10),
        guidance_scale=1.0,
        noise_level=0.7,
        sde_type="sde",
        sde_steps=list(range(10)),
        train_steps=list(range(9)),
        generators=[torch.Generator().manual_seed(s) for s in range(b)],
        record=FlowDPPO.records,
        record_dtype=torch.bfloat16,
    )
    idx = torch.arange(b)
    for j in range(traj.num_trained):
        sigma = torch.full((b,), float(traj.sigmas[j]))
        step = traj.score(field.velocity(traj.latents[:, j].float(), sigma, embeds, 1.0), j, idx)
        kl = gaussian_step_kl(
            step.prev_sample_mean, traj.prev_sample_means[:, j], traj.std_dev_t[:, j], traj.sqrt_dt[:, j]
        )
        assert torch.equal(kl, torch.zeros(b))
    assert traj.latents.dtype == torch.bfloat16 and traj.prev_sample_means.dtype == torch.float32


# ---------------------------------------------------------------- settings that cannot work, refused


def test_cps_last_step_has_no_noise_so_the_kl_to_the_reference_is_not_finite() -> None:
    """Why the next test refuses: CPS's noise at the last step is σ_next·sin(ηπ/2) = 0, and the KL to
    the reference divides by it (0/0 on-policy, x/0 after any update)."""
    from lit_flowgrpo.algorithms import kl_to_reference
    from lit_flowgrpo.sde import sde_step_with_logprob

    x, v = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    step = sde_step_with_logprob(v, x, 0.25, 0.0, noise_level=0.8, sde_type="cps")
    assert torch.equal(step.std_dev_t, torch.zeros(2))
    assert torch.isfinite(step.log_prob).all()  # the policy term alone stays finite
    kl = kl_to_reference(step.prev_sample_mean, step.prev_sample_mean + 1e-3, step.std_dev_t)
    assert not torch.isfinite(kl).any()


@pytest.mark.parametrize(
    ("sampler", "measure", "fix"),
    [
        (
            dict(sde_window_size=2, num_steps=4),
            False,
            "--model.init_args.sampler.sde_window_range (unset: [0, 4]) lets the window reach the last of "
            "num_steps (4): end it at 3 or before, or use sde_type sde",
        ),
        (
            dict(sde_window_size=2, sde_window_range=(1, 6), num_steps=6),
            False,
            "--model.init_args.sampler.sde_window_range ([1, 6]) lets the window reach",
        ),
        (
            dict(timestep_fraction=1.0),
            True,
            "--model.init_args.sampler.timestep_fraction (1.0) trains the last of num_steps (10): set it "
            "below 1 (Flow-GRPO: 0.99)",
        ),
    ],
)
def test_cps_with_a_kl_that_can_reach_the_last_step_is_refused(
    sampler: dict, measure: bool, fix: str
) -> None:
    from lit_flowgrpo.rollout import Sampler

    objective = FlowGRPO()
    kl = KLSettings(coef=0.0 if measure else 0.04, measure=measure)
    (problem,) = objective.sampler_problems(Sampler(sde_type="cps", **sampler), kl)
    which = "--model.init_args.kl.measure" if measure else "--model.init_args.kl.coef 0.04"
    assert problem.startswith("--model.init_args.sampler.sde_type=cps with the KL to the reference (")
    assert which in problem and fix in problem and "\n" not in problem
    # Any of the fixes it names is accepted; so is CPS without a KL.
    ok = Sampler(sde_type="cps", **{**sampler, "timestep_fraction": 0.99})
    if "sde_window_size" in sampler:
        ok = Sampler(sde_type="cps", **{**sampler, "sde_window_range": (0, sampler["num_steps"] - 1)})
    assert objective.sampler_problems(ok, kl) == []
    assert objective.sampler_problems(Sampler(sde_type="sde", **sampler), kl) == []
    off = KLSettings().resolved(FlowGRPO.default_kl_coef)
    assert FlowGRPO().sampler_problems(Sampler(sde_type="cps", **sampler), off) == []
    assert (
        GRPOGuardRatioNorm().sampler_problems(Sampler(sde_type="cps", **sampler), KLSettings(coef=0.1)) != []
    )


def test_cps_kl_on_the_last_step_stops_the_module_before_loading(tiny_sd3_path: str) -> None:
    from lit_flowgrpo import FlowGRPOModule, Sampler
    from lit_flowgrpo.errors import SettingsError
    from lit_flowgrpo.policies import SD3Policy

    with pytest.raises(SettingsError, match=r"sde_type=cps with the KL to the reference"):
        FlowGRPOModule(
            policy=SD3Policy(tiny_sd3_path),
            reward=lambda images, prompts, metadata: images.mean(dim=(1, 2, 3)),
            objective=FlowGRPO(),
            kl=KLSettings(coef=0.04),
            sampler=Sampler(height=32, width=32, sde_type="cps", sde_window_size=2, num_steps=4),
        )
