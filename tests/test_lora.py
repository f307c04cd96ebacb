"""lit_flowgrpo/lora.py: TrainableWeights.reference on a small network (no model download)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lit_flowgrpo.lora import LoraSettings, TrainableWeights


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Policy(nn.Module):
    default_lora_targets = ("proj",)

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.transformer = Net()


def test_lora_reference_is_the_network_with_its_adapter_off() -> None:
    policy, x = Policy(), torch.randn(3, 4)
    base = policy.transformer(x).detach()
    weights = TrainableWeights(LoraSettings(rank=2, alpha=4, init="default"))
    weights.attach(policy)
    with torch.no_grad():
        for name, p in policy.transformer.named_parameters():
            if "lora_B" in name:
                p.fill_(0.1)  # a trained adapter
    tuned = policy.transformer(x).detach()
    assert not torch.allclose(tuned, base)
    with weights.reference(policy):
        torch.testing.assert_close(policy.transformer(x), base)
    torch.testing.assert_close(policy.transformer(x), tuned)  # the adapter is back on


def test_full_fine_tune_reference_is_the_frozen_initial_copy() -> None:
    policy, x = Policy(), torch.randn(3, 4)
    base = policy.transformer(x).detach()
    weights = TrainableWeights(None, reference_copy=True)
    weights.attach(policy)
    trained = policy.transformer
    with torch.no_grad():
        trained.proj.weight.add_(1.0)
    with weights.reference(policy):
        assert policy.transformer is weights.reference_network
        torch.testing.assert_close(policy.transformer(x), base)
    assert policy.transformer is trained


def test_full_fine_tune_without_a_copy_has_no_reference() -> None:
    weights = TrainableWeights(None)
    assert weights.problems(uses_reference=True)[0].startswith(
        "--model.init_args.objective.init_args.kl_coef > 0 with a full fine-tune"
    )
    policy = Policy()
    weights.attach(policy)
    with pytest.raises(RuntimeError, match="reference_copy=true"), weights.reference(policy):
        pass
