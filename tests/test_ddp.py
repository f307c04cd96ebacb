"""DDP on 2 CPU processes (gloo) gives the advantages and the update of a single process."""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import lightning as L
import pytest
import torch
from ddp_helpers import CloseProcessGroup
from tolerances import EPS32, depth, image_mean_atol

from lit_flowgrpo import (
    AdvantageSettings,
    FlowGRPO,
    FlowGRPOModule,
    LoraSettings,
    PromptDataModule,
    Sampler,
    UpdateSettings,
    WeightsSettings,
)
from lit_flowgrpo.objective import DiffusionNFT
from lit_flowgrpo.performance import PerformanceSettings
from lit_flowgrpo.policies import SD3Policy


def brightness(images, prompts, metadata):
    return images.mean(dim=(1, 2, 3))


class RecordingModule(FlowGRPOModule):
    """Writes each rank's (sample id, reward, advantage) rows, and the first and final adapter, to
    ``out``."""

    def __init__(self, out: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.out = out

    def on_train_batch_end(self, outputs, batch, batch_idx):
        rows = [
            [int(s), float(r), float(a)]
            for s, r, a in zip(
                outputs["sample_ids"].tolist(),
                outputs["rewards"].tolist(),
                outputs["advantages"].tolist(),
                strict=True,
            )
        ]
        path = Path(self.out) / f"adv_rank{self.global_rank}_step{batch.step}.json"
        path.write_text(json.dumps(rows))

    def on_train_start(self) -> None:
        self._save("lora_init.pt")

    def on_train_end(self) -> None:
        self._save("lora.pt")

    def _save(self, name: str) -> None:
        if self.global_rank == 0:
            state = {k: v.detach().cpu().clone() for k, v in self.named_parameters() if v.requires_grad}
            torch.save(state, Path(self.out) / name)


def fit_two_steps(module: FlowGRPOModule, data: PromptDataModule, devices: int) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp_spawn" if devices > 1 else "auto",
        callbacks=[CloseProcessGroup()],
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, datamodule=data)


STEPS, SIZE = 3, 32  # the rollout's denoising steps and image size
# Terms of each LoRA gradient element, at most: 2 rollouts × 8 samples × 2 trained steps (NFT: 2
# visits) × 2 CFG halves × 349 tokens (256 image tokens of the tiny SD3 at 32 px, 93 of text).
GRADIENT_TERMS = 2 * 8 * 2 * 2 * 349


def guidance(nft: bool) -> float:
    return 1.0 if nft else 4.5


def brightness_atol(path: str, *, steps: int, guidance: float, size: int) -> float:
    """How far two ranks' batches may put ``brightness`` of one sample: the rollout's forwards through
    the tiny SD3 transformer, its decoder and the mean of 3·size² pixels, each rounding in another order
    (tests/tolerances.py). 3 steps at guidance 4.5: 1115 layers, 1.4e-4."""
    policy = SD3Policy(path, dtype="float32", max_sequence_length=16)
    policy.load()
    layers, decoder = depth(policy.transformer), depth(policy.vae.decoder)
    return image_mean_atol(layers, decoder, steps=steps, guidance=guidance, pixels=3 * size * size)


def run(path: str, prompts: str, out: Path, devices: int, fp8: bool = False, nft: bool = False) -> None:
    out.mkdir()
    module = RecordingModule(
        out=str(out),
        policy=SD3Policy(path, dtype="float32", max_sequence_length=16),
        reward=brightness,
        # DiffusionNFT: its visits' noise levels and noise are seeded per sample id, and its old policy
        # (a stored adapter copy) is refreshed from the synced weights on every rank alike
        objective=DiffusionNFT() if nft else FlowGRPO(clip_range=1e-2),
        sampler=Sampler(
            num_steps=STEPS, eval_num_steps=2, height=SIZE, width=SIZE, guidance_scale=guidance(nft)
        ),
        update=UpdateSettings(micro_batch_size=2, optimizer_steps_per_rollout=1),
        weights=WeightsSettings(lora=LoraSettings(rank=2, alpha=4)),
        performance=PerformanceSettings(fp8_base_matmuls=fp8),
        # SGD: the weights move by lr × gradient, so ranks that agree on the gradient agree on the
        # weights. Adam's first step is ±lr for every element whatever its gradient's size, so a
        # gradient element near 0 turns rounding into a whole ±lr step (3.4e-4 was seen).
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),  # picklable: ddp_spawn sends the module
    )
    data = PromptDataModule(train=prompts, prompts_per_step=2, group_size=4, seed=5)
    fit_two_steps(module, data, devices)


