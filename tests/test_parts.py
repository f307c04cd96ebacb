"""The lifecycle of the parts with state (lit_flowgrpo/parts.py): a new part plugs in with one
registration and resumes exactly, and checkpoints written before the parts existed still load."""

from __future__ import annotations

import math

import pytest
import torch
from test_module import lora_state, make_data, make_module, make_trainer

from lit_flowgrpo.kl import ReferenceSettings
from lit_flowgrpo.objective import DiffusionNFT
from lit_flowgrpo.parts import AfterUpdate, Counters, Part, Parts


class RunningLossBaseline:
    """A part of the kind the next capabilities add: a running mean of the update's loss (a baseline
    a later stage could subtract), which moves after each update and resumes with the run. Written
    against the Part protocol only; registered with one line."""

    key = "running_loss_baseline"

    def __init__(self, decay: float = 0.5) -> None:
        self.decay = decay
        self.mean = 0.0
        self.updates = 0
        self.seen_steps: list[int] = []

    def state_dict(self) -> dict:
        return {"mean": self.mean, "updates": self.updates, "seen_steps": list(self.seen_steps)}

    def load_state_dict(self, state: dict | None) -> None:
        if state is None:
            raise ValueError("the checkpoint holds no running_loss_baseline")
        self.mean, self.updates = float(state["mean"]), int(state["updates"])
        self.seen_steps = list(state["seen_steps"])

    def after_update(self, done: AfterUpdate) -> None:
        loss = done.losses["actor/loss"]
        self.mean = loss if self.updates == 0 else self.decay * self.mean + (1 - self.decay) * loss
        self.updates += 1
        self.seen_steps.append(done.optimizer_steps)


def test_parts_refuse_a_duplicate_key_and_what_is_not_a_part() -> None:
    parts = Parts([Counters(["a"])])
    with pytest.raises(ValueError, match="two parts save under the key 'counters'"):
        parts.add(Counters(["b"]))
    with pytest.raises(TypeError, match="is not a part"):
        parts.add(object())  # type: ignore[arg-type]
    assert isinstance(RunningLossBaseline(), Part)


def test_counters_restore_and_a_missing_counter_starts_at_zero() -> None:
    counters = Counters(["skipped", "dropped"])
    counters.add("dropped", 3)
    with pytest.raises(KeyError, match="no counter 'lost'"):
        counters.add("lost")
    fresh = Counters(["skipped", "dropped", "new"])
    fresh.load_state_dict(counters.state_dict())
    assert fresh.values == {"skipped": 0, "dropped": 3, "new": 0}
    fresh.load_state_dict(None)  # a checkpoint without counters changes nothing
    assert fresh.values["dropped"] == 3


def test_a_new_part_moves_after_each_update_and_resumes_exactly(tiny_sd3_path, prompt_file, tmp_path) -> None:
    def run(root: str, max_steps: int, **fit):
        module = make_module(tiny_sd3_path)
        baseline = module.parts.add(RunningLossBaseline())  # the one registration
        trainer = make_trainer(tmp_path / root, max_steps=max_steps)
        trainer.fit(module, datamodule=make_data(prompt_file), **fit)
        return module, baseline, trainer

    straight, straight_baseline, _ = run("a", 4)
    # 2 optimizer steps per rollout: the part saw the steps so far after each update.
    assert straight_baseline.seen_steps == [2, 4] and straight_baseline.updates == 2
    assert math.isfinite(straight_baseline.mean)
    _, half_baseline, trainer = run("b", 2)
    ckpt = tmp_path / "half.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["lit_flowgrpo"]
    assert saved["running_loss_baseline"] == half_baseline.state_dict()
    resumed, resumed_baseline, _ = run("c", 4, ckpt_path=ckpt)
    assert resumed_baseline.state_dict() == straight_baseline.state_dict()  # the same floats, bit for bit
    a, b = lora_state(straight), lora_state(resumed)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


