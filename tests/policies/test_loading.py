"""What every family shares before and at loading: the requested dtype is the loaded one, on any
supported diffusers; image sizes are checked before any weight is read."""

from __future__ import annotations

import pytest
import torch

import lit_flowgrpo.policies.base as base
from lit_flowgrpo.policies import (
    FlowPolicy,
    Flux2KleinPolicy,
    FluxPolicy,
    QwenImagePolicy,
    SD3Policy,
    ZImagePolicy,
)
from lit_flowgrpo.toy import ToyPolicy
from lit_flowgrpo.toy.model import ToyModelConfig, build_models, save_checkpoint

FAMILIES = ("sd3", "flux", "qwenimage", "toy", "flux2", "zimage")


@pytest.fixture(scope="module")
def toy_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    config = ToyModelConfig(block_out_channels=(8, 16), attention_heads=2, norm_num_groups=4, text_dim=16)
    unet, text_encoder = build_models(config)
    path = str(tmp_path_factory.mktemp("toy") / "tiny.safetensors")
    save_checkpoint(path, unet, text_encoder, dtype=torch.float32, info={"steps": "0"})
    return path


def make_policy(family: str, request: pytest.FixtureRequest, dtype: str) -> FlowPolicy:
    if family == "sd3":
        return SD3Policy(request.getfixturevalue("tiny_sd3_path"), dtype=dtype, max_sequence_length=16)
    if family == "flux":
        return FluxPolicy(request.getfixturevalue("tiny_flux_path"), dtype=dtype, max_sequence_length=16)
    if family == "qwenimage":
        return QwenImagePolicy(
            request.getfixturevalue("tiny_qwenimage_path"), dtype=dtype, max_sequence_length=16
        )
    if family == "flux2":
        return Flux2KleinPolicy(
            request.getfixturevalue("tiny_flux2_path"), dtype=dtype, max_sequence_length=16
        )
    if family == "zimage":
        return ZImagePolicy(request.getfixturevalue("tiny_zimage_path"), dtype=dtype, max_sequence_length=16)
    return ToyPolicy(request.getfixturevalue("toy_checkpoint"), dtype=dtype)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_loaded_transformer_has_the_requested_dtype(
    family: str, dtype: str, request: pytest.FixtureRequest
) -> None:
    # The tiny models are saved in fp32, diffusers' default: a dropped dtype keyword loads fp32.
    policy = make_policy(family, request, dtype)
    policy.load()
    wanted = getattr(torch, dtype)
    assert {p.dtype for p in policy.transformer.parameters()} == {wanted}


@pytest.mark.parametrize(
    ("installed", "keyword"),
    [
        ("0.36.0", "torch_dtype"),
        ("0.39.0", "torch_dtype"),
        ("0.40.0", "dtype"),
        ("0.42.1", "dtype"),
        ("1.0.0.dev0", "dtype"),
    ],
)
def test_dtype_keyword_follows_the_installed_diffusers(
    installed: str, keyword: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(base, "version", lambda name: installed if name == "diffusers" else "0")
    assert base.pretrained_dtype_kwargs(torch.bfloat16) == {keyword: torch.bfloat16}


@pytest.mark.parametrize(
    ("policy", "multiple"),
    [
        (SD3Policy("org/sd3"), 16),
        (FluxPolicy("org/flux"), 16),
        (QwenImagePolicy("org/qwen"), 16),
        (ToyPolicy(), 4),
        (Flux2KleinPolicy("org/flux2"), 16),
        (ZImagePolicy("org/zimage"), 16),
    ],
    ids=FAMILIES,
)
def test_image_size_is_checked_before_loading(policy: FlowPolicy, multiple: int) -> None:
    assert policy.image_size_problems(2 * multiple, 3 * multiple) == []
    height, width = policy.image_size_problems(2 * multiple + 1, 0)
    assert height.startswith(
        f"--model.init_args.sampler.height ({2 * multiple + 1}) must be a positive multiple of {multiple}"
    )
    assert f"use {2 * multiple}, for example" in height
    assert width.startswith(f"--model.init_args.sampler.width (0) must be a positive multiple of {multiple}")
    assert policy.image_size_problems(33.0, multiple) == [  # type: ignore[arg-type]
        "--model.init_args.sampler.height (33.0) must be an integer number of pixels"
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_loaded_models_accept_every_size_the_early_check_accepts(
    family: str, request: pytest.FixtureRequest
) -> None:
    # The early check's multiple must be one of the loaded model's: what passes it never fails later.
    policy = make_policy(family, request, "float32")
    policy.load()
    size = policy.image_size_multiple
    assert policy.image_size_problems(size, 2 * size) == []
    policy.latent_shape(size, 2 * size)  # raises if the loaded factors do not divide the multiple