def collect(out: Path) -> dict[int, dict[int, tuple[float, float]]]:
    steps: dict[int, dict[int, tuple[float, float]]] = {}
    for f in out.glob("adv_rank*_step*.json"):
        step = int(f.stem.split("step")[1])
        for sample, reward, adv in json.loads(f.read_text()):
            steps.setdefault(step, {})[sample] = (reward, adv)
    return steps


def assert_rewards_and_advantages_close(
    single: dict[int, tuple[float, float]], multi: dict[int, tuple[float, float]], reward_atol: float
) -> float:
    """One step's {sample id: (reward, advantage)} of a multi-rank run against one process's; returns
    the largest advantage difference.

    Different batch compositions change float summation order, nothing more: rewards agree to
    ``reward_atol``, the caller's bound for its reward (unscored, NaN, ones stay NaN with advantage
    0), and advantages (r − mean) / (std + 1e-4), over the global std of the step's rewards, to what
    the reward differences δ can move them (the numerator by 2δ, the std by 2δ), plus their rounding
    from fp64 to fp32 on each side (half an ulp each)."""
    assert sorted(single) == sorted(multi)
    scored = [s for s, (r, _) in single.items() if math.isfinite(r)]
    assert {s for s, (r, _) in multi.items() if math.isfinite(r)} == set(scored)
    assert all(multi[s][1] == 0.0 for s in single if s not in scored)
    delta = max(abs(multi[s][0] - single[s][0]) for s in scored)
    assert delta <= reward_atol, (delta, reward_atol)
    rewards = torch.tensor([single[s][0] for s in scored], dtype=torch.float64)
    scale = float(rewards.std(unbiased=False)) + 1e-4
    for sample in scored:
        adv = single[sample][1]
        bound = 2 * delta * (1 + abs(adv)) / scale + EPS32 * max(1.0, abs(adv))
        assert abs(multi[sample][1] - adv) <= bound, (sample, bound)
    return max(abs(multi[s][1] - single[s][1]) for s in scored)


# fp8: the float8 copies of the base stay out of DDP's buffer broadcast (gloo cannot send float8),
# and each token quantizes alone, so two ranks compute what one process does.
@pytest.mark.parametrize(
    ("fp8", "nft"),
    [(False, False), (True, False), (False, True)],
    ids=["bf16_base", "fp8_base", "diffusion_nft"],
)
def test_ddp_two_processes_equal_single_process(tiny_sd3_path, prompt_file, tmp_path, fp8, nft):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    run(tiny_sd3_path, prompt_file, tmp_path / "single", devices=1, fp8=fp8, nft=nft)
    run(tiny_sd3_path, prompt_file, tmp_path / "ddp", devices=2, fp8=fp8, nft=nft)
    single, ddp = collect(tmp_path / "single"), collect(tmp_path / "ddp")
    assert sorted(single) == sorted(ddp) == [0, 1]
    # fp8: the quantized layers round their inputs to e4m3, and a difference upstream flips an element to
    # the neighbouring e4m3 value only where it lies within that difference of a rounding midpoint, with
    # a probability of the difference over the e4m3 step: on average it passes the difference on, as an
    # fp32 rounding does. Measured: 9e-8 (fp32 base) and 0.4-13e-6 (fp8) against 1.4e-4, on AVX-512,
    # AVX2 and the default kernels.
    reward_atol = brightness_atol(tiny_sd3_path, steps=STEPS, guidance=guidance(nft), size=SIZE)
    adv_change = 0.0
    for step in single:
        assert sorted(single[step]) == sorted(ddp[step]) == list(range(8))  # every sample once, across ranks
        adv_change = max(
            adv_change, assert_rewards_and_advantages_close(single[step], ddp[step], reward_atol)
        )
    init = torch.load(tmp_path / "single" / "lora_init.pt")
    a = torch.load(tmp_path / "single" / "lora.pt")
    b = torch.load(tmp_path / "ddp" / "lora.pt")
    assert all(torch.equal(init[k], v) for k, v in torch.load(tmp_path / "ddp" / "lora_init.pt").items())
    # SGD: the weights move by lr × Σ_i A_i·∇ℓ_i over the 16 samples of two rollouts. Summed in another
    # order, a gradient element of n terms moves by n·eps of their size (Higham §4.2; the largest step
    # stands in for it); advantages that differ by ΔA (above) move sample i's share by ΔA_i·∇ℓ_i, each
    # share taken as at most the whole step (16 shares of unit-spread advantages). Then the two final
    # roundings of W. Measured: 1e-9 (fp32 base), 4e-7 (fp8); a gradient off by 2 misses by 1.4e-4.
    moved = max(float((a[k] - init[k]).abs().max()) for k in a)
    atol = moved * (GRADIENT_TERMS * EPS32 + 16 * adv_change)

    def close(w: dict[str, torch.Tensor]) -> bool:
        return all(torch.allclose(w[k], v, rtol=2 * EPS32, atol=atol) for k, v in a.items())

    assert not close({k: init[k] + (a[k] - init[k]) / 2 for k in a})  # the check sees a halved gradient
    assert close(b)


