"""Each family's joint attention at an image size: what the attention kernel is chosen for
(lit_flowgrpo.attention)."""

from __future__ import annotations

from lit_flowgrpo.attention import AttentionShape
from lit_flowgrpo.policies import FluxPolicy, QwenImagePolicy, SD3Policy


def test_policies_report_their_joint_attention(tiny_sd3_path, tiny_flux_path, tiny_qwenimage_path):
    sd3 = SD3Policy(tiny_sd3_path, max_sequence_length=16)
    flux = FluxPolicy(tiny_flux_path, max_sequence_length=24)
    qwen = QwenImagePolicy(tiny_qwenimage_path, max_sequence_length=20)
    for policy in (sd3, flux, qwen):
        policy.load()
    config = flux.transformer.config
    # 16 px latents per 2×2-patch side at 128 px: 77 CLIP + 16 T5 tokens and the image patches
    f = sd3.pipe.vae_scale_factor * sd3.pipe.patch_size
    assert sd3.attention_shape(128, 64) == AttentionShape(
        sd3.transformer.config.num_attention_heads,
        sd3.transformer.config.attention_head_dim,
        77 + 16 + (128 // f) * (64 // f),
    )
    rows, cols = flux._packed_grid(128, 64)
    assert flux.attention_shape(128, 64) == AttentionShape(
        config.num_attention_heads, config.attention_head_dim, 24 + rows * cols
    )
    rows, cols = qwen._packed_grid(128, 64)
    shape = qwen.attention_shape(128, 64)
    assert shape.tokens == 20 + rows * cols and shape.masked
