"""Speed settings of the transformer's forward: compute dtype, regional compilation, attention backend.

Every setting acts on the one place all transformer forwards go through, the transformer itself, so
the rollout, the update and the KL reference (and the FLOP count) run with the same numerics: the
importance ratio at the first update stays at 1 up to the dtype's rounding. A speed-up that made the
rollout and the update compute differently would show up as policy change and be clipped.

- ``compute_dtype``: the matrix products run under ``torch.autocast`` in the dtype the policy loaded
  (bf16 for the shipped recipes). The LoRA weights, and a full fine-tune's transformer, stay fp32
  master weights, as the optimizer needs (``--model.init_args.weights.master_dtype``); without autocast peft
  computes the adapters in fp32, casting every adapter input to fp32 and back. A full fine-tune's
  frozen copies (the KL reference, the old policy) keep the loaded dtype and get the same autocast.
- ``compile_blocks``: ``torch.compile`` of each repeated transformer block (regional compilation, as
  diffusers' ``ModelMixin.compile_repeated_blocks``): one compiled graph serves every block of a
  class, so compiling costs seconds per graph rather than minutes for the whole model. The largest
  lever measured (``benchmarks/results``): the SD3.5-M step twice as fast on an H100. Off by default
  only because the first rollout and update pay for compiling.
- ``compile_decoder``: the VAE decoder compiled as well (the rollout's decode, about 6% of it at
  SD3.5-M / 512 px on an H200).
- ``compile_mode``: torch.compile's mode for everything compiled here. ``"reduce-overhead"`` and
  ``"max-autotune"`` capture CUDA graphs (inductor's CUDA graph trees), which replay a block's kernels
  in one launch: the lever for a host that cannot launch kernels as fast as the GPU runs them.
  ``"max-autotune(-no-cudagraphs)"`` benchmarks Triton templates against cuBLAS for each product at
  compile time (minutes more per graph).

  CUDA graph trees start a new "step" at each compiled call when no backward is pending, and free
  the outputs of the previous step. Blocks compiled one by one chain their outputs (block i's output
  is block i + 1's input), so in a no-grad forward each block would free its own input (PyTorch issue
  152887: "advise users against using cudagraph when compiling individual transformer blocks"). Once
  ``torch.compiler.cudagraph_mark_step_begin()`` has been called, steps begin only at such calls; so
  each no-grad transformer forward (a sampling step, an evaluation, the update's reference and
  old-policy forwards) begins one, and its blocks chain inside it. Nothing crosses those forwards:
  the transformer's head, which makes its output, runs eagerly. Forwards with gradients begin none:
  a step begun between a forward and its backward would free the activations that backward needs;
  the trees' own tracking of which outputs are still alive keeps them (a forward then records as a
  child of the previous backward, and replays as one).
- ``attention_backend``: the ``scaled_dot_product_attention`` kernel (``torch.nn.attention.sdpa_kernel``);
  ``auto`` is PyTorch's choice minus kernels known to fail at the model's shape (:mod:`lit_flowgrpo.attention`).
- ``fp8_base_matmuls``: the frozen base weights of a LoRA run multiply in float8 (``lit_flowgrpo.fp8``).
  Not exact against bf16, but the rollout, the update and the reference all use it and each token
  is quantized alone, so the importance ratio is unaffected; off by default.
- ``activation_checkpointing``: the update recomputes each transformer block's activations in its
  backward instead of keeping them (the model's own gradient checkpointing), on one GPU, under DDP
  or fsdp2 alike: memory for one more forward per update pass. Sampling (no gradient) is unaffected.
- ``rollout_merged_lora``: sampling (no gradient) runs on a copy of each adapted weight with the LoRA
  delta merged in: one matrix product per layer instead of three. Not exact: the update keeps the
  adapter path, so rollout and update round differently in bf16 (``actor/on_policy_ratio_err``
  reports by how much); off by default.
- ``sequence_parallel``: each sample's tokens split over this many ranks inside the transformer
  (diffusers' context parallelism, Ulysses attention; :mod:`lit_flowgrpo.sequence_parallel`), in the
  rollout, the update and the reference alike; the ranks of one group hold the same samples
  (:mod:`lit_flowgrpo.distributed`). Exact up to the order of float sums.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lit_flowgrpo.attention import AttentionShape, capability_of, choose_kernels, sdpa_backends
from lit_flowgrpo.errors import SettingsError

__all__ = ["PerformanceSettings"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: ``torch.compile``'s modes (``None``: its default).
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: The modes that run the compiled graphs as CUDA graphs.
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bf16 matrices in hardware: a CUDA GPU that supports bf16, or a
    CPU with AVX-512 BF16 or AMX instructions.

    Elsewhere PyTorch emulates the bf16 products, and on a CPU that is ruinous: a 1024 × 1024 product
    took 2.2 s in bf16 against 0.014 s in float32 on a 2-core AVX2 machine. ``torch.cpu`` has no public
    query for these instructions; its private ones are what inductor asks, read here with a fallback
    so a PyTorch without them answers "no" rather than failing.
    """
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        queries = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(bool(getattr(torch.cpu, q, lambda: False)()) for q in queries)
    return False


