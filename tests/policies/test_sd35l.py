"""SD3.5-Large: its public spec, and SD3Policy on a tiny pipeline of the Large's block layout (QK RMS
norm, no dual-attention blocks) against StableDiffusion3Pipeline."""

from __future__ import annotations

import itertools

import pytest
import torch
from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
from peft import LoraConfig
from tolerances import depth, network_atol, sampling_layers

from lit_flowgrpo.policies.sd3 import SD3Policy
from lit_flowgrpo.tiny import sd3 as tiny_sd3
from lit_flowgrpo.tiny.specs import SPECS

SIZE, STEPS = 32, 3
PROMPTS = ["a red cat", "two blue dogs"]


def test_public_spec_has_the_published_size() -> None:
    with torch.device("meta"):
        large = SD3Transformer2DModel(**SPECS["sd35l"]["transformer"])
    assert sum(p.numel() for p in large.parameters()) / 1e9 == pytest.approx(8.06, abs=0.01)
    # 38 blocks of 38 heads of 64; the joint blocks only (SD3.5-Medium's first 13 have a second attention).
    assert large.config.caption_projection_dim == 38 * 64 == large.inner_dim
    assert not any(block.attn2 is not None for block in large.transformer_blocks)
    assert SPECS["sd35l"]["vae"] == SPECS["sd35m"]["vae"] and SPECS["sd35l"]["text"] == SPECS["sd35m"]["text"]


@pytest.fixture(scope="module")
def large_path(tiny_sd3_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny SD3 pipeline with a transformer of the Large's layout at the tiny sizes."""
    sizes = (
        "sample_size",
        "patch_size",
        "in_channels",
        "out_channels",
        "num_layers",
        "attention_head_dim",
        "num_attention_heads",
        "joint_attention_dim",
        "caption_projection_dim",
        "pooled_projection_dim",
        "pos_embed_max_size",
    )
    config = dict(SPECS["sd35l"]["transformer"], **{k: tiny_sd3.TRANSFORMER[k] for k in sizes})
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        pipe.transformer = SD3Transformer2DModel(**config)
    path = str(tmp_path_factory.mktemp("tiny_sd35l"))
    pipe.save_pretrained(path)
    return path


def test_large_layout_loads_and_reproduces_the_pipeline(large_path: str) -> None:
    policy = SD3Policy(large_path, dtype="float32", max_sequence_length=16)
    policy.load()
    config = policy.transformer.config
    assert config.qk_norm == "rms_norm" and tuple(config.dual_attention_layers) == ()
    pipe = StableDiffusion3Pipeline.from_pretrained(large_path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    x1 = torch.randn(2, *policy.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(2))
    x = x1.clone()
    embeds = policy.encode_prompts(PROMPTS)
    with torch.no_grad():
        for sigma, sigma_next in itertools.pairwise(policy.sigmas(STEPS, SIZE, SIZE)):
            x = x + (sigma_next - sigma) * policy.velocity(x, sigma.expand(2), embeds, 4.5)
    ref = pipe(
        prompt=list(PROMPTS),
        latents=x1.clone(),
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        guidance_scale=4.5,
        max_sequence_length=16,
        output_type="latent",
    ).images
    # Our CFG batch is [uncond; cond] as the pipeline's, but prompts encoded one by one (the cache) and
    # the step written by us: STEPS guided forwards (|1 − 4.5| + 4.5 = 8 times each one's rounding).
    atol = network_atol(sampling_layers(depth(pipe.transformer), STEPS, 4.5) + STEPS, float(ref.abs().max()))
    torch.testing.assert_close(x, ref, atol=atol, rtol=0)
    assert (x - x1).abs().max() > 0.1
    # LoRA on the family's targets reaches the 8 joint-attention projections of each block, no more.
    policy.transformer.add_adapter(
        LoraConfig(r=2, lora_alpha=4, target_modules=list(policy.default_lora_targets))
    )
    adapted = {n.split(".lora_")[0] for n, _ in policy.transformer.named_parameters() if "lora_" in n}
    assert len(adapted) == 8 * config.num_layers - 1  # the last block has no to_add_out (its text ends there)
