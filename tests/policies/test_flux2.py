"""Flux2KleinPolicy and Flux2DevPolicy against diffusers' own FLUX.2 pipelines, on tiny random FLUX.2s
saved to disk, and the public FLUX.2 specs."""

from __future__ import annotations

import itertools

import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline
from peft import LoraConfig
from recipe_run import fit_export_resume
from tolerances import EPS32, depth, network_atol, sampling_layers

from lit_flowgrpo.policies.flux2 import Flux2DevPolicy, Flux2KleinPolicy
from lit_flowgrpo.tiny.flux2 import build_tiny_flux2
from lit_flowgrpo.tiny.specs import SPECS

FLAG = "--model.init_args.policy.init_args.pretrained"
PROMPTS = ["a red cat", "two blue dogs, 3 birds"]
SIZE = 32
STEPS = 4
MAX_LEN = 24


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_flux2")
    return {v: build_tiny_flux2(root / v, v) for v in ("klein", "klein_distilled", "dev")}


@pytest.fixture(scope="module")
def policy(paths: dict[str, str]) -> Flux2KleinPolicy:
    p = Flux2KleinPolicy(paths["klein"], dtype="float32", max_sequence_length=MAX_LEN)
    p.load()
    return p


def _load_pipe(cls: type, path: str) -> object:
    pipe = cls.from_pretrained(path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _euler(policy: Flux2KleinPolicy, x: torch.Tensor, embeds: dict, cfg: float) -> torch.Tensor:
    sigmas = policy.sigmas(STEPS, SIZE, SIZE)
    with torch.no_grad():
        for sigma, sigma_next in itertools.pairwise(sigmas):
            x = x + (sigma_next - sigma) * policy.velocity(x, sigma.expand(x.shape[0]), embeds, cfg)
    return x


def test_klein_noise_level_zero_sampling_reproduces_the_pipeline(policy: Flux2KleinPolicy, paths) -> None:
    pipe = _load_pipe(Flux2KleinPipeline, paths["klein"])
    # The pipeline's latents argument is the unpacked (B, 4C, h/2, w/2) noise; it packs it itself.
    noise = torch.randn(len(PROMPTS), 16, SIZE // 4, SIZE // 4, generator=torch.Generator().manual_seed(7))
    x1 = pipe._pack_latents(noise)
    assert tuple(x1.shape[1:]) == policy.latent_shape(SIZE, SIZE) == (64, 16)
    ours = _euler(policy, x1, policy.encode_prompts(PROMPTS), 4.0)
    last: dict[str, torch.Tensor] = {}

    def keep(pipe, i, t, kwargs):  # the pipeline's packed latents after its last step
        last["latents"] = kwargs["latents"]
        return {}

    ref_images = pipe(
        prompt=list(PROMPTS),
        latents=noise.clone(),
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        guidance_scale=4.0,
        max_sequence_length=MAX_LEN,
        output_type="pt",
        callback_on_step_end=keep,
    ).images
    torch.testing.assert_close(policy.sigmas(STEPS, SIZE, SIZE), pipe.scheduler.sigmas, atol=0, rtol=0)
    # The pipeline runs its conditional and unconditional forwards one after the other, we run them as
    # one batch: the same layers with other batch shapes, which the kernels may sum in another order.
    # Along the loop: STEPS guided forwards (CFG 4 scales their rounding by |1 − 4| + 4 = 7) and one
    # Euler rounding per step; then the decoder for the images in [0, 1].
    layers = sampling_layers(depth(pipe.transformer), STEPS, guidance=4.0) + STEPS
    atol = network_atol(layers, float(last["latents"].abs().max()))
    torch.testing.assert_close(ours, last["latents"], atol=atol, rtol=0)
    images = policy.decode(ours)
    assert images.shape == (2, 3, SIZE, SIZE) and images.dtype == torch.float32
    atol = network_atol(layers + depth(pipe.vae.decoder), 1.0)
    torch.testing.assert_close(images, ref_images, atol=atol, rtol=0)
    # Meaningful only if the images are not clamped flat and the prompts matter.
    assert ((ref_images > 0.01) & (ref_images < 0.99)).float().mean() > 0.9
    assert (images[0] - images[1]).abs().max() > 1e-3


def test_dev_guidance_embedding_reproduces_the_pipeline(paths: dict[str, str]) -> None:
    policy = Flux2DevPolicy(paths["dev"], dtype="float32", guidance_scale=2.5, max_sequence_length=MAX_LEN)
    policy.load()
    assert not policy.uses_cfg_batch
    pipe = _load_pipe(Flux2Pipeline, paths["dev"])
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(2, 16, SIZE // 4, SIZE // 4, generator=g)
    # Prompt rows of the transformer's width: dev's Mistral encoder is not built here (tiny/flux2.py).
    embeds = {"prompt_embeds": torch.randn(2, MAX_LEN, 48, generator=g)}
    # 4.5: the loop's CFG scale, which dev ignores (its guidance is the policy's embedding).
    ours = _euler(policy, pipe._pack_latents(noise), embeds, 4.5)
    kwargs = dict(height=SIZE, width=SIZE, num_inference_steps=STEPS, guidance_scale=2.5)
    ref = pipe(prompt_embeds=embeds["prompt_embeds"], latents=noise.clone(), output_type="latent", **kwargs)
    # The same forwards on the same batch, stepped alike: equal bits.
    torch.testing.assert_close(ours, ref.images, atol=0, rtol=0)
    ref_images = pipe(
        prompt_embeds=embeds["prompt_embeds"], latents=noise.clone(), output_type="pt", **kwargs
    )
    torch.testing.assert_close(policy.decode(ours), ref_images.images, atol=0, rtol=0)
    other = Flux2DevPolicy(paths["dev"], dtype="float32", guidance_scale=1.0, max_sequence_length=MAX_LEN)
    other.load()
    x, sigma = pipe._pack_latents(noise), torch.tensor([0.6, 0.6])
    with torch.no_grad():
        assert (
            policy.velocity(x, sigma, embeds, 1.0) - other.velocity(x, sigma, embeds, 1.0)
        ).abs().max() > 1e-4


def test_sigmas_follow_the_empirical_shift_of_tokens_and_steps(policy: Flux2KleinPolicy) -> None:
    # Independent reference: the FLUX.2 pipelines' mu is linear in the token count at 10 and at 200 steps
    # and interpolated linearly in the step count between them; sigma' = e^mu / (e^mu + 1/sigma − 1).
    import math

    for size, steps in [(32, 4), (256, 10), (1024, 28)]:
        seq = (size // 4) ** 2  # the tiny VAE's factor 2, then 2x2 patches
        m10, m200 = 8.73809524e-05 * seq + 1.89833333, 0.00016927 * seq + 0.45666666
        mu = m200 if seq > 4300 else m200 + (m200 - m10) / 190.0 * (steps - 200)
        base = [1 - i * (1 - 1 / steps) / (steps - 1) for i in range(steps)]
        expected = [math.exp(mu) / (math.exp(mu) + (1 / s - 1)) for s in base] + [0.0]
        got = policy.sigmas(steps, size, size)
        assert got.dtype == torch.float32 and got.shape == (steps + 1,)
        # The scheduler's float64 shift rounded once to float32 (sigmas <= 1): within half an eps.
        torch.testing.assert_close(
            got.double(), torch.tensor(expected, dtype=torch.float64), atol=EPS32, rtol=0
        )


def test_prompts_are_the_pipelines_rows_encoded_once(policy: Flux2KleinPolicy) -> None:
    policy._cache.clear()
    alone = policy.encode_prompts(["a red cat"])
    both = policy.encode_prompts(["two blue dogs, 3 birds", "a red cat", "two blue dogs, 3 birds"])
    assert set(both) == {"prompt_embeds"} and both["prompt_embeds"].shape == (3, MAX_LEN, 48)
    torch.testing.assert_close(both["prompt_embeds"][1], alone["prompt_embeds"][0], atol=0, rtol=0)
    assert len(policy._cache) == 2
    ref, _ = policy.pipe.encode_prompt(["a red cat"], max_sequence_length=MAX_LEN)
    torch.testing.assert_close(alone["prompt_embeds"], ref, atol=0, rtol=0)


def test_one_lora_step_trains_only_the_adapter(paths: dict[str, str]) -> None:
    policy = Flux2KleinPolicy(paths["klein"], dtype="float32", max_sequence_length=MAX_LEN)
    policy.load()
    policy.transformer.add_adapter(
        LoraConfig(
            r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=list(policy.default_lora_targets)
        )
    )
    adapted = {n.split(".lora_")[0] for n, _ in policy.named_parameters() if "lora_" in n}
    # 8 attention and 4 MLP projections of the double block, the single block's fused input projection.
    assert len(adapted) == 8 + 4 + 1
    lora = {n: p for n, p in policy.named_parameters() if "lora_" in n}
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(2, *policy.latent_shape(SIZE, SIZE), generator=g)
    noise = torch.randn(x0.shape, generator=g)
    sigma = torch.tensor([0.3, 0.8])
    xt = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
    embeds = policy.encode_prompts(PROMPTS)
    before = policy.velocity(xt, sigma, embeds, 4.0).detach()
    (policy.velocity(xt, sigma, embeds, 4.0) - (noise - x0)).pow(2).mean().backward()
    for name, param in policy.named_parameters():
        assert param.requires_grad == ("lora_" in name), name
        assert ("lora_" in name) or param.grad is None, name
    torch.optim.SGD(lora.values(), lr=0.1).step()
    with torch.no_grad():
        assert (policy.velocity(xt, sigma, embeds, 4.0) - before).abs().max() > 1e-4


def test_bad_input_names_the_flag(paths: dict[str, str], tmp_path) -> None:
    with pytest.raises(ValueError, match=f"{FLAG}.*does not exist"):
        Flux2KleinPolicy(str(tmp_path / "nowhere" / "flux2")).load()
    # The tiny pipeline's default folder, not built yet: the message says how to build it.
    missing = str(tmp_path / ".tiny_models" / "flux2")
    (problem,) = Flux2KleinPolicy(missing).problems()
    assert problem.endswith(f"first with `python -m lit_flowgrpo.tiny.flux2 {missing}`"), problem
    (problem,) = Flux2KleinPolicy(paths["dev"]).problems()  # read before any weight
    assert problem.startswith(FLAG) and "Flux2Pipeline" in problem and "Flux2KleinPipeline" in problem
    (problem,) = Flux2DevPolicy(paths["klein"], guidance_scale=1.0).problems()
    assert "Flux2KleinPipeline" in problem
    assert Flux2DevPolicy(paths["dev"], guidance_scale=0.0).problems() == [
        "--model.init_args.policy.init_args.guidance_scale (0.0) must be positive (FLUX.2-dev samples with 4.0)"
    ]
    distilled = Flux2KleinPolicy(paths["klein_distilled"], dtype="float32", max_sequence_length=MAX_LEN)
    distilled.load()
    x = torch.zeros(1, *distilled.latent_shape(SIZE, SIZE))
    embeds = distilled.encode_prompts(["a"])
    assert distilled.velocity(x, torch.ones(1), embeds, 1.0).shape == x.shape
    with pytest.raises(ValueError, match=r"sampler.guidance_scale \(4.0\) must be 1 .* step-distilled"):
        distilled.velocity(x, torch.ones(1), embeds, 4.0)


def test_public_specs_have_the_published_sizes() -> None:
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    sizes = {}
    for name in ("flux2_klein4b", "flux2_klein9b", "flux2_dev"):
        with torch.device("meta"):
            model = Flux2Transformer2DModel(**SPECS[name]["transformer"])
        sizes[name] = sum(p.numel() for p in model.parameters()) / 1e9
        # The text width is three stacked layers of the encoder (Qwen3-4B 2560, Qwen3-8B 4096, Mistral 5120).
        assert SPECS[name]["text"]["dim"] == model.config.joint_attention_dim
    assert sizes == pytest.approx(
        {"flux2_klein4b": 3.88, "flux2_klein9b": 9.08, "flux2_dev": 32.22}, abs=0.01
    )
    with torch.device("meta"):
        vae = AutoencoderKLFlux2(**SPECS["flux2_klein4b"]["vae"])
    assert 4 * vae.config.latent_channels == SPECS["flux2_klein4b"]["transformer"]["in_channels"]


@pytest.mark.slow
def test_the_recipe_trains_exports_and_resumes_on_the_tiny_pipeline(
    paths: dict[str, str], prompt_file: str, tmp_path
) -> None:
    """configs/flux2_klein_pickscore_flowgrpo.yaml end to end on the tiny klein, on the CPU: fit (rollout,
    reward, update, checkpoint), export (read back by Flux2KleinPipeline.load_lora_weights), resume."""
    fit_export_resume(
        "flux2_klein_pickscore_flowgrpo.yaml", paths["klein"], Flux2KleinPipeline, prompt_file, tmp_path
    )
