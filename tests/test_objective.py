"""lit_flowgrpo/objective.py: objectives as dataclasses, what they declare, their settings and problems."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lit_flowgrpo.metrics import DiagnosticsSettings, PolicyRatioStats
from lit_flowgrpo.objective import FlowGRPO, GRPOGuard, GRPOGuardRatioNorm, RatioObjective, build_objective


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
