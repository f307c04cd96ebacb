"""lit_flowgrpo/update.py: the update loop with a stand-in objective (counts of visits, chunking,
optimizer steps, padding rows, the on-policy check, the loss sums), no model and no Trainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lit_flowgrpo.distributed import DataParallel
from lit_flowgrpo.objective import Objective, Visit, VisitContext
from lit_flowgrpo.rollout import RolloutBatch, Trajectory
from lit_flowgrpo.update import UpdateHooks, UpdateSettings, run_update


def trajectory(batch: int, steps: int) -> Trajectory:
    latent = (2, 3)
    return Trajectory(
        latents=torch.randn(batch, steps, *latent),
        next_latents=torch.randn(batch, steps, *latent),
        log_probs=torch.zeros(batch, steps),
        prev_sample_means=None,
        std_dev_t=torch.ones(batch, steps),
        sqrt_dt=torch.ones(batch, steps),
        sigmas=torch.linspace(1, 0.1, steps),
        sigmas_next=torch.linspace(0.9, 0.0, steps),
        step_indices=torch.arange(steps),
        final=torch.randn(batch, *latent),
        transformer_forwards=steps,
        noise_level=0.7,
        sde_type="sde",
        sigma_max=None,
    )


def rollout(batch: int, steps: int, keep: list[bool] | None = None) -> RolloutBatch:
    return RolloutBatch(
        trajectory(batch, steps),
        {"prompt_embeds": torch.randn(batch, 4, 8)},
        advantages=torch.linspace(-1, 1, batch),
        sample_ids=torch.arange(batch) + 100,
        keep=torch.tensor(keep) if keep is not None else torch.ones(batch, dtype=torch.bool),
    )


@dataclass
class Counting(Objective):
    """Loss = w · (advantage of each live row); records every visit."""

    weight: nn.Parameter = field(default_factory=lambda: nn.Parameter(torch.ones(())))
    error: float | None = 0.0
    seen: list[tuple[list[int], int, int]] = field(default_factory=list)
    num_visits: int = 3

    def visits(self, batch: RolloutBatch) -> range:
        return range(self.num_visits)

    def visit(self, ctx: VisitContext, batch: RolloutBatch, idx: Tensor, live: int, v: int) -> Visit:
        self.seen.append((idx.tolist(), live, v))
        rows = batch.advantages[idx[:live]]
        loss = (self.weight * rows).sum() if live else self.weight * 0.0
        zero = torch.zeros(())
        diagnostics = {"value": rows} if live else None
        error = None if self.error is None else torch.tensor(self.error if live else 0.0)
        return Visit(loss, loss, zero, error, diagnostics)


class Recorder:
    def __init__(self) -> None:
        self.backward: list[float] = []
        self.steps = 0
        self.logged: dict[str, float] = {}
        self.metric_rows: list[Tensor] = []

    def hooks(self) -> UpdateHooks:
        def step() -> bool:
            self.steps += 1
            return True

        return UpdateHooks(
            backward=lambda loss: self.backward.append(float(loss.detach())),
            optimizer_step=step,
            log=self.logged.update,
            clock=lambda: 0.0,
        )

    def update(self, value: Tensor) -> None:  # the diagnostics "metric"
        self.metric_rows.append(value)


def run(objective: Counting, batch: RolloutBatch, **settings) -> tuple:
    rec = Recorder()
    ctx = VisitContext(policy=None, copies=None, guidance=1.0)  # type: ignore[arg-type]
    done = run_update(
        UpdateSettings(**settings),
        objective,
        ctx,
        batch,
        rec.hooks(),
        rec,  # type: ignore[arg-type]
        dp=DataParallel(),
        generator=torch.Generator().manual_seed(0),
        on_policy_tol=1e-3,
        forwards_per_sample=2,
    )
    return done, rec


def test_every_kept_sample_is_visited_once_per_visit_and_epoch() -> None:
    objective = Counting()
    done, rec = run(
        objective, rollout(8, 2), micro_batch_size=4, optimizer_steps_per_rollout=2, num_inner_epochs=2
    )
    # 2 epochs × 2 micro-batches × 3 visits
    assert len(objective.seen) == len(rec.backward) == done.num_losses == 12
    for epoch in (objective.seen[:6], objective.seen[6:]):
        for v in range(3):
            rows = sorted(i for idx, live, w in epoch if w == v for i in idx[:live])
            assert rows == list(range(8))
    assert [v for _, _, v in objective.seen[:6]] == [0, 1, 2, 0, 1, 2]  # micro-batch-major
    assert rec.steps == done.optimizer_steps == 4  # 2 per epoch
    assert done.forwards == {"update": 2 * 12 * 4, "ref": 0}
    assert sorted(done.trained.tolist()) == list(range(100, 108))
    assert done.kept_per_rank == [8]


def test_chunks_scale_the_backward_and_step_after_each() -> None:
    objective = Counting(num_visits=1)
    batch = rollout(4, 1)
    done, rec = run(objective, batch, micro_batch_size=1, optimizer_steps_per_rollout=2)
    # 2 optimizer steps of 2 samples, each in 2 micro-batches of 1 × 1 visit: each loss is divided by
    # the step's (sample, visit) pairs.
    expected = [float(batch.advantages[idx[0]]) / 2 for idx, _, _ in objective.seen]
    assert rec.backward == pytest.approx(expected)
    assert rec.steps == 2
    loss, _, _, nonfinite = done.loss_sums.tolist()
    # The 4 losses summed in another order than the advantages: (n − 1)·eps of the sum of magnitudes.
    bound = 3 * torch.finfo(torch.float32).eps * float(batch.advantages.abs().sum())
    assert loss == pytest.approx(float(batch.advantages.sum()), abs=bound) and nonfinite == 0


@dataclass
class Mean(Counting):
    """Loss = w · mean advantage of the live rows: a mean over the visit's samples, as every
    objective's loss is."""

    def visit(self, ctx: VisitContext, batch: RolloutBatch, idx: Tensor, live: int, v: int) -> Visit:
        out = super().visit(ctx, batch, idx, live, v)
        loss = out.loss / live if live else out.loss
        return Visit(loss, loss, out.kl, out.on_policy_error, out.diagnostics)


