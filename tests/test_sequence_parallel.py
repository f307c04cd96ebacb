"""Sequence parallelism (``performance.sequence_parallel``) on CPU processes (gloo), tiny Wan.

gloo runs every collective diffusers' Ulysses attention uses on CPU tensors (the all-to-all of the
functional collectives, the all-gather of the output), forward and backward, so these runs are the
product's own path end to end; only the GPU kernels differ on GPUs.

What is compared, and why the tolerances are what they are:

- rollouts (final latents, rollout log-probs): every transformer op of a sequence-parallel rank
  computes the same dot products as one process (a matrix product splits its rows, never its
  reduction; the attention of each head still sees every token), so the latents are expected bitwise
  equal; the check allows a few units in the last place of the largest element.
- rewards and advantages: ``test_ddp.assert_rewards_and_advantages_close``, the rewards to
  :func:`reward_atol` (latents a few ulps apart through the decoder, then each video's mean summed in
  another order by torchrun's one thread per process), then their propagation through the advantage
  normalisation.
- the LoRA weights after two SGD steps: each gradient element is a sum of n per-token terms (2 steps
  × 8 samples × 2 trained steps × 2 CFG halves × 8 tokens = 512) that sequence parallelism adds in
  another order (two partial gradients, then the all-reduce). Reordering a sum of n fp32 terms moves
  it by at most γ_n·Σ|terms| ≈ n·eps·Σ|terms| (Higham, Accuracy and Stability, §4.2); with the step's
  largest element standing in for Σ|terms|, the weights agree to n·eps·max|ΔW| (plus eps·|W| for
  the final rounding). A gradient off by the factor sp would miss by max|ΔW|/2, a thousand times more.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import sp_worker
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from test_ddp import assert_rewards_and_advantages_close
from tolerances import EPS32, depth, network_atol, sum_rtol

from lit_flowgrpo.data import PromptDataModule
from lit_flowgrpo.distributed import DataParallel, ParallelLayout
from lit_flowgrpo.performance import PerformanceSettings
from lit_flowgrpo.policies import SD3Policy, WanPolicy
from lit_flowgrpo.rollout import Sampler
from lit_flowgrpo.sequence_parallel import FLAG, attach_sequence_parallel, sequence_parallel_problems
from lit_flowgrpo.tiny.wan import build_tiny_wan

WORKER = str(Path(sp_worker.__file__))
GRADIENT_TERMS = 2 * 8 * 2 * 2 * 8  # the docstring's n


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_wan(tmp_path_factory.mktemp("tiny_wan"))


# -- the data-parallel view and the checks (one process) ---------------------------------------------


def _held(rank: int, world: int = 4, sp: int = 2) -> SimpleNamespace:
    """A stand-in strategy holding the layout of a (world / sp, sp) grid (no mesh: one process)."""
    return SimpleNamespace(parallel_layout=ParallelLayout(rank=rank, world=world, sequence_parallel=sp))


def test_ranks_of_a_sequence_parallel_group_are_one_data_parallel_peer(prompt_file):
    def view(rank: int) -> DataParallel:
        # The view comes from the layout the strategy holds; the LightningModule is not asked.
        trainer = SimpleNamespace(global_rank=rank, world_size=4, strategy=_held(rank))
        return DataParallel.of(trainer)

    assert [(view(r).rank, view(r).size) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert view(3).gradient_scale == 2.0 and DataParallel().gradient_scale == 1.0
    # The prompts, group ids, sample ids and noise seeds each rank draws: the same within a group.
    batches = []
    for rank in range(4):
        dm = PromptDataModule(train=prompt_file, prompts_per_step=2, group_size=4, seed=5)
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=4, strategy=_held(rank))
        batch = next(iter(dm.train_dataloader()))
        batches.append((batch.prompts, batch.sample_ids.tolist(), batch.seeds.tolist()))
    assert batches[0] == batches[1] and batches[2] == batches[3]
    assert sorted(batches[0][1] + batches[2][1]) == list(range(8))


def test_bad_settings_are_refused_before_any_weight_is_read(tiny_wan, tiny_sd3_path):
    ddp = DDPStrategy()
    wan = WanPolicy(tiny_wan, dtype="float32")
    video = Sampler(height=32, width=32, frames=5)  # 2 × 2 × 2 = 8 tokens; the tiny model has 2 heads

    def problem(sp, world=4, strategy=ddp, policy=wan, sampler=video) -> str:
        (message,) = sequence_parallel_problems(sp, world, strategy, policy, sampler)
        assert message.startswith(FLAG), message
        return message

    assert sequence_parallel_problems(2, 4, ddp, wan, video) == []
    assert sequence_parallel_problems(1, 3, SingleDeviceStrategy(), SD3Policy(tiny_sd3_path), video) == []
    # Validation runs through the same split: its size (here 3 × 1 × 1 tokens) is checked too.
    longer = Sampler(height=32, width=32, frames=5, eval_height=16, eval_width=16, eval_frames=9)
    (message,) = sequence_parallel_problems(2, 4, ddp, wan, longer)
    assert message.startswith("at the validation size (eval_height, eval_width, eval_frames): " + FLAG)
    assert "must divide the 3 video tokens" in message
    assert "must divide the number of ranks (4" in problem(3)
    assert "--trainer.strategy=ddp or fsdp2" in problem(2, strategy=SingleDeviceStrategy())
    assert "Wan and HunyuanVideo 1.5 only" in problem(2, policy=SD3Policy(tiny_sd3_path))
    assert "must divide the 2 attention heads" in problem(4)
    # 1 latent frame × 3 × 3 patches at 48 px: 9 tokens do not split in two
    assert "must divide the 9 video tokens" in problem(2, sampler=Sampler(height=48, width=48, frames=1))
    assert wan.pipe is None  # all of it from the checkpoint's config files
    assert PerformanceSettings(sequence_parallel=0).problems() == [f"{FLAG} (0) must be at least 1 (1: off)"]


def test_a_network_without_a_context_parallel_plan_is_refused():
    with pytest.raises(ValueError, match="has no context-parallel plan"):
        attach_sequence_parallel(torch.nn.Linear(2, 2), None, torch.device("cpu"))


# -- whole runs against one process (several processes, gloo) ---------------------------------------


def torchrun(config: dict, tmp: Path, name: str, procs: int) -> subprocess.Popen:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(dict(config, out=str(tmp / name), devices=procs)))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={procs}",
        WORKER,
        str(path),
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-6000:]


def rollouts(out: Path, step: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{sample id: (final latents, rollout log-probs)} of one step, from every rank (a sample a
    sequence-parallel group holds appears once per rank of the group: all copies must agree)."""
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for f in out.glob(f"rank*_rollout_step{step}.pt"):
        record = torch.load(f)
        for i, sample in enumerate(record["sample_ids"].tolist()):
            seen.setdefault(sample, []).append((record["final"][i], record["log_probs"][i]))
    for copies in seen.values():
        for final, log_prob in copies[1:]:
            assert torch.equal(final, copies[0][0]) and torch.equal(log_prob, copies[0][1])
    return {s: c[0] for s, c in seen.items()}


