"""The toy policies' ``dtype: auto``: bf16 only where the device computes it in hardware.

A CPU without bf16 instructions emulates bf16 products, many times slower than float32, so the main
job (``dtype: auto``) must load in float32 there and in bf16 where the instructions exist.
"""

from __future__ import annotations

import copy as copy_module

import pytest
import torch

from lit_flowgrpo.copies import frozen_copy
from lit_flowgrpo.performance import native_bf16
from lit_flowgrpo.toy.edit_model import default_edit_checkpoint, load_edit_checkpoint, predict_edit_velocity
from lit_flowgrpo.toy.model import default_checkpoint, load_checkpoint, predict_velocity
from lit_flowgrpo.toy.policy import ToyPolicy, toy_dtype
from lit_flowgrpo.toy.video_model import (
    default_video_checkpoint,
    load_video_checkpoint,
    predict_video_velocity,
)
from lit_flowgrpo.toy.video_policy import ToyVideoPolicy


def _cpu_has(monkeypatch, avx512_bf16: bool, amx: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "expected"),
    [(False, False, torch.float32), (True, False, torch.bfloat16), (False, True, torch.bfloat16)],
)
def test_auto_follows_the_cpus_bf16_instructions(monkeypatch, avx512_bf16, amx, expected):
    _cpu_has(monkeypatch, avx512_bf16, amx)
    assert native_bf16(torch.device("cpu")) == (expected == torch.bfloat16)
    assert toy_dtype("auto", torch.device("cpu")) == expected


def test_a_named_dtype_is_kept_whatever_the_device(monkeypatch):
    _cpu_has(monkeypatch, False, False)
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        assert toy_dtype(name, torch.device("cpu")) == dtype


def test_a_torch_without_the_queries_answers_no(monkeypatch):
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert not native_bf16(torch.device("cpu"))
    assert not native_bf16(torch.device("meta"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without a GPU")
def test_no_gpu_no_gpu_bf16():
    assert not native_bf16(torch.device("cuda"))


@pytest.mark.parametrize("bf16", [False, True])
def test_auto_loads_both_networks_in_the_resolved_dtype(monkeypatch, bf16):
    _cpu_has(monkeypatch, bf16, False)
    policy = ToyPolicy(dtype="auto")
    assert policy.problems() == []
    policy.load()
    want = torch.bfloat16 if bf16 else torch.float32
    assert {p.dtype for p in policy.unet.parameters()} == {want}
    assert {p.dtype for p in policy.text_encoder.parameters()} == {want}


def test_auto_resolves_for_the_device_the_policy_loads_on(monkeypatch):
    # Inside a fit Lightning builds the model under the fit's device; a "meta" default device (a
    # sharded strategy's empty init) stands for the GPU when there is one, the CPU otherwise.
    _cpu_has(monkeypatch, True, False)
    policy = ToyPolicy(dtype="auto")
    with torch.device("meta"):
        policy.load()
    want = (
        torch.float32
        if torch.cuda.is_available() and not native_bf16(torch.device("cuda"))
        else torch.bfloat16
    )
    assert next(policy.unet.parameters()).dtype == want


def test_an_unknown_dtype_names_the_setting_and_the_choices():
    (problem,) = ToyVideoPolicy(dtype="float8").problems()  # type: ignore[arg-type]
    assert "--model.init_args.policy.init_args.dtype ('float8')" in problem and "'auto'" in problem


@pytest.mark.parametrize("world", ["image", "edit", "video"])
def test_a_bf16_copy_beside_float32_masters_gets_their_input_dtype_and_velocity(world):
    # The frozen copies of a float32-master run (the old policy, the KL reference) hold their
    # matrices in bf16 and their norms in float32 (copies.frozen_copy). The inputs must reach both
    # networks in the same dtype, the norms' (diffusers adds the class embedding to the time
    # embedding in the sample's dtype, outside autocast), for the two to compute the same velocity
    # before any update. Cast to the first parameter's dtype (a bf16 conv in the copy, float32 in the
    # masters), the edit toy's copy got bf16 inputs and its velocity differed. With the same inputs,
    # autocast rounds the masters' matrices to the copy's values, so the velocities are equal, not close.
    torch.manual_seed(0)
    load, path, predict = {
        "image": (load_checkpoint, default_checkpoint(), predict_velocity),
        "edit": (load_edit_checkpoint, default_edit_checkpoint(), predict_edit_velocity),
        "video": (load_video_checkpoint, default_video_checkpoint(), predict_video_velocity),
    }[world]
    loaded, encoder, _ = load(path, dtype=torch.bfloat16)  # a full fine-tune loads in bf16, then
    master = copy_module.deepcopy(loaded).float()  # takes float32 masters of those weights
    shape = (2, loaded.config.frames, 3, 32, 32) if world == "video" else (2, 3, 32, 32)
    latents = torch.randn(shape)
    embeds = {
        "text_hidden": torch.randn(2, encoder.max_length, encoder.dim),
        "text_mask": torch.ones(2, encoder.max_length, dtype=torch.bool),
        "text_pooled": torch.randn(2, encoder.dim),
        "source": torch.rand(2, 3, 32, 32) * 2 - 1,  # read by the edit toy only
    }
    copy = frozen_copy(loaded, torch.float32)
    seen = []
    for net in (master, copy):
        net.register_forward_pre_hook(lambda _, args: seen.append(args[0].dtype))
    sigma = torch.tensor([0.3, 0.8])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = predict(master, latents, sigma, embeds), predict(copy, latents, sigma, embeds)
    assert seen == [torch.float32, torch.float32]
    assert torch.equal(want, got)