@dataclass
class PerformanceSettings:
    """How the policy's transformer computes (rollout, update and reference alike).

    Args:
        compute_dtype: dtype of the transformer's matrix products. ``"auto"``: the dtype the policy
            loaded it in (bf16 in the recipes), so fp32 LoRA weights, or a full fine-tune's fp32
            master weights, compute in bf16 through ``torch.autocast`` while staying fp32 for the
            optimizer; a float32 model computes in float32. ``"float32"``: no autocast (peft then computes fp32 adapters in fp32).
        compile_blocks: ``torch.compile`` each repeated transformer block (regional compilation).
            The first rollout and the first update compile (about a minute at SD3.5-M scale); each
            new batch shape compiles once more (a short last rollout chunk too).
        compile_backend: the ``torch.compile`` backend (``"inductor"``; ``"aot_eager"`` traces without
            generating kernels, for debugging).
        compile_decoder: ``torch.compile`` the VAE's decoder too (``vae.decoder``), which turns each
            rollout's latents into images; it recompiles for each new batch shape. Needs
            ``compile_blocks`` (the same backend).
        compile_mode: ``torch.compile``'s ``mode`` for the blocks and the decoder: ``None`` (torch's
            default), ``"default"``, ``"reduce-overhead"`` (CUDA graphs), ``"max-autotune"`` (Triton
            templates benchmarked against cuBLAS at compile time, and CUDA graphs) or
            ``"max-autotune-no-cudagraphs"``. Inductor's modes: other backends ignore them (with
            torch's warning), except for the step marks below.
            The CUDA graph modes begin a CUDA graph step at each no-grad transformer forward (see the
            module docstring); on a CPU inductor captures no graph and they compile as the others.
            Measured on one GPU only, and not with ``rollout_merged_lora``, which swaps the weights
            the graphs read at every rollout.
        attention_backend: the ``scaled_dot_product_attention`` kernel: ``"auto"`` lets PyTorch choose
            (cuDNN first on Hopper), except kernels known to fail at the model's attention shape on
            this GPU (:data:`lit_flowgrpo.attention.KNOWN_FAULTS`: cuDNN at FLUX's 512 px shape);
            ``"cudnn"``, ``"flash"``, ``"efficient"`` or ``"math"`` force one: a warning if it is
            known to fail there; an error, before any rollout, if it cannot run the model's attention
            (flash with masked prompts; cuDNN or flash with float32 compute). The math kernel stays
            on as the last resort for rewards scoring on other threads (PyTorch's switches are
            process-wide; :func:`lit_flowgrpo.attention.sdpa_backends`).
        fp8_base_matmuls: the frozen base weights of the transformer blocks multiply in float8 (e4m3,
            one scale per row; ``lit_flowgrpo.fp8``), in the rollout, the update and the reference
            alike; adapters, norms and attention stay in ``compute_dtype``. A LoRA run on a GPU with
            float8 tensor cores (Hopper, Ada); the CPU computes the same values without a speed-up.
            Not exact against bf16 (each product rounds its inputs to 3 mantissa bits), so off by
            default. Every token of every product quantizes with its own scale, whatever the batch,
            so the on-policy ratio is unaffected (``actor/on_policy_ratio_err``).
        activation_checkpointing: recompute each transformer block's activations in the update's
            backward instead of keeping them (diffusers' ``enable_gradient_checkpointing``): the
            activation memory of one block instead of all, for about one more forward per update
            pass. The one flag for it, under any strategy (DDP, fsdp2, one device).
        rollout_merged_lora: sample the rollout (and validation) with each LoRA delta merged into a
            copy of its base weight, which costs the memory of the adapted weights (bf16). Not exact
            (see the module docstring): watch ``actor/on_policy_ratio_err``. Single-device and DDP
            only (sharded weights cannot be swapped).
        sequence_parallel: split each sample's tokens over this many ranks (sequence parallelism, for
            long videos): the world of dp × sp ranks becomes dp data-parallel groups of sp ranks, each
            group generating and training the same samples, each rank computing every transformer
            block on 1/sp of the tokens (Ulysses attention: an all-to-all in each self-attention).
            Must divide the number of ranks, the transformer's attention heads and the video tokens
            per sample; Wan and HunyuanVideo 1.5; under ``--trainer.strategy=ddp`` or ``fsdp2``. 1: off.
    """

    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    compile_blocks: bool = False
    compile_backend: str = "inductor"
    compile_decoder: bool = False
    compile_mode: (
        Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None
    ) = None
    attention_backend: Literal["auto", "cudnn", "flash", "efficient", "math"] = "auto"
    fp8_base_matmuls: bool = False
    activation_checkpointing: bool = False
    rollout_merged_lora: bool = False
    sequence_parallel: int = 1

    def problems(
        self,
        flag: str = "--model.init_args.performance",
        full_fine_tune: bool = False,
        masked_prompts: bool = False,
    ) -> list[str]:
        """Every problem with these settings; ``full_fine_tune``: also what they ask of trained weights
        that a full fine-tune cannot give, and ``masked_prompts`` (the policy pads and masks its
        prompts): of the attention kernel, known from the config alone (:meth:`apply` would find them
        only once the weights are loaded)."""
        p = []
        if self.fp8_base_matmuls:
            from lit_flowgrpo.fp8 import fp8_problems

            p += fp8_problems(
                flag, full_fine_tune=full_fine_tune, rollout_merged_lora=self.rollout_merged_lora
            )
        if full_fine_tune and self.rollout_merged_lora:
            p.append(
                f"{flag}.rollout_merged_lora with a full fine-tune (--model.init_args.weights.lora=null): it merges a "
                "LoRA adapter, and a full fine-tune has none; set --model.init_args.weights.lora, or drop the setting"
            )
        if isinstance(self.sequence_parallel, bool) or not isinstance(self.sequence_parallel, int):
            p.append(f"{flag}.sequence_parallel ({self.sequence_parallel!r}) must be a whole number of ranks")
        elif self.sequence_parallel < 1:
            p.append(f"{flag}.sequence_parallel ({self.sequence_parallel}) must be at least 1 (1: off)")
        if self.compute_dtype not in ("auto", *_DTYPES):
            p.append(
                f"{flag}.compute_dtype ({self.compute_dtype}) must be auto, float32, bfloat16 or float16"
            )
        shape = AttentionShape(0, 0, 0, masked=True) if masked_prompts else None
        p += choose_kernels(self.attention_backend, shape, None, f"{flag}.attention_backend")[2]
        if self.compile_decoder and not self.compile_blocks:
            p.append(f"{flag}.compile_decoder needs {flag}.compile_blocks=true (it uses its compile_backend)")
        if self.compile_mode not in COMPILE_MODES:
            p.append(
                f"{flag}.compile_mode ({self.compile_mode}) must be null or one of "
                f"{', '.join(m for m in COMPILE_MODES if m)} (torch.compile's modes)"
            )
        elif self.compile_mode is not None and not self.compile_blocks:
            p.append(
                f"{flag}.compile_mode needs {flag}.compile_blocks=true (it is the mode of what that compiles)"
            )
        if self.uses_cudagraphs and self.rollout_merged_lora:
            p.append(
                f"{flag}.compile_mode={self.compile_mode} (CUDA graphs) and {flag}.rollout_merged_lora: each "
                "rollout swaps in new merged weights, whose addresses the recorded graphs do not read, so "
                "they would be recorded again at every rollout; choose one"
            )
        if self.compile_blocks:
            import torch._dynamo

            backends = torch._dynamo.list_backends(exclude_tags=())
            if self.compile_backend not in backends:
                p.append(
                    f"{flag}.compile_backend ({self.compile_backend}) is not a torch.compile backend: "
                    f"use one of {backends}"
                )
        return p

    @property
    def uses_cudagraphs(self) -> bool:
        """Whether the compiled blocks run as CUDA graphs (``compile_mode``)."""
        return self.compile_blocks and self.compile_mode in CUDAGRAPH_MODES

    def computes_fp32(self, transformer: nn.Module, model_dtype: torch.dtype | None = None) -> bool:
        """Whether the transformer holds and computes float32 throughout: what the update's on-policy
        check takes fp32's bound for (:meth:`~lit_flowgrpo.update.UpdateSettings.on_policy_tolerance`).

        Not with ``fp8_base_matmuls``: each activation is rounded to e4m3 there, and a last-bit
        difference between the rollout's batch and the update's micro-batch can flip one such
        rounding, a step of 2^-4 of the value, far above fp32's epsilon.

        >>> PerformanceSettings().computes_fp32(nn.Linear(2, 2))
        True
        >>> PerformanceSettings(fp8_base_matmuls=True).computes_fp32(nn.Linear(2, 2))
        False
        """
        held = {p.dtype for p in transformer.parameters() if p.is_floating_point()}
        compute = self.resolved_dtype(transformer, model_dtype)
        return held | {compute} == {torch.float32} and not self.fp8_base_matmuls

    def resolved_dtype(self, transformer: nn.Module, model_dtype: torch.dtype | None = None) -> torch.dtype:
        """The dtype the transformer's matrix products run in; ``model_dtype``: the dtype the policy
        loaded it in, which ``auto`` means when given (a full fine-tune's float32 master weights are
        not the model's dtype)."""
        if self.compute_dtype != "auto":
            return _DTYPES[self.compute_dtype]
        if model_dtype is not None:
            return model_dtype
        counts: Counter[torch.dtype] = Counter()
        for p in transformer.parameters():
            if p.is_floating_point():
                counts[p.dtype] += p.numel()
        return counts.most_common(1)[0][0] if counts else torch.float32

    def apply(
        self,
        transformer: nn.Module,
        attention: AttentionShape | None = None,
        device: Any = "cpu",
        model_dtype: torch.dtype | None = None,
        master_dtype: torch.dtype | None = None,
    ) -> None:
        """Set the transformer up to compute as configured; call once, after the adapter is attached.

        ``attention``: the model's attention shape at the run's image size (the policy's
        ``attention_shape``), and ``device`` the one it will run on, for ``attention_backend``.
        ``model_dtype``: the dtype the policy loaded the transformer in; ``master_dtype``: the dtype a
        full fine-tune trains it in, when that differs (the weights may not be cast yet: a sharded run
        casts each block as it shards it).
        """
        dtype = self.resolved_dtype(transformer, model_dtype)
        autocast = dtype != torch.float32 and (
            master_dtype not in (None, dtype)
            or any(p.dtype != dtype for p in transformer.parameters() if p.is_floating_point())
        )
        if autocast:
            from peft.tuners.tuners_utils import BaseTunerLayer

            # peft casts each adapter's input to the adapter weights' dtype (fp32); autocast casts it
            # straight back to `dtype`: two wasted passes over the activations per adapted layer.
            for module in transformer.modules():
                if isinstance(module, BaseTunerLayer):
                    module.cast_input_dtype_enabled = False
        kernels = self._attention_kernels(attention, device, dtype)
        if autocast or kernels is not None or self.uses_cudagraphs:
            scope = _ForwardScope(
                dtype if autocast else None, kernels and sdpa_backends(kernels), self.uses_cudagraphs
            )
            transformer.register_forward_pre_hook(scope.enter, with_kwargs=True)
            transformer.register_forward_hook(scope.exit, always_call=True)
        if self.activation_checkpointing:
            enable_activation_checkpointing(
                transformer, "--model.init_args.performance.activation_checkpointing"
            )
        if self.rollout_merged_lora:
            _mergeable_lora_layers(transformer)  # fails now, not at the first rollout
        if self.fp8_base_matmuls:  # its rules: lit_flowgrpo.fp8.fp8_problems, checked before loading
            from lit_flowgrpo.fp8 import convert_frozen_linears

            if not convert_frozen_linears(repeated_blocks(transformer, "fp8_base_matmuls")):
                raise ValueError(
                    "--model.init_args.performance.fp8_base_matmuls: the transformer blocks have no frozen "
                    "linear layer (a full fine-tune trains them all): use it with --model.init_args.weights.lora"
                )
        if self.compile_blocks:
            _compile_repeated_blocks(transformer, self.compile_backend, self.compile_mode)

    def apply_to_copy(
        self,
        network: nn.Module,
        attention: AttentionShape | None = None,
        device: Any = "cpu",
        model_dtype: torch.dtype | None = None,
        master_dtype: torch.dtype | None = None,
    ) -> None:
        """Give a frozen copy of the transformer (a full fine-tune's KL reference or old policy, kept
        in the model's dtype) the trained transformer's autocast and attention kernels, so that before
        any update both compute the same velocity: with float32 masters the trained one computes under
        autocast (norms and softmax in float32), which a bf16 copy would not do by itself."""
        dtype = self.resolved_dtype(network, model_dtype)
        autocast = dtype != torch.float32 and master_dtype not in (None, dtype)
        kernels = self._attention_kernels(attention, device, dtype, quiet=True)
        if autocast or kernels is not None:
            scope = _ForwardScope(dtype if autocast else None, kernels and sdpa_backends(kernels))
            network.register_forward_pre_hook(scope.enter, with_kwargs=True)
            network.register_forward_hook(scope.exit, always_call=True)

    def _attention_kernels(
        self, shape: AttentionShape | None, device: Any, dtype: torch.dtype, quiet: bool = False
    ) -> tuple[str, ...] | None:
        flag = "--model.init_args.performance.attention_backend"
        kernels, warns, errors = choose_kernels(self.attention_backend, shape, capability_of(device), flag)
        if self.attention_backend in ("cudnn", "flash") and dtype == torch.float32:
            errors.append(
                f"{flag}={self.attention_backend} runs only in bf16 or fp16, and this transformer computes "
                "in float32 (--model.init_args.performance.compute_dtype and the policy's dtype): use auto, "
                "efficient or math, or a bf16 policy"
            )
        if errors:
            raise SettingsError("; ".join(errors))
        if quiet:  # said once already, for the trained transformer
            return kernels
        for message in warns:
            rank_zero_warn(message)
        if self.attention_backend == "auto" and kernels is not None:
            rank_zero_info(
                f"{flag}=auto: PyTorch chooses among {', '.join(kernels)} (known faults at this shape)"
            )
        return kernels

    def apply_to_decoder(self, vae: nn.Module | None) -> None:
        """Compile the VAE's decoder (``compile_decoder``); call once, with the policy's ``vae``."""
        if not self.compile_decoder:
            return
        decoder = getattr(vae, "decoder", None)
        if not isinstance(decoder, nn.Module):
            raise ValueError(
                f"--model.init_args.performance.compile_decoder: the policy's VAE ({type(vae).__name__}) has no "
                "`decoder` module to compile: set it to false"
            )
        decoder.compile(backend=self.compile_backend, dynamic=False, mode=self.compile_mode)

    @contextmanager
    def sampling_weights(self, *transformers: nn.Module) -> Iterator[None]:
        """Inside, the transformers (the policy's trainable networks) sample with merged LoRA weights
        (``rollout_merged_lora``); else nothing changes. The base weights are swapped, not modified:
        they are bit for bit the same afterwards (merging into them and subtracting again would drift
        by a rounding per rollout)."""
        if not self.rollout_merged_lora:
            yield
            return
        layers = [layer for t in transformers for layer in _mergeable_lora_layers(t)]
        swapped: list[tuple[nn.Parameter, torch.Tensor]] = []
        try:
            with torch.no_grad():
                for layer in layers:
                    base = layer.get_base_layer()
                    delta = sum(layer.get_delta_weight(name) for name in layer.active_adapters)
                    # one rounding to the base dtype, of W + s·B·A computed in fp32
                    merged = (base.weight.float() + delta.float()).to(base.weight.dtype)
                    swapped.append((base.weight, base.weight.data))
                    base.weight.data = merged
                    layer.enable_adapters(False)
            yield
        finally:
            for layer in layers:
                layer.enable_adapters(True)
            for param, data in swapped:
                param.data = data


