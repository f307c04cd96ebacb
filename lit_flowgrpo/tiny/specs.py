"""Each model family's public configs, written once: the transformer and VAE of each hub repository
(``transformer/config.json``, ``vae/config.json``), its scheduler (``scheduler/scheduler_config.json``)
and the shapes of its text conditioning.

The benchmarks build full-size models with random weights from these (``benchmarks/throughput.py``,
``scaling.py``, ``attention_probe.py``); the tiny pipelines of this package are these configs with
small overrides (fewer and narrower layers), as are the benchmarks' own CPU-sized models, so that
none of them restates a family's config. A spec is a dict of plain dicts of constructor keyword
arguments, derived with ``dict(SPECS["flux"]["transformer"], num_layers=1)``; never change one in
place.

Keys of a spec: ``family`` (the policy family: ``sd3``, ``flux``, ``flux2``, ``zimage``, ``qwenimage``,
``wan``); ``pipeline`` (the diffusers pipeline class, where a family has more than one: FLUX.2 klein
and dev);
``transformer``, ``vae``, ``scheduler`` (keyword arguments of the diffusers classes);
``scheduler_class`` (when it is not ``FlowMatchEulerDiscreteScheduler``); ``text`` (the conditioning's
shapes: ``tokens`` × ``dim``, and the ``pooled`` vector's size); for Wan 2.2 A14B, ``experts`` (2)
and ``boundary_ratio``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FLUX2_VAE", "FLUX_VAE", "SD3_VAE", "SPECS", "TINY_IMAGE_VAE", "WAN21_VAE"]

#: stabilityai/stable-diffusion-3.5-medium vae/config.json (AutoencoderKL: 8× in space, 16 latent
#: channels, no quant convs); FLUX.1's is the same network with its own normalisation constants.
SD3_VAE: dict[str, Any] = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[128, 256, 512, 512],
    layers_per_block=2,
    latent_channels=16,
    norm_num_groups=32,
    sample_size=1024,
    scaling_factor=1.5305,
    shift_factor=0.0609,
    use_quant_conv=False,
    use_post_quant_conv=False,
    mid_block_add_attention=True,
)

#: black-forest-labs/FLUX.1-dev vae/config.json.
FLUX_VAE: dict[str, Any] = dict(SD3_VAE, scaling_factor=0.3611, shift_factor=0.1159)

#: Wan 2.1's causal video VAE (Wan-AI/Wan2.1-T2V-1.3B-Diffusers vae/config.json, AutoencoderKLWan):
#: 8× in space, 4× in time, 16 latent channels normalised by these. Qwen-Image's VAE is the same
#: network with the same config (Qwen/Qwen-Image vae/config.json, AutoencoderKLQwenImage).
_WAN21_LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]  # fmt: skip
_WAN21_LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.916]  # fmt: skip
WAN21_VAE: dict[str, Any] = dict(
    base_dim=96,
    z_dim=16,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    dropout=0.0,
    latents_mean=_WAN21_LATENTS_MEAN,
    latents_std=_WAN21_LATENTS_STD,
)

#: FLUX.2's VAE (AutoencoderKLFlux2): diffusers ``scripts/convert_flux2_to_diffusers.py`` builds it with
#: the class's defaults (8x in space, 32 latent channels, quant convs, a batch norm over the 2x2-patchified
#: 128 channels whose running statistics normalise the latents). The same VAE serves klein and dev.
FLUX2_VAE: dict[str, Any] = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[128, 256, 512, 512],
    layers_per_block=2,
    latent_channels=32,
    norm_num_groups=32,
    sample_size=1024,
    use_quant_conv=True,
    use_post_quant_conv=True,
    mid_block_add_attention=True,
    batch_norm_eps=1e-4,
    batch_norm_momentum=0.1,
    patch_size=[2, 2],
)

#: black-forest-labs/FLUX.1-dev scheduler/scheduler_config.json, which the FLUX.2 conversion script
#: (above) copies into every FLUX.2 pipeline: dynamic exponential shift. The FLUX.2 pipelines pass their
#: own ``mu`` (``compute_empirical_mu`` of the token count and the step count), not this config's line.
FLUX_SCHEDULER: dict[str, Any] = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)

#: The override that shrinks an image VAE of these families (FLUX.1's, Z-Image's, FLUX.2's) for the tiny
#: pipelines: two levels (2× in space), 4 latent channels, 32-pixel samples.
TINY_IMAGE_VAE: dict[str, Any] = dict(
    down_block_types=["DownEncoderBlock2D"] * 2,
    up_block_types=["UpDecoderBlock2D"] * 2,
    block_out_channels=[8, 16],
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=4,
    sample_size=32,
)

SPECS: dict[str, dict[str, Any]] = {
    # stabilityai/stable-diffusion-3.5-medium; text: 77 CLIP + 256 T5 tokens of 4096, pooled CLIP-L + G
    "sd35m": dict(
        family="sd3",
        transformer=dict(
            sample_size=128,
            patch_size=2,
            in_channels=16,
            num_layers=24,
            attention_head_dim=64,
            num_attention_heads=24,
            joint_attention_dim=4096,
            caption_projection_dim=1536,
            pooled_projection_dim=2048,
            out_channels=16,
            pos_embed_max_size=384,
            dual_attention_layers=tuple(range(13)),
            qk_norm="rms_norm",
        ),
        vae=SD3_VAE,
        scheduler=dict(num_train_timesteps=1000, shift=3.0),
        text=dict(tokens=333, dim=4096, pooled=2048),
    ),
    # black-forest-labs/FLUX.1-dev (11.9B); text: 512 T5 tokens, pooled CLIP-L
    "flux": dict(
        family="flux",
        transformer=dict(
            patch_size=1,
            in_channels=64,
            num_layers=19,
            num_single_layers=38,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=4096,
            pooled_projection_dim=768,
            guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),
        ),
        vae=FLUX_VAE,
        # dynamic shift from the image sequence length
        scheduler=dict(
            num_train_timesteps=1000,
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        ),
        text=dict(tokens=512, dim=4096, pooled=768),
    ),
    # Qwen/Qwen-Image (20.4B)
    "qwenimage": dict(
        family="qwenimage",
        transformer=dict(
            patch_size=2,
            in_channels=64,
            out_channels=16,
            num_layers=60,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=3584,
            guidance_embeds=False,
            axes_dims_rope=(16, 56, 56),
        ),
        vae=WAN21_VAE,
        scheduler=dict(
            num_train_timesteps=1000,
            shift=1.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=0.9,
            base_image_seq_len=256,
            max_image_seq_len=8192,
            shift_terminal=0.02,
            time_shift_type="exponential",
        ),
        # A prompt after the chat template's prefix is tens of tokens; 128 is a long one.
        text=dict(tokens=128, dim=3584),
    ),
    # Wan-AI/Wan2.1-T2V-1.3B-Diffusers: transformer 30 blocks of 12 x 128 = 1536 wide; UniPC flow
    # schedule (its scheduler_config.json: flow_shift 3.0); UMT5-XXL states padded to 512 tokens.
    "wan1p3b": dict(
        family="wan",
        transformer=dict(
            patch_size=(1, 2, 2),
            num_attention_heads=12,
            attention_head_dim=128,
            in_channels=16,
            out_channels=16,
            text_dim=4096,
            freq_dim=256,
            ffn_dim=8960,
            num_layers=30,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
            rope_max_seq_len=1024,
        ),
        vae=WAN21_VAE,
        scheduler_class="UniPCMultistepScheduler",
        scheduler=dict(
            num_train_timesteps=1000,
            prediction_type="flow_prediction",
            use_flow_sigmas=True,
            flow_shift=3.0,
            solver_order=2,
            final_sigmas_type="zero",
        ),
        text=dict(tokens=512, dim=4096),
    ),
}
# Wan-AI/Wan2.1-T2V-14B-Diffusers: 40 blocks of 40 x 128 = 5120 wide, FFN 13824; VAE, scheduler and text
# as the 1.3B's (the schedule's shift does not change the cost of a step).
SPECS["wan14b"] = dict(
    SPECS["wan1p3b"],
    transformer=dict(SPECS["wan1p3b"]["transformer"], num_attention_heads=40, ffn_dim=13824, num_layers=40),
)
# Wan-AI/Wan2.2-T2V-A14B-Diffusers: two experts of the Wan 2.1 14B config (transformer/ and
# transformer_2/ config.json: 40 blocks of 40 x 128, FFN 13824, 16 channels in and out, text_dim 4096),
# the Wan 2.1 VAE (z_dim 16), boundary_ratio 0.875 (its model_index.json). The flow shift is the
# official sampler's (Wan-Video/Wan2.2 wan/configs/wan_t2v_A14B.py: sample_shift 12.0, boundary 0.875):
# it sets how many steps fall to each expert (σ ≥ 0.368 before the shift is high-noise), not their cost.
SPECS["wan22a14b"] = dict(
    SPECS["wan14b"],
    scheduler=dict(SPECS["wan14b"]["scheduler"], flow_shift=12.0),
    experts=2,
    boundary_ratio=0.875,
)
# Wan-AI/Wan2.1-I2V-14B-480P-Diffusers: the 14B transformer with the image conditioning (transformer/
# config.json: 36 channels in = 16 latent + 4 mask + 16 first-frame latent, 16 out; CLIP cross-attention
# of image_dim 1280 states projected to added_kv_proj_dim 5120), its CLIP ViT-H/14 image encoder
# (image_encoder/config.json, CLIPVisionModel; the penultimate layer's 257 x 1280 states condition) and
# image processor (image_processor/preprocessor_config.json); VAE and text as the 14B T2V's; flow_shift
# 3.0 (scheduler/scheduler_config.json; 5.0 in the 720P folder).
SPECS["wan21_i2v_14b_480p"] = dict(
    SPECS["wan14b"],
    pipeline="WanImageToVideoPipeline",
    transformer=dict(SPECS["wan14b"]["transformer"], in_channels=36, image_dim=1280, added_kv_proj_dim=5120),
    image_encoder=dict(
        hidden_size=1280,
        intermediate_size=5120,
        num_hidden_layers=32,
        num_attention_heads=16,
        image_size=224,
        patch_size=14,
        projection_dim=1024,
        hidden_act="gelu",
    ),
    image_processor=dict(
        do_resize=True,
        size={"shortest_edge": 224},
        resample=3,
        do_center_crop=True,
        crop_size={"height": 224, "width": 224},
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
        do_convert_rgb=True,
    ),
)
# Wan-AI/Wan2.2-TI2V-5B-Diffusers: 30 blocks of 24 x 128 = 3072 wide, FFN 14336, 48 channels in and out
# (transformer/config.json, no image encoder); Wan 2.2's VAE (vae/config.json: 16x in space, 2x2 pixel
# patches of 12 channels, residual blocks, 48 latent channels); expand_timesteps (model_index.json: one
# timestep per token, 0 on a given first frame); flow_shift 5.0 (scheduler/scheduler_config.json).
_WAN22_LATENTS_MEAN = [-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891, 0.157, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.123, -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.052, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667]  # fmt: skip
_WAN22_LATENTS_STD = [0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.499, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659, 0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.06, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744]  # fmt: skip
SPECS["wan22_ti2v_5b"] = dict(
    SPECS["wan1p3b"],
    pipeline="WanImageToVideoPipeline",
    transformer=dict(
        SPECS["wan1p3b"]["transformer"],
        num_attention_heads=24,
        in_channels=48,
        out_channels=48,
        ffn_dim=14336,
        num_layers=30,
    ),
    vae=dict(
        base_dim=160,
        decoder_base_dim=256,
        z_dim=48,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=2,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        dropout=0.0,
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=_WAN22_LATENTS_MEAN,
        latents_std=_WAN22_LATENTS_STD,
    ),
    scheduler=dict(SPECS["wan1p3b"]["scheduler"], flow_shift=5.0),
    expand_timesteps=True,
)

# FLUX.2 (diffusers ``Flux2Transformer2DModel``): the transformer configs of diffusers
# ``scripts/convert_flux2_to_diffusers.py`` (``get_flux2_transformer_config``), which writes each hub
# repository's transformer/config.json: klein 4B (black-forest-labs/FLUX.2-klein-4B and -base-4B, the same
# config), klein 9B (FLUX.2-klein-9B, -base-9B) and dev (FLUX.2-dev, 32B, with a guidance embedding).
# Text: the stacked hidden states of three text-encoder layers, padded to 512 tokens: 3 x 2560 (Qwen3-4B),
# 3 x 4096 (Qwen3-8B), 3 x 5120 (Mistral-Small-3.1-24B).
_FLUX2_KLEIN4B = dict(
    patch_size=1,
    in_channels=128,
    num_layers=5,
    num_single_layers=20,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=7680,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=(32, 32, 32, 32),
    rope_theta=2000,
    eps=1e-6,
    guidance_embeds=False,
)
SPECS["flux2_klein4b"] = dict(
    family="flux2",
    pipeline="Flux2KleinPipeline",
    transformer=_FLUX2_KLEIN4B,
    vae=FLUX2_VAE,
    scheduler=FLUX_SCHEDULER,
    text=dict(tokens=512, dim=7680),
)
SPECS["flux2_klein9b"] = dict(
    SPECS["flux2_klein4b"],
    transformer=dict(
        _FLUX2_KLEIN4B, num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288
    ),
    text=dict(tokens=512, dim=12288),
)
SPECS["flux2_dev"] = dict(
    SPECS["flux2_klein4b"],
    pipeline="Flux2Pipeline",
    transformer=dict(
        _FLUX2_KLEIN4B,
        num_layers=8,
        num_single_layers=48,
        num_attention_heads=48,
        joint_attention_dim=15360,
        guidance_embeds=True,
    ),
    text=dict(tokens=512, dim=15360),
)
# Tongyi-MAI/Z-Image-Turbo transformer/config.json (ZImageTransformer2DModel, 6.15B: 30 single-stream
# blocks of 3840, 2 noise and 2 caption refiner blocks); the VAE is FLUX.1's (vae/config.json); its
# scheduler_config.json: FlowMatchEulerDiscreteScheduler, shift 3.0, no dynamic shift. Tongyi-MAI/Z-Image
# (the undistilled base) has the same transformer and VAE and shift 6.0. Text: Qwen3-4B's second-to-last
# hidden state (2560) of the prompt's real tokens only (each prompt its own length); 128 is a long prompt.
SPECS["zimage_turbo"] = dict(
    family="zimage",
    transformer=dict(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=3840,
        n_layers=30,
        n_refiner_layers=2,
        n_heads=30,
        n_kv_heads=30,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=2560,
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=[32, 48, 48],
        axes_lens=[1536, 512, 512],
    ),
    vae=FLUX_VAE,
    scheduler=dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False),
    text=dict(tokens=128, dim=2560),
)
SPECS["zimage"] = dict(SPECS["zimage_turbo"], scheduler=dict(SPECS["zimage_turbo"]["scheduler"], shift=6.0))
# stabilityai/stable-diffusion-3.5-large transformer/config.json (8.1B): 38 blocks of 38 x 64 = 2432, no
# dual-attention blocks, QK RMS norm, a 192 x 192 position table; VAE, scheduler and text as SD3.5-Medium's.
SPECS["sd35l"] = dict(
    SPECS["sd35m"],
    transformer=dict(
        SPECS["sd35m"]["transformer"],
        num_layers=38,
        num_attention_heads=38,
        caption_projection_dim=2432,
        pos_embed_max_size=192,
        dual_attention_layers=(),
    ),
)
# HunyuanVideo 1.5 text-to-video at 480p (hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v, the smallest
# published resolution), 8.3B: the configs diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py
# writes to that repository's transformer/config.json (TRANSFORMER_CONFIGS["480p_t2v"]: 54 blocks of
# 16 x 128 = 2048, 65 channels in = 32 latent + 32 condition + 1 mask), vae/config.json (the
# AutoencoderKLHunyuanVideo15 defaults: 16x in space, 4x in time, 32 channels), scheduler (shift 5.0) and
# guider (ClassifierFreeGuidance 6.0). Text: HunyuanVideo15Pipeline's own lengths: 1000 Qwen2.5-VL-7B
# states of 3584 (after the template's 108), 256 ByT5 glyph states of 1472, 729 SigLIP image rows of 1152
# (zero and masked in text-to-video).
SPECS["hunyuanvideo15_480p"] = dict(
    family="hunyuanvideo15",
    transformer=dict(
        in_channels=65,
        out_channels=32,
        num_attention_heads=16,
        attention_head_dim=128,
        num_layers=54,
        num_refiner_layers=2,
        mlp_ratio=4.0,
        patch_size=1,
        patch_size_t=1,
        qk_norm="rms_norm",
        text_embed_dim=3584,
        text_embed_2_dim=1472,
        image_embed_dim=1152,
        rope_theta=256.0,
        rope_axes_dim=(16, 56, 56),
        use_meanflow=False,
        target_size=640,
        task_type="t2v",
    ),
    vae=dict(
        in_channels=3,
        out_channels=3,
        latent_channels=32,
        block_out_channels=(128, 256, 512, 1024, 1024),
        layers_per_block=2,
        spatial_compression_ratio=16,
        temporal_compression_ratio=4,
        downsample_match_channel=True,
        upsample_match_channel=True,
        scaling_factor=1.03682,
    ),
    scheduler=dict(num_train_timesteps=1000, shift=5.0),
    guider=dict(guidance_scale=6.0),
    text=dict(tokens=1000, dim=3584, glyph_tokens=256, glyph_dim=1472, image_tokens=729, image_dim=1152),
)
# Qwen/Qwen-Image-Edit-2509 (QwenImageEditPlusPipeline): Qwen-Image's transformer, VAE and scheduler
# (transformer/, vae/, scheduler/ config.json as Qwen/Qwen-Image's), and its text encoder Qwen2.5-VL-7B-Instruct
# with the vision tower that sees the sources (text_encoder/config.json: 28 layers of 3584, 28 heads, 4 KV
# heads, multimodal RoPE sections [16, 24, 24]; a 32-block ViT of 1280 on 14-pixel patches merged 2x2 into
# one 3584-wide token per 28x28 pixels); processor/preprocessor_config.json: Qwen2VLImageProcessor of the
# same patch, merge and temporal sizes. Qwen/Qwen-Image-Edit-2511 differs in transformer zero_cond_t only
# (the source tokens modulated with timestep 0).
SPECS["qwenimage_edit_2509"] = dict(
    SPECS["qwenimage"],
    family="qwenimage_edit",
    pipeline="QwenImageEditPlusPipeline",
    text_encoder=dict(
        text_config=dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            rms_norm_eps=1e-6,
            max_position_embeddings=128000,
            rope_parameters=dict(rope_type="default", mrope_section=[16, 24, 24], rope_theta=1e6),
        ),
        vision_config=dict(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            out_hidden_size=3584,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[7, 15, 23, 31],
        ),
    ),
    processor=dict(
        patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=56 * 56, max_pixels=28 * 28 * 1280
    ),
)
SPECS["qwenimage_edit_2511"] = dict(
    SPECS["qwenimage_edit_2509"],
    transformer=dict(SPECS["qwenimage_edit_2509"]["transformer"], zero_cond_t=True),
)
