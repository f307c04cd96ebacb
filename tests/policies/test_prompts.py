"""Prompt encoding shared by the families: rows that do not depend on the batch or the cache's
history, and one truthful note when a prompt is longer than the T5 limit."""

from __future__ import annotations

import warnings

import pytest
import torch

from lit_flowgrpo.policies import FluxPolicy, SD3Policy
from lit_flowgrpo.policies.base import FlowPolicy

LIMIT = 8
LONG = "a very long prompt about a red cube standing on a wooden table in the morning light"
OTHER_LONG = "another very long prompt about two green spheres and one blue cone on the grass"


@pytest.fixture(params=["sd3", "flux"])
def policy(request: pytest.FixtureRequest, tiny_sd3_path: str, tiny_flux_path: str) -> FlowPolicy:
    if request.param == "sd3":
        out: FlowPolicy = SD3Policy(tiny_sd3_path, dtype="float32", max_sequence_length=LIMIT)
    else:
        out = FluxPolicy(tiny_flux_path, dtype="float32", max_sequence_length=LIMIT)
    out.load()
    return out


def test_a_long_prompt_is_reported_once_by_its_flag_and_short_ones_never(
    policy: FlowPolicy, capfd: pytest.CaptureFixture[str]
) -> None:
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        policy.encode_prompts(["a cat", LONG, ""])  # a CFG batch: the empty negative prompt beside it
        policy.encode_prompts(["", "a dog", OTHER_LONG])
    ours = [str(w.message) for w in caught if "max_sequence_length" in str(w.message)]
    assert len(ours) == 1, ours
    assert (
        "--model.init_args.policy.init_args.max_sequence_length (8)" in ours[0] and repr(LONG[:60]) in ours[0]
    )
    # The pipeline's own notice, which listed an empty "truncated part" for every prompt of the batch,
    # is not printed.
    assert "truncated" not in capfd.readouterr().err


def test_rows_do_not_depend_on_the_batch_or_the_cache(policy: FlowPolicy) -> None:
    """What makes a resume exact with the cache on (tests/test_module.py): batched encoders round
    differently with the batch size, yet a prompt first met in a batch (an uninterrupted run) and one
    met alone (a resumed run, whose cache starts empty) get the same rows, cached or not."""
    prompts = [f"prompt number {i} with a few more words" for i in range(6)]
    together = policy.encode_prompts(prompts)
    for i in (0, 5):
        policy._cache.clear()
        alone = policy.encode_prompts([prompts[i]])
        for key, rows in together.items():
            assert torch.equal(rows[i : i + 1], alone[key]), (key, i)
    policy._cache.clear()
    policy._cache.size = 0  # prompt_cache_size=0: nothing kept between calls, the same rows
    again = policy.encode_prompts([*prompts[:3], prompts[0]])
    assert len(policy._cache) == 0
    for key, rows in again.items():
        assert torch.equal(rows[:3], together[key][:3]) and torch.equal(rows[3], rows[0])
