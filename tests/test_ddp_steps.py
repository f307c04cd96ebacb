"""2-process DDP (gloo) takes one process's optimizer steps with the shipped update settings: 2 optimizer
steps per rollout and AdamW (configs/tiny_sd3.yaml's, as the sd35m_* recipes: lr 3e-4, weight decay
1e-4).

Each optimizer step must train the same (sample, denoising step) pairs whatever the number of ranks
(:meth:`~lit_flowgrpo.update.UpdateSettings.steps_of`). Splitting each rank's own share instead gave
two ranks other samples per step than one process (and, with one micro-batch per rank, a step boundary
between denoising steps): rollout 0's gradient norm was 0.0072 on 2 ranks against 0.0016 on one.

Why the bounds below hold: with one sample per micro-batch (``micro_batch_size: 1``), each backward is
one (sample, denoising step) pair computed by the same kernels on the same rows in both runs (the
rollout chunks of the one process are the ranks' batches, and prompts are encoded one at a time), so
each pair's gradient term is the same, up to the loss's scale by the number of ranks, a power of 2
that DDP's average undoes exactly. A step's gradient is then the same n terms summed in another order
(one process in turn; each rank its share, then the all-reduce), and two orders of a sum of n terms
differ by at most 2·(n − 1)·eps·Σ|term| per element (Higham, Accuracy and Stability of Numerical
Algorithms, §4.2). That holds for the first optimizer step, taken at the same weights; AdamW's step then
moves the weights by an amount whose sensitivity to the gradient is known (:func:`_adam_first_step_bound`).
The later steps start from weights a few roundings apart, whose effect on the gradient the arithmetic
alone does not bound: for them the test checks that they train the same pairs.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from ddp_helpers import CloseProcessGroup
from test_ddp import RecordingModule, brightness, collect

from lit_flowgrpo import FlowGRPO, LoraSettings, PromptDataModule, Sampler, UpdateSettings, WeightsSettings
from lit_flowgrpo.policies import SD3Policy

EPS32 = torch.finfo(torch.float32).eps
LR, WEIGHT_DECAY, ADAM_EPS = 3e-4, 1e-4, 1e-8  # configs/tiny_sd3.yaml's AdamW (torch's eps)


class StepRecorder(RecordingModule):
    """Also records, for each optimizer step, on each rank: the (sample id, visit) pairs it trained,
    the gradient it stepped with, Σ|term| over that gradient's terms (one per backward), and the
    weights after it."""

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.steps: list[dict[str, Any]] = []
        self._pairs: list[tuple[int, int]] = []
        self._abs: dict[str, torch.Tensor] = {}
        visit = self.objective.visit

        def recorded(ctx, batch, idx, live, v):
            self._pairs += [(int(i), int(v)) for i in batch.sample_ids[idx[:live]].tolist()]
            return visit(ctx, batch, idx, live, v)

        self.objective.visit = recorded  # an instance attribute, set in each process after the spawn

    def _trainable(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.named_parameters() if p.requires_grad}

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        before = {n: None if p.grad is None else p.grad.clone() for n, p in self._trainable().items()}
        super().manual_backward(loss, *args, **kwargs)
        for n, p in self._trainable().items():
            term = p.grad if before[n] is None else p.grad - before[n]
            self._abs[n] = self._abs.get(n, 0) + term.abs()

    def _optimizer_step(self, opt: Any, sched: Any) -> bool:
        grads = {n: p.grad.detach().clone() for n, p in self._trainable().items()}
        done = super()._optimizer_step(opt, sched)
        weights = {n: p.detach().clone() for n, p in self._trainable().items()}
        self.steps.append(dict(pairs=sorted(self._pairs), grad=grads, abs=self._abs, weights=weights))
        self._pairs, self._abs = [], {}
        return done

    def on_train_end(self) -> None:
        super().on_train_end()
        torch.save(self.steps, Path(self.out) / f"steps_rank{self.global_rank}.pt")


def run(path: str, prompts: str, out: Path, devices: int) -> None:
    out.mkdir()
    module = StepRecorder(
        out=str(out),
        policy=SD3Policy(path, dtype="float32", max_sequence_length=16),
        reward=brightness,
        objective=FlowGRPO(clip_range=1e-2),
        # Rollout chunks of 4: the one process's two chunks are the two ranks' batches.
        sampler=Sampler(num_steps=3, eval_num_steps=2, height=32, width=32, batch_size=4),
        update=UpdateSettings(micro_batch_size=1, optimizer_steps_per_rollout=2),
        weights=WeightsSettings(lora=LoraSettings(rank=2, alpha=4)),
        optimizer=functools.partial(torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, eps=ADAM_EPS),
    )
    data = PromptDataModule(train=prompts, prompts_per_step=2, group_size=4, seed=5)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp_spawn" if devices > 1 else "auto",
        callbacks=[CloseProcessGroup()],
        max_steps=4,  # 2 rollouts
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, datamodule=data)


def _sum_bound(steps: list[dict[str, Any]], index: int) -> dict[str, torch.Tensor]:
    """Per element, how far two orders of step ``index``'s gradient sum may put it: 2·(n − 1)·eps·Σ|term|
    with n its terms (one per (sample, visit) pair); the terms are the one process's increments, each
    within a rounding of the term it added (hence n, not n − 1)."""
    n = len(steps[index]["pairs"])
    return {k: 2 * n * EPS32 * v for k, v in steps[index]["abs"].items()}


def _adam_first_step_bound(grad: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per element, how far AdamW's first step may put the weights of two runs whose gradients differ
    by at most ``delta``: the step is lr·g/(|g| + ε) (bias-corrected moments of one gradient), whose
    slope is ε/(|g| + ε)², so while |g| > δ the two steps differ by at most lr·δ·ε/(|g| − δ + ε)²; an
    element with |g| ≤ δ may flip its sign, 2·lr. Each run rounds its ~8 elementwise operations (moments,
    bias corrections, square root, division) by eps of the step's size (≤ lr), and its update of the
    weight by eps of the weight."""
    margin = (grad.abs() - delta).clamp_min(0)
    slope = torch.where(
        grad.abs() > delta, delta * ADAM_EPS / (margin + ADAM_EPS) ** 2, torch.full_like(grad, 2.0)
    )
    return LR * (slope.clamp_max(2.0) + 2 * 8 * EPS32) + 2 * EPS32 * weight.abs()


