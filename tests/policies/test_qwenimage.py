"""QwenImagePolicy against diffusers' own QwenImagePipeline, on a tiny random Qwen-Image saved to disk."""

from __future__ import annotations

import itertools

import pytest
import torch
from diffusers import QwenImagePipeline
from peft import LoraConfig
from tolerances import EPS32, depth, network_atol, sampling_layers

from lit_flowgrpo.policies.qwenimage import QwenImagePolicy
from lit_flowgrpo.weights import LoraSettings

FLAG = "--model.init_args.policy.init_args.pretrained"
PROMPTS = ["a red cat", "two blue dogs and three birds"]  # different token counts
SIZE = 32
STEPS = 4
MAX_LEN = 48
# What the template leaves after its 34-token prefix: the prompt, then "<|im_end|>\n<|im_start|>assistant\n".
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def policy(tiny_qwenimage_path: str) -> QwenImagePolicy:
    p = QwenImagePolicy(tiny_qwenimage_path, dtype="float32", max_sequence_length=MAX_LEN)
    p.load()
    return p


@pytest.fixture(scope="module")
def pipe(tiny_qwenimage_path: str) -> QwenImagePipeline:
    pipe = QwenImagePipeline.from_pretrained(tiny_qwenimage_path, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def ours_and_pipelines(
    policy: QwenImagePolicy, pipe: QwenImagePipeline, cfg: float
) -> dict[str, torch.Tensor]:
    """Latents and images of our fp32 Euler loop and of the pipeline, from the pipeline's own noise."""
    device, dtype = pipe.transformer.device, pipe.transformer.dtype
    shape = policy.latent_shape(SIZE, SIZE)
    assert shape == (64, 16)
    generator = torch.Generator(device).manual_seed(3)
    # The pipeline's own draw for this seed: (B, 1, C, h, w) Gaussian noise, packed.
    x1 = pipe.prepare_latents(len(PROMPTS), shape[1] // 4, SIZE, SIZE, dtype, device, generator)
    assert x1.shape[1:] == shape

    x = x1.float()
    embeds = policy.encode_prompts(PROMPTS)
    sigmas = policy.sigmas(STEPS, SIZE, SIZE).to(device)
    with torch.no_grad():
        for sigma, sigma_next in itertools.pairwise(sigmas):
            x = x + (sigma_next - sigma) * policy.velocity(x, sigma.expand(len(PROMPTS)), embeds, cfg)
    kwargs = dict(
        prompt=PROMPTS,
        negative_prompt=" ",
        true_cfg_scale=cfg,
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        max_sequence_length=MAX_LEN,
    )
    return {
        "ours_latents": x,
        "ours_images": policy.decode(x),
        "ref_latents": pipe(latents=x1.clone(), output_type="latent", **kwargs).images,
        "ref_images": pipe(latents=x1.clone(), output_type="pt", **kwargs).images,
    }


@pytest.mark.parametrize("cfg", [4.0, 1.0], ids=["true_cfg", "no_cfg"])
def test_noise_level_zero_sampling_reproduces_the_pipeline(
    policy: QwenImagePolicy, pipe: QwenImagePipeline, cfg: float
) -> None:
    out = ours_and_pipelines(policy, pipe, cfg)
    sigmas = policy.sigmas(STEPS, SIZE, SIZE)
    torch.testing.assert_close(sigmas, pipe.scheduler.sigmas, atol=1e-7, rtol=0)
    # Qwen-Image's terminal shift stretches the schedule so that its last non-zero sigma is 0.02.
    assert abs(sigmas[-2].item() - 0.02) < 1e-6 and sigmas[-1] == 0
    # Our CFG halves share one padded batch, the pipeline runs two unpadded ones: each forward's
    # reductions may sum in another order. Along the loop: STEPS forwards, each rounding amplified by
    # the guidance, and one rounding per Euler step; then the decoder (images in [0, 1]).
    # Measured: 1e-6 (latents), 3e-7 (images) on AVX-512, AVX2 and the default kernels.
    layers = sampling_layers(depth(pipe.transformer), STEPS, cfg) + STEPS
    atol = network_atol(layers, float(out["ref_latents"].abs().max()))  # cfg 4: 7.6e-4; 1: 1.1e-4
    torch.testing.assert_close(out["ours_latents"], out["ref_latents"], atol=atol, rtol=0)
    assert out["ours_images"].shape == (2, 3, SIZE, SIZE) and out["ours_images"].dtype == torch.float32
    atol = network_atol(layers + depth(pipe.vae.decoder), 1.0)
    torch.testing.assert_close(out["ours_images"], out["ref_images"], atol=atol, rtol=0)
    assert ((out["ref_images"] > 0.01) & (out["ref_images"] < 0.99)).float().mean() > 0.9
    assert (out["ours_images"][0] - out["ours_images"][1]).abs().max() > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_on_gpu_tracks_the_pipeline(tiny_qwenimage_path: str) -> None:
    policy = QwenImagePolicy(tiny_qwenimage_path, dtype="bfloat16", max_sequence_length=MAX_LEN)
    policy.load()
    policy.to("cuda")
    pipe = QwenImagePipeline.from_pretrained(tiny_qwenimage_path, torch_dtype=torch.bfloat16).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    out = ours_and_pipelines(policy, pipe, 4.0)
    assert out["ours_latents"].device.type == "cuda" and out["ours_images"].dtype == torch.float32
    # Same network in bf16; the pipeline rounds its latents to bf16 after every step, we keep fp32,
    # and our CFG halves share one padded batch where the pipeline runs two unpadded ones.
    # Measured on an H100: max |Δ| of 0.030 and 0.008 for latents (|x| up to ~4) and images.
    torch.testing.assert_close(out["ours_latents"], out["ref_latents"].float(), atol=5e-2, rtol=0)
    torch.testing.assert_close(out["ours_images"], out["ref_images"].float(), atol=1.5e-2, rtol=0)


def test_cfg_is_one_batched_forward_with_the_norm_rescale(policy: QwenImagePolicy) -> None:
    x = torch.randn(2, *policy.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.9, 0.4])
    calls = []
    hook = policy.transformer.register_forward_hook(lambda m, args, kwargs_out: calls.append(1))
    try:
        with torch.no_grad():
            guided = policy.velocity(x, sigma, policy.encode_prompts(PROMPTS), 4.0)
    finally:
        hook.remove()
    assert len(calls) == 1
    # Independent reference: separate, unpadded conditional and unconditional forwards combined by hand.
    with torch.no_grad():
        cond = policy.velocity(x, sigma, policy.encode_prompts(PROMPTS), 1.0)
        uncond = policy.velocity(x, sigma, policy.encode_prompts([" ", " "]), 1.0)
    comb = uncond + 4.0 * (cond - uncond)
    expected = comb * cond.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True)
    # One batch of four against two of two: each forward's output may round by depth·eps of its scale
    # (dv); the guidance combination amplifies it by |1 − 4| + 4 = 7 (dcomb). The rescale factor
    # f = |cond| / |comb| (per token, over D channels) moves by the two norms' relative errors, and
    # its own few roundings. Measured: 1.5e-6 at most; the bound is elementwise.
    dv = network_atol(depth(policy.transformer), float(torch.maximum(cond.abs().max(), uncond.abs().max())))
    dcomb = 7 * dv
    root_d = comb.shape[-1] ** 0.5
    cond_norm, comb_norm = cond.norm(dim=-1, keepdim=True), comb.norm(dim=-1, keepdim=True)
    f = cond_norm / comb_norm
    rel_f = dv * root_d / cond_norm + dcomb * root_d / comb_norm + 4 * EPS32
    atol = f * dcomb + comb.abs() * f * rel_f
    assert ((guided - expected).abs() <= atol).all(), float(((guided - expected).abs() / atol).max())
    assert (guided - comb).abs().max() > 1e-3  # the rescale is not a no-op here


