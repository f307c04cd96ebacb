"""Which steps of Z-Image-Turbo's few-step schedule can carry an SDE window: a Gaussian toy.

A distilled few-step sampler's distribution is what its own Euler ODE produces at its own schedule, not
the data's: a stochastic step in the window should leave that distribution as it is (Flow-GRPO's SDE is
built to keep the marginals of the continuous flow, which few large steps do not resolve). On a toy
whose velocity is known exactly, x0 ~ N(0, s²) per dimension (so v(x, σ) = E[ε − x0 | x_σ] is linear
in x), this runs Z-Image-Turbo's schedule (its scheduler config from lit_flowgrpo.tiny.specs and the
pipeline's default sigmas) as an ODE and with one stochastic step at step j (the package's
``sde_step_with_logprob``), and reports the final spread against the ODE's, per step type, noise level
and j, with the transition's noise std in units of the step's |dt|.

    python benchmarks/turbo_window.py --out benchmarks/results/zimage_turbo_window_toy.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

from lit_flowgrpo.sde import sde_step_with_logprob
from lit_flowgrpo.tiny.specs import SPECS


def turbo_sigmas(num_steps: int) -> list[float]:
    """Z-Image-Turbo's sampling sigmas (static shift 3), terminal 0 included, as ZImagePipeline sets them."""
    scheduler = FlowMatchEulerDiscreteScheduler(**SPECS["zimage_turbo"]["scheduler"])
    scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(num_steps), device="cpu")
    return [float(s) for s in scheduler.sigmas]


def exact_velocity(x: torch.Tensor, sigma: float, data_std: float) -> torch.Tensor:
    """E[ε − x0 | x_σ] for x0 ~ N(0, s²), ε ~ N(0, 1), x_σ = (1 − σ)·x0 + σ·ε (both conditional means
    are linear in x with the marginal variance (1 − σ)²s² + σ²)."""
    var = (1 - sigma) ** 2 * data_std**2 + sigma**2
    return (sigma - (1 - sigma) * data_std**2) / var * x


def final_std(
    sigmas: list[float], data_std: float, window: int | None, sde_type: str, noise: float, n: int, seed: int
) -> tuple[float, float | None]:
    """The final samples' std (float64 Euler, fp32 stochastic step at ``window``) and that step's noise
    std / |dt|."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, generator=g, dtype=torch.float64)
    ratio = None
    for i, (s, s_next) in enumerate(itertools.pairwise(sigmas)):
        v = exact_velocity(x, s, data_std)
        if i == window:
            step = sde_step_with_logprob(
                v.float(),
                x.float(),
                s,
                s_next,
                noise_level=noise,
                sde_type=sde_type,
                generator=g,
                sigma_max=sigmas[1],
            )
            x = step.prev_sample.double()
            ratio = float((step.std_dev_t * step.sqrt_dt).mean()) / abs(s_next - s)
        else:
            x = x + (s_next - s) * v
    return float(x.std()), ratio


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--steps", type=int, nargs="+", default=[6, 8], help="schedules (the recipe's 6, sampling's 8)"
    )
    p.add_argument("--samples", type=int, default=400_000)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for num_steps in args.steps:
        sigmas = turbo_sigmas(num_steps)
        for data_std in (0.5, 1.0):
            ode, _ = final_std(sigmas, data_std, None, "sde", 0.0, args.samples, 0)
            for sde_type, noise in (("sde", 0.5), ("sde", 0.7), ("cps", 0.7)):
                for j in range(num_steps - 1):  # the last step (to σ = 0) is never trained
                    std, ratio = final_std(sigmas, data_std, j, sde_type, noise, args.samples, 1 + j)
                    rows.append(
                        dict(
                            num_steps=num_steps,
                            data_std=data_std,
                            sde_type=sde_type,
                            noise_level=noise,
                            step=j,
                            sigma=round(sigmas[j], 4),
                            spread_vs_ode=round(std / ode - 1, 4),
                            noise_std_over_dt=round(ratio, 2),
                        )
                    )
                    print(rows[-1])
    result = {
        "what": __doc__.split("\n\n")[0],
        "sigmas": {n: turbo_sigmas(n) for n in args.steps},
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