@dataclass(frozen=True)
class OtherPeer(DataParallel):
    """Rank 0 of two peers, the other of which keeps ``other_kept`` samples: what its gather of the
    kept counts returns (the rest of the loop asks nothing else of the peers here)."""

    other_kept: int = 0

    def gather(self, x: Tensor) -> Tensor:
        return torch.cat([x, torch.tensor([float(self.other_kept)])])

    def mean(self, x: Tensor) -> Tensor:
        return x


def _backward_sum(batch: RolloutBatch, dp: DataParallel, **settings) -> float:
    rec = Recorder()
    ctx = VisitContext(policy=None, copies=None, guidance=1.0)  # type: ignore[arg-type]
    settings = dict(micro_batch_size=4, optimizer_steps_per_rollout=1) | settings
    run_update(
        UpdateSettings(**settings), Mean(num_visits=2), ctx, batch, rec.hooks(), rec,  # type: ignore[arg-type]
        dp=dp, generator=torch.Generator().manual_seed(0), on_policy_tol=1e-3, forwards_per_sample=1,
    )  # fmt: skip
    return sum(rec.backward)  # w = 1: the gradient of the step's loss with respect to w


def test_each_kept_sample_weighs_alike_whatever_its_micro_batch_and_peer() -> None:
    """The optimizer step's loss is the mean over the (sample, visit) pairs it trains: a short last
    micro-batch (5 kept samples in micro-batches of 4 and 1) and a peer that keeps fewer (5 against
    2) give each sample the same weight. Weighing micro-batches alike would give the lone sample of
    the short micro-batch 4 times the weight of the others."""
    torch.manual_seed(0)
    a = rollout(5, 1)
    a.advantages.copy_(torch.tensor([0.5, -1.0, 2.0, 0.25, 3.0]))
    assert _backward_sum(a, DataParallel()) == pytest.approx(float(a.advantages.mean()), rel=1e-6)
    # Two peers: DDP averages their gradients, so the pair's gradient is (g0 + g1) / 2.
    b = rollout(2, 1)
    b.advantages.copy_(torch.tensor([-4.0, 1.5]))
    g0 = _backward_sum(a, OtherPeer(rank=0, size=2, other_kept=2))
    g1 = _backward_sum(b, OtherPeer(rank=0, size=2, other_kept=5))
    everything = torch.cat([a.advantages, b.advantages])
    assert (g0 + g1) / 2 == pytest.approx(float(everything.mean()), rel=1e-6)
    # Two optimizer steps: each step's loss is the mean over its own rows (3 and 2 of the 5 samples,
    # one micro-batch each), each step taken on its own.
    rec, objective = Recorder(), Mean(num_visits=1)
    ctx = VisitContext(policy=None, copies=None, guidance=1.0)  # type: ignore[arg-type]
    run_update(
        UpdateSettings(micro_batch_size=4, optimizer_steps_per_rollout=2), objective, ctx, a,
        rec.hooks(), rec, dp=DataParallel(), generator=torch.Generator().manual_seed(0),  # type: ignore[arg-type]
        on_policy_tol=1e-3, forwards_per_sample=1,
    )  # fmt: skip
    assert sorted(live for _, live, _ in objective.seen) == [2, 3] and rec.steps == 2
    expected = [float(a.advantages[idx[:live]].mean()) for idx, live, _ in objective.seen]
    assert rec.backward == pytest.approx(expected, rel=1e-6)


