"""Every attribute the package reads from a policy is declared on FlowPolicy, with the default a policy
that says nothing gets, so that no reader needs ``getattr(policy, "x", default)``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lit_flowgrpo.policies import FlowPolicy, SD3Policy

REPO = Path(__file__).resolve().parents[2]
#: ``getattr(policy, "x"`` / ``hasattr(self.policy, "x"`` / ``getattr(self._policy, "x"``, any spacing.
READ = re.compile(r"\b(?:getattr|hasattr)\(\s*(?:self\.|pl_module\.)?_?policy\s*,\s*[\"'](\w+)[\"']")


def _declared(name: str) -> bool:
    return hasattr(FlowPolicy, name) or any(
        name in getattr(c, "__annotations__", {}) for c in FlowPolicy.__mro__
    )


def test_every_attribute_read_from_a_policy_is_declared() -> None:
    reads = {
        f"{path.relative_to(REPO)}: {name}"
        for folder in ("lit_flowgrpo", "benchmarks")
        for path in sorted((REPO / folder).rglob("*.py"))
        for name in READ.findall(path.read_text(encoding="utf-8"))
        if not _declared(name)
    }
    assert not reads, f"declare these on FlowPolicy (lit_flowgrpo/policies/base.py): {sorted(reads)}"
    assert READ.findall('getattr(self.policy, "masked_prompts", False)') == [
        "masked_prompts"
    ]  # it finds them


def test_the_declared_defaults() -> None:
    from lit_flowgrpo.policies.flux import FluxPolicy
    from lit_flowgrpo.policies.qwenimage import QwenImagePolicy
    from lit_flowgrpo.policies.wan import WanPolicy

    assert (FlowPolicy.default_lora_rank, FlowPolicy.default_lora_alpha) == (32, None)  # None: twice the rank
    assert (FluxPolicy.default_lora_rank, FluxPolicy.default_lora_alpha) == (64, 128)
    assert (WanPolicy.default_lora_rank, WanPolicy.default_lora_alpha) == (32, 64)
    assert FlowPolicy.lora_subfolders == () and WanPolicy.lora_subfolders == ("transformer_2",)
    assert not FlowPolicy.masked_prompts and not FluxPolicy.masked_prompts and QwenImagePolicy.masked_prompts


def test_the_vae_is_none_until_loaded_then_a_submodule(tiny_sd3_path: str) -> None:
    policy = SD3Policy(tiny_sd3_path, dtype="float32", max_sequence_length=16)
    assert policy.vae is None and policy.declared_networks == 1 and policy.boundary_timestep is None
    policy.load()
    assert policy.vae is policy.pipe.vae  # registered in place of the None: moved and sharded with the policy
    assert "vae" in dict(policy.named_children()) and any(k.startswith("vae.") for k in policy.state_dict())


@pytest.mark.parametrize("name", ["vae", "masked_prompts", "declared_networks", "lora_subfolders"])
def test_a_policy_that_declares_nothing_reads_the_defaults(name: str) -> None:
    from lit_flowgrpo.toy import ToyPolicy

    defaults = {"vae": None, "masked_prompts": False, "declared_networks": 1, "lora_subfolders": ()}
    assert getattr(ToyPolicy(), name) == defaults[name]
