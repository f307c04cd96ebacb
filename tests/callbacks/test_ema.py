"""TrainableEMA: flow_grpo's schedule through diffusers' EMAModel, the validation swap, exact resume."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from callback_helpers import StandIn, loader, trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor

from lit_flowgrpo.callbacks import TrainableEMA


def reference_ema(
    start: Tensor, history: Sequence[Tensor], decay: float, every: int, first_step: int = 1
) -> Tensor:
    """flow_grpo's schedule in float64, one optimizer step at a time."""
    ema = start.double().clone()
    for k, theta in enumerate(history, start=first_step):
        if k % every == 0:
            d = min((1 + k) / (10 + k), decay)
            ema = d * ema + (1 - d) * theta.double()
    return ema


def flat(ema: dict[str, Tensor], model: StandIn) -> Tensor:
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(ema) == sorted(names)  # the trainable parameters only, frozen layers left out
    return torch.cat([ema[n].flatten() for n in names])


def test_ema_math_through_optimizer_steps(tmp_path: Any) -> None:
    ema = TrainableEMA(decay=0.9, update_every=2)
    model = StandIn(opt_steps=3)
    start = model._flat_trainable()
    trainer(tmp_path, [ema], limit_train_batches=4).fit(model, loader(4))
    assert ema.optimizer_steps == 12 and ema.num_updates == 6
    assert {t.dtype for t in ema.ema.values()} == {torch.float32}
    expected = reference_ema(start, model.history, 0.9, 2)
    torch.testing.assert_close(flat(ema.ema, model).double(), expected, rtol=1e-6, atol=1e-7)
    # it really averaged: the EMA is neither the start nor the final weights
    assert not torch.allclose(flat(ema.ema, model), model.history[-1])
    assert TrainableEMA.current_decay(1, 0.9) == pytest.approx(2 / 11)


def test_ema_swap_for_validation_and_export(tmp_path: Any) -> None:
    ema = TrainableEMA(decay=0.9, update_every=1)
    model = StandIn(opt_steps=2)
    t = trainer(tmp_path, [ema], limit_train_batches=3, limit_val_batches=2)
    t.fit(model, loader(3), loader(2))
    trained = model._flat_trainable()
    averaged = flat(ema.ema, model)
    assert not torch.allclose(trained, averaged)
    # validation inside fit ran with the EMA weights, and the training weights came back after it
    assert len(model.seen_in_validation) == 2
    for seen in model.seen_in_validation:  # fp32 shadows copied into fp32 weights: exact
        assert torch.equal(seen, averaged)
    assert torch.equal(trained, model.history[-1])

    with ema.swapped(model):
        assert torch.equal(model._flat_trainable(), averaged)
        # a checkpoint saved while swapped keeps the training weights in its state_dict
        checkpoint = {"state_dict": {k: v.clone() for k, v in model.state_dict().items()}}
        ema.on_save_checkpoint(t, model, checkpoint)
        saved = torch.cat(
            [checkpoint["state_dict"][n].flatten() for n, p in model.named_parameters() if p.requires_grad]
        )
        assert torch.equal(saved, trained)
    assert torch.equal(model._flat_trainable(), trained)

    with pytest.raises(KeyError), ema.swapped(model):
        raise KeyError("export failed")
    assert torch.equal(model._flat_trainable(), trained)  # restored on the error path too
    with ema.swapped(model), pytest.raises(RuntimeError, match="already swapped in"):
        ema._swap_in(model)