# slow: a single-process run and a 2-process DDP run of 2 rollouts, micro-batches of 1 (~1 min).
@pytest.mark.slow
def test_ddp_two_processes_take_the_single_process_optimizer_steps(tiny_sd3_path, prompt_file, tmp_path):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    run(tiny_sd3_path, prompt_file, tmp_path / "single", devices=1)
    run(tiny_sd3_path, prompt_file, tmp_path / "ddp", devices=2)
    one = torch.load(tmp_path / "single" / "steps_rank0.pt")
    ranks = [torch.load(tmp_path / "ddp" / f"steps_rank{r}.pt") for r in (0, 1)]
    assert len(one) == len(ranks[0]) == len(ranks[1]) == 4

    # Each optimizer step trains the same (sample, visit) pairs, every visit of each of its samples.
    for step in range(4):
        pairs = one[step]["pairs"]
        assert sorted(ranks[0][step]["pairs"] + ranks[1][step]["pairs"]) == pairs, step
        samples = {s for s, _ in pairs}
        visits = {v for _, v in pairs}
        assert len(samples) == 4 and len(pairs) == len(samples) * len(visits) >= 8, step

    # The first rollout is the same computation in the same order on one process and on two ranks.
    single, ddp = collect(tmp_path / "single"), collect(tmp_path / "ddp")
    assert single[0] == ddp[0]

    # The first optimizer step: the same gradient terms summed in another order, at the same weights.
    grad, grad2 = one[0]["grad"], ranks[0][0]["grad"]
    delta = _sum_bound(one, 0)
    for key in grad:
        assert torch.equal(ranks[1][0]["grad"][key], grad2[key])  # the all-reduce leaves one gradient
        assert bool(((grad2[key] - grad[key]).abs() <= delta[key]).all()), key
    # Then AdamW's first step, from the same weights.
    for key in grad:
        w, w2 = one[0]["weights"][key], ranks[0][0]["weights"][key]
        bound = _adam_first_step_bound(grad[key], delta[key], w)
        assert bool(((w2 - w).abs() <= bound).all()), key
    # The bound is not loose enough to pass the old split: its first step's gradient was another one.
    total = sum(float(g.norm() ** 2) for g in grad.values()) ** 0.5
    slack = sum(float(d.norm() ** 2) for d in delta.values()) ** 0.5
    assert slack < 1e-3 * total
