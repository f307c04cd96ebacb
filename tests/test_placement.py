"""Placement in one call (``lit_flowgrpo.placement``) and the (dp, sp) layout the strategy holds.

The sharded and sequence-parallel placements run on several processes in ``test_fsdp.py`` and
``test_sequence_parallel.py``; here, one process: every network a policy declares is placed (Wan 2.2's
second expert too), and the layout is checked once, built once and read from the strategy only.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lit_flowgrpo.distributed import DataParallel, ParallelLayout
from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.performance import PerformanceSettings
from lit_flowgrpo.placement import build_layout, place
from lit_flowgrpo.policies import WanPolicy
from lit_flowgrpo.rollout import Sampler
from lit_flowgrpo.sequence_parallel import FLAG
from lit_flowgrpo.strategies import parallel_layout, transformer_blocks
from lit_flowgrpo.tiny.wan import build_tiny_wan


@pytest.fixture(scope="module")
def tiny_wan_a14b(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_wan(tmp_path_factory.mktemp("tiny_wan_a14b"), "a14b")


def test_place_sets_up_every_network_the_policy_declares(tiny_wan_a14b):
    """Both experts of Wan 2.2 A14B get the blocks' compilation and activation checkpointing, and
    the policy its compute dtype, from one call (no trainer: one process, on the CPU)."""
    policy = WanPolicy(tiny_wan_a14b, dtype="float32")
    policy.load()
    experts = policy.trainable_networks
    assert len(experts) == 2
    performance = PerformanceSettings(
        compile_blocks=True, compile_backend="eager", activation_checkpointing=True
    )
    place(policy, [], performance, None, Sampler(height=32, width=32, frames=5))
    assert policy.compute_dtype == torch.float32
    for expert in experts:
        assert expert.gradient_checkpointing
        blocks = transformer_blocks(expert)
        assert blocks and all(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)


def test_the_layout_is_built_once_and_held_by_the_strategy():
    """DDP has no layout of its own: the first call builds it and the strategy carries it, where the
    data module's and the callbacks' ``DataParallel.of(trainer)`` find it; the second call returns it."""
    strategy = DDPStrategy()
    layout = parallel_layout(strategy, 1, rank=1, world=2)
    assert parallel_layout(strategy, 1, rank=1, world=2) is layout
    assert strategy.parallel_layout is layout and layout.mesh is None
    view = DataParallel.of(SimpleNamespace(strategy=strategy, world_size=2, global_rank=1))
    assert (view.rank, view.size, view.sequence_parallel, view.group) == (1, 2, 1, None)
    # With sp ranks per sample the peers are the groups (a stand-in layout, without its mesh).
    grid = ParallelLayout(rank=3, world=4, sequence_parallel=2).data_parallel
    assert (grid.rank, grid.size, grid.gradient_scale) == (1, 2, 2.0)


def test_sequence_parallel_is_checked_once_before_the_layout_is_built(tiny_wan_a14b):
    trainer = SimpleNamespace(strategy=DDPStrategy(), world_size=3, global_rank=0)
    policy = WanPolicy(tiny_wan_a14b, dtype="float32")
    with pytest.raises(SettingsError, match=rf"{FLAG} \(2\) must divide the number of ranks \(3"):
        build_layout(trainer, 2, policy, Sampler(height=32, width=32, frames=5))
    assert not hasattr(trainer.strategy, "parallel_layout")  # nothing was built
    assert build_layout(trainer, 1, policy, Sampler()).data_parallel.size == 3
