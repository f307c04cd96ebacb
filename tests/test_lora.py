"""lit_flowgrpo/weights.py and copies.py: the KL reference of the trained weights on a small network (no model download)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lit_flowgrpo.kl import KLSettings, ReferenceSettings
from lit_flowgrpo.weights import LoraSettings, TrainableWeights, WeightsSettings


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Policy(nn.Module):
    """The attributes of a FlowPolicy that the trained weights read."""

    default_lora_targets = ("proj",)
    default_lora_rank = 32
    default_lora_alpha = None

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.transformer = Net()

    @property
    def trainable_networks(self) -> tuple[nn.Module, ...]:
        return (self.transformer,)

    def unused_modules(self) -> tuple[str, ...]:
        return ()


def test_lora_reference_is_the_network_with_its_adapter_off() -> None:
    policy, x = Policy(), torch.randn(3, 4)
    base = policy.transformer(x).detach()
    weights = TrainableWeights(WeightsSettings(lora=LoraSettings(rank=2, alpha=4, init="default")))
    weights.attach(policy)
    with torch.no_grad():
        for name, p in policy.transformer.named_parameters():
            if "lora_B" in name:
                p.fill_(0.1)  # a trained adapter
    tuned = policy.transformer(x).detach()
    assert not torch.allclose(tuned, base)
    with weights.copies.reference():
        torch.testing.assert_close(policy.transformer(x), base)
    torch.testing.assert_close(policy.transformer(x), tuned)  # the adapter is back on


def test_full_fine_tune_reference_is_the_frozen_initial_copy() -> None:
    policy, x = Policy(), torch.randn(3, 4)
    base = policy.transformer(x).detach()
    weights = TrainableWeights(WeightsSettings(lora=None), reference=ReferenceSettings(copy=True))
    weights.attach(policy)
    trained = policy.transformer
    with torch.no_grad():
        trained.proj.weight.add_(1.0)
    with weights.copies.reference():
        assert policy.transformer is weights.copies.kl_reference.network
        torch.testing.assert_close(policy.transformer(x), base)
    assert policy.transformer is trained


def test_full_fine_tune_without_a_copy_has_no_reference() -> None:
    weights = TrainableWeights(WeightsSettings(lora=None))
    problem = KLSettings(coef=0.04).problems(full_fine_tune=True)[0]
    assert problem.startswith(
        "the KL to the reference (--model.init_args.kl.coef > 0 or --model.init_args.kl.measure) with a "
        "full fine-tune (--model.init_args.weights.lora=null) needs --model.init_args.kl.reference.copy=true"
    )
    policy = Policy()
    weights.attach(policy)
    with pytest.raises(RuntimeError, match=r"kl\.reference\.copy=true"), weights.copies.reference():
        pass
