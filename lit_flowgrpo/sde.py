"""Sigma schedules and one stochastic denoising step with its log-probability (pure functions).

Conventions (DESIGN.md): x_σ = (1−σ)·x0 + σ·ε, velocity v = ε − x0, σ runs from 1 to 0, and a
step goes from σ to σ_next < σ with dt = σ_next − σ < 0.

Every step type here is a Gaussian transition x_next ~ N(μ, (std_dev_t·sqrt_dt)²) per element, so
``std_dev_t * sqrt_dt`` is always the transition standard deviation:

- ``"sde"``  Flow-GRPO's reverse SDE (Liu et al. 2025, "Flow-GRPO", arXiv:2505.05470, ODE-to-SDE conversion;
  reference code ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``, ``sde_type == "sde"``);
- ``"cps"``  coefficients-preserving sampling (Wang et al. 2025, arXiv:2509.05952; the same
  reference file, ``sde_type == "cps"``); ``std_dev_t`` is the transition std and ``sqrt_dt`` is 1;
- ``"dance"`` DanceGRPO's step (Xue et al. 2025; ``flux_step(..., sde_solver=True)`` in
  DanceGRPO's ``fastvideo/train_grpo_flux.py``); ``std_dev_t`` is η and ``sqrt_dt`` is √(σ−σ_next).

The log-probability is the **mean** over all non-batch elements (Flow-GRPO's unit).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.utils.torch_utils import randn_tensor
from torch import Tensor

SDEType = Literal["sde", "cps", "dance"]
_SDE_TYPES = ("sde", "cps", "dance")

__all__ = [
    "SDEStep",
    "SDEType",
    "calculate_shift",
    "flux_sigmas",
    "sd3_sigmas",
    "sde_step_with_logprob",
]


# --------------------------------------------------------------------------------------------------
# Schedules
# --------------------------------------------------------------------------------------------------


def sd3_sigmas(num_steps: int, shift: float = 3.0) -> Tensor:
    """The sigmas ``StableDiffusion3Pipeline`` samples with, terminal 0 included.

    The pipeline calls ``FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(num_steps)``
    without custom sigmas. That spaces the timesteps linearly from the scheduler's largest to its
    smallest *already shifted* training sigma (1 and s·0.001/(1+(s−1)·0.001)), divides by 1000 and
    applies the static shift σ' = s·σ/(1+(s−1)·σ) once more. The schedule therefore does not end
    at shift(1/num_steps); reusing the scheduler keeps every bit identical to the pipeline's.

    Args:
        num_steps: number of denoising steps (at least 1).
        shift: the static time shift (3.0 for SD3 / SD3.5).

    Returns:
        (num_steps + 1,) fp32, descending from 1.0 to 0.0.
    """
    _check_num_steps(num_steps)
    if not shift > 0:
        raise ValueError(f"shift ({shift}) must be positive: SD3/SD3.5 use 3.0")
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps)
    return scheduler.sigmas.to(torch.float32).clone()


def calculate_shift(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """FLUX's resolution-dependent shift μ, linear in the image token count.

    μ runs linearly from ``base_shift`` at ``base_seq_len`` tokens to ``max_shift`` at
    ``max_seq_len`` tokens (diffusers ``pipelines/flux/pipeline_flux.py::calculate_shift``; the
    straight line is written out here because importing the pipeline module pulls in every text
    encoder class).
    """
    if max_seq_len == base_seq_len:
        raise ValueError(f"max_seq_len ({max_seq_len}) must differ from base_seq_len ({base_seq_len})")
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    intercept = base_shift - slope * base_seq_len
    return image_seq_len * slope + intercept


def flux_sigmas(
    num_steps: int,
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
    shift_terminal: float | None = None,
) -> Tensor:
    """The sigmas ``FluxPipeline`` samples with, terminal 0 included.

    FluxPipeline passes ``sigmas = linspace(1, 1/num_steps, num_steps)`` and ``mu =
    calculate_shift(image_seq_len, ...)`` to a scheduler with ``use_dynamic_shifting=True``, which
    applies the exponential time shift σ' = e^μ / (e^μ + (1/σ − 1)). The scheduler does the work
    here, so the numbers are the pipeline's bit for bit.

    Args:
        num_steps: number of denoising steps (at least 1).
        image_seq_len: packed latent tokens per image, (H/16)·(W/16) for FLUX at 8x VAE + 2x2 packing.
        base_seq_len: scheduler config ``base_image_seq_len``.
        max_seq_len: scheduler config ``max_image_seq_len``.
        base_shift: scheduler config ``base_shift``.
        max_shift: scheduler config ``max_shift``.
        shift_terminal: scheduler config ``shift_terminal`` (Qwen-Image uses 0.02; FLUX none).

    Returns:
        (num_steps + 1,) fp32, descending, ending at 0.0.
    """
    _check_num_steps(num_steps)
    if image_seq_len < 1:
        raise ValueError(f"image_seq_len ({image_seq_len}) must be at least 1 latent token")
    mu = calculate_shift(image_seq_len, base_seq_len, max_seq_len, base_shift, max_shift)
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_shift=base_shift,
        max_shift=max_shift,
        base_image_seq_len=base_seq_len,
        max_image_seq_len=max_seq_len,
        shift_terminal=shift_terminal,
    )
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    return scheduler.sigmas.to(torch.float32).clone()


def _check_num_steps(num_steps: int) -> None:
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps ({num_steps!r}) must be a positive integer")


# --------------------------------------------------------------------------------------------------
# One step with its log-probability
# --------------------------------------------------------------------------------------------------


class SDEStep(NamedTuple):
    """One denoising transition, all fp32."""

    prev_sample: Tensor
    """x_next, the sample at σ_next (drawn, or the given ``prev_sample``); shape of ``sample``."""
    log_prob: Tensor
    """(B,) log N(x_next; μ, ...) averaged over all non-batch elements."""
    prev_sample_mean: Tensor
    """μ, the transition mean; shape of ``sample``. Differentiable w.r.t. ``velocity``."""
    std_dev_t: Tensor
    """(B,) diffusion coefficient: the transition std is ``std_dev_t * sqrt_dt``."""
    sqrt_dt: Tensor
    """(B,) √(σ − σ_next) for "sde" and "dance", 1 for "cps"."""


def sde_step_with_logprob(
    velocity: Tensor,
    sample: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    *,
    noise_level: float = 0.7,
    sde_type: SDEType = "sde",
    prev_sample: Tensor | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    sigma_max: float | None = None,
) -> SDEStep:
    """One step from σ to σ_next: draw (or score) x_next and return its Gaussian log-probability.

    All math runs in fp32 whatever the input dtype (bf16 overflows in μ, as Flow-GRPO notes).

    ``noise_level == 0`` is the deterministic Euler step ``x + dt·v``, computed exactly as
    diffusers' ``FlowMatchEulerDiscreteScheduler.step`` does in fp32 (bit for bit). A Dirac
    transition has no density, so its ``log_prob`` is defined as 0 for every sample (the ratio is 1
    and the step carries no policy gradient), ``std_dev_t`` is 0 and ``sqrt_dt`` keeps its
    definition.

    Validation: shapes are always checked. Value checks on σ (range, σ_next < σ) run on Python
    floats and on CPU tensors; tensors on an accelerator are not checked, since reading them would
    force a device synchronisation every step.

    Args:
        velocity: predicted velocity v = ε − x0, (B, ...) any float dtype.
        sample: x at σ, same shape as ``velocity``.
        sigma: current noise level, a float or a (B,) tensor (one per sample).
        sigma_next: next noise level (< ``sigma``), a float or a (B,) tensor.
        noise_level: η, the noise scale (Flow-GRPO default 0.7); 0 gives the ODE step.
        sde_type: ``"sde"`` (Flow-GRPO), ``"cps"`` (coefficients-preserving) or ``"dance"``
            (DanceGRPO).
        prev_sample: score this x_next instead of drawing one (same shape as ``sample``).
        generator: a ``torch.Generator`` or one generator per batch row; with a list, each row's
            noise depends only on its own generator, whatever else is in the batch.
        sigma_max: ``"sde"`` only: the value used in σ/(1−σ) in place of σ where σ == 1, which
            would divide by zero. ``None`` uses σ_next there, which is Flow-GRPO's choice (its
            ``sigmas[1]``) when the step from σ = 1 is the schedule's first.

    Returns:
        An :class:`SDEStep`.
    """
    if sde_type not in _SDE_TYPES:
        raise ValueError(f"sde_type ({sde_type!r}) must be one of {list(_SDE_TYPES)}")
    if not isinstance(noise_level, (int, float)) or not math.isfinite(noise_level) or noise_level < 0:
        raise ValueError(f"noise_level ({noise_level!r}) must be a finite number >= 0 (0 gives the ODE step)")
    if velocity.shape != sample.shape:
        raise ValueError(
            f"velocity {tuple(velocity.shape)} and sample {tuple(sample.shape)} must have the same shape"
        )
    if sample.ndim < 1:
        raise ValueError("sample must have a batch dimension: shape (B, ...)")
    if prev_sample is not None and prev_sample.shape != sample.shape:
        raise ValueError(
            f"prev_sample {tuple(prev_sample.shape)} must have the shape of sample {tuple(sample.shape)}"
        )
    if sigma_max is not None and not 0 < sigma_max < 1:
        raise ValueError(f"sigma_max ({sigma_max}) must lie in (0, 1): pass the schedule's second sigma")
    batch = sample.shape[0]
    if isinstance(generator, (list, tuple)) and len(generator) != batch:
        raise ValueError(f"generator is a list of {len(generator)} generators for a batch of {batch}")

    device = sample.device
    sig = _as_sigma(sigma, "sigma", batch, device)  # (B,) or () fp32
    sig_next = _as_sigma(sigma_next, "sigma_next", batch, device)
    _check_sigmas(sig, sig_next)

    x = sample.float()
    v = velocity.float()
    view = (-1,) + (1,) * (x.ndim - 1)
    s = sig.reshape(view) if sig.ndim else sig  # broadcastable against x
    s_next = sig_next.reshape(view) if sig_next.ndim else sig_next
    # dt from the fp32 sigmas, as the diffusers scheduler subtracts its fp32 schedule entries.
    dt = s_next - s  # () or (B,1,...) fp32, negative
    sqrt_dt = torch.sqrt(-dt)

    if noise_level == 0:
        # Exactly FlowMatchEulerDiscreteScheduler.step: fp32 sample + dt * model_output.
        mean = x + dt * v
        x_next = mean if prev_sample is None else prev_sample.float()
        zeros = torch.zeros(batch, device=device, dtype=torch.float32)
        root = torch.ones_like(zeros) if sde_type == "cps" else _per_sample(sqrt_dt, batch, device)
        return SDEStep(x_next, zeros, mean, zeros.clone(), root)

    if sde_type == "sde":
        # Flow-GRPO's reverse SDE (reference: sd3_sde_with_logprob.py): σ in the denominator of σ/(1−σ) is
        # replaced where σ == 1 so the first step of a schedule starting at 1 stays finite.
        replacement = s_next if sigma_max is None else torch.full_like(s, sigma_max)
        std = noise_level * torch.sqrt(s / (1 - torch.where(s == 1, replacement, s)))  # fp32
        mean = x * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt
        scale = std * sqrt_dt  # transition std
        x_next = _draw(mean, scale, prev_sample, generator)
        # Gaussian log-density with every constant (reference: same file).
        log_prob = (
            -((x_next.detach() - mean) ** 2) / (2 * scale**2) - torch.log(scale) - 0.5 * math.log(2 * math.pi)
        )
        root = sqrt_dt
    elif sde_type == "cps":
        # Coefficients-preserving sampling (arXiv:2509.05952; reference: flow_grpo
        # sd3_sde_with_logprob.py, sde_type == "cps"): std = σ_next·sin(ηπ/2), and μ re-mixes the
        # predicted x0 and x1 so that the coefficients of x0 and noise stay (1−σ_next, σ_next).
        std = s_next * math.sin(noise_level * math.pi / 2)
        x0_hat = x - s * v
        x1_hat = x + (1 - s) * v
        mean = x0_hat * (1 - s_next) + x1_hat * torch.sqrt(s_next**2 - std**2)
        x_next = _draw(mean, std, prev_sample, generator)
        # The reference drops every constant and the variance scale: log p := −(x_next − μ)².
        log_prob = -((x_next.detach() - mean) ** 2)
        root = torch.ones_like(sig)
    else:
        # DanceGRPO flux_step(sde_solver=True): Euler mean plus the score correction
        # −½η²·score·dσ with score = −(x − (1−σ)·x̂0)/σ², and std = η·√(σ − σ_next).
        x0_hat = x - s * v
        score = -(x - x0_hat * (1 - s)) / s**2
        mean = x + dt * v + (-0.5 * noise_level**2 * score) * dt
        std = torch.full_like(sig, noise_level)
        scale = noise_level * sqrt_dt
        x_next = _draw(mean, scale, prev_sample, generator)
        # The reference's log-prob is −(x_next − μ)²/(2·std²): its −log std − log √(2π) terms sit
        # on a separate statement and never enter the sum. Kept so; they cancel in every ratio.
        log_prob = -((x_next.detach() - mean) ** 2) / (2 * scale**2)
        root = sqrt_dt

    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))  # (B,) fp32
    return SDEStep(x_next, log_prob, mean, _per_sample(std, batch, device), _per_sample(root, batch, device))


def _as_sigma(value: float | Tensor, name: str, batch: int, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        if value.ndim > 1 or (value.ndim == 1 and value.shape[0] != batch):
            raise ValueError(
                f"{name} has shape {tuple(value.shape)}: give a float, a 0-d tensor or one value per "
                f"sample, shape ({batch},)"
            )
        if value.ndim == 0 and value.device.type == "cpu":
            return value.to(torch.float32)
        return value.to(device=device, dtype=torch.float32)
    if not isinstance(value, (int, float)):
        raise ValueError(f"{name} ({value!r}) must be a float or a tensor")
    # A 0-d CPU tensor: the step's scalar math stays on the host and enters the device kernels as a
    # scalar argument. A 0-d tensor created on the device would cost a host-to-device copy and a
    # stream synchronisation at every step.
    return torch.tensor(value, dtype=torch.float32)


def _check_sigmas(sig: Tensor, sig_next: Tensor) -> None:
    if sig.device.type != "cpu" or sig_next.device.type != "cpu":
        return  # reading accelerator tensors would synchronise the device on every step
    if not bool(((sig >= 0) & (sig <= 1)).all()):
        raise ValueError(f"sigma ({sig.tolist()}) must lie in [0, 1]")
    if not bool(((sig_next >= 0) & (sig_next <= 1)).all()):
        raise ValueError(f"sigma_next ({sig_next.tolist()}) must lie in [0, 1]")
    if not bool((sig_next < sig).all()):
        raise ValueError(
            f"sigma_next ({sig_next.tolist()}) must be smaller than sigma ({sig.tolist()}): "
            "sampling runs from σ = 1 down to 0"
        )


def _draw(
    mean: Tensor,
    scale: Tensor,
    prev_sample: Tensor | None,
    generator: torch.Generator | Sequence[torch.Generator] | None,
) -> Tensor:
    if prev_sample is not None:
        return prev_sample.float()
    gen = list(generator) if isinstance(generator, (list, tuple)) else generator
    noise = randn_tensor(mean.shape, generator=gen, device=mean.device, dtype=torch.float32)
    return mean + scale * noise


def _per_sample(value: Tensor, batch: int, device: torch.device) -> Tensor:
    """(B,) fp32 on ``device`` from a scalar or (B, 1, ..., 1) tensor."""
    flat = value.reshape(-1) if value.ndim else value.reshape(1)
    if flat.numel() == 1 and flat.device.type == "cpu":
        # A fill kernel on the device: no copy for the host to wait on.
        return torch.full((batch,), float(flat), dtype=torch.float32, device=device)
    if flat.numel() == 1:
        return flat.expand(batch).to(torch.float32).clone()
    return flat.to(device=device, dtype=torch.float32).clone()