class _ForwardScope:
    """Autocast and the attention backend around each transformer forward, and the CUDA graph step
    each no-grad forward begins (``mark_steps``; see the module docstring).

    Entered by a forward pre-hook and left by a forward hook that also runs when the forward raises,
    so every caller (the sampler, the update, the reference, FLOP counting) gets the same numerics
    without wrapping its calls. Hooks rather than a wrapper module keep the transformer's parameter
    names, hence the checkpoints and exported adapters, unchanged.
    """

    def __init__(
        self, dtype: torch.dtype | None, backends: list[Any] | None, mark_steps: bool = False
    ) -> None:
        self.dtype = dtype
        self.backends = backends
        self.mark_steps = mark_steps
        self._open: list[ExitStack] = []

    def enter(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.mark_steps and not torch.is_grad_enabled():
            torch.compiler.cudagraph_mark_step_begin()
        stack = ExitStack()
        if self.dtype is not None:
            device = next(module.parameters()).device.type
            stack.enter_context(torch.autocast(device_type=device, dtype=self.dtype))
        if self.backends is not None:
            from torch.nn.attention import sdpa_kernel

            stack.enter_context(sdpa_kernel(self.backends))
        self._open.append(stack)

    def exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._open:
            self._open.pop().close()


def enable_activation_checkpointing(transformer: nn.Module, flag: str) -> None:
    """The model's own gradient checkpointing of its blocks (diffusers' ``enable_gradient_checkpointing``,
    which recomputes each block in the backward, non-reentrant, and only where gradients are taken),
    the recomputation under the attention kernels of the forward (:func:`_checkpoint_block`)."""
    enable = getattr(transformer, "enable_gradient_checkpointing", None)
    if not callable(enable) or not getattr(transformer, "_supports_gradient_checkpointing", False):
        raise SettingsError(
            f"{flag}=true: {type(transformer).__name__} has no gradient checkpointing of its blocks "
            "(diffusers' enable_gradient_checkpointing); drop the setting"
        )
    enable(gradient_checkpointing_func=_checkpoint_block)


def _checkpoint_block(block: nn.Module, *args: Any) -> Any:
    """``torch.utils.checkpoint`` of one block, recomputed under the attention kernels its forward ran with.

    The backward recomputes the block after the transformer's forward scope has closed. Checkpointing
    restores the autocast state, but not PyTorch's attention-kernel switches, so the recomputation
    would run PyTorch's default kernel: a kernel left out at this shape (cuDNN at FLUX's 512 px) would
    run after all, and a different kernel saves differently shaped tensors, which checkpointing
    rejects ("Recomputed values ... have different metadata").
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.checkpoint import checkpoint

    switches = torch.backends.cuda
    kernels = [
        backend
        for backend, enabled in (
            (SDPBackend.CUDNN_ATTENTION, switches.cudnn_sdp_enabled()),
            (SDPBackend.FLASH_ATTENTION, switches.flash_sdp_enabled()),
            (SDPBackend.EFFICIENT_ATTENTION, switches.mem_efficient_sdp_enabled()),
            (SDPBackend.MATH, switches.math_sdp_enabled()),
        )
        if enabled
    ]

    def contexts() -> tuple[Any, Any]:
        return contextlib.nullcontext(), sdpa_kernel(kernels)

    return checkpoint(block.__call__, *args, use_reentrant=False, context_fn=contexts)


def _mergeable_lora_layers(transformer: nn.Module) -> list[Any]:
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in transformer.modules() if isinstance(m, BaseTunerLayer)]
    flag = "--model.init_args.performance.rollout_merged_lora"
    if not layers:
        raise ValueError(
            f"{flag} needs a LoRA adapter (--model.init_args.weights.lora): there is nothing to merge"
        )
    for layer in layers:
        if not isinstance(layer, LoraLinear) or layer.lora_variant or layer.merged or layer.disable_adapters:
            raise ValueError(
                f"{flag}: {type(layer).__name__} layers (variants such as DoRA, merged or disabled adapters) "
                "cannot be merged for sampling; set it to false"
            )
    return layers


def _compile_repeated_blocks(transformer: nn.Module, backend: str, mode: str | None = None) -> None:
    import torch._dynamo

    # Each block class × mode (rollout: eval, no grad; update: train, grad) × batch shape is its own
    # graph on the one code object all compiled modules share; past torch's default limit of 8 the
    # remaining blocks would silently run eagerly.
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), 64))
    for block in repeated_blocks(transformer, "compile_blocks"):
        block.compile(backend=backend, dynamic=False, mode=mode)


def repeated_blocks(transformer: nn.Module, setting: str) -> list[nn.Module]:
    """The repeated layers of ``transformer`` (its blocks), which compilation, float8 matmuls and
    activation checkpointing act on; ``setting`` names the flag in the error when there are none."""
    classes = set(getattr(transformer, "_repeated_blocks", None) or _block_classes(transformer))
    if not classes:
        raise ValueError(
            f"--model.init_args.performance.{setting}: {type(transformer).__name__} has no repeated blocks "
            "(no _repeated_blocks and no list of same-class layers): set it to false"
        )
    return [m for m in transformer.modules() if type(m).__name__ in classes]


def _block_classes(transformer: nn.Module) -> set[str]:
    """Class names of the layers of every ``nn.ModuleList`` holding several of one class.

    diffusers names them in ``_repeated_blocks`` only for some models (not SD3 as of 0.42); their
    layer stacks are such lists (``transformer_blocks``, ``single_transformer_blocks``).
    """
    names: set[str] = set()
    for module in transformer.modules():
        if isinstance(module, nn.ModuleList):
            counts = Counter(type(m).__name__ for m in module)
            names |= {n for n, c in counts.items() if c > 1}
    return names
