"""The toy model and ToyPolicy: interface, CFG batching, caching, checkpoints, the shipped base."""

from __future__ import annotations

import os
from copy import deepcopy
from dataclasses import replace

import pytest
import torch
from peft import LoraConfig
from tolerances import depth, network_atol

import lit_flowgrpo.toy.policy as toy_policy_module
from lit_flowgrpo.policies.base import FlowPolicy
from lit_flowgrpo.toy import world
from lit_flowgrpo.toy.evaluate import evaluate_base
from lit_flowgrpo.toy.model import (
    CHECKPOINT_FORMAT,
    PRETRAIN_COMMAND,
    ToyModelConfig,
    build_models,
    default_checkpoint,
    predict_velocity,
    read_checkpoint_metadata,
    save_checkpoint,
    unet_config,
)
from lit_flowgrpo.toy.policy import ToyPolicy

TINY = ToyModelConfig(
    block_out_channels=(8, 16),
    attention_heads=2,
    norm_num_groups=4,
    text_dim=16,
    text_layers=1,
    text_heads=2,
)
PROMPTS = ["a red circle", "two green squares", "a blue square to the left of a yellow circle"]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.manual_seed(0)
    unet, text_encoder = build_models(TINY)
    # Random init leaves the output convolution at zero; perturb every weight so outputs depend on inputs.
    with torch.no_grad():
        for p in unet.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = str(tmp_path_factory.mktemp("toy") / "tiny.safetensors")
    save_checkpoint(path, unet, text_encoder, dtype=torch.float32, info={"steps": "0"})
    return path


def _depth(policy: ToyPolicy) -> int:
    """Reducing layers of the toy's two networks (tests/tolerances.py): an upper bound on the
    reductions along any path, each of which may round by ~eps of its output's scale when a kernel
    orders its sum differently (another batch size, another code path)."""
    return depth(policy.unet, policy.text_encoder)


@pytest.fixture
def policy(tiny_checkpoint: str) -> ToyPolicy:
    p = ToyPolicy(tiny_checkpoint)
    p.load()
    return p


def test_interface_shapes_and_decode(policy: ToyPolicy) -> None:
    assert isinstance(policy, FlowPolicy)
    assert policy.latent_shape(32, 32) == (3, 32, 32)
    embeds = policy.encode_prompts(PROMPTS)
    assert embeds["text_hidden"].shape == (3, TINY.max_length, TINY.text_dim)
    assert embeds["text_pooled"].shape == (3, TINY.text_dim)
    # The mask marks the begin token plus every word: 1 + 3, 1 + 3, 1 + 10.
    assert embeds["text_mask"].sum(1).tolist() == [4, 4, 11]
    x = torch.randn(3, 3, 32, 32)
    v = policy.velocity(x, torch.tensor([1.0, 0.5, 0.1]), embeds, 4.5)
    assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    images = policy.decode(torch.tensor([-2.0, -1.0, 0.0, 0.5, 1.0, 3.0]).view(1, 1, 1, 6).expand(1, 3, 1, 6))
    assert images[0, 0, 0].tolist() == [0.0, 0.0, 0.5, 0.75, 1.0, 1.0]


def test_bfloat16_policy_returns_fp32_close_to_fp32(tiny_checkpoint: str, policy: ToyPolicy) -> None:
    low = ToyPolicy(tiny_checkpoint, dtype="bfloat16")
    low.load()
    assert low.transformer.dtype == torch.bfloat16
    x, sigma = torch.randn(2, 3, 32, 32), torch.tensor([0.8, 0.3])
    low_embeds, ref_embeds = low.encode_prompts(PROMPTS[:2]), policy.encode_prompts(PROMPTS[:2])
    assert low.velocity(x, sigma, low_embeds, 3.0).dtype == torch.float32  # the guided path casts too
    v_low = low.velocity(x, sigma, low_embeds, 1.0)
    v_ref = policy.velocity(x, sigma, ref_embeds, 1.0)
    assert v_low.dtype == torch.float32
    # First-order error bound: each reducing layer on the way rounds its operands to bf16 (unit
    # roundoff 2^-8), adding at most that relative error to what flows through it; no path has more
    # such layers than the network (113). Measured: 0.014 · max|v|; the bound is 113 · 2^-8 ≈ 0.44.
    bound = _depth(policy) * 2.0**-8 * v_ref.abs().max()
    assert (v_low - v_ref).abs().max() <= bound