def test_ema_checkpoint_round_trip(tmp_path: Any) -> None:
    ckpt_dir = tmp_path / "ckpt"
    ema = TrainableEMA(decay=0.9, update_every=2)
    model = StandIn(opt_steps=3)
    start = model._flat_trainable()
    cbs = [ema, ModelCheckpoint(dirpath=str(ckpt_dir), save_last=True)]
    trainer(tmp_path, cbs, limit_train_batches=2, enable_checkpointing=True).fit(model, loader(2))
    path = str(ckpt_dir / "last.ckpt")

    # offline export reads the EMA from the file, keyed like the module's state_dict
    from_file = TrainableEMA.weights_from_checkpoint(path)
    torch.testing.assert_close(flat(from_file, model), flat(ema.ema, model))
    restored = StandIn()
    restored.load_state_dict(from_file, strict=False)
    torch.testing.assert_close(restored._flat_trainable(), flat(ema.ema, model))
    with pytest.raises(ValueError, match="no TrainableEMA"):
        TrainableEMA.weights_from_checkpoint({"callbacks": {}})

    # resume: the average and the step counter continue where they were
    resumed = TrainableEMA(decay=0.9, update_every=2)
    model2 = StandIn(opt_steps=3)
    trainer(tmp_path, [resumed], limit_train_batches=2, max_epochs=2).fit(model2, loader(2), ckpt_path=path)
    assert resumed.optimizer_steps == 12 and resumed.num_updates == 6
    expected = reference_ema(start, model.history + model2.history, 0.9, 2)
    torch.testing.assert_close(flat(resumed.ema, model2).double(), expected, rtol=1e-6, atol=1e-7)


def test_ema_rejects_bad_arguments_and_mismatched_state() -> None:
    with pytest.raises(ValueError, match="decay"):
        TrainableEMA(decay=1.0)
    with pytest.raises(ValueError, match="update_every"):
        TrainableEMA(update_every=0)
    ema = TrainableEMA()
    ema.load_state_dict(
        {"optimizer_steps": 3, "num_updates": 1, "ema_state_dict": {"not.a.param": torch.zeros(1)}}
    )
    with pytest.raises(ValueError, match="does not match"):
        ema._initialize(StandIn())


def test_ema_resume_is_bit_exact(tmp_path: Any) -> None:
    """Two rollouts, a checkpoint, two more: every shadow equals the uninterrupted run's, bit for bit."""
    torch.manual_seed(0)
    model = StandIn(opt_steps=3)
    straight = TrainableEMA(decay=0.9, update_every=2)
    trainer(tmp_path / "a", [straight], limit_train_batches=2, max_epochs=2).fit(model, loader(2))

    torch.manual_seed(0)  # the same initial weights
    model = StandIn(opt_steps=3)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    first = TrainableEMA(decay=0.9, update_every=2)
    trainer(tmp_path / "b", [first, ckpt], limit_train_batches=2, enable_checkpointing=True).fit(
        model, loader(2)
    )
    resumed = TrainableEMA(decay=0.9, update_every=2)
    trainer(tmp_path / "b", [resumed], limit_train_batches=2, max_epochs=2).fit(
        StandIn(opt_steps=3), loader(2), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt")
    )
    assert (resumed.optimizer_steps, resumed.num_updates) == (straight.optimizer_steps, straight.num_updates)
    assert resumed.ema.keys() == straight.ema.keys()
    for name, value in straight.ema.items():
        assert torch.equal(resumed.ema[name], value), name


def test_ema_kept_on_the_host_is_the_same_average(tmp_path: Any) -> None:
    """``device="cpu"``: the shadows live in host memory and each update averages host copies of the
    weights; copying is exact, so the EMA equals the default one bit for bit (on a CPU machine this
    checks the path, not the placement)."""
    averages = []
    for device in ("parameters", "cpu"):
        torch.manual_seed(0)
        ema = TrainableEMA(decay=0.9, update_every=2, device=device)
        model = StandIn(opt_steps=3)
        trainer(tmp_path / device, [ema], limit_train_batches=4).fit(model, loader(4))
        assert ema.num_updates == 6
        assert {t.device.type for t in ema.ema.values()} == {"cpu"}
        averages.append(flat(ema.ema, model))
        # averaged, not copied (EMAModel copies what does not require grad)
        assert not torch.equal(averages[-1], model._flat_trainable())
    assert torch.equal(averages[0], averages[1])
    with pytest.raises(ValueError, match=r"device \('gpu'\) must be 'parameters' or 'cpu'"):
        TrainableEMA(device="gpu")  # type: ignore[arg-type]
