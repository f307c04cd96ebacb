"""performance.fp8_base_matmuls: the float8 products of the frozen base weights, checked against their
exact arithmetic on the CPU (the quantized values multiplied in float64), and the settings' errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lit_flowgrpo.fp8 import (
    Float8FrozenLinear,
    _quantize_rows,
    convert_frozen_linears,
    fp8_problems,
    fp8_supported,
)
from lit_flowgrpo.performance import PerformanceSettings
from lit_flowgrpo.policies import SD3Policy
from lit_flowgrpo.weights import LoraSettings, TrainableWeights, WeightsSettings

# e4m3 keeps 3 mantissa bits: rounding to it moves a value by at most 2^-4 of itself (the scale maps
# each row's largest magnitude to 448, inside the normal range, so nothing underflows that matters at
# this size). A product of two rounded factors is off by at most (1 + 2^-4)^2 - 1 of the exact one.
_E4M3_REL = 2.0**-4
_PRODUCT_REL = (1 + _E4M3_REL) ** 2 - 1


def _frozen_linear(k: int, n: int, seed: int, bias: bool = True) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias)
    linear.requires_grad_(False)
    return linear


def test_rows_are_quantized_within_e4m3_rounding():
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 64)[:, None]
    q, scale = _quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    back = q.double() * scale.double()
    # the largest magnitude of each row lands on 448 exactly, up to the float32 scale's rounding
    assert torch.allclose(back.abs().amax(dim=1), x.double().abs().amax(dim=1), rtol=2**-20)
    big = x.abs() > x.abs().amax(dim=1, keepdim=True) * 2**-6  # normal e4m3 range of each row
    assert ((back - x.double()).abs() <= _E4M3_REL * x.double().abs() + 1e-30)[big].all()


def test_forward_and_input_gradient_are_the_quantized_products():
    linear = _frozen_linear(64, 48, seed=1)
    fp8 = Float8FrozenLinear.from_linear(linear)
    assert fp8.weight is linear.weight and fp8.bias is linear.bias  # same parameters, same names
    # the e4m3 copies are not checkpointed, nor buffers (DDP would broadcast them: gloo cannot)
    assert set(fp8.state_dict()) == {"weight", "bias"} and not list(fp8.buffers())
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    out = fp8(x)
    assert out.shape == (3, 5, 48)
    # exact arithmetic of the quantized operands
    xq, xs = _quantize_rows(x.detach().reshape(-1, 64))
    wq, ws = _quantize_rows(linear.weight)
    expected = (xq.double() * xs.double()) @ (wq.double() * ws.double()).t() + linear.bias.double()
    # float32 accumulation over 64 terms: a few ulps of the sum of magnitudes
    magnitude = (xq.double() * xs.double()).abs() @ (wq.double() * ws.double()).abs().t()
    assert ((out.detach().reshape(-1, 48).double() - expected).abs() <= 64 * 2**-23 * magnitude + 1e-6).all()
    # and within e4m3 rounding of the unquantized product
    exact = x.detach().double() @ linear.weight.double().t() + linear.bias.double()
    bound = _PRODUCT_REL * (x.detach().double().abs() @ linear.weight.double().abs().t()) + 1e-6
    assert ((out.detach().double() - exact).abs() <= bound).all()

    grad = torch.randn(3, 5, 48, generator=torch.Generator().manual_seed(3))
    out.backward(grad)
    gq, gs = _quantize_rows(grad.reshape(-1, 48))
    wtq, wts = _quantize_rows(linear.weight.t())
    expected_dx = (gq.double() * gs.double()) @ (wtq.double() * wts.double()).t()
    magnitude = (gq.double() * gs.double()).abs() @ (wtq.double() * wts.double()).abs().t()
    dx = x.grad.reshape(-1, 64).double()
    assert ((dx - expected_dx).abs() <= 48 * 2**-23 * magnitude + 1e-6).all()
    assert linear.weight.grad is None  # the frozen weight gets no gradient


def test_each_row_is_quantized_the_same_in_any_batch():
    # The rollout and the update batch samples differently: the on-policy ratio needs each token's
    # float8 operand to depend on that token alone (a scale per tensor would couple the batch), so
    # batches differ only by the accumulation order of the product, as bf16 products do.
    fp8 = Float8FrozenLinear.from_linear(_frozen_linear(32, 16, seed=4))
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(5)) * torch.logspace(-2, 2, 8)[:, None]
    q, scale = _quantize_rows(x)
    for i in range(8):
        q_i, scale_i = _quantize_rows(x[i : i + 1])
        assert torch.equal(q_i.view(torch.uint8), q[i : i + 1].view(torch.uint8))
        assert torch.equal(scale_i, scale[i : i + 1])
    together, alone = fp8(x), torch.cat([fp8(x[i : i + 1]) for i in range(8)])
    magnitude = x.abs() @ fp8.weight.abs().t() * (1 + _PRODUCT_REL)
    assert ((together - alone).abs() <= 2 * 32 * 2**-24 * magnitude + 1e-7).all()


def test_loading_weights_quantizes_them_again():
    fp8 = Float8FrozenLinear.from_linear(_frozen_linear(32, 16, seed=10))
    other = _frozen_linear(32, 16, seed=11)
    fp8.load_state_dict(other.state_dict())
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(12))
    assert torch.equal(fp8(x), Float8FrozenLinear.from_linear(other)(x))


def test_a_dtype_conversion_keeps_float8_copies():
    fp8 = Float8FrozenLinear.from_linear(_frozen_linear(32, 16, seed=6))
    fp8.to(torch.bfloat16)
    assert fp8.weight.dtype == torch.bfloat16
    assert fp8.w_fp8.dtype == fp8.w_t_fp8.dtype == torch.float8_e4m3fn
    assert fp8.w_scale.dtype == fp8.w_t_scale.dtype == torch.float32
    assert fp8(torch.randn(4, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_only_frozen_block_linears_outside_the_norms_convert():
    block = nn.Module()
    block.norm1 = nn.Module()
    block.norm1.linear = _frozen_linear(32, 96, seed=7)  # adaptive-norm modulation: stays
    block.proj = _frozen_linear(32, 64, seed=8)
    block.odd = _frozen_linear(32, 24, seed=9)  # not a multiple of 16
    block.trained = nn.Linear(32, 32)
    block.trained_bias = _frozen_linear(32, 32, seed=14)
    block.trained_bias.bias.requires_grad_(True)  # the float8 backward gives a bias no gradient
    assert convert_frozen_linears([block]) == 1
    assert type(block.proj) is Float8FrozenLinear
    assert type(block.norm1.linear) is nn.Linear and type(block.odd) is nn.Linear
    assert type(block.trained) is nn.Linear and type(block.trained_bias) is nn.Linear


def _policy(path: str, lora: LoraSettings | None, performance: PerformanceSettings) -> SD3Policy:
    policy = SD3Policy(path, dtype="float32", max_sequence_length=16)
    policy.load()
    TrainableWeights(WeightsSettings(lora=lora)).attach(policy)
    performance.apply(policy.transformer)
    return policy


def test_lora_policy_runs_its_base_in_float8(tiny_sd3_path):
    plain = _policy(tiny_sd3_path, LoraSettings(rank=4, alpha=8), PerformanceSettings())
    policy = _policy(
        tiny_sd3_path,
        LoraSettings(rank=4, alpha=8),
        PerformanceSettings(fp8_base_matmuls=True),
    )
    converted = [m for m in policy.transformer.modules() if isinstance(m, Float8FrozenLinear)]
    assert converted
    # parameter names, hence checkpoints and exported adapters, are unchanged
    assert [n for n, _ in policy.transformer.named_parameters()] == [
        n for n, _ in plain.transformer.named_parameters()
    ]
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn((2, *policy.latent_shape(32, 32)), generator=gen)
    sigma = torch.tensor([0.3, 0.8])
    embeds = policy.encode_prompts(["a red square", "two blue circles"])
    policy.transformer.train()
    out = policy.velocity(latents, sigma, embeds, 4.5)
    out.square().mean().backward()
    lora_grads = [p.grad for n, p in policy.transformer.named_parameters() if "lora_" in n]
    assert lora_grads and all(g is not None and bool(torch.isfinite(g).all()) for g in lora_grads)
    with torch.no_grad():
        reference = plain.velocity(latents, sigma, embeds, 4.5)
    # a different model (each product's accuracy is pinned by the tests above): the products did run
    # in float8
    assert not torch.equal(out.detach(), reference)


def test_a_full_fine_tune_has_no_frozen_linear_to_convert(tiny_sd3_path):
    with pytest.raises(
        ValueError,
        match=r"--model\.init_args\.performance\.fp8_base_matmuls.*--model\.init_args\.weights\.lora",
    ):
        _policy(tiny_sd3_path, None, PerformanceSettings(fp8_base_matmuls=True))


def test_fp8_and_merged_sampling_exclude_each_other():
    settings = PerformanceSettings(fp8_base_matmuls=True, rollout_merged_lora=True)
    (problem,) = settings.problems()
    assert "fp8_base_matmuls" in problem and "rollout_merged_lora" in problem


def test_every_rule_of_fp8_base_matmuls_is_one_function():
    """The settings' rules and the run's (strategy, device), in one place (``fp8_problems``): what
    ``PerformanceSettings.problems`` reports at construction and the module's setup under a strategy."""
    assert fp8_problems() == [] and fp8_problems(device=torch.device("cpu")) == []
    (full,) = fp8_problems(full_fine_tune=True)
    assert full == PerformanceSettings(fp8_base_matmuls=True).problems(full_fine_tune=True)[0]
    assert "with a full fine-tune (--model.init_args.weights.lora=null)" in full
    (sharded,) = fp8_problems(sharded=True)
    assert "defeats --trainer.strategy=fsdp2: use ddp" in sharded
    assert PerformanceSettings().problems(full_fine_tune=True) == []  # off: no rule applies


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or not fp8_supported(torch.device("cuda")),
    reason="needs a CUDA GPU with float8 tensor cores",
)
def test_scaled_mm_computes_the_quantized_products_on_the_gpu():
    # torch._scaled_mm against the same quantized operands multiplied in float64: the kernel
    # accumulates in float32 and rounds the result to bf16 (2^-8 relative) once.
    device = torch.device("cuda")
    linear = _frozen_linear(256, 512, seed=13).to(device, torch.bfloat16)
    fp8 = Float8FrozenLinear.from_linear(linear)
    x = torch.randn(4, 96, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    out = fp8(x)
    xq, xs = _quantize_rows(x.detach().reshape(-1, 256))
    a, w = xq.double() * xs.double(), fp8.w_fp8.double() * fp8.w_scale.double()
    expected = a @ w.t() + linear.bias.double()
    magnitude = a.abs() @ w.abs().t() + linear.bias.double().abs()
    err = (out.detach().reshape(-1, 512).double() - expected).abs()
    assert (err <= (2**-8 + 256 * 2**-23) * magnitude + 1e-6).all()
    grad = torch.randn(4, 96, 512, device=device, dtype=torch.bfloat16)
    out.backward(grad)
    gq, gs = _quantize_rows(grad.reshape(-1, 512))
    g, wt = gq.double() * gs.double(), fp8.w_t_fp8.double() * fp8.w_t_scale.double()
    magnitude = g.abs() @ wt.abs().t()
    err = (x.grad.reshape(-1, 256).double() - g @ wt.t()).abs()
    assert (err <= (2**-8 + 512 * 2**-23) * magnitude + 1e-6).all()