def test_prompts_are_padded_to_a_fixed_length_with_their_mask(
    policy: QwenImagePolicy, pipe: QwenImagePipeline
) -> None:
    policy._cache.clear()
    embeds = policy.encode_prompts([PROMPTS[1], PROMPTS[0], PROMPTS[1]])
    assert embeds["prompt_embeds"].shape == (3, MAX_LEN, 32)
    assert embeds["prompt_embeds_mask"].dtype == torch.long
    assert len(policy._cache) == 2
    # Real lengths: the prompt's tokens plus the template's tail, counted with the tokenizer itself.
    lengths = [len(pipe.tokenizer(p + SUFFIX).input_ids) for p in (PROMPTS[1], PROMPTS[0], PROMPTS[1])]
    assert lengths[0] != lengths[1]
    assert embeds["prompt_embeds_mask"].sum(dim=1).tolist() == lengths
    for i, n in enumerate(lengths):
        assert embeds["prompt_embeds_mask"][i, :n].all() and not embeds["prompt_embeds_mask"][i, n:].any()
        assert not embeds["prompt_embeds"][i, n:].any()
    ref, ref_mask = pipe.encode_prompt(PROMPTS[:1], device="cpu", max_sequence_length=MAX_LEN)
    assert ref_mask is None  # one prompt: the pipeline drops an all-ones mask
    # The policy encodes each prompt alone, through the pipeline's own encode_prompt: the same
    # computation as the pipeline's for this one prompt, so the rows are bit-equal.
    torch.testing.assert_close(embeds["prompt_embeds"][1:2, : lengths[1]], ref, atol=0, rtol=0)


