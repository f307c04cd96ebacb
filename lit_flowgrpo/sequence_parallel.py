"""Sequence parallelism: each sample's tokens split over ``--model.init_args.performance.sequence_parallel``
ranks inside the transformer, through diffusers' context parallelism (Ulysses attention).

What diffusers does (0.42, ``hooks/context_parallel.py`` and ``models/attention_dispatch.py``), and so
what this run does: the model's ``_cp_plan`` names where its forward splits and gathers. For
``WanTransformer3DModel``: the patchified video tokens are split along the sequence before the first
block (and the rotary embedding with them), every block works on 1/sp of the tokens, and the output
projection's result is all-gathered, so every rank of the group gets the whole velocity. In the
self-attention, an all-to-all trades the token split for a head split (each rank attends all tokens
with heads/sp of the heads) and back; the cross-attention's queries stay local and attend the whole
prompt, which is not split. Backward: the all-to-all's backward is an all-to-all, the gather's backward
is each rank's slice of the output gradient, so each rank's gradient is the part flowing through its
own tokens (:attr:`lit_flowgrpo.distributed.DataParallel.gradient_scale` turns their average into
the full gradient).

Only diffusers' ``native`` attention backend is used (``torch.nn.functional.scaled_dot_product_attention``
inside, so ``performance.attention_backend`` still picks its kernel): it runs a backward under Ulysses
by recomputing the local attention, whereas its ring attention needs the log-sum-exp that this
backend does not return. Ring attention (flash / cuDNN backends, GPU only) is not offered.

The data side (which ranks hold which samples, the gathers of rewards and metrics over data-parallel
peers only) is :mod:`lit_flowgrpo.distributed`'s; its :class:`~lit_flowgrpo.distributed.ParallelLayout`
holds the (dp, ring, ulysses) mesh the hooks are attached on, built once per run and handed here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["FLAG", "attach_sequence_parallel", "sequence_parallel_problems", "size_problems"]

FLAG = "--model.init_args.performance.sequence_parallel"


def sequence_parallel_problems(sp: int, world: int, strategy: Any, policy: Any, sampler: Any) -> list[str]:
    """What stops ``sp`` ranks per sample in this run, known before any weight is read: the world
    size, the strategy, and the policy's own answer (its transformer's plan, heads and token count
    at the sampler's size). The one check of the setting against the run, made before its layout is
    built (:func:`lit_flowgrpo.placement.build_layout`); the value alone (a whole number ≥ 1) is
    :class:`~lit_flowgrpo.performance.PerformanceSettings`'."""
    if sp == 1:
        return []
    if world % sp:
        return [
            f"{FLAG} ({sp}) must divide the number of ranks ({world} = --trainer.devices × "
            f"--trainer.num_nodes): each group of {sp} ranks holds one sample's tokens; set "
            f"--trainer.devices to a multiple of {sp}, or {FLAG} to a divisor of {world}"
        ]
    problems = []
    name = getattr(strategy, "strategy_name", None) or type(strategy).__name__
    if not _splits(strategy):
        problems.append(
            f"{FLAG} ({sp}) needs a multi-process strategy whose gradient reduction covers every rank: "
            f"--trainer.strategy=ddp or fsdp2 (this run has {name})"
        )
    ask = getattr(policy, "sequence_parallel_problems", None)
    if ask is None:
        problems.append(
            f"{FLAG} ({sp}): {type(policy).__name__} does not say whether its transformer can split its "
            f"tokens over ranks: set {FLAG}=1"
        )
    else:
        problems += size_problems(ask, sp, sampler)
    return problems


def size_problems(ask: Any, sp: int, sampler: Any) -> list[str]:
    """The policy's answer (``ask``: its ``sequence_parallel_problems``) at the rollout's size and,
    where it differs, at validation's: the hooks split the validation forwards too."""
    frames = getattr(sampler, "frames", 1)
    rollout = (sampler.height, sampler.width, frames)
    out = ask(sp, *rollout, FLAG)
    height, width = getattr(sampler, "eval_size", rollout[:2])
    validation = (height, width, getattr(sampler, "eval_frame_count", frames))
    if validation != rollout:
        prefix = "at the validation size (eval_height, eval_width, eval_frames): "
        out += [prefix + m for m in ask(sp, *validation, FLAG) if m not in out]
    return out


def _splits(strategy: Any) -> bool:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    # DDP (``ddp``, ``ddp_spawn``, ...) averages gradients over every rank; so does FSDP2's reduce-
    # scatter over its one-dimensional mesh of every rank (FSDP2Strategy). Both are what
    # DataParallel.gradient_scale assumes.
    return isinstance(strategy, DDPStrategy | ModelParallelStrategy)


def attach_sequence_parallel(network: nn.Module, mesh: Any, device: torch.device) -> None:
    """Split ``network``'s tokens over the sp ranks of this rank's group, with diffusers' own hooks
    (its ``_cp_plan``) and its Ulysses attention.

    ``mesh``: the run's (dp, ring = 1, ulysses = sp) device mesh
    (:attr:`lit_flowgrpo.distributed.ParallelLayout.mesh`, built once per run by the strategy's owner).

    Written as the context-parallel branch of diffusers' ``ModelMixin.enable_parallelism`` (0.42), which
    cannot be called here: it takes the device as ``rank % torch.accelerator.device_count()``, a
    division by zero on a CPU-only host (where the gloo tests run), and it builds a mesh of all ranks
    when given none. The steps below are its steps, on the given mesh and this rank's own device: the
    config set up on that mesh, the attention backend checked, every attention processor given the
    config, the plan's hooks registered.
    """
    import torch.distributed as dist
    from diffusers import ContextParallelConfig, ParallelConfig
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    plan = getattr(network, "_cp_plan", None)
    if plan is None:
        raise ValueError(
            f"{FLAG}: {type(network).__name__} has no context-parallel plan (diffusers' _cp_plan): "
            f"set {FLAG}=1"
        )
    if getattr(network, "_parallel_config", None) is not None:
        return  # attached already: a second call would register every hook twice
    sp = mesh["ulysses"].size()
    config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=sp, mesh=mesh))
    config.setup(dist.get_rank(), dist.get_world_size(), device, mesh=mesh)
    for module in network.modules():
        processor = getattr(module, "processor", None)
        if processor is None or not hasattr(processor, "_parallel_config"):
            continue
        backend = getattr(processor, "_attention_backend", None)
        backend = (
            _AttentionBackendRegistry.get_active_backend()[0]
            if backend is None
            else AttentionBackendName(backend)
        )
        if not _AttentionBackendRegistry._is_context_parallel_available(backend):
            raise ValueError(
                f"{FLAG} ({sp}): diffusers' attention backend '{backend.value}' (DIFFUSERS_ATTN_BACKEND) has no "
                "context-parallel form: unset DIFFUSERS_ATTN_BACKEND (the default, 'native', has one)"
            )
        processor._parallel_config = config
    network._parallel_config = config
    apply_context_parallel(network, config.context_parallel_config, plan)
