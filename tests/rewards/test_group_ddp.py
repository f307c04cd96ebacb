"""Group rewards on 2 CPU processes (gloo) train the tiny pipeline as one process does, with groups that
span both ranks: a pairwise win rate (the images of a group gathered on the rank that judges it) and a
rank within the group (only the base scores gathered)."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import torch
from test_ddp import (
    GRADIENT_TERMS,
    SIZE,
    STEPS,
    RecordingModule,
    assert_rewards_and_advantages_close,
    collect,
    fit_two_steps,
)
from tolerances import EPS32

from lit_flowgrpo import FlowGRPO, LoraSettings, PromptDataModule, Sampler, UpdateSettings, WeightsSettings
from lit_flowgrpo.policies import SD3Policy
from lit_flowgrpo.rewards import MultiReward, register_reward

GROUP = 4


@register_reward("brightness_for_group_tests")
class Brightness:
    """The mean pixel: a per-sample score for the judge and the rank to compare."""

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        return images.mean(dim=(1, 2, 3))


def run(path: str, prompts: str, out: Path, devices: int) -> None:
    out.mkdir()
    reward = MultiReward(
        {"pairwise_win_rate": 1.0, "group_rank": 0.5},
        config={
            "pairwise_win_rate": {
                "judge": "reward",
                "judge_config": {"reward": "brightness_for_group_tests"},
            },
            "group_rank": {"reward": "brightness_for_group_tests"},
        },
    )
    module = RecordingModule(
        out=str(out),
        policy=SD3Policy(path, dtype="float32", max_sequence_length=16),
        reward=reward,
        objective=FlowGRPO(clip_range=1e-2),
        sampler=Sampler(num_steps=STEPS, eval_num_steps=2, height=SIZE, width=SIZE, guidance_scale=4.5),
        update=UpdateSettings(micro_batch_size=2, optimizer_steps_per_rollout=1),
        weights=WeightsSettings(lora=LoraSettings(rank=2, alpha=4)),
        # SGD, as tests/test_ddp.py: the weights move by lr × gradient
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
    )
    data = PromptDataModule(train=prompts, prompts_per_step=2, group_size=GROUP, seed=5)
    fit_two_steps(module, data, devices)


@pytest.mark.slow
def test_group_rewards_under_ddp_equal_single_process(tiny_sd3_path, prompt_file, tmp_path):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    run(tiny_sd3_path, prompt_file, tmp_path / "single", devices=1)
    run(tiny_sd3_path, prompt_file, tmp_path / "ddp", devices=2)
    single, ddp = collect(tmp_path / "single"), collect(tmp_path / "ddp")
    assert sorted(single) == sorted(ddp) == [0, 1]
    spans = 0
    for step in single:
        assert sorted(single[step]) == sorted(ddp[step]) == list(range(8))
        # Which rank held each sample: a group (sample id // GROUP) with members on both ranks spans them.
        rank0 = {row[0] for row in json.loads((tmp_path / "ddp" / f"adv_rank0_step{step}.json").read_text())}
        groups0 = {s // GROUP for s in rank0}
        groups1 = {s // GROUP for s in set(range(8)) - rank0}
        spans += len(groups0 & groups1)
        # Win rates are k/6 and mean ranks k/8 (halves for ties): discrete values, from brightness
        # differences far above the 1e-4 by which the two runs' images differ (tests/test_ddp.py), so the
        # rewards agree exactly; the advantages then to their rounding.
        totals = [r for r, _ in single[step].values()]  # 1·k/6 + 0.5·k'/8: multiples of 1/48, in fp32
        assert all(abs(v * 48 - round(v * 48)) < 1e-4 for v in totals), totals
        assert_rewards_and_advantages_close(single[step], ddp[step], reward_atol=0.0)
    assert spans, "the seed should deal some group over both ranks"
    init = torch.load(tmp_path / "single" / "lora_init.pt")
    a = torch.load(tmp_path / "single" / "lora.pt")
    b = torch.load(tmp_path / "ddp" / "lora.pt")
    # As tests/test_ddp.py: SGD moves the weights by lr × Σ A_i ∇ℓ_i; summed in another order, an element
    # of n terms moves by n·eps of the step; equal advantages add nothing more.
    moved = max(float((a[k] - init[k]).abs().max()) for k in a)
    atol = moved * GRADIENT_TERMS * EPS32
    assert moved > 0
    assert all(torch.allclose(b[k], v, rtol=2 * EPS32, atol=atol) for k, v in a.items())
    assert not all(
        torch.allclose(init[k] + (a[k] - init[k]) / 2, v, rtol=2 * EPS32, atol=atol) for k, v in a.items()
    )
