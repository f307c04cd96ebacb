"""Placement: where and how every network of a policy computes, in one call.

Once the weights are attached (the LoRA adapter, or a full fine-tune's trained transformer), each
network a policy declares (:attr:`~lit_flowgrpo.policies.base.FlowPolicy.trainable_networks`: Wan 2.2's
second expert too) and each copy of them (the frozen KL reference, the old policy) is placed, in this
order, the order the parts depend on:

1. sequence parallelism: diffusers' context-parallel hooks on the (dp, sp) mesh of the run's
   :class:`~lit_flowgrpo.distributed.ParallelLayout` (before compiling, so the compiled blocks see them);
2. the compute dtype, the forward scope (autocast, attention kernels), activation checkpointing,
   float8 base products and compiled blocks of the trained networks, the same scope for the copies,
   and the compiled decoder (:class:`~lit_flowgrpo.performance.PerformanceSettings`);
3. FSDP2 sharding under :class:`~lit_flowgrpo.strategies.FSDP2Strategy`: the trained networks (cast to
   the master dtype, computing in the compute dtype; a LoRA run's frozen base replicated or sharded as
   the strategy decides), then the copies, of which the offloaded ones keep their shards in host memory.

Under any other strategy step 3 does nothing: DDP wraps the LightningModule itself.

The layout is built once, in the module's ``setup``, by :func:`build_layout` (the one check of
``performance.sequence_parallel`` against the run), and held by the strategy, where every part that
gathers finds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lit_flowgrpo.distributed import LAYOUT_ATTRIBUTE, ParallelLayout
from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.performance import PerformanceSettings
from lit_flowgrpo.sequence_parallel import attach_sequence_parallel, sequence_parallel_problems, size_problems
from lit_flowgrpo.strategies import FSDP2Strategy, parallel_layout

__all__ = ["build_layout", "place"]


def build_layout(trainer: Any, sequence_parallel: int, policy: Any, sampler: Any) -> ParallelLayout:
    """Check ``sequence_parallel`` against the run (the world size, the strategy, the policy's
    transformer at the sampler's sizes: :func:`~lit_flowgrpo.sequence_parallel.sequence_parallel_problems`),
    then build the (dp, sp) layout once and hand it to the trainer's strategy.

    Called by every rank at the same point, before anything asks for the data-parallel view (the
    module's ``setup``): building the mesh creates process groups collectively."""
    strategy = trainer.strategy
    problems = sequence_parallel_problems(sequence_parallel, trainer.world_size, strategy, policy, sampler)
    if problems:
        raise SettingsError("invalid settings:\n  " + "\n  ".join(problems))
    return parallel_layout(
        strategy, sequence_parallel, rank=getattr(trainer, "global_rank", 0), world=trainer.world_size
    )


def place(
    policy: Any,
    copies: Sequence[nn.Module],
    performance: PerformanceSettings,
    trainer: Any,
    sampler: Any,
    *,
    offloaded: Sequence[nn.Module] = (),
    model_dtype: torch.dtype | None = None,
    master_dtype: torch.dtype | None = None,
    device: Any = None,
) -> None:
    """Place the policy's networks and their ``copies`` for this run; call once, after the weights
    are attached.

    Args:
        policy: the loaded policy; its ``trainable_networks`` are placed, and its ``vae``'s decoder.
        copies: frozen copies of the trained networks (a full fine-tune's KL reference, DiffusionNFT's
            old policy): the same forward scope and sequence split; sharded alike.
        performance: how the networks compute.
        trainer: the run's trainer (``None``: one process, on ``device``).
        sampler: the rollout's settings: its size gives the attention shape the kernels are chosen for,
            and the token counts the sequence split is checked at.
        offloaded: those of ``copies`` whose shards stay in host memory (fsdp2).
        model_dtype: the dtype the policy loaded its transformer in.
        master_dtype: the dtype a full fine-tune trains in, when it differs (``None``: LoRA, or the
            model's dtype); under fsdp2 the trainable weights are cast to it as they are sharded.
        device: where the networks run when there is no trainer.
    """
    strategy = getattr(trainer, "strategy", None)
    if strategy is not None:
        device = strategy.root_device
    device = torch.device("cpu") if device is None else torch.device(device)
    trained = tuple(policy.trainable_networks)
    layout = getattr(strategy, LAYOUT_ATTRIBUTE, None)
    if isinstance(layout, ParallelLayout) and layout.sequence_parallel > 1:
        # Again with the loaded configs: a hub id's first look, and the checkpoint's own numbers.
        problems = size_problems(policy.sequence_parallel_problems, layout.sequence_parallel, sampler)
        if problems:
            raise SettingsError("invalid settings:\n  " + "\n  ".join(problems))
        for network in (*trained, *copies):
            attach_sequence_parallel(network, layout.mesh, device)
    shape = policy.attention_shape(sampler.height, sampler.width)
    dtypes = dict(model_dtype=model_dtype, master_dtype=master_dtype)
    # The inputs in the compute dtype: the masters and their copies see the same tensors.
    compute_dtype = performance.resolved_dtype(policy.transformer, model_dtype)
    policy.compute_dtype = compute_dtype
    for network in trained:
        performance.apply(network, shape, device, **dtypes)
    for network in copies:
        performance.apply_to_copy(network, shape, device, **dtypes)
    performance.apply_to_decoder(getattr(policy, "vae", None))
    if not isinstance(strategy, FSDP2Strategy):
        return
    # After the adapter is attached, so that its weights shard with their blocks. The copies gather as
    # the trained networks do (their blocks in the compute dtype), so that they compute alike; a frozen
    # copy has no parameter to cast.
    replicate = strategy.replicates_frozen(trained)
    for network in trained:
        strategy.shard(
            network,
            master_dtype=master_dtype,
            compute_dtype=compute_dtype,
            replicate_frozen=replicate,
        )
    for network in copies:
        strategy.shard(
            network,
            master_dtype=master_dtype,
            compute_dtype=compute_dtype,
            offload=any(network is o for o in offloaded),
        )
