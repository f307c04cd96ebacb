"""The training step with its reward scored beside the rollout (the reward's ``overlap``), on the tiny
SD3: the same rewards, advantages and update as scoring after the rollout; a rollout that fails
raises its own error and leaves no worker thread behind."""

from __future__ import annotations

import math
import threading

import lightning as L
import pytest
import torch
from test_module import brightness, logged, lora_state, make_data, make_module, make_trainer

from lit_flowgrpo.rewards import MultiReward
from lit_flowgrpo.rewards.overlap import THREAD_NAME


class StepOutputs(L.Callback):
    """Keeps each training step's rewards, advantages and kept samples."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append({k: outputs[k].detach().clone() for k in ("rewards", "advantages", "keep")})


def two_rollouts(tiny_sd3_path: str, prompt_file: str, root, overlap: bool):
    reward = MultiReward(
        {"jpeg_incompressibility": 0.2, "bright": 1.0}, rewards={"bright": brightness}, overlap=overlap
    )
    module = make_module(tiny_sd3_path, reward=reward, batch_size=3)  # 8 samples: chunks of 3, 3, 2
    outputs = StepOutputs()
    trainer = make_trainer(root, max_steps=4, callbacks=[outputs])
    trainer.fit(module, datamodule=make_data(prompt_file))
    return module, logged(trainer), outputs.steps


def test_overlap_on_and_off_give_the_same_step(tiny_sd3_path, prompt_file, tmp_path):
    on, rows_on, steps_on = two_rollouts(tiny_sd3_path, prompt_file, tmp_path / "on", overlap=True)
    off, rows_off, steps_off = two_rollouts(tiny_sd3_path, prompt_file, tmp_path / "off", overlap=False)

    assert len(steps_on) == len(steps_off) == 2
    for a, b in zip(steps_on, steps_off, strict=True):
        for key in a:
            assert torch.equal(a[key], b[key]), key
    a, b = lora_state(on), lora_state(off)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same update followed

    logs_on = [r for r in rows_on if "critic/rewards/mean" in r]
    logs_off = [r for r in rows_off if "critic/rewards/mean" in r]
    assert len(logs_on) == len(logs_off) == 2
    for r_on, r_off in zip(logs_on, logs_off, strict=True):
        for key in r_off:
            if key.startswith(("critic/", "reward/failure_rate")):
                assert r_on[key] == r_off[key] or (math.isnan(r_on[key]) and math.isnan(r_off[key])), key
        for row in (r_on, r_off):
            assert row["reward/exposed_s"] >= 0 and row["reward/latency_s/bright"] >= 0
    assert not [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME)]


def test_a_failing_rollout_raises_its_error_and_leaves_no_worker(tiny_sd3_path, prompt_file, tmp_path):
    scored = []

    def recording(images, prompts, metadata):
        scored.append(images.shape[0])
        return images.mean(dim=(1, 2, 3))

    module = make_module(tiny_sd3_path, reward=recording, batch_size=3)
    module.configure_model()
    decode, decoded = module.policy.decode, []

    def fails_on_the_second_chunk(latents):
        decoded.append(latents.shape[0])
        if len(decoded) == 2:
            for _ in range(3000):  # let the worker score the first chunk (a bounded poll, no clock)
                if scored:
                    break
                threading.Event().wait(0.01)
            raise RuntimeError("decoder ran out of memory")
        return decode(latents)

    module.policy.decode = fails_on_the_second_chunk
    with pytest.raises(RuntimeError, match="decoder ran out of memory"):
        make_trainer(tmp_path, max_steps=2).fit(module, datamodule=make_data(prompt_file))
    assert scored == [3]  # the first chunk was scored beside the rollout; the second never came
    assert not [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME)]