def test_sigmas_linear_and_shifted(tiny_checkpoint: str) -> None:
    assert ToyPolicy(tiny_checkpoint).sigmas(4, 32, 32).tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    # SD3 shift s = 3: σ' = 3σ / (1 + 2σ); at σ = 0.5 that is 1.5 / 2 = 0.75, at 0.25 it is 0.5.
    shifted = ToyPolicy(tiny_checkpoint, shift=3.0).sigmas(4, 32, 32)
    torch.testing.assert_close(shifted, torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0]))


def test_cfg_is_one_batched_forward_equal_to_two_separate(policy: ToyPolicy) -> None:
    torch.manual_seed(1)
    x = torch.randn(3, 3, 32, 32)
    sigma = torch.tensor([0.9, 0.5, 0.2])
    embeds = policy.encode_prompts(PROMPTS)
    batches = []
    hook = policy.transformer.register_forward_hook(lambda m, args, out: batches.append(args[0].shape[0]))
    try:
        guided = policy.velocity(x, sigma, embeds, 3.0)
        assert batches == [6]  # cond and uncond together, one forward
        cond = policy.velocity(x, sigma, embeds, 1.0)
        uncond = policy.velocity(x, sigma, policy.encode_prompts([""] * 3), 1.0)
        assert batches == [6, 3, 3]
    finally:
        hook.remove()
    # The batched forward may order its reductions differently from the two batch-3 forwards: each
    # reducing layer may move its output by ~eps of its scale, at most depth · eps at the end; the
    # guidance (1 − g)·v_u + g·v_c scales that by |1 − g| + g = 5. Measured: 6e-6; bound: 1.6e-4.
    bound = network_atol(5 * _depth(policy), float(torch.maximum(cond.abs().max(), uncond.abs().max())))
    assert (guided - (uncond + 3.0 * (cond - uncond))).abs().max() <= bound
    assert (cond - uncond).abs().max() > 1e-3  # the text really changes the prediction


def test_prompt_cache_and_padding_independence(policy: ToyPolicy) -> None:
    together = policy.encode_prompts(PROMPTS)
    assert set(policy._cache) == set(PROMPTS)
    policy._cache.clear()
    alone = policy.encode_prompts([PROMPTS[0]])
    # A prompt's states do not depend on the other prompts of its batch, to the bit: each prompt is
    # encoded alone (PromptCache), so batched kernels' rounding cannot enter.
    for key in together:
        assert torch.equal(alone[key][0], together[key][0]), key
    repeated = policy.encode_prompts([PROMPTS[0], PROMPTS[0]])
    assert len(policy._cache) == 1
    assert torch.equal(repeated["text_pooled"][0], repeated["text_pooled"][1])
    # Padding rows are exactly zero.
    assert together["text_hidden"][0, 4:].abs().max() == 0


def test_unknown_words_are_listed(policy: ToyPolicy) -> None:
    with pytest.raises(ValueError, match=r"\['purple', 'hexagon'\]"):
        policy.encode_prompts(["a purple hexagon and a red circle"])