def test_long_prompts_are_truncated_like_the_pipeline(
    tiny_qwenimage_path: str, pipe: QwenImagePipeline
) -> None:
    policy = QwenImagePolicy(tiny_qwenimage_path, dtype="float32", max_sequence_length=5)
    policy.load()
    embeds = policy.encode_prompts(PROMPTS)
    ref, _ = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=5)
    assert embeds["prompt_embeds_mask"].sum().item() == 10
    # Each prompt encoded alone (exact resume), the pipeline's two in one batch: its matrix products
    # may sum in another order (by batch size and SIMD width), each reducing layer rounding by about
    # eps of its scale. A truncation at the wrong token moves the states by O(1).
    layers = depth(pipe.text_encoder.model.language_model)
    atol = network_atol(layers, float(ref.abs().max()))  # 23 layers: 7.7e-6; measured 2.4e-7 (AVX-512)
    torch.testing.assert_close(embeds["prompt_embeds"], ref, atol=atol, rtol=0)


def test_one_lora_training_step_trains_only_the_adapter(tiny_qwenimage_path: str) -> None:
    policy = QwenImagePolicy(tiny_qwenimage_path, dtype="float32", max_sequence_length=MAX_LEN)
    policy.load()
    policy.transformer.add_adapter(
        LoraConfig(
            r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=list(policy.default_lora_targets)
        )
    )
    lora = {n: p for n, p in policy.named_parameters() if "lora_" in n}
    # 12 projections (attention and MLP of both streams) in each of the 2 blocks.
    assert len({n.split(".lora_")[0] for n in lora}) == 12 * 2
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(2, *policy.latent_shape(SIZE, SIZE), generator=g)
    noise = torch.randn(x0.shape, generator=g)
    sigma = torch.tensor([0.3, 0.8])
    xt = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
    embeds = policy.encode_prompts(PROMPTS)
    before = policy.velocity(xt, sigma, embeds, 4.0).detach()
    loss = (policy.velocity(xt, sigma, embeds, 4.0) - (noise - x0)).pow(2).mean()
    loss.backward()
    # The last block's text-stream outputs feed nothing: the image tokens are all that is read out.
    dead = ("transformer_blocks.1.attn.to_add_out", "transformer_blocks.1.txt_mlp")
    for name, param in policy.named_parameters():
        if "lora_" in name:
            assert param.requires_grad, name
            assert (param.grad is None) == any(d in name for d in dead), name
        else:
            assert not param.requires_grad and param.grad is None, name
    # ... and the last block's text queries only shape those outputs: connected, but a zero gradient.
    zero = {n for n, p in lora.items() if p.grad is not None and p.grad.abs().sum() == 0}
    assert {n for n in zero if "lora_B" in n} == {
        "_transformer.transformer_blocks.1.attn.add_q_proj.lora_B.default.weight"
    }
    torch.optim.SGD(lora.values(), lr=0.1).step()
    with torch.no_grad():
        after = policy.velocity(xt, sigma, embeds, 4.0)
    assert (after - before).abs().max() > 1e-4


def test_the_adapter_leaves_out_what_gets_no_gradient(tiny_qwenimage_path: str) -> None:
    # The run's own path (TrainableWeights.attach) with the default targets: the last block's text-stream
    # output and MLP get no adapter, and every adapter tensor it does add gets a gradient, as DDP needs.
    from lit_flowgrpo.weights import TrainableWeights, WeightsSettings

    policy = QwenImagePolicy(tiny_qwenimage_path, dtype="float32", max_sequence_length=MAX_LEN)
    policy.load()
    TrainableWeights(WeightsSettings(lora=LoraSettings(rank=4, alpha=8, init="gaussian"))).attach(policy)
    lora = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    adapted = {n.split(".lora_")[0] for n in lora}
    assert len(adapted) == 12 * 2 - 3
    assert not any(m in n for n in adapted for m in policy.unused_modules())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, *policy.latent_shape(SIZE, SIZE), generator=g)
    policy.velocity(
        x, torch.tensor([0.3, 0.8]), policy.encode_prompts(PROMPTS), 4.0
    ).square().mean().backward()
    assert all(p.grad is not None for p in lora.values()), [n for n, p in lora.items() if p.grad is None]


def test_bad_input_names_the_flag(tmp_path, tiny_flux_path: str, tiny_qwenimage_path: str) -> None:
    with pytest.raises(ValueError, match=f"{FLAG}.*does not exist"):
        QwenImagePolicy(str(tmp_path / "nowhere" / "qwen")).load()
    wrong = QwenImagePolicy(tiny_flux_path)
    assert len(wrong.problems()) == 1
    with pytest.raises(ValueError, match=f"{FLAG}.*FluxPipeline.*QwenImagePipeline"):
        wrong.load()
    problems = QwenImagePolicy(
        tiny_qwenimage_path, true_cfg_scale=0.0, negative_prompt="", max_sequence_length=2000
    ).problems()
    assert len(problems) == 3
    for flag, problem in zip(
        ("max_sequence_length", "true_cfg_scale", "negative_prompt"), problems, strict=True
    ):
        assert problem.startswith(f"--model.init_args.policy.init_args.{flag}")