def rewards(out: Path, step: int) -> dict[int, tuple[float, float]]:
    rows: dict[int, tuple[float, float]] = {}
    for f in out.glob(f"rank*_adv_step{step}.json"):
        for sample, reward, adv in json.loads(f.read_text()):
            assert rows.setdefault(sample, (reward, adv)) == (reward, adv)  # one group, one answer
    return rows


def reward_atol(pipeline: str) -> float:
    """How far sp_worker's Brightness may move: final latents 4 ulps apart (the check below) through
    the VAE's decoder (each reducing layer rounding by about eps of the video's scale, 1), then the mean
    of 3 × 5 frames × 32² pixels summed in another order (tests/tolerances.py)."""
    policy = WanPolicy(pipeline, dtype="float32", max_sequence_length=16)
    policy.load()
    return network_atol(4 + depth(policy.vae.decoder), 1.0) + sum_rtol(3 * 5 * 32 * 32)


def check_equal(reference: Path, run: Path, ranks: int, reward_atol: float) -> None:
    logp = 1.0
    for step in (0, 1):
        ref, got = rollouts(reference, step), rollouts(run, step)
        assert sorted(ref) == sorted(got) == list(range(8))
        for sample, (final, log_prob) in ref.items():
            scale = float(final.abs().max())
            torch.testing.assert_close(got[sample][0], final, rtol=0, atol=4 * EPS32 * scale)
            torch.testing.assert_close(got[sample][1], log_prob, rtol=4 * EPS32, atol=4 * EPS32)
            logp = max(logp, float(log_prob.abs().max()))
        assert_rewards_and_advantages_close(rewards(reference, step), rewards(run, step), reward_atol)
    init, trained = torch.load(reference / "rank0_lora_init.pt"), torch.load(reference / "rank0_lora.pt")
    moved = max(float((trained[k] - init[k]).abs().max()) for k in trained)

    def close(a: dict[str, torch.Tensor]) -> bool:
        tol = dict(rtol=EPS32, atol=GRADIENT_TERMS * EPS32 * moved)
        return all(torch.allclose(a[k], v, **tol) for k, v in trained.items())

    # The check can see a gradient off by the factor sp: half the steps would fail it.
    assert not close({k: init[k] + (trained[k] - init[k]) / 2 for k in trained})
    for rank in range(ranks):
        assert close(torch.load(run / f"rank{rank}_lora.pt")), rank
    # Metrics over data-parallel peers only: a sequence-parallel group counts its samples once.
    ref_metrics, metrics = (json.loads((p / "metrics.json").read_text()) for p in (reference, run))
    counts = ("critic/rewards/count", "critic/rewards/num_groups", "critic/rewards/group_size")
    # The mean of 8 rewards that agree to reward_atol, summed in another order; the ratio exp(log p −
    # log p_old) of log-probs that agree to 4 eps of their size (above) on both sides, and its rounding.
    tol = {
        "critic/rewards/mean": reward_atol + sum_rtol(8),
        "actor/ratio_mean": 2 * 4 * EPS32 * (1 + logp) + 2 * EPS32,
    }
    for step, row in ref_metrics.items():
        for key in counts:
            assert metrics[step][key] == row[key], key
        for key, atol in tol.items():
            assert metrics[step][key] == pytest.approx(row[key], rel=0, abs=atol * max(1.0, abs(row[key]))), (
                key
            )