def test_export_round_trip_fp32_and_fp16(tmp_path: os.PathLike) -> None:
    torch.manual_seed(2)
    unet, text_encoder = build_models(TINY)
    with torch.no_grad():
        for p in unet.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x, sigma = torch.randn(2, 3, 32, 32), torch.tensor([0.7, 0.3])
    velocities = {}
    for dtype in (torch.float32, torch.float16):
        # An fp16 export is the model with every floating tensor rounded to fp16, nothing else: the
        # reference is that rounded model, so both comparisons are exact.
        reference = _rounded_copy(unet, dtype), _rounded_copy(text_encoder, dtype)
        path = str(tmp_path / f"m_{dtype}.safetensors")
        save_checkpoint(path, unet, text_encoder, dtype=dtype, info={"steps": "7"})
        assert read_checkpoint_metadata(path)["steps"] == "7"
        policy = ToyPolicy(path)
        policy.load()
        for module, ref in zip((policy.unet, policy.text_encoder), reference, strict=True):
            loaded, expected = module.state_dict(), ref.state_dict()
            assert loaded.keys() == expected.keys()
            assert all(torch.equal(loaded[k], expected[k]) for k in expected)
        got = policy.velocity(x, sigma, policy.encode_prompts(PROMPTS[:2]), 1.0)
        assert torch.equal(got, _reference_velocity(*reference, x, sigma, PROMPTS[:2]))
        velocities[dtype] = got
    assert not torch.equal(velocities[torch.float16], velocities[torch.float32])  # fp16 really rounds


def test_text_at_full_resolution_round_trips_and_reads_the_text_at_32x32(tmp_path: os.PathLike) -> None:
    # The default keeps the shipped layout: no text at 32x32, diffusers' defaults untouched.
    assert "only_cross_attention" not in unet_config(TINY)
    config = replace(TINY, text_at_full_resolution=True)
    torch.manual_seed(3)
    unet, text_encoder = build_models(config)
    assert [type(b).__name__ for b in unet.down_blocks] == ["CrossAttnDownBlock2D"] * 2
    assert [type(b).__name__ for b in unet.up_blocks] == ["CrossAttnUpBlock2D"] * 2
    first, last = unet.down_blocks[0].attentions[0], unet.down_blocks[1].attentions[0]
    # 32x32: both attentions read the text (keys from text_dim); 16x16 keeps its self-attention.
    assert first.transformer_blocks[0].attn1.to_k.in_features == config.text_dim
    assert last.transformer_blocks[0].attn1.to_k.in_features == config.block_out_channels[1]
    assert unet.up_blocks[-1].attentions[0].transformer_blocks[0].attn1.to_k.in_features == config.text_dim
    with torch.no_grad():
        for p in unet.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = str(tmp_path / "full.safetensors")
    save_checkpoint(path, unet, text_encoder, dtype=torch.float32, info={"steps": "0"})
    policy = ToyPolicy(path)
    policy.load()  # the layout travels in the checkpoint's unet_config
    assert policy.unet.config.only_cross_attention == [True, False]
    x, sigma = torch.randn(2, 3, 32, 32), torch.tensor([0.9, 0.9])
    got = policy.velocity(x, sigma, policy.encode_prompts(PROMPTS[:2]), 1.0)
    assert torch.equal(got, _reference_velocity(unet, text_encoder, x, sigma, PROMPTS[:2]))
    # The 32x32 attentions are on the path: zeroing their output projections changes the velocity.
    with torch.no_grad():
        policy.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn2.to_out[0].weight.zero_()
        policy.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_out[0].weight.zero_()
    assert not torch.equal(policy.velocity(x, sigma, policy.encode_prompts(PROMPTS[:2]), 1.0), got)


