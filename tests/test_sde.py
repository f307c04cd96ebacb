"""Schedules and the SDE / CPS / Dance step against diffusers and closed-form references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from diffusers.pipelines.flux.pipeline_flux import calculate_shift as diffusers_calculate_shift
from torch.distributions import Normal

from lit_flowgrpo.sde import calculate_shift, flux_sigmas, sd3_sigmas, sde_step_with_logprob

SDE_TYPES = ("sde", "cps", "dance")


# ----------------------------------------------------------------------------------------------
# Schedules: the numbers the real diffusers pipelines sample with
# ----------------------------------------------------------------------------------------------


def _run_tiny_pipeline(pipe, height: int, width: int, num_steps: int) -> torch.Tensor:
    pipe.set_progress_bar_config(disable=True)
    pipe(
        prompt_embeds=torch.zeros(1, 3, 8),
        pooled_prompt_embeds=torch.zeros(1, 8),
        height=height,
        width=width,
        num_inference_steps=num_steps,
        guidance_scale=1.0,
        output_type="latent",
    )
    return pipe.scheduler.sigmas


@pytest.mark.parametrize("num_steps", [5, 10])
def test_sd3_sigmas_equal_stable_diffusion_3_pipeline(num_steps: int) -> None:
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=8,
        patch_size=1,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        attention_head_dim=4,
        num_attention_heads=2,
        joint_attention_dim=8,
        caption_projection_dim=8,
        pooled_projection_dim=8,
    )
    pipe = StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),  # SD3.5's scheduler config
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        text_encoder_3=None,
        tokenizer_3=None,
        transformer=transformer,
    )
    expected = _run_tiny_pipeline(pipe, 32, 32, num_steps)
    got = sd3_sigmas(num_steps, shift=3.0)
    assert got.dtype == torch.float32 and got.shape == (num_steps + 1,)
    assert torch.equal(got, expected)
    # Independent closed form: linspace from 1 to the shifted smallest training sigma, shifted again.
    shift = lambda s: 3.0 * s / (1 + 2.0 * s)  # noqa: E731
    ref = shift(np.linspace(1.0, shift(1 / 1000), num_steps))
    np.testing.assert_allclose(got[:-1].numpy(), ref, rtol=1e-6)
    assert got[-1] == 0


@pytest.mark.parametrize(("height", "width"), [(64, 64), (128, 96)])
def test_flux_sigmas_equal_flux_pipeline(height: int, width: int) -> None:
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=4,
        num_attention_heads=2,
        joint_attention_dim=8,
        pooled_projection_dim=8,
        axes_dims_rope=[0, 2, 2],
    )
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.1-dev's scheduler config
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        scheduler=scheduler,
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=transformer,
    )
    num_steps = 6
    expected = _run_tiny_pipeline(pipe, height, width, num_steps)
    seq_len = (height // 16) * (width // 16)  # 8x VAE, 2x2 packing
    got = flux_sigmas(num_steps, seq_len)
    assert torch.equal(got, expected)
    # Independent closed form of the exponential time shift.
    mu = 0.5 + (1.15 - 0.5) * (seq_len - 256) / (4096 - 256)
    t = np.linspace(1.0, 1 / num_steps, num_steps)
    np.testing.assert_allclose(got[:-1].numpy(), np.exp(mu) / (np.exp(mu) + (1 / t - 1)), rtol=1e-6)


@pytest.mark.parametrize("seq_len", [16, 256, 1024, 4096, 6000])
def test_calculate_shift_equals_diffusers(seq_len: int) -> None:
    assert calculate_shift(seq_len) == pytest.approx(diffusers_calculate_shift(seq_len), abs=1e-12)
    assert calculate_shift(seq_len, 256, 8192, 0.3, 0.9) == pytest.approx(
        diffusers_calculate_shift(seq_len, 256, 8192, 0.3, 0.9), abs=1e-12
    )


def test_schedule_bad_input() -> None:
    with pytest.raises(ValueError, match="num_steps"):
        sd3_sigmas(0)
    with pytest.raises(ValueError, match="shift"):
        sd3_sigmas(4, shift=0.0)
    with pytest.raises(ValueError, match="num_steps"):
        flux_sigmas(2.5, 16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="image_seq_len"):
        flux_sigmas(4, 0)


# ----------------------------------------------------------------------------------------------
# noise_level = 0 is diffusers' Euler step, bit for bit
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sde_type", SDE_TYPES)
def test_noise_level_zero_equals_diffusers_euler_step(sde_type: str) -> None:
    num_steps = 6
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(num_steps)
    sigmas = sd3_sigmas(num_steps)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 8, 8, generator=gen)
    ours = x.clone()
    for i, t in enumerate(scheduler.timesteps):
        v = torch.randn(x.shape, generator=gen)
        x = scheduler.step(v, t, x).prev_sample
        per_sample = torch.full((3,), float(sigmas[i]))
        step = sde_step_with_logprob(
            v, ours, float(sigmas[i]), float(sigmas[i + 1]), noise_level=0.0, sde_type=sde_type
        )
        step_b = sde_step_with_logprob(
            v, ours, per_sample, torch.full((3,), float(sigmas[i + 1])), noise_level=0.0, sde_type=sde_type
        )
        assert torch.equal(step.prev_sample, x)
        assert torch.equal(step_b.prev_sample, x)
        assert torch.equal(step.prev_sample_mean, x)
        assert torch.equal(step.log_prob, torch.zeros(3))  # a Dirac step: defined as 0, never NaN
        assert torch.equal(step.std_dev_t, torch.zeros(3))
        ours = step.prev_sample


# ----------------------------------------------------------------------------------------------
# Log-probabilities against closed-form Gaussians (float64 references written out here)
# ----------------------------------------------------------------------------------------------


def _reference(sde_type, v, x, sigma, sigma_next, eta, sigma_max):
    """Mean (float64) and per-element transition std of each step type, from the formulas."""
    v, x = v.double(), x.double()
    s = torch.as_tensor(sigma, dtype=torch.float64).reshape(-1, *([1] * (x.ndim - 1)))
    sn = torch.as_tensor(sigma_next, dtype=torch.float64).reshape(-1, *([1] * (x.ndim - 1)))
    dt = sn - s
    if sde_type == "sde":
        denom = torch.where(s == 1, torch.full_like(s, sigma_max), s)
        std = eta * torch.sqrt(s / (1 - denom))
        mean = x * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt
        return mean, std * torch.sqrt(-dt)
    if sde_type == "cps":
        std = sn * math.sin(eta * math.pi / 2)
        mean = (1 - sn) * (x - s * v) + torch.sqrt(sn**2 - std**2) * (x + (1 - s) * v)
        return mean, std
    # DanceGRPO: Euler + ½η²·(x + (1−σ)v)/σ·dt (the score correction written out), std η√(σ−σ_next)
    mean = x + dt * v + 0.5 * eta**2 * (x + (1 - s) * v) / s * dt
    return mean, eta * torch.sqrt(-dt)


def _ref_log_prob(sde_type, x_next, mean, scale):
    dims = tuple(range(1, x_next.ndim))
    if sde_type == "sde":
        return Normal(mean, scale.expand_as(mean)).log_prob(x_next.double()).mean(dims)
    if sde_type == "cps":
        return -((x_next.double() - mean) ** 2).mean(dims)
    return (-((x_next.double() - mean) ** 2) / (2 * scale**2)).mean(dims)


@pytest.mark.parametrize("sde_type", SDE_TYPES)
@pytest.mark.parametrize("given", [False, True])
def test_log_prob_matches_closed_form_gaussian(sde_type: str, given: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    v = torch.randn(4, 3, 5, 5, generator=gen)
    x = torch.randn(4, 3, 5, 5, generator=gen)
    sigma = torch.tensor([1.0, 0.8, 0.5, 0.2])  # per sample, σ == 1 included
    sigma_next = torch.tensor([0.95, 0.7, 0.3, 0.05])
    prev = torch.randn(4, 3, 5, 5, generator=gen) if given else None
    step = sde_step_with_logprob(
        v, x, sigma, sigma_next, noise_level=0.7, sde_type=sde_type, prev_sample=prev, sigma_max=0.95
    )
    mean, scale = _reference(sde_type, v, x, sigma, sigma_next, 0.7, 0.95)
    if given:
        assert torch.equal(step.prev_sample, prev)
    torch.testing.assert_close(step.prev_sample_mean.double(), mean, rtol=1e-5, atol=1e-5)
    expected = _ref_log_prob(sde_type, step.prev_sample, mean, scale)
    torch.testing.assert_close(step.log_prob.double(), expected, rtol=1e-4, atol=1e-4)
    product = (step.std_dev_t * step.sqrt_dt).double()
    torch.testing.assert_close(product, scale.reshape(-1).expand(4), rtol=1e-6, atol=1e-7)
    assert step.log_prob.shape == (4,) and step.std_dev_t.shape == (4,) and step.sqrt_dt.shape == (4,)


def test_sigma_max_default_is_sigma_next_at_sigma_one() -> None:
    gen = torch.Generator().manual_seed(3)
    v, x = torch.randn(2, 6, generator=gen), torch.randn(2, 6, generator=gen)
    a = sde_step_with_logprob(v, x, 1.0, 0.9, generator=torch.Generator().manual_seed(0))
    b = sde_step_with_logprob(v, x, 1.0, 0.9, sigma_max=0.9, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.prev_sample, b.prev_sample) and torch.isfinite(a.log_prob).all()
    assert a.std_dev_t[0].item() == pytest.approx(0.7 * math.sqrt(1 / (1 - 0.9)), rel=1e-6)


@pytest.mark.parametrize("sde_type", SDE_TYPES)
def test_draws_have_the_stated_mean_and_std(sde_type: str) -> None:
    gen = torch.Generator().manual_seed(4)
    n = 40_000
    v = torch.randn(2, n, generator=gen)
    x = torch.randn(2, n, generator=gen)
    sigma, sigma_next = torch.tensor([0.9, 0.4]), torch.tensor([0.7, 0.3])
    step = sde_step_with_logprob(v, x, sigma, sigma_next, noise_level=0.9, sde_type=sde_type, generator=gen)
    z = (step.prev_sample - step.prev_sample_mean) / (step.std_dev_t * step.sqrt_dt)[:, None]
    # Standard errors: mean 1/√n ≈ 0.005, std ≈ 1/√(2n) ≈ 0.0035; 5 standard errors of slack.
    assert z.mean(dim=1).abs().max() < 5 / math.sqrt(n)
    assert (z.std(dim=1) - 1).abs().max() < 5 / math.sqrt(2 * n)


@pytest.mark.parametrize("sde_type", SDE_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_policy_ratio_is_exactly_one(sde_type: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    v = torch.randn(3, 4, 4, 4, generator=gen).to(dtype)
    x = torch.randn(3, 4, 4, 4, generator=gen).to(dtype)
    rollout = sde_step_with_logprob(v, x, 0.6, 0.5, sde_type=sde_type, generator=gen)
    again = sde_step_with_logprob(v, x, 0.6, 0.5, sde_type=sde_type, prev_sample=rollout.prev_sample)
    for t in rollout:
        assert t.dtype == torch.float32
    ratio = torch.exp(again.log_prob - rollout.log_prob)
    assert torch.equal(ratio, torch.ones(3))


def test_per_sample_generators_make_each_row_independent_of_the_batch() -> None:
    v = torch.randn(3, 2, 4, 4)
    x = torch.randn(3, 2, 4, 4)
    gens = [torch.Generator().manual_seed(s) for s in (10, 11, 12)]
    batch = sde_step_with_logprob(v, x, 0.8, 0.6, generator=gens)
    alone = sde_step_with_logprob(v[1:2], x[1:2], 0.8, 0.6, generator=[torch.Generator().manual_seed(11)])
    assert torch.equal(batch.prev_sample[1:2], alone.prev_sample)
    assert not torch.equal(batch.prev_sample[0], batch.prev_sample[1])


def test_velocity_gradient_flows_through_the_mean() -> None:
    v = torch.randn(2, 8, requires_grad=True)
    x = torch.randn(2, 8)
    step = sde_step_with_logprob(v, x, 0.7, 0.6, generator=torch.Generator().manual_seed(0))
    step.log_prob.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"velocity": torch.zeros(2, 3)}, "velocity"),
        ({"prev_sample": torch.zeros(2, 5)}, "prev_sample"),
        ({"sigma": torch.tensor([0.5, 0.5, 0.5])}, "sigma"),
        ({"sigma_next": torch.zeros(2, 1)}, "sigma_next"),
        ({"sigma": 1.5}, "sigma"),
        ({"sigma": -0.1, "sigma_next": -0.2}, "sigma"),
        ({"sigma_next": -0.1}, "sigma_next"),
        ({"sigma": 0.5, "sigma_next": 0.5}, "sigma_next .* smaller than sigma"),
        ({"sigma": torch.tensor([0.5, 0.4]), "sigma_next": torch.tensor([0.3, 0.45])}, "smaller than sigma"),
        ({"sde_type": "ode"}, "sde_type"),
        ({"noise_level": -0.1}, "noise_level"),
        ({"noise_level": float("nan")}, "noise_level"),
        ({"sigma_max": 1.0}, "sigma_max"),
        ({"generator": [torch.Generator()]}, "generator"),
    ],
)
def test_step_bad_input(kwargs: dict, match: str) -> None:
    args = {"velocity": torch.zeros(2, 4), "sample": torch.zeros(2, 4), "sigma": 0.5, "sigma_next": 0.4}
    args.update(kwargs)
    velocity, sample, sigma, sigma_next = (args.pop(k) for k in ("velocity", "sample", "sigma", "sigma_next"))
    with pytest.raises(ValueError, match=match):
        sde_step_with_logprob(velocity, sample, sigma, sigma_next, **args)


def test_cps_noise_level_above_one_is_refused() -> None:
    """CPS's noise is σ_next·sin(η·π/2): largest at η = 1, shrinking again above it, gone at η = 2."""
    from lit_flowgrpo.rollout import Sampler

    (problem,) = Sampler(sde_type="cps", noise_level=2.0).problems()
    assert problem.startswith(
        "--model.init_args.sampler.noise_level (2.0) must be at most 1 with --model.init_args.sampler.sde_type=cps"
    )
    assert Sampler(sde_type="cps", noise_level=1.0).problems() == []
    assert Sampler(sde_type="sde", noise_level=2.0).problems() == []  # Flow-GRPO's η has no such bound
    x, v = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    low = sde_step_with_logprob(v, x, 0.5, 0.25, noise_level=0.5, sde_type="cps").std_dev_t
    high = sde_step_with_logprob(v, x, 0.5, 0.25, noise_level=1.5, sde_type="cps").std_dev_t
    torch.testing.assert_close(low, high)  # η and 2 − η draw the same noise