def test_dropped_samples_leave_padding_rows_that_do_not_count() -> None:
    objective = Counting(num_visits=1)
    keep = [True, False, True, False, False, True]
    _, rec = run(objective, rollout(6, 1, keep), micro_batch_size=2, optimizer_steps_per_rollout=1)
    # 3 kept samples in micro-batches of 2: the second has one live row and one padding row.
    assert [(len(idx), live) for idx, live, _ in objective.seen] == [(2, 2), (2, 1)]
    live_rows = sorted(i for idx, live, _ in objective.seen for i in idx[:live])
    assert live_rows == [0, 2, 5]
    assert sum(len(r) for r in rec.metric_rows) == 3  # the metric sees live rows only
    assert rec.logged["global_load/max"] == 3.0  # kept samples × visits


def test_nothing_kept_makes_no_visit_and_no_step() -> None:
    objective = Counting()
    done, rec = run(objective, rollout(4, 2, [False] * 4))
    assert objective.seen == [] and rec.steps == 0 and done.optimizer_steps == 0
    assert done.loss_sums.tolist() == [0.0] * 4


def test_on_policy_check_logs_the_first_visit_and_warns_above_the_tolerance() -> None:
    _, rec = run(Counting(error=0.0), rollout(4, 1))
    assert rec.logged["actor/on_policy_ratio_err"] == 0.0
    with pytest.warns(UserWarning, match=r"on-policy check: mean \|ratio − 1\| = 0\.5"):
        _, rec = run(Counting(error=0.5), rollout(4, 1))
    assert rec.logged["actor/on_policy_ratio_err"] == 0.5


def test_an_objective_without_a_ratio_logs_no_on_policy_error() -> None:
    # on_policy_error None (DiffusionNFT, SFT, Diffusion-DPO): no value, not a 0 that reads as a pass.
    _, rec = run(Counting(error=None), rollout(4, 1))
    assert "actor/on_policy_ratio_err" not in rec.logged and rec.steps > 0