#: The ``lit_flowgrpo`` entry of a checkpoint as main wrote it before the parts (one hand-written line
#: per stateful part in ``on_save_checkpoint``).
LEGACY_KEYS = {"trainable_keys", "counters", "idle_rollouts", "old_policy", "reference", "kl_gate"}


def test_the_checkpoint_keeps_the_keys_it_had_before_the_parts(tiny_sd3_path, prompt_file, tmp_path) -> None:
    module = make_module(tiny_sd3_path, objective=DiffusionNFT(), guidance_scale=1.0)
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.fit(module, datamodule=make_data(prompt_file))
    ckpt = tmp_path / "new.ckpt"
    trainer.save_checkpoint(ckpt)
    ours = torch.load(ckpt, weights_only=False)["lit_flowgrpo"]
    # The same entries in the same form; a run without a KL gate has no gate's part, so no "kl_gate"
    # (main wrote None there, which a load treats as absent).
    assert set(ours) == LEGACY_KEYS - {"kl_gate"}
    assert isinstance(ours["idle_rollouts"], int) and ours["reference"] == {}
    assert set(ours["counters"]) == {"skipped_optimizer_steps", "nonfinite_losses", "dropped_samples"}


def test_a_checkpoint_built_with_the_old_keys_restores_every_part(tiny_sd3_path) -> None:
    # An NFT run with a refreshed reference: the old policy and the moving reference both have tensors.
    settings = dict(
        objective=DiffusionNFT(),
        kl_coef=0.04,
        guidance_scale=1.0,
        reference=ReferenceSettings(mode="refreshed", refresh_every=4),
    )
    source = make_module(tiny_sd3_path, **settings)
    source.configure_model()
    trainable = lora_state(source)
    old = {k: v + 0.25 for k, v in source.copies.old_policy.state_dict().items()}
    reference_tensors = {k: v - 0.5 for k, v in source.copies.kl_reference.adapter().items()}
    legacy = {
        "state_dict": {k: v + 1.0 for k, v in trainable.items()},
        "lit_flowgrpo": {
            "trainable_keys": sorted(trainable),
            "counters": {"skipped_optimizer_steps": 1, "nonfinite_losses": 2, "dropped_samples": 3},
            "idle_rollouts": 2,
            "old_policy": old,
            "reference": {"tensors": reference_tensors, "steps_at_refresh": 8, "refreshes": 2},
            "kl_gate": None,
        },
    }
    assert set(legacy["lit_flowgrpo"]) == LEGACY_KEYS
    module = make_module(tiny_sd3_path, **settings)
    module.configure_model()
    module.on_load_checkpoint(legacy)
    assert module.counters.values == {
        "skipped_optimizer_steps": 1,
        "nonfinite_losses": 2,
        "dropped_samples": 3,
    }
    idle = next(p for p in module.parts if p.key == "idle_rollouts")
    assert idle.count == 2
    restored_old = module.copies.old_policy.state_dict()
    assert restored_old.keys() == old.keys() and all(torch.equal(restored_old[k], old[k]) for k in old)
    reference = module.copies.kl_reference
    assert (reference.steps_at_refresh, reference.refreshes) == (8, 2)
    assert all(torch.equal(reference.adapter()[k], reference_tensors[k]) for k in reference_tensors)


def test_a_checkpoint_without_the_old_policy_is_refused_naming_the_objective(tiny_sd3_path) -> None:
    module = make_module(tiny_sd3_path, objective=DiffusionNFT(), guidance_scale=1.0)
    module.configure_model()
    trainable = lora_state(module)
    legacy = {
        "state_dict": trainable,
        "lit_flowgrpo": {"trainable_keys": sorted(trainable), "old_policy": {}},
    }
    with pytest.raises(ValueError, match="holds no old policy, which DiffusionNFT needs"):
        module.on_load_checkpoint(legacy)
