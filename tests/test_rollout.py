"""lit_flowgrpo/rollout.py: Sampler.plan, the records, Trajectory.score, with a stand-in velocity."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from lit_flowgrpo.rollout import Sampler, cfg_forwards, sample_trajectory


class Field:
    """A policy stand-in: a fixed, sample-dependent velocity field (no network)."""

    uses_cfg_batch = True
    modality = "image"

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


class Pixels:
    """A policy stand-in for Sampler.rollout and evaluate: latents are (3, h/4, w/4), decoded by
    repetition, and the only parameter is there to say the device."""

    uses_cfg_batch = True
    modality = "image"

    image_size_multiple, image_size_reason = 4, ""

    def __init__(self) -> None:
        self.transformer = torch.nn.Linear(1, 1)
        self.trainable_networks = (self.transformer,)

    def velocity(self, x: Tensor, sigma: Tensor, embeds: dict, guidance: float) -> Tensor:
        return torch.tanh(x * embeds["scale"].view(-1, 1, 1, 1)) + sigma.view(-1, 1, 1, 1)

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        return (3, height // 4, width // 4)

    def sigmas(self, num_steps: int, height: int, width: int) -> Tensor:
        return torch.linspace(1.0, 0.0, num_steps + 1)

    def encode_prompts(self, prompts: list[str]) -> dict:
        return {"scale": torch.linspace(0.5, 2.0, len(prompts))}

    def encode(self, prompts: list[str], conditions=None, height=0, width=0, frames=1) -> dict:
        assert conditions is None  # a text-only family (FlowPolicy.encode)
        return self.encode_prompts(prompts)

    def decode_conditioned(self, latents: Tensor, embeds: dict) -> Tensor:
        return self.decode(latents)  # as FlowPolicy's: the latents alone

    def decode(self, latents: Tensor) -> Tensor:
        return latents.repeat_interleave(4, dim=-1).repeat_interleave(4, dim=-2).sigmoid()

    def image_size_problems(self, height, width, flags=("h", "w")):
        from lit_flowgrpo.policies.base import FlowPolicy

        return FlowPolicy.image_size_problems(self, height, width, flags)

    def frame_problems(self, frames: int, flag: str) -> list[str]:
        from lit_flowgrpo.policies.base import FlowPolicy

        return FlowPolicy.frame_problems(self, frames, flag)  # as an image family: one frame


def test_initial_seeds_share_the_start_and_nothing_else() -> None:
    sampler = Sampler(num_steps=3, timestep_fraction=1.0, height=8, width=8, batch_size=3)
    seeds = torch.tensor([11, 12, 13, 14, 15, 16])
    starts = torch.tensor([5, 5, 5, 9, 9, 9])  # two groups of three
    embeds = {"scale": torch.ones(6)}  # one prompt: only the noise tells the samples apart
    traj, images = sampler.rollout(Pixels(), embeds, seeds, step=0, seed=0, initial_seeds=starts)
    x_t = traj.latents[:, 0]  # step 0 is trained: the recorded x at σ = 1 is the initial noise
    assert torch.equal(x_t[0], x_t[1]) and torch.equal(x_t[0], x_t[2]) and torch.equal(x_t[3], x_t[5])
    assert not torch.equal(x_t[0], x_t[3])
    # The stochastic steps draw each sample's own noise: the samples of a group part at the first step.
    assert all(not torch.equal(traj.next_latents[i, 0], traj.next_latents[i + 1, 0]) for i in (0, 3))
    # The start is the one a sample seeded with its group's seed draws; without initial seeds, as before.
    alone, _ = sampler.rollout(Pixels(), embeds, starts, step=0, seed=0)
    assert torch.equal(x_t, alone.latents[:, 0])
    before, _ = sampler.rollout(Pixels(), embeds, seeds, step=0, seed=0)
    assert all(not torch.equal(before.latents[i, 0], before.latents[i + 1, 0]) for i in range(5))
    # The chunking (batch_size) does not change which start a sample gets.
    whole, _ = Sampler(num_steps=3, timestep_fraction=1.0, height=8, width=8).rollout(
        Pixels(), embeds, seeds, step=0, seed=0, initial_seeds=starts
    )
    assert torch.equal(whole.latents, traj.latents) and images.shape == (6, 3, 8, 8)


def test_validation_samples_at_its_own_size() -> None:
    sampler = Sampler(num_steps=2, eval_num_steps=2, height=8, width=8, eval_height=12, eval_width=16)
    assert sampler.eval_size == (12, 16)
    images = sampler.evaluate(Pixels(), ["a", "b"], torch.tensor([1, 2]))
    assert images.shape == (2, 3, 12, 16)
    _, rollout = sampler.rollout(Pixels(), {"scale": torch.ones(2)}, torch.tensor([1, 2]), step=0, seed=0)
    assert rollout.shape == (2, 3, 8, 8)
    assert Sampler(height=8, width=12, eval_width=16).eval_size == (8, 16)  # null: the rollout's


def test_eval_sizes_are_checked_against_the_policy_under_their_own_flags() -> None:
    flag = "--model.init_args.sampler"
    assert Sampler(height=8, width=8, eval_height=12).image_size_problems(Pixels()) == []
    (problem,) = Sampler(height=8, width=8, eval_height=10).image_size_problems(Pixels())
    assert problem.startswith(f"{flag}.eval_height (10) must be a positive multiple of 4")
    # A bad rollout size is named once, under its own flag, even where eval sizes default to it.
    problems = Sampler(height=10, width=8, eval_width=6).image_size_problems(Pixels())
    assert [p.split(" ")[0] for p in problems] == ["h", f"{flag}.eval_width"]
    assert Sampler(eval_height=0).problems() == [
        f"{flag}.eval_height (0) must be at least 1, or null to use height"
    ]


class VideoField:
    """A stand-in video policy: (B, C, F, h, w) latents, a fixed sample-dependent field."""

    uses_cfg_batch = True
    modality = "image"

    def velocity(self, x: Tensor, sigma: Tensor, embeds: dict, guidance: float) -> Tensor:
        return torch.tanh(x * embeds["scale"].view(-1, 1, 1, 1, 1)) + sigma.view(-1, 1, 1, 1, 1)


@pytest.mark.parametrize("record_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_video_records_re_score_on_policy_in_either_storage_dtype(record_dtype: torch.dtype) -> None:
    """The on-policy ratio of 5-D (video) latents: exact with fp32 records; with bf16 records the chain
    continues from the stored values and the log-prob is that of the stored x_next, so it stays exact
    (the check the update makes tolerates 1e-3)."""
    gens = [torch.Generator().manual_seed(s) for s in range(3)]
    noise = torch.randn(3, 4, 2, 3, 5, generator=torch.Generator().manual_seed(9))
    embeds = {"scale": torch.tensor([0.5, 1.0, 2.0])}
    field = VideoField()
    traj = sample_trajectory(
        field,
        embeds,
        noise,
        torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]),
        guidance_scale=1.0,
        noise_level=0.7,
        sde_type="sde",
        sde_steps=[0, 1, 2, 3],
        train_steps=[0, 1, 2],
        generators=gens,
        record=("transitions", "means"),
        record_dtype=record_dtype,
    )
    assert traj.latents.dtype == traj.next_latents.dtype == record_dtype
    assert traj.prev_sample_means.dtype == torch.float32  # μ_old is never rounded (Sampler.record_dtype)
    assert traj.latents.shape == (3, 3, 4, 2, 3, 5) and traj.log_probs.shape == (3, 3)
    assert traj.final.dtype == traj.log_probs.dtype == torch.float32
    # Each trained step starts where the previous one's record ends (the chain runs on stored values).
    assert torch.equal(traj.latents[:, 1:], traj.next_latents[:, :-1])
    for j in range(traj.num_trained):
        idx = torch.tensor([2, 0])
        x = traj.latents[idx, j].float()
        sigma = torch.full((2,), float(traj.sigmas[j]))
        step = traj.score(field.velocity(x, sigma, {"scale": embeds["scale"][idx]}, 1.0), j, idx)
        ratio = torch.exp(step.log_prob - traj.log_probs[idx, j])
        assert (ratio - 1).abs().max() <= (0 if record_dtype == torch.float32 else 1e-3)
        assert torch.equal(step.log_prob, traj.log_probs[idx, j])
    # The log-prob is a mean over every non-batch element (Flow-GRPO's unit), 5-D as 3-D.
    mean_of_elements = traj.log_probs.abs().max()
    assert mean_of_elements < 10  # a sum over the 120 elements of a sample would be ~100x larger


def test_record_dtype_and_frames_are_checked() -> None:
    problems = Sampler(record_dtype="float16", frames=0).problems()
    assert any(p.startswith("--model.init_args.sampler.frames (0) must be at least 1") for p in problems)
    assert any(
        p.startswith("--model.init_args.sampler.record_dtype ('float16') must be one of") for p in problems
    )