@dataclass(frozen=True)
class PaddedPeer(OtherPeer):
    """Rank 0 of two peers the other of which kept nothing, so its first micro-batch is all padding
    (error 0 over 0 live rows): what a mean over the two peers returns."""

    def mean(self, x: Tensor) -> Tensor:
        return (x + torch.zeros_like(x)) / 2


def test_the_on_policy_error_of_peers_weighs_their_live_rows() -> None:
    # This rank's first micro-batch has 4 live rows at error 0.5; the other peer's has none. The error
    # over the rows that exist is 0.5 (a mean over peers would say 0.25).
    rec = Recorder()
    ctx = VisitContext(policy=None, copies=None, guidance=1.0)  # type: ignore[arg-type]
    hooks = rec.hooks()
    run_update(
        UpdateSettings(micro_batch_size=4, optimizer_steps_per_rollout=1), Counting(error=0.5, num_visits=1),
        ctx, rollout(4, 1), hooks, rec, dp=PaddedPeer(rank=0, size=2), generator=torch.Generator().manual_seed(0),
        on_policy_tol=1.0, forwards_per_sample=1,
    )  # fmt: skip
    assert rec.logged["actor/on_policy_ratio_err"] == 0.5


def test_on_policy_tolerance_is_resolved_by_its_settings() -> None:
    assert UpdateSettings().on_policy_tolerance(fp32=True) == 1e-6
    assert UpdateSettings().on_policy_tolerance(fp32=False) == 1e-3
    assert UpdateSettings(on_policy_tol=0.1).on_policy_tolerance(fp32=True) == 0.1


# --------------------------------------------------------------------------------------------------
# Optimizer steps are defined over the batch of all ranks: two peers take one process's steps
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ThreadPeer(DataParallel):
    """One of ``size`` peers run as threads of this process: ``stack`` exchanges tensors through a
    barrier, as an all-gather does (every collective of the loop goes through it)."""

    exchange: Any = None

    def stack(self, x: Tensor) -> Tensor:
        slots, barrier = self.exchange
        slots[self.rank] = x.clone()
        barrier.wait()
        out = torch.stack(list(slots))
        barrier.wait()  # everyone has read before the next collective writes
        return out

    def mean(self, x: Tensor) -> Tensor:
        return self.stack(x).mean(0)


@dataclass
class StepRecording(Mean):
    """Records, per visit, (optimizer step so far, sample id, visit) of each live row."""

    recorder: Any = None
    trained: list[tuple[int, int, int]] = field(default_factory=list)
    visit_steps: list[int] = field(default_factory=list)  # the optimizer step of each visit

    def visit(self, ctx: VisitContext, batch: RolloutBatch, idx: Tensor, live: int, v: int) -> Visit:
        ids = batch.sample_ids[idx[:live]].tolist()
        self.trained += [(self.recorder.steps, int(i), v) for i in ids]
        self.visit_steps.append(self.recorder.steps)
        return super().visit(ctx, batch, idx, live, v)


def _walk(
    batch: RolloutBatch, dp: DataParallel, settings: UpdateSettings
) -> tuple[list, list[float], Recorder]:
    rec = Recorder()
    objective = StepRecording(num_visits=3, recorder=rec)
    ctx = VisitContext(policy=None, copies=None, guidance=1.0)  # type: ignore[arg-type]
    run_update(
        settings, objective, ctx, batch, rec.hooks(), rec, dp=dp,  # type: ignore[arg-type]
        generator=torch.Generator().manual_seed(7), on_policy_tol=1e-3, forwards_per_sample=1,
    )  # fmt: skip
    # The gradient of each optimizer step's loss with respect to w: the backward values in between.
    grads = [0.0] * rec.steps
    for step, g in zip(objective.visit_steps, rec.backward, strict=True):
        grads[step] += g
    return objective.trained, grads, rec


