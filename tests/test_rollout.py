"""lit_flowgrpo/rollout.py: Sampler.plan, the records, Trajectory.score, with a stand-in velocity."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from lit_flowgrpo.rollout import Sampler, cfg_forwards, sample_trajectory


class Field:
    """A policy stand-in: a fixed, sample-dependent velocity field (no network)."""

    uses_cfg_batch = True

    def velocity(self, x: Tensor, sigma: Tensor, embeds: dict, guidance: float) -> Tensor:
        return torch.tanh(x * embeds["scale"].view(-1, 1, 1)) + sigma.view(-1, 1, 1)


def draw(record=("transitions",), steps=(0, 1, 2)) -> tuple:
    gens = [torch.Generator().manual_seed(s) for s in range(4)]
    noise = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(9))
    embeds = {"scale": torch.linspace(0.5, 2.0, 4)}
    traj = sample_trajectory(
        Field(),
        embeds,
        noise,
        torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]),
        guidance_scale=1.0,
        noise_level=0.7,
        sde_type="sde",
        sde_steps=[0, 1, 2, 3],
        train_steps=list(steps),
        generators=gens,
        record=record,
    )
    return traj, embeds


def test_score_reproduces_the_recorded_log_probs_bit_for_bit() -> None:
    traj, embeds = draw(record=("transitions", "means"))
    field = Field()
    for j in range(traj.num_trained):
        idx = torch.tensor([3, 1])  # another batch composition than the rollout's
        x = traj.latents[idx, j]
        sigma = torch.full((2,), float(traj.sigmas[j]))
        step = traj.score(field.velocity(x, sigma, {"scale": embeds["scale"][idx]}, 1.0), j, idx)
        assert torch.equal(step.log_prob, traj.log_probs[idx, j])
        assert torch.equal(step.prev_sample, traj.next_latents[idx, j])  # scored, not drawn
        assert torch.equal(step.prev_sample_mean, traj.prev_sample_means[idx, j])


def test_score_follows_the_velocity_it_is_given() -> None:
    traj, embeds = draw()
    idx = torch.arange(4)
    x = traj.latents[idx, 0]
    v = Field().velocity(x, torch.full((4,), float(traj.sigmas[0])), embeds, 1.0)
    other = traj.score(v + 0.5, 0, idx)
    assert torch.equal(other.prev_sample, traj.next_latents[:, 0])  # the same recorded transition
    assert not torch.isclose(other.log_prob, traj.log_probs[:, 0]).any()  # under another mean


def test_records_choose_what_is_kept() -> None:
    traj, _ = draw(record=("transitions",))
    assert traj.prev_sample_means is None and traj.latents.shape[:2] == (4, 3)
    traj, _ = draw(record=("transitions", "means"))
    assert traj.prev_sample_means.shape == traj.latents.shape
    traj, _ = draw(record=())  # only the final sample (an objective that trains on x0)
    assert traj.num_trained == 0 and traj.final.shape == (4, 2, 3)
    with pytest.raises(ValueError, match="unknown rollout records"):
        draw(record=("velocities",))


def test_plan_trains_a_fraction_or_a_window() -> None:
    assert Sampler(num_steps=10, timestep_fraction=0.99).plan(0, 0) == (list(range(10)), list(range(9)))
    sampler = Sampler(num_steps=10, sde_window_size=2, sde_window_range=(2, 8))
    windows = {tuple(sampler.plan(step, seed=1)[1]) for step in range(30)}
    assert all(len(w) == 2 and 2 <= w[0] <= 6 and w[1] == w[0] + 1 for w in windows)
    assert len(windows) > 1  # drawn per rollout
    assert sampler.plan(5, seed=1) == sampler.plan(5, seed=1)  # from (seed, step)


def test_cfg_forwards_counts_the_batched_halves() -> None:
    assert cfg_forwards(Field(), 4.5) == 2
    assert cfg_forwards(Field(), 1.0) == 1
