"""FluxPolicy against diffusers' own FluxPipeline, on a tiny random FLUX saved to disk."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil

import pytest
import torch
from diffusers import FluxPipeline
from peft import LoraConfig
from tolerances import depth, network_atol, sampling_layers

from lit_flowgrpo.policies.flux import FluxPolicy

FLAG = "--model.init_args.policy.init_args.pretrained"
PROMPTS = ["a red cat", "two blue dogs, 3 birds"]
SIZE = 32
STEPS = 4
MAX_LEN = 24


@pytest.fixture(scope="module")
def policy(tiny_flux_path: str) -> FluxPolicy:
    # Not the default guidance, so the pipeline comparison shows that this value is the one used.
    p = FluxPolicy(tiny_flux_path, dtype="float32", guidance_scale=5.0, max_sequence_length=MAX_LEN)
    p.load()
    return p


@pytest.fixture(scope="module")
def pipe(tiny_flux_path: str) -> FluxPipeline:
    pipe = FluxPipeline.from_pretrained(tiny_flux_path, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def euler_sample(policy: FluxPolicy, x: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    embeds = policy.encode_prompts(prompts)
    sigmas = policy.sigmas(STEPS, SIZE, SIZE).to(x.device)
    with torch.no_grad():
        for sigma, sigma_next in itertools.pairwise(sigmas):
            # 4.5: the training loop's CFG scale, which FLUX ignores (its guidance is the policy's).
            v = policy.velocity(x, sigma.expand(x.shape[0]), embeds, 4.5)
            x = x + (sigma_next - sigma) * v
    return x


def ours_and_pipelines(policy: FluxPolicy, pipe: FluxPipeline) -> dict[str, torch.Tensor]:
    """Latents and images of our fp32 Euler loop and of the pipeline, from the pipeline's own noise."""
    device, dtype = pipe.transformer.device, pipe.transformer.dtype
    shape = policy.latent_shape(SIZE, SIZE)
    generator = torch.Generator(device).manual_seed(7)
    # The pipeline's initial noise for this seed (drawn unpacked, then packed).
    x1, _ = pipe.prepare_latents(len(PROMPTS), shape[1] // 4, SIZE, SIZE, dtype, device, generator)
    assert tuple(x1.shape[1:]) == shape == (64, 16)
    ours = euler_sample(policy, x1.float(), PROMPTS)
    kwargs = dict(
        prompt=PROMPTS,
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        guidance_scale=policy.guidance_scale,
        max_sequence_length=MAX_LEN,
    )
    return {
        "ours_latents": ours,
        "ours_images": policy.decode(ours),
        "ref_latents": pipe(latents=x1.clone(), output_type="latent", **kwargs).images,
        "ref_images": pipe(latents=x1.clone(), output_type="pt", **kwargs).images,
    }


def test_noise_level_zero_sampling_reproduces_the_pipeline(policy: FluxPolicy, pipe: FluxPipeline) -> None:
    out = ours_and_pipelines(policy, pipe)
    torch.testing.assert_close(policy.sigmas(STEPS, SIZE, SIZE), pipe.scheduler.sigmas, atol=1e-7, rtol=0)
    # Our Euler loop and the pipeline's scheduler: the same forwards on the same batch (bit-equal on
    # AVX-512, AVX2 and the default kernels), but two codes that need not order each step's arithmetic
    # alike. Along the loop: STEPS forwards and one Euler rounding per step; then the decoder (images
    # in [0, 1]).
    layers = sampling_layers(depth(pipe.transformer), STEPS) + STEPS
    atol = network_atol(layers, float(out["ref_latents"].abs().max()))  # 188 layers: 9.4e-5
    torch.testing.assert_close(out["ours_latents"], out["ref_latents"], atol=atol, rtol=0)
    assert out["ours_images"].shape == (2, 3, SIZE, SIZE) and out["ours_images"].dtype == torch.float32
    atol = network_atol(layers + depth(pipe.vae.decoder), 1.0)
    torch.testing.assert_close(out["ours_images"], out["ref_images"], atol=atol, rtol=0)
    # The comparison means something only if the images are not clamped flat and the prompts matter.
    assert ((out["ref_images"] > 0.01) & (out["ref_images"] < 0.99)).float().mean() > 0.9
    assert (out["ours_images"][0] - out["ours_images"][1]).abs().max() > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_on_gpu_tracks_the_pipeline(tiny_flux_path: str) -> None:
    policy = FluxPolicy(tiny_flux_path, dtype="bfloat16", max_sequence_length=MAX_LEN)
    policy.load()
    policy.to("cuda")
    pipe = FluxPipeline.from_pretrained(tiny_flux_path, torch_dtype=torch.bfloat16).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    out = ours_and_pipelines(policy, pipe)
    assert out["ours_latents"].device.type == "cuda" and out["ours_images"].dtype == torch.float32
    # Same network in bf16; the pipeline rounds its latents to bf16 after every step, we keep fp32.
    # Measured on an H100: max |Δ| of 0.030 and 0.004 for latents (|x| up to ~4) and images.
    torch.testing.assert_close(out["ours_latents"], out["ref_latents"].float(), atol=5e-2, rtol=0)
    torch.testing.assert_close(out["ours_images"], out["ref_images"].float(), atol=1.5e-2, rtol=0)


def test_guidance_is_the_policys_embedding_not_the_loops_cfg(policy: FluxPolicy, tiny_flux_path: str) -> None:
    assert not policy.uses_cfg_batch
    x = torch.randn(1, *policy.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(0))
    embeds = policy.encode_prompts(PROMPTS[:1])
    sigma = torch.tensor([0.6])
    other = FluxPolicy(tiny_flux_path, dtype="float32", guidance_scale=1.0, max_sequence_length=MAX_LEN)
    other.load()
    with torch.no_grad():
        v_no_cfg = policy.velocity(x, sigma, embeds, 1.0)
        v_cfg = policy.velocity(x, sigma, embeds, 4.5)
        v_other = other.velocity(x, sigma, embeds, 4.5)
    assert v_no_cfg.shape == x.shape and v_no_cfg.dtype == torch.float32
    torch.testing.assert_close(v_no_cfg, v_cfg, atol=0, rtol=0)  # rollout and update agree
    assert (v_cfg - v_other).abs().max() > 1e-4  # the guidance embedding is live


def test_sigmas_follow_the_dynamic_shift_of_the_token_count(policy: FluxPolicy) -> None:
    # Independent reference: diffusers FluxPipeline mu = linear in seq from (256, 0.5) to (4096, 1.15),
    # sigma' = e^mu / (e^mu + 1/sigma - 1) on linspace(1, 1/n, n), then a terminal 0.
    config = policy.pipe.scheduler.config
    for height, width in [(32, 32), (64, 128)]:
        seq = (height // 4) * (width // 4)
        slope = (config.max_shift - config.base_shift) / (
            config.max_image_seq_len - config.base_image_seq_len
        )
        mu = config.base_shift + slope * (seq - config.base_image_seq_len)
        base = [1 - i * (1 - 1 / STEPS) / (STEPS - 1) for i in range(STEPS)]
        expected = [math.exp(mu) / (math.exp(mu) + (1 / s - 1)) for s in base] + [0.0]
        got = policy.sigmas(STEPS, height, width)
        assert got.dtype == torch.float32 and got.shape == (STEPS + 1,)
        torch.testing.assert_close(got, torch.tensor(expected), atol=1e-6, rtol=0)


def test_prompts_are_encoded_once_and_rows_do_not_depend_on_the_batch(policy: FluxPolicy) -> None:
    policy._cache.clear()
    alone = policy.encode_prompts(["a red cat"])
    both = policy.encode_prompts(["two blue dogs, 3 birds", "a red cat", "two blue dogs, 3 birds"])
    assert set(both) == {"prompt_embeds", "pooled_prompt_embeds"}
    assert both["prompt_embeds"].shape == (3, MAX_LEN, 32) and both["pooled_prompt_embeds"].shape == (3, 32)
    torch.testing.assert_close(both["prompt_embeds"][1], alone["prompt_embeds"][0], atol=0, rtol=0)
    torch.testing.assert_close(both["prompt_embeds"][0], both["prompt_embeds"][2], atol=0, rtol=0)
    assert len(policy._cache) == 2
    ref_t5, ref_clip, _ = policy.pipe.encode_prompt(["a red cat"], max_sequence_length=MAX_LEN)
    torch.testing.assert_close(alone["prompt_embeds"], ref_t5, atol=0, rtol=0)
    torch.testing.assert_close(alone["pooled_prompt_embeds"], ref_clip, atol=0, rtol=0)


def test_one_lora_training_step_trains_only_the_adapter(tiny_flux_path: str) -> None:
    policy = FluxPolicy(tiny_flux_path, dtype="float32", max_sequence_length=MAX_LEN)
    policy.load()
    policy.transformer.add_adapter(
        LoraConfig(
            r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=list(policy.default_lora_targets)
        )
    )
    lora = {n: p for n, p in policy.named_parameters() if "lora_" in n}
    # 8 projections in the one double-stream block; the single-stream block has to_q/k/v only.
    assert len({n.split(".lora_")[0] for n in lora}) == 8 + 3
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(2, *policy.latent_shape(SIZE, SIZE), generator=g)
    noise = torch.randn(x0.shape, generator=g)
    sigma = torch.tensor([0.3, 0.8])
    xt = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
    embeds = policy.encode_prompts(PROMPTS)
    before = policy.velocity(xt, sigma, embeds, 3.5).detach()
    loss = (policy.velocity(xt, sigma, embeds, 3.5) - (noise - x0)).pow(2).mean()
    loss.backward()
    for name, param in policy.named_parameters():
        if "lora_" in name:
            assert param.requires_grad and param.grad is not None, name
        else:
            assert not param.requires_grad and param.grad is None, name
    assert all(p.grad.abs().sum() > 0 for n, p in lora.items() if "lora_B" in n)
    torch.optim.SGD(lora.values(), lr=0.1).step()
    with torch.no_grad():
        after = policy.velocity(xt, sigma, embeds, 3.5)
    assert (after - before).abs().max() > 1e-4


def test_bad_pretrained_names_the_flag(tmp_path, tiny_flux_path: str, tiny_qwenimage_path: str) -> None:
    cases = [
        (str(tmp_path / "nowhere" / "flux"), "does not exist"),
        (str(tmp_path), "without model_index.json"),
        (tiny_qwenimage_path, "QwenImagePipeline.*FluxPipeline"),
    ]
    for pretrained, why in cases:
        policy = FluxPolicy(pretrained)  # the constructor only records
        (problem,) = policy.problems()
        assert re.search(f"{FLAG}.*{why}", problem), problem
        with pytest.raises(ValueError, match=f"{FLAG}.*{why}"):
            policy.load()
        assert policy.pipe is None
    # A folder that looked right when configured but was swapped before loading.
    swapped = shutil.copytree(tiny_flux_path, tmp_path / "swapped")
    policy = FluxPolicy(str(swapped))
    index = json.loads((swapped / "model_index.json").read_text())
    index["_class_name"] = "StableDiffusion3Pipeline"
    (swapped / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"{FLAG}.*StableDiffusion3Pipeline"):
        policy.load()
    os.remove(swapped / "model_index.json")
    with pytest.raises(ValueError, match=f"{FLAG}.*model_index.json"):
        policy.load()


def test_bad_settings_are_reported_together(tiny_flux_path: str) -> None:
    problems = FluxPolicy(tiny_flux_path, guidance_scale=0.0, max_sequence_length=1000).problems()
    assert len(problems) == 2
    assert "--model.init_args.policy.init_args.guidance_scale (0.0)" in problems[1]
    assert "--model.init_args.policy.init_args.max_sequence_length (1000)" in problems[0]


def test_image_size_must_fit_the_packing(policy: FluxPolicy) -> None:
    with pytest.raises(ValueError, match=r"height \(30\) must be a positive multiple of 4"):
        policy.latent_shape(30, 32)
    with pytest.raises(ValueError, match="call latent_shape"):
        policy.velocity(torch.zeros(1, 8, 16), torch.ones(1), policy.encode_prompts(["a"]), 3.5)