# slow: three runs of two processes and one in-process run, each two rollouts (about a minute on 2 cores)
@pytest.mark.slow
def test_two_ranks_splitting_each_sample_equal_one_process(tiny_wan, prompt_file, tmp_path):
    """sp = 2, dp = 1, under DDP, under FSDP2 with activation checkpointing (their meshes compose:
    FSDP2 shards over all ranks, diffusers' attention exchanges within the (dp, ring, ulysses) mesh;
    the recomputed blocks run their all-to-alls again in the backward), and under FSDP2 with the
    frozen base replicated (what ``frozen_weights="auto"`` gives a small LoRA run on GPUs): the same
    rollouts, rewards, advantages, metrics and, after two SGD steps, LoRA weights as one process."""
    config = dict(pipeline=tiny_wan, prompts=prompt_file, sp=2)
    procs = [
        torchrun(dict(config, strategy="ddp"), tmp_path, "ddp_sp2", 2),
        torchrun(
            dict(config, strategy={}, performance=dict(activation_checkpointing=True)),
            tmp_path,
            "fsdp2_sp2",
            2,
        ),
        torchrun(dict(config, strategy=dict(frozen_weights="replicate")), tmp_path, "replicated_sp2", 2),
    ]
    sp_worker.run(dict(config, sp=1, out=str(tmp_path / "single")))
    for proc in procs:
        finish(proc)
    for name in ("ddp_sp2", "fsdp2_sp2", "replicated_sp2"):
        check_equal(tmp_path / "single", tmp_path / name, ranks=2, reward_atol=reward_atol(tiny_wan))


# slow: six processes (about two minutes on 2 cores)
@pytest.mark.slow
def test_two_peers_of_two_ranks_equal_two_peers(tiny_wan, prompt_file, tmp_path):
    """dp = 2 × sp = 2 on 4 ranks against dp = 2 on 2 ranks: each group draws its own half of the samples,
    the advantages pool both halves, the gradient is the data-parallel mean."""
    config = dict(pipeline=tiny_wan, prompts=prompt_file, strategy="ddp")
    procs = [
        torchrun(dict(config, sp=2), tmp_path, "dp2_sp2", 4),
        torchrun(dict(config, sp=1), tmp_path, "dp2", 2),
    ]
    for proc in procs:
        finish(proc)
    check_equal(tmp_path / "dp2", tmp_path / "dp2_sp2", ranks=4, reward_atol=reward_atol(tiny_wan))