def half_saturated(images, prompts, metadata):
    """Even-numbered prompts score 1 whatever the image: their groups tie, their advantages are 0."""
    bright = images.mean(dim=(1, 2, 3))
    even = torch.tensor([int(p.split()[-1]) % 2 == 0 for p in prompts], device=bright.device)
    return torch.where(even, torch.ones_like(bright), bright)


class BalanceRecorder(FlowGRPOModule):
    """Writes, per rank and step (from the step's output), the sample ids it kept, the ids it trained
    and every rank's load after balancing."""

    def __init__(self, out: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.out = out
        self._step = 0

    def _write(self, name: str, value) -> None:
        path = Path(self.out) / f"{name}_rank{self.global_rank}_step{self._step}.json"
        path.write_text(json.dumps(value))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self._step = batch.step
        ids, keep = outputs["sample_ids"].tolist(), outputs["keep"].tolist()
        self._write("kept", [int(s) for s, k in zip(ids, keep, strict=True) if k])
        self._write("loads", outputs["kept_per_rank"])
        self._write("trained", sorted(int(i) for i in outputs["trained_sample_ids"].tolist()))


def run_balanced(path: str, prompts: str, out: Path) -> None:
    out.mkdir()
    module = BalanceRecorder(
        out=str(out),
        policy=SD3Policy(path, dtype="float32", max_sequence_length=16),
        reward=half_saturated,
        objective=FlowGRPO(clip_range=1e-2),
        sampler=Sampler(num_steps=3, eval_num_steps=2, height=32, width=32),
        advantage=AdvantageSettings(filter_zero=True, std="group"),
        update=UpdateSettings(micro_batch_size=2, optimizer_steps_per_rollout=1, balance_load=True),
        weights=WeightsSettings(lora=LoraSettings(rank=2, alpha=4)),
    )
    data = PromptDataModule(train=prompts, prompts_per_step=4, group_size=2, seed=3)
    fit_two_steps(module, data, devices=2)


def test_balance_load_trains_every_kept_sample_once_with_even_loads(tiny_sd3_path, prompt_file, tmp_path):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    out = tmp_path / "balanced"
    run_balanced(tiny_sd3_path, prompt_file, out)

    def read(name: str, rank: int, step: int):
        return json.loads((out / f"{name}_rank{rank}_step{step}.json").read_text())

    uneven = 0
    for step in (0, 1):
        before = [len(read("kept", r, step)) for r in (0, 1)]
        after = read("loads", 0, step)
        assert read("loads", 1, step) == after  # every rank computed the same plan
        assert max(after) - min(after) <= 1 and sum(after) == sum(before)
        uneven += max(before) - min(before) > 1
        kept = sorted(read("kept", 0, step) + read("kept", 1, step))
        trained = [read("trained", r, step) for r in (0, 1)]
        assert [len(t) for t in trained] == after
        assert sorted(trained[0] + trained[1]) == kept  # each kept sample trained once, on one rank
    assert uneven, "the seed should draw at least one rollout whose kept samples are uneven across ranks"