@pytest.mark.parametrize("balance_load", [False, True])
def test_optimizer_steps_train_the_same_samples_on_one_process_and_two_peers(balance_load: bool) -> None:
    """The shipped 2 optimizer steps per rollout: each step trains the same samples (every visit of
    each), with the same gradient, whether one process holds the 8 samples or two peers hold 4 each
    (rank-major: peer 0 the first 4). Splitting each rank's own micro-batches into the steps instead
    put all 8 samples' first half of the visits in one step on two ranks, their micro-batches in one
    process. Dropped samples leave the peers uneven (3 and 1 kept), with and without rebalancing."""
    import threading

    torch.manual_seed(0)
    keep = [True, False, True, True, True, False, False, True]
    whole = rollout(8, 3, keep)
    settings = UpdateSettings(micro_batch_size=2, optimizer_steps_per_rollout=2, num_inner_epochs=2)
    settings.balance_load = balance_load
    one, one_grads, one_rec = _walk(whole, DataParallel(), settings)

    halves = [whole.with_rows({k: v[i * 4 : (i + 1) * 4] for k, v in whole.rows().items()}) for i in (0, 1)]
    exchange = ([None, None], threading.Barrier(2))
    results: list[Any] = [None, None]

    def peer(rank: int) -> None:
        results[rank] = _walk(halves[rank], ThreadPeer(rank=rank, size=2, exchange=exchange), settings)

    threads = [threading.Thread(target=peer, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(r is not None for r in results)
    assert one_rec.steps == results[0][2].steps == results[1][2].steps == 4  # 2 steps × 2 inner epochs

    def by_step(trained: list[tuple[int, int, int]]) -> dict[int, set[tuple[int, int]]]:
        out: dict[int, set[tuple[int, int]]] = {}
        for step, sample, visit in trained:
            out.setdefault(step, set()).add((sample, visit))
        return out

    two = by_step(results[0][0] + results[1][0])
    assert two == by_step(one)
    kept_ids = {100 + i for i, k in enumerate(keep) if k}
    for pairs in two.values():  # every visit of each sample in the step, no sample in two steps
        samples = {s for s, _ in pairs}
        assert pairs == {(s, v) for s in samples for v in range(3)}
    for epoch in (0, 1):
        assert set().union(*({s for s, _ in two[step]} for step in (2 * epoch, 2 * epoch + 1))) == kept_ids
    # DDP averages the two peers' gradients: each step's is one process's (a mean over its pairs).
    for step in range(4):
        pair = (results[0][1][step] + results[1][1][step]) / 2
        assert pair == pytest.approx(one_grads[step], rel=16 * torch.finfo(torch.float32).eps)


def test_each_rank_must_hold_whole_optimizer_steps_of_whole_micro_batches() -> None:
    """What cannot be split alike on any number of ranks is refused at setup, naming the flag."""
    settings = UpdateSettings(micro_batch_size=4, optimizer_steps_per_rollout=2)
    assert settings.batch_problems(16, 2) == []  # 8 a rank, 4 a step: one micro-batch
    # 4 a rank, 2 a step: micro-batches of the 2 (one process, 4 a step, runs micro-batches of 4)
    assert settings.batch_problems(8, 2) == [] and settings.micro_size(4) == 2 and settings.micro_size(8) == 4
    (problem,) = settings.batch_problems(24, 2)  # 12 a rank, 6 a step: not whole micro-batches of 4
    assert problem.startswith("--model.init_args.update.micro_batch_size (4) must divide the per-rank batch")
    assert "(24 samples / 2 ranks / 2 optimizer_steps_per_rollout = 6), or be at least that" in problem
    (problem,) = UpdateSettings(micro_batch_size=1, optimizer_steps_per_rollout=3).batch_problems(8, 2)
    assert problem.startswith("--model.init_args.update.optimizer_steps_per_rollout (3) must divide")
    assert "(8 samples / 2 ranks = 4)" in problem
