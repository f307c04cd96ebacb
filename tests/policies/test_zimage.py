"""ZImagePolicy against diffusers' own ZImagePipeline, on tiny random Z-Images saved to disk, and the
public Z-Image spec."""

from __future__ import annotations

import itertools

import pytest
import torch
from diffusers import ZImagePipeline
from peft import LoraConfig
from recipe_run import fit_export_resume
from tolerances import EPS32

from lit_flowgrpo.policies.zimage import ZImagePolicy
from lit_flowgrpo.tiny.specs import SPECS
from lit_flowgrpo.tiny.zimage import build_tiny_zimage

FLAG = "--model.init_args.policy.init_args.pretrained"
PROMPTS = ["a red cat", "two blue dogs, 3 birds"]  # different token counts
SIZE = 32
STEPS = 4
MAX_LEN = 48


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_zimage")
    return {v: build_tiny_zimage(root / v, v) for v in ("turbo", "base")}


@pytest.fixture(scope="module")
def policy(paths: dict[str, str]) -> ZImagePolicy:
    p = ZImagePolicy(paths["base"], dtype="float32", max_sequence_length=MAX_LEN)
    p.load()
    return p


@pytest.mark.parametrize(("cfg", "pipeline_scale"), [(4.0, 3.0), (1.0, 0.0)], ids=["cfg", "turbo_no_cfg"])
def test_noise_level_zero_sampling_reproduces_the_pipeline(
    policy: ZImagePolicy, paths: dict[str, str], cfg: float, pipeline_scale: float
) -> None:
    pipe = ZImagePipeline.from_pretrained(paths["base"], dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    x1 = torch.randn(
        len(PROMPTS), *policy.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(5)
    )
    assert tuple(x1.shape[1:]) == (4, 16, 16)
    x = x1.clone()
    embeds = policy.encode_prompts(PROMPTS)
    sigmas = policy.sigmas(STEPS, SIZE, SIZE)
    with torch.no_grad():
        for sigma, sigma_next in itertools.pairwise(sigmas):
            x = x + (sigma_next - sigma) * policy.velocity(x, sigma.expand(len(PROMPTS)), embeds, cfg)
    # The pipeline's scale g is the loop's s − 1 (its CFG is pos + g·(pos − neg)). It rewrites the prompt
    # list it is given in place (the chat template), so each call gets its own copy.
    kwargs = dict(
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        guidance_scale=pipeline_scale,
        max_sequence_length=MAX_LEN,
    )
    ref = pipe(prompt=list(PROMPTS), latents=x1.clone(), output_type="latent", **kwargs).images
    ref_images = pipe(prompt=list(PROMPTS), latents=x1.clone(), output_type="pt", **kwargs).images
    torch.testing.assert_close(sigmas, pipe.scheduler.sigmas, atol=0, rtol=0)
    # The same list-of-samples forwards (the transformer pads them alike) and the same Euler step and
    # decoder: equal bits.
    torch.testing.assert_close(x, ref, atol=0, rtol=0)
    images = policy.decode(x)
    torch.testing.assert_close(images, ref_images, atol=0, rtol=0)
    assert images.shape == (2, 3, SIZE, SIZE) and images.dtype == torch.float32
    assert ((ref_images > 0.01) & (ref_images < 0.99)).float().mean() > 0.9
    assert (images[0] - images[1]).abs().max() > 1e-3 and (x - x1).abs().max() > 0.1


def test_bfloat16_sampling_reproduces_the_pipeline_bit_for_bit(paths: dict[str, str]) -> None:
    """In bf16 too: the pipeline feeds the transformer its time 1 − σ in float32 (its latents stay float32),
    so a policy that rounded it to bf16 (up to 2⁻⁹, about one unit of t·1000) drew other samples
    (0.08 apart here)."""
    policy = ZImagePolicy(paths["base"], dtype="bfloat16", max_sequence_length=MAX_LEN)
    policy.load()
    pipe = ZImagePipeline.from_pretrained(paths["base"], dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    x1 = torch.randn(
        len(PROMPTS), *policy.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(5)
    )
    x, embeds = x1.clone(), policy.encode_prompts(PROMPTS)
    with torch.no_grad():
        for sigma, sigma_next in itertools.pairwise(policy.sigmas(STEPS, SIZE, SIZE)):
            x = x + (sigma_next - sigma) * policy.velocity(x, sigma.expand(len(PROMPTS)), embeds, 4.0)
    ref = pipe(
        prompt=list(PROMPTS),
        latents=x1.clone(),
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        guidance_scale=3.0,
        max_sequence_length=MAX_LEN,
        output_type="latent",
    ).images
    # The same bf16 forwards on the same inputs, the same fp32 CFG and Euler step: equal bits.
    torch.testing.assert_close(x, ref, atol=0, rtol=0)


def test_turbo_and_base_schedules_are_their_shifts(paths: dict[str, str]) -> None:
    # Static shift s: sigma' = s·σ / (1 + (s − 1)·σ) on linspace(1, 1/n, n), then 0 (FlowMatchEuler).
    for variant, shift in (("turbo", 3.0), ("base", 6.0)):
        policy = ZImagePolicy(paths[variant], dtype="float32", max_sequence_length=MAX_LEN)
        policy.load()
        base = torch.linspace(1.0, 1 / 8, 8, dtype=torch.float64)
        expected = torch.cat([shift * base / (1 + (shift - 1) * base), torch.zeros(1, dtype=torch.float64)])
        # The scheduler's shift rounded to float32 (sigmas <= 1): within half an eps of the float64 value.
        torch.testing.assert_close(policy.sigmas(8, 64, 64).double(), expected, atol=EPS32, rtol=0)


def test_prompts_keep_their_own_lengths_with_a_mask(policy: ZImagePolicy) -> None:
    policy._cache.clear()
    embeds = policy.encode_prompts([*PROMPTS, PROMPTS[0]])
    mask = embeds["prompt_embeds_mask"]
    assert embeds["prompt_embeds"].shape == (3, MAX_LEN, 16) and mask.dtype == torch.long
    ref, _ = policy.pipe.encode_prompt(
        list(PROMPTS), do_classifier_free_guidance=False, max_sequence_length=MAX_LEN
    )
    for i, rows in enumerate(ref):
        assert int(mask[i].sum()) == rows.shape[0]
        torch.testing.assert_close(embeds["prompt_embeds"][i, : rows.shape[0]], rows, atol=0, rtol=0)
        assert not embeds["prompt_embeds"][i, rows.shape[0] :].any()
    assert mask[0].sum() != mask[1].sum() and len(policy._cache) == 2


def test_one_lora_step_trains_only_the_adapter(paths: dict[str, str]) -> None:
    policy = ZImagePolicy(paths["turbo"], dtype="float32", max_sequence_length=MAX_LEN)
    policy.load()
    policy.transformer.add_adapter(
        LoraConfig(
            r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=list(policy.default_lora_targets)
        )
    )
    adapted = {n.split(".lora_")[0] for n, _ in policy.named_parameters() if "lora_" in n}
    # 7 projections in each of the main block, the noise refiner and the caption refiner.
    assert len(adapted) == 7 * 3
    lora = {n: p for n, p in policy.named_parameters() if "lora_" in n}
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(2, *policy.latent_shape(SIZE, SIZE), generator=g)
    noise = torch.randn(x0.shape, generator=g)
    sigma = torch.tensor([0.3, 0.8])
    xt = (1 - sigma[:, None, None, None]) * x0 + sigma[:, None, None, None] * noise
    embeds = policy.encode_prompts(PROMPTS)
    before = policy.velocity(xt, sigma, embeds, 1.0).detach()
    (policy.velocity(xt, sigma, embeds, 1.0) - (noise - x0)).pow(2).mean().backward()
    for name, param in policy.named_parameters():
        assert param.requires_grad == ("lora_" in name), name
        assert ("lora_" in name) or param.grad is None, name
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in lora.items() if "lora_B" in n)
    torch.optim.SGD(lora.values(), lr=0.1).step()
    with torch.no_grad():
        assert (policy.velocity(xt, sigma, embeds, 1.0) - before).abs().max() > 1e-4


def test_bad_input_names_the_flag(paths: dict[str, str], tmp_path, tiny_flux_path: str) -> None:
    with pytest.raises(ValueError, match=f"{FLAG}.*does not exist"):
        ZImagePolicy(str(tmp_path / "nowhere" / "zimage")).load()
    # The tiny pipeline's default folder, not built yet: the message says how to build it.
    missing = str(tmp_path / ".tiny_models" / "zimage")
    (problem,) = ZImagePolicy(missing).problems()
    assert problem.endswith(f"first with `python -m lit_flowgrpo.tiny.zimage {missing}`"), problem
    (problem,) = ZImagePolicy(tiny_flux_path).problems()  # read before any weight
    assert problem.startswith(FLAG) and "FluxPipeline" in problem and "ZImagePipeline" in problem
    problems = ZImagePolicy(paths["turbo"], max_sequence_length=0, prompt_cache_size=-1).problems()
    assert [p.split(" (")[0] for p in problems] == [
        "--model.init_args.policy.init_args.max_sequence_length",
        "--model.init_args.policy.init_args.prompt_cache_size",
    ]
    assert ZImagePolicy("org/zimage").image_size_problems(50, 48) == [
        "--model.init_args.sampler.height (50) must be a positive multiple of 16 for ZImagePolicy (the VAE "
        "downsamples by 8 and the transformer cuts 2×2 patches): use 48, for example"
    ]


def test_public_spec_has_the_published_size() -> None:
    from diffusers import ZImageTransformer2DModel

    with torch.device("meta"):
        model = ZImageTransformer2DModel(**SPECS["zimage_turbo"]["transformer"])
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(6.15, abs=0.01)
    assert SPECS["zimage"]["transformer"] == SPECS["zimage_turbo"]["transformer"]
    assert (SPECS["zimage_turbo"]["scheduler"]["shift"], SPECS["zimage"]["scheduler"]["shift"]) == (3.0, 6.0)


@pytest.mark.slow
def test_the_recipe_trains_exports_and_resumes_on_the_tiny_pipeline(
    paths: dict[str, str], prompt_file: str, tmp_path
) -> None:
    """configs/zimage_turbo_pickscore_flowgrpo.yaml end to end on the tiny Turbo, on the CPU: fit (rollout,
    reward, update, checkpoint), export (read back by ZImagePipeline.load_lora_weights), resume."""
    fit_export_resume(
        "zimage_turbo_pickscore_flowgrpo.yaml",
        paths["turbo"],
        ZImagePipeline,
        prompt_file,
        tmp_path,
        max_len=MAX_LEN,
    )
