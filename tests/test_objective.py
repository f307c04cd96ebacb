"""lit_flowgrpo/objective.py: objectives as dataclasses, what they declare, their settings and problems."""

from __future__ import annotations

import dataclasses

import pytest
import torch

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
        "kl_coef": 0.0,
        "kl_with_dt": False,
    }
    assert GRPOGuard().clip_range == 2e-6  # a subclass changes a default in one line
    assert GRPOGuard(1e-5).clip_range == 1e-5  # positional order unchanged
    assert [f.name for f in dataclasses.fields(GRPOGuardRatioNorm)][-1] == "target_std"
    assert repr(FlowGRPO(kl_coef=0.5)).startswith("FlowGRPO(clip_range=0.0001, clip_range_high=None")


def test_hparams_round_trip_through_the_class_path() -> None:
    objective = GRPOGuardRatioNorm(clip_range=1e-3, target_std=1e-4, kl_coef=0.1)
    saved = objective.hparams()
    assert saved["class_path"] == "lit_flowgrpo.objective.GRPOGuardRatioNorm"
    module, _, name = saved["class_path"].rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    assert cls(**saved["init_args"]) == objective
    # An older checkpoint's init_args (the same keys, written by hand then) build the same objective.
    old = {
        "clip_range": 2e-6,
        "clip_range_high": None,
        "adv_clip_max": 5.0,
        "kl_coef": 0.0,
        "kl_with_dt": False,
    }
    assert GRPOGuard(**old) == GRPOGuard()


def test_declarations() -> None:
    assert FlowGRPO.records == ("transitions",) and FlowGRPO.sde_types == ()
    assert GRPOGuard.records == ("transitions", "means") and GRPOGuard.sde_types == ("sde",)
    assert GRPOGuardRatioNorm.records == ("transitions",)
    assert all(issubclass(c, RatioObjective) for c in (FlowGRPO, GRPOGuard, GRPOGuardRatioNorm))
    assert not FlowGRPO().uses_reference and FlowGRPO(kl_coef=0.1).uses_reference
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
        (FlowGRPO(kl_coef=-1.0), "--model.init_args.objective.init_args.kl_coef (-1.0) must be >= 0"),
        (
            GRPOGuardRatioNorm(target_std=0.5),
            "--model.init_args.objective.init_args.target_std (0.5) must lie in (0, 0.1)",
        ),
    ],
)
def test_problems_name_the_flag_the_cli_accepts(objective, message) -> None:
    assert any(p.startswith(message) for p in objective.problems("sde")), objective.problems("sde")


def test_clip_range_has_one_rule_for_the_objective_and_the_metric() -> None:
    with pytest.raises(ValueError, match=r"clip_range_high \(inf\) must be a finite number > 0"):
        PolicyRatioStats(clip_range=0.1, clip_range_high=float("inf"))


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
        "adv_clip_max": 5.0,
        "kl_coef": 0.0,
        "kl_with_dt": False,
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