def _rounded_copy(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    copy = deepcopy(module)
    with torch.no_grad():
        for tensor in copy.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(tensor.to(dtype))
    return copy


def _reference_velocity(unet, text_encoder, x: torch.Tensor, sigma: torch.Tensor, prompts: list[str]):
    # ToyPolicy.load freezes the text encoder in eval mode, where torch runs its fused encoder
    # kernel; the reference does the same so that both sides run identical arithmetic.
    text_encoder.requires_grad_(False).eval()
    ids, mask = text_encoder.tokenize(prompts)
    with torch.no_grad():
        hidden, pooled = text_encoder(ids, mask)
    embeds = {"text_hidden": hidden, "text_mask": mask, "text_pooled": pooled}
    return predict_velocity(unet, x, sigma, embeds).float()


def test_missing_and_corrupt_checkpoints_say_how_to_regenerate(
    tmp_path: os.PathLike, tiny_checkpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = ToyPolicy(str(tmp_path / "nope.safetensors"))
    assert any("--model.init_args.policy.init_args.pretrained" in p for p in missing.problems())
    with pytest.raises(ValueError, match=r"--model\.init_args\.policy\.init_args\.pretrained"):
        missing.load()

    # The shipped default gone (a packaging mistake): the problem says how to get it back.
    monkeypatch.setattr(
        toy_policy_module, "default_checkpoint", lambda: str(tmp_path / "toy_base.safetensors")
    )
    (problem,) = ToyPolicy().problems()
    assert "shipped toy checkpoint" in problem and PRETRAIN_COMMAND in problem and "git checkout" in problem

    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 1\n")
    truncated = tmp_path / "truncated.safetensors"
    with open(tiny_checkpoint, "rb") as f:
        truncated.write_bytes(f.read()[:5000])
    foreign = tmp_path / "foreign.safetensors"
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(foreign))
    for path in (garbage, truncated, foreign):
        policy = ToyPolicy(str(path))
        assert policy.problems() == []
        with pytest.raises(ValueError, match=PRETRAIN_COMMAND.replace(".", r"\.")):
            policy.load()


def test_bad_settings_are_reported(tiny_checkpoint: str) -> None:
    problems = ToyPolicy(tiny_checkpoint, dtype="float64", shift=0.0).problems()  # type: ignore[arg-type]
    assert len(problems) == 2
    assert (
        "--model.init_args.policy.init_args.dtype" in problems[0]
        and "--model.init_args.policy.init_args.shift" in problems[1]
    )
    with pytest.raises(ValueError, match="divisible by 2"):
        _loaded(tiny_checkpoint).latent_shape(31, 32)
    with pytest.raises(RuntimeError, match="load"):
        _ = ToyPolicy(tiny_checkpoint).transformer


def _loaded(path: str) -> ToyPolicy:
    policy = ToyPolicy(path)
    policy.load()
    return policy


def test_default_lora_targets_match_and_train_only_lora(policy: ToyPolicy) -> None:
    unet = policy.transformer
    names = [n for n, _ in unet.named_modules()]
    for target in ToyPolicy.default_lora_targets:
        assert any(n == target or n.endswith("." + target) for n in names), target
    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=list(ToyPolicy.default_lora_targets)))
    with torch.no_grad():  # LoRA B starts at zero; move it so gradients reach A too
        for n, p in unet.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.01)
    x = torch.randn(2, 3, 32, 32)
    v = policy.velocity(x, torch.tensor([0.5, 0.5]), policy.encode_prompts(PROMPTS[:2]), 2.0)
    v.square().mean().backward()
    grads = {n: p.grad for n, p in unet.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)
    assert all(p.grad is None for p in policy.text_encoder.parameters())


def test_shipped_checkpoint_loads_and_is_small() -> None:
    path = default_checkpoint()
    assert os.path.isfile(path), f"the shipped checkpoint is missing; regenerate with `{PRETRAIN_COMMAND}`"
    assert os.path.getsize(path) <= 8 * 2**20
    metadata = read_checkpoint_metadata(path)
    assert metadata["format"] == CHECKPOINT_FORMAT
    policy = ToyPolicy()
    assert policy.problems() == []
    policy.load()
    assert policy.text_encoder.vocab == world.VOCAB


def test_shipped_checkpoint_draws_single_colored_objects() -> None:
    # The shipped base scores 0.88 strict on held-out "a <colour> <shape>" prompts (1000 samples,
    # configs/toy_pretrain.yaml's header). 16 samples at 10 steps: a broken or untrained checkpoint
    # scores ~0 here, and the base falls below 0.5 with probability well under 1e-3.
    policy = ToyPolicy()
    policy.load()
    records = [r for r in world.load_prompts("val") if r["tag"] == "colors"][:8]
    result = evaluate_base(policy, records, seeds=[0, 1], num_steps=10, guidance=4.0)
    assert result["n"] == 16
    assert result["strict"] >= 0.5, result
