"""PerformanceSettings: fp32 adapters computing in the bf16 base's dtype, the forward hooks, compiled
blocks, and the errors that name the flag."""

from __future__ import annotations

import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from tolerances import depth, network_atol

from lit_flowgrpo import FlowGRPOModule
from lit_flowgrpo.performance import PerformanceSettings
from lit_flowgrpo.policies import SD3Policy
from lit_flowgrpo.weights import LoraSettings, TrainableWeights, WeightsSettings


def adapted_policy(path: str, dtype: str, performance: PerformanceSettings) -> SD3Policy:
    policy = SD3Policy(path, dtype=dtype, max_sequence_length=16)
    policy.load()
    TrainableWeights(WeightsSettings(lora=LoraSettings(rank=4, alpha=8))).attach(policy)
    performance.apply(policy.transformer)
    return policy


def velocity_inputs(policy: SD3Policy, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn((2, *policy.latent_shape(32, 32)), generator=gen)
    sigma = torch.rand(2, generator=gen) * 0.9 + 0.05
    return latents, sigma, policy.encode_prompts(["a red square", "two blue circles"])


def lora_output_dtypes(policy: SD3Policy) -> set[torch.dtype]:
    """dtypes of every adapter's down-projection output during one CFG velocity forward."""
    seen: set[torch.dtype] = set()
    hooks = [
        m.lora_A["default"].register_forward_hook(lambda mod, args, out: seen.add(out.dtype))
        for m in policy.transformer.modules()
        if isinstance(m, BaseTunerLayer)
    ]
    try:
        with torch.no_grad():
            policy.velocity(*velocity_inputs(policy), 4.5)
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_problems_name_the_flag(tiny_sd3_path):
    bad = PerformanceSettings(
        compute_dtype="float8",  # type: ignore[arg-type]
        attention_backend="fastest",  # type: ignore[arg-type]
        compile_blocks=True,
        compile_backend="no_such_backend",
    )
    problems = bad.problems()
    assert len(problems) == 3
    for name in ("compute_dtype", "attention_backend", "compile_backend"):
        assert any(p.startswith(f"--model.init_args.performance.{name}") for p in problems), problems
    with pytest.raises(ValueError, match=r"--model\.init_args\.performance\.compute_dtype"):
        FlowGRPOModule(
            policy=SD3Policy(tiny_sd3_path),
            reward=lambda images, prompts, metadata: images.mean(dim=(1, 2, 3)),
            performance=PerformanceSettings(compute_dtype="float8"),  # type: ignore[arg-type]
        )


def test_auto_runs_fp32_adapters_in_the_bf16_base_dtype(tiny_sd3_path):
    policy = adapted_policy(tiny_sd3_path, "bfloat16", PerformanceSettings())
    trainable = [p for p in policy.transformer.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)  # master weights stay fp32
    assert lora_output_dtypes(policy) == {torch.bfloat16}
    assert not any(
        m.cast_input_dtype_enabled for m in policy.transformer.modules() if isinstance(m, BaseTunerLayer)
    )

    policy.transformer.train()
    policy.velocity(*velocity_inputs(policy), 4.5).square().mean().backward()
    grads = [p.grad for p in trainable]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    assert any(bool(g.abs().sum() > 0) for g in grads)
    assert not torch.is_autocast_enabled("cpu")  # the scope ends with the forward


def test_float32_keeps_pefts_fp32_adapter_compute(tiny_sd3_path):
    policy = adapted_policy(tiny_sd3_path, "bfloat16", PerformanceSettings(compute_dtype="float32"))
    assert lora_output_dtypes(policy) == {torch.float32}
    assert not policy.transformer._forward_pre_hooks


def test_auto_leaves_a_float32_model_alone(tiny_sd3_path):
    settings = PerformanceSettings()
    policy = adapted_policy(tiny_sd3_path, "float32", settings)
    assert settings.resolved_dtype(policy.transformer) == torch.float32
    assert not policy.transformer._forward_pre_hooks and not policy.transformer._forward_hooks
    assert lora_output_dtypes(policy) == {torch.float32}


def test_scope_is_left_when_the_forward_raises(tiny_sd3_path):
    policy = adapted_policy(tiny_sd3_path, "bfloat16", PerformanceSettings(attention_backend="math"))
    with pytest.raises((RuntimeError, ValueError, TypeError)):
        policy.transformer(hidden_states=torch.randn(1, 3, 5, 5), timestep=torch.ones(1))
    assert not torch.is_autocast_enabled("cpu")
    # the next forward opens its scope afresh and works
    assert lora_output_dtypes(policy) == {torch.bfloat16}


def test_compiled_blocks_compute_what_eager_blocks_compute(tiny_sd3_path):
    # dynamo's "eager" backend runs the captured ops unchanged, so outputs and gradients must agree
    # bit for bit: this checks the wiring (every block compiled, hooks and adapters inside the graph),
    # not a code generator's rounding.
    eager = adapted_policy(tiny_sd3_path, "float32", PerformanceSettings())
    compiled = adapted_policy(
        tiny_sd3_path, "float32", PerformanceSettings(compile_blocks=True, compile_backend="eager")
    )
    blocks = compiled.transformer.transformer_blocks
    assert len(blocks) > 1 and all(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)
    inputs = velocity_inputs(eager, seed=1)
    outs, grads = [], []
    for policy in (eager, compiled):
        policy.transformer.train()
        out = policy.velocity(*inputs, 4.5)
        out.square().mean().backward()
        outs.append(out.detach())
        grads.append([p.grad.clone() for p in policy.transformer.parameters() if p.requires_grad])
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_compile_mode_is_checked_and_names_the_flag():
    flag = "--model.init_args.performance.compile_mode"
    (bad,) = PerformanceSettings(compile_blocks=True, compile_mode="fastest").problems()  # type: ignore[arg-type]
    assert bad.startswith(f"{flag} (fastest) must be null or one of default, reduce-overhead")
    (alone,) = PerformanceSettings(compile_mode="max-autotune").problems()
    assert alone.startswith(flag) and "compile_blocks=true" in alone
    (merged,) = PerformanceSettings(
        compile_blocks=True, compile_mode="reduce-overhead", rollout_merged_lora=True
    ).problems()
    assert merged.startswith(f"{flag}=reduce-overhead (CUDA graphs)") and "rollout_merged_lora" in merged
    for mode in (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
        settings = PerformanceSettings(compile_blocks=True, compile_mode=mode)
        assert settings.problems() == []
        assert settings.uses_cudagraphs == (mode in ("reduce-overhead", "max-autotune"))
    assert not PerformanceSettings(compile_mode="reduce-overhead").uses_cudagraphs  # nothing compiled


def test_compile_mode_reaches_every_compiled_module(tiny_sd3_path, monkeypatch):
    compiled: dict[str, dict] = {}

    def record(module, *args, **kwargs):  # what torch.compile would be given, without compiling
        compiled[type(module).__name__ + str(id(module))] = kwargs

    monkeypatch.setattr(torch.nn.Module, "compile", record)
    settings = PerformanceSettings(
        compile_blocks=True, compile_decoder=True, compile_mode="max-autotune-no-cudagraphs"
    )
    policy = adapted_policy(tiny_sd3_path, "float32", settings)
    settings.apply_to_decoder(policy.vae)
    blocks = len(policy.transformer.transformer_blocks)
    assert len(compiled) == blocks + 1  # every block and the decoder
    assert all(
        k == {"backend": "inductor", "dynamic": False, "mode": "max-autotune-no-cudagraphs"}
        for k in compiled.values()
    )


def test_cuda_graph_modes_begin_a_step_at_each_no_grad_forward(tiny_sd3_path, monkeypatch):
    """The step marks of the CUDA graph modes (see lit_flowgrpo.performance): one before each no-grad
    transformer forward, none before a forward whose backward is to come. The eager backend ignores
    the mode, so the blocks run compiled without inductor and without CUDA graphs here."""
    marks: list[bool] = []
    monkeypatch.setattr(
        torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(torch.is_grad_enabled())
    )
    for mode, expected in (("reduce-overhead", 2), ("max-autotune-no-cudagraphs", 0)):
        marks.clear()
        settings = PerformanceSettings(compile_blocks=True, compile_backend="eager", compile_mode=mode)
        policy = adapted_policy(tiny_sd3_path, "float32", settings)
        inputs = velocity_inputs(policy)
        with torch.no_grad():
            first = policy.velocity(*inputs, 4.5)
            assert torch.equal(policy.velocity(*inputs, 4.5), first)
        policy.transformer.train()
        policy.velocity(*inputs, 4.5).square().mean().backward()
        assert marks == [False] * expected, (mode, marks)


def test_merged_sampling_computes_the_adapted_model_and_restores_the_weights(tiny_sd3_path):
    settings = PerformanceSettings(rollout_merged_lora=True)
    policy = adapted_policy(tiny_sd3_path, "float32", settings)
    transformer = policy.transformer
    with torch.no_grad():  # a non-zero adapter (gaussian init starts B at 0: a merge of nothing)
        for i, (name, p) in enumerate(transformer.named_parameters()):
            if "lora_B" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(i))
    frozen = {n: p.detach().clone() for n, p in transformer.named_parameters() if not p.requires_grad}
    layers = [m for m in transformer.modules() if isinstance(m, BaseTunerLayer)]
    inputs = velocity_inputs(policy, seed=2)
    with torch.no_grad():
        adapted = policy.velocity(*inputs, 4.5)
        transformer.disable_adapters()
        base = policy.velocity(*inputs, 4.5)
        transformer.enable_adapters()
        with settings.sampling_weights(transformer):
            assert all(m.disable_adapters for m in layers)  # the merged weights alone compute
            merged = policy.velocity(*inputs, 4.5)
    # fp32 reassociation W·x + B·(A·x) → (W + B·A)·x: each adapted layer rounds by about eps of its
    # scale in another way, and CFG amplifies each forward's rounding by |1 − 4.5| + 4.5 = 8
    # (tests/tolerances.py; 8.9e-5 here, measured 1.6e-6), while the adapter itself moves the output
    # by orders of magnitude more
    atol = network_atol(8 * depth(transformer), float(adapted.abs().max()))
    torch.testing.assert_close(merged, adapted, rtol=0, atol=atol)
    assert (base - adapted).abs().max() > 100 * atol
    for n, p in transformer.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"{n} changed"
    assert all(not m.disable_adapters for m in layers)
    assert all(p.requires_grad for n, p in transformer.named_parameters() if "lora_" in n)


def test_merged_sampling_needs_an_adapter(tiny_sd3_path):
    policy = SD3Policy(tiny_sd3_path, dtype="float32", max_sequence_length=16)
    policy.load()
    TrainableWeights(WeightsSettings(lora=None)).attach(policy)
    with pytest.raises(
        ValueError, match=r"--model\.init_args\.performance\.rollout_merged_lora needs a LoRA"
    ):
        PerformanceSettings(rollout_merged_lora=True).apply(policy.transformer)


def test_flop_counting_leaves_compiled_blocks_compiled(tiny_sd3_path):
    # RLThroughputMonitor counts FLOPs at train start, before the first rollout: a compiled block
    # first called under FlopCounterMode used to stay eager for the whole run, silently.
    from torch._dynamo.utils import counters

    from lit_flowgrpo.callbacks import measure_transformer_flops

    policy = adapted_policy(
        tiny_sd3_path, "float32", PerformanceSettings(compile_blocks=True, compile_backend="eager")
    )
    measure_transformer_flops(policy, 32, 32)
    counters.clear()
    with torch.no_grad():
        policy.velocity(*velocity_inputs(policy), 4.5)
    assert counters["frames"]["ok"] > 0, "no block was compiled after the FLOP count"


def test_compiled_decoder_decodes_what_the_eager_decoder_decodes(tiny_sd3_path):
    # the "eager" backend runs the captured ops unchanged: bit for bit equal, and the wiring checked
    settings = PerformanceSettings(compile_blocks=True, compile_backend="eager", compile_decoder=True)
    eager = SD3Policy(tiny_sd3_path, dtype="float32", max_sequence_length=16)
    compiled = SD3Policy(tiny_sd3_path, dtype="float32", max_sequence_length=16)
    for p in (eager, compiled):
        p.load()
    from torch._dynamo.utils import counters

    settings.apply_to_decoder(compiled.vae)
    assert getattr(compiled.vae.decoder, "_compiled_call_impl", None) is not None
    latents = torch.randn((2, *eager.latent_shape(32, 32)), generator=torch.Generator().manual_seed(3))
    counters.clear()
    with torch.no_grad():
        assert torch.equal(eager.decode(latents), compiled.decode(latents))
    assert counters["frames"]["ok"] > 0, "the decoder ran without being compiled"


def test_compile_decoder_needs_compiled_blocks_and_a_decoder():
    (problem,) = PerformanceSettings(compile_decoder=True).problems()
    assert (
        problem.startswith("--model.init_args.performance.compile_decoder")
        and "compile_blocks=true" in problem
    )
    with pytest.raises(ValueError, match=r"--model\.init_args\.performance\.compile_decoder.*no `decoder`"):
        PerformanceSettings(compile_blocks=True, compile_decoder=True).apply_to_decoder(torch.nn.Linear(2, 2))


def test_activation_checkpointing_recomputes_blocks_with_the_same_gradients(tiny_sd3_path):
    # Recomputing a deterministic fp32 forward gives the same activations, so the gradients are
    # bit-equal; each block runs once more, in the backward, and only where gradients are taken.
    plain = adapted_policy(tiny_sd3_path, "float32", PerformanceSettings())
    checkpointed = adapted_policy(
        tiny_sd3_path, "float32", PerformanceSettings(activation_checkpointing=True)
    )
    assert (
        checkpointed.transformer.is_gradient_checkpointing and not plain.transformer.is_gradient_checkpointing
    )
    inputs = velocity_inputs(plain, seed=2)
    grads, calls = [], []
    for policy in (plain, checkpointed):
        seen: list[int] = []
        block = policy.transformer.transformer_blocks[0]
        hook = block.register_forward_pre_hook(lambda *_, seen=seen: seen.append(1))
        policy.transformer.train()
        with torch.no_grad():
            policy.velocity(*inputs, 4.5)  # a rollout forward: nothing to recompute
        policy.velocity(*inputs, 4.5).square().mean().backward()
        hook.remove()
        calls.append(len(seen))
        grads.append([p.grad.clone() for p in policy.transformer.parameters() if p.requires_grad])
    assert calls == [2, 3]
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_activation_checkpointing_of_a_model_without_it_names_the_setting():
    with pytest.raises(
        ValueError, match=r"performance\.activation_checkpointing=true: Linear has no gradient"
    ):
        PerformanceSettings(activation_checkpointing=True).apply(torch.nn.Linear(2, 2))


def test_activation_checkpointing_recomputes_under_the_forwards_attention_kernels(tiny_sd3_path):
    # The backward recomputes each block after the transformer's forward scope has closed: the
    # recomputation must still run with the kernels the forward chose (PyTorch's switches are global).
    policy = adapted_policy(
        tiny_sd3_path, "float32", PerformanceSettings(attention_backend="math", activation_checkpointing=True)
    )
    switches = torch.backends.cuda
    seen: list[tuple[bool, bool, bool, bool]] = []

    def record(*_):
        seen.append(
            (
                switches.cudnn_sdp_enabled(),
                switches.flash_sdp_enabled(),
                switches.mem_efficient_sdp_enabled(),
                switches.math_sdp_enabled(),
            )
        )

    hook = policy.transformer.transformer_blocks[0].register_forward_pre_hook(record)
    policy.transformer.train()
    policy.velocity(*velocity_inputs(policy), 4.5).square().mean().backward()
    hook.remove()
    assert seen == [(False, False, False, True)] * 2  # the forward and its recomputation
    assert switches.cudnn_sdp_enabled() and switches.flash_sdp_enabled()  # restored afterwards


def test_flop_count_leaves_out_what_activation_checkpointing_recomputes(tiny_sd3_path):
    # MFU counts the model's FLOPs: a checkpointed backward runs each block's forward again, and that
    # rematerialisation must not raise perf/mfu/actor.
    from lit_flowgrpo.callbacks import measure_transformer_flops

    counts = [
        measure_transformer_flops(
            adapted_policy(tiny_sd3_path, "float32", PerformanceSettings(activation_checkpointing=on)), 32, 32
        )
        for on in (False, True)
    ]
    assert counts[0] == counts[1] and counts[0][1] > counts[0][0]
