"""Throughput, MFU, memory and the on-policy ratio of Flow-GRPO steps at real model scale.

The policy is built from the public model config alone: random weights, no text encoders, prompt
embeddings of the real shapes (SD3.5: 77 CLIP + 256 T5 tokens = 333 × 4096, pooled 2048). The real
``FlowGRPOModule`` runs under a real ``lightning.Trainer`` with ``RLThroughputMonitor``; the figures
are the callback's own logged keys, read back from an in-memory logger. Each optimization is one
``PerformanceSettings`` / ``Sampler`` setting, switched on one after the other in one run and
compared with the eager baseline of the same run.

    # SD3.5-Medium, 512 px: eager baseline, each lever, and Flow-GRPO-Fast (one GPU)
    python benchmarks/throughput.py --model sd35m
    # FLUX.1-dev / Qwen-Image sized: the rollout (sampling) only
    python benchmarks/throughput.py --model flux --rollout-only
    python benchmarks/throughput.py --model qwenimage --rollout-only
    # the CPU smoke run the tests use (tiny configs, seconds)
    python benchmarks/throughput.py --tiny --out tiny_results
    # Wan 2.1 T2V 1.3B, 480x832, 33 frames: 4 videos of 8 steps, 2 of them trained, CFG 4.5 in rollout
    # and update (1 video = a CFG pair per update forward), the update's blocks checkpointed
    python benchmarks/throughput.py --model wan1p3b --resolution 480 --width 832 --frames 33 \
        --record-dtype bfloat16 --num-steps 8 --sde-window-size 2 --prompts 1 --group 4 --micro-batch 1 \
        --variants activation_checkpointing --no-fast

Videos (``--frames`` > 1, ``--model wan1p3b``): ``images_per_gpu_s`` and the ``ms_per_image`` stages count
frames (the callback's ``perf/throughput``), ``videos_per_gpu_s`` and ``ms_per_video`` count videos
(``perf/video_throughput``, ``timing_per_video_ms/<stage>``), and ``flops_per_image_forward`` is one
video's forward. The UMT5 states are random rows of the padded 512 tokens; the VAE is float32, as
the recipe keeps it; a brightness reward (the mean over the frames).
    # the step with a reward of real cost, scored after the rollout and beside it
    python benchmarks/throughput.py --model sd35m --variants compile --no-fast \
        --reward pickscore_sized --reward-overlap both

``--reward`` chooses what scores the images: ``brightness`` (free, on the GPU: the RL machinery
alone), ``pickscore_sized`` (the real PickScore code on a CLIP-H-sized model with random weights on
the policy's device), ``ocr`` (the real OCR reward, RapidOCR on the CPU, on images with the prompt's
text drawn in) or ``remote:<ms>`` (the real VLM-judge client against a server on 127.0.0.1 that
answers each request after ``<ms>`` milliseconds). ``--reward-overlap on|off|both`` scores each
rollout chunk beside the sampling of the next (the reward's ``overlap``), after the rollout, or each
variant both ways.

Results: ``<out>/<device>_<model>.json`` and a markdown table ``<out>/README.md`` (one section per
results file); ``--tag NAME`` appends ``_NAME`` to the file's name, so that a run does not replace a
recorded one. A variant that fails (a compile mode this GPU refuses) is recorded as a failed row, with
its error, and the next one runs.

``--profile DIR`` profiles ``--profile-steps`` more steps of each variant after its measured ones
(left out of its figures) with ``torch.profiler`` (``profiling.py``): per variant, the trace and a
summary in ``DIR/<results name>/<variant>/`` (GPU busy share of the step, of the rollout, its decoding
and the update; GPU time per kernel category; the top kernels; the thin matrix products, LoRA's
adapters, where operators' shapes were recorded), all variants' summaries in
``DIR/<results name>/profiles.txt`` and the headline figures in each variant's ``profile`` key.
    # where the GPU time of the best exact setting goes, and of its CUDA-graph variant
    python benchmarks/throughput.py --model sd35m --variants compile_batch16_decoder \
        --no-fast --profile prof --tag profile
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from PIL import Image
from torch import Tensor, nn

from lit_flowgrpo import (
    FlowGRPO,
    FlowGRPOModule,
    KLSettings,
    LoraSettings,
    PromptDataModule,
    Sampler,
    UpdateSettings,
    WeightsSettings,
)
from lit_flowgrpo.callbacks import RLThroughputMonitor, available_flops
from lit_flowgrpo.objective import DiffusionNFT, FlowDPPO, Objective
from lit_flowgrpo.performance import PerformanceSettings
from lit_flowgrpo.policies.base import Embeds, FlowPolicy, resolve_dtype
from lit_flowgrpo.policies.flux import FluxPolicy
from lit_flowgrpo.policies.flux2 import Flux2DevPolicy, Flux2KleinPolicy
from lit_flowgrpo.policies.hunyuanvideo15 import HunyuanVideo15Policy
from lit_flowgrpo.policies.qwenimage import QwenImagePolicy
from lit_flowgrpo.policies.sd3 import SD3Policy
from lit_flowgrpo.policies.wan import WanPolicy
from lit_flowgrpo.policies.zimage import ZImagePolicy
from lit_flowgrpo.rewards import MultiReward
from lit_flowgrpo.tiny.specs import SPECS


def _sibling(name: str) -> Any:
    """A module of this folder: importable as it is when this file runs as a script (its folder is then
    on ``sys.path``), loaded by path when it is imported from elsewhere (the tests)."""
    if name in sys.modules:
        return sys.modules[name]
    try:
        return __import__(name)
    except ImportError:
        import importlib.util

        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module


profiling = _sibling("profiling")

# --------------------------------------------------------------------------------------------------
# Model specs: the public configs (transformer, VAE, scheduler, conditioning shapes) of each family live
# once, in lit_flowgrpo.tiny.specs; the CPU smoke run's tiny configs are those with small overrides.
# --------------------------------------------------------------------------------------------------


def _tiny_vae(vae: dict[str, Any]) -> dict[str, Any]:
    """An SD3 / FLUX.1 VAE config shrunk to two levels of 8 channels (its latent channels and constants kept)."""
    return dict(
        vae,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        block_out_channels=[8, 8],
        layers_per_block=1,
        norm_num_groups=4,
        sample_size=32,
    )


TINY: dict[str, dict[str, Any]] = {
    "sd35m": dict(
        SPECS["sd35m"],
        transformer=dict(
            SPECS["sd35m"]["transformer"],
            sample_size=16,
            num_layers=3,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=32,
            caption_projection_dim=16,
            pooled_projection_dim=24,
            pos_embed_max_size=32,
            dual_attention_layers=(0,),
        ),
        vae=_tiny_vae(SPECS["sd35m"]["vae"]),
        text=dict(tokens=12, dim=32, pooled=24),
    ),
    "flux": dict(
        SPECS["flux"],
        transformer=dict(
            SPECS["flux"]["transformer"],
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=24,
            axes_dims_rope=(4, 6, 6),
        ),
        vae=_tiny_vae(SPECS["flux"]["vae"]),
        text=dict(tokens=8, dim=32, pooled=24),
    ),
    "qwenimage": dict(
        SPECS["qwenimage"],
        transformer=dict(
            SPECS["qwenimage"]["transformer"],
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            axes_dims_rope=(4, 6, 6),
        ),
        vae=dict(SPECS["qwenimage"]["vae"], base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1),
        text=dict(tokens=6, dim=32),
    ),
}


def tiny_spec(model: str) -> dict[str, Any]:
    """The tiny config of ``model`` for the CPU smoke run: :data:`TINY`'s, and for Wan the configs of
    the tiny pipeline the tests build (:mod:`lit_flowgrpo.tiny.wan`; its two-expert ``"a14b"`` variant
    for a two-expert model)."""
    family = SPECS[model]["family"]
    if family in ("flux2", "zimage"):
        # the tiny pipelines' configs (lit_flowgrpo.tiny.flux2 / .zimage), dev with its guidance embedding
        from lit_flowgrpo.tiny import flux2, zimage

        if family == "flux2":
            guidance = SPECS[model]["transformer"]["guidance_embeds"]
            transformer = dict(flux2.TRANSFORMER, guidance_embeds=guidance)
            return dict(SPECS[model], transformer=transformer, vae=flux2.VAE, text=dict(tokens=8, dim=48))
        return dict(SPECS[model], transformer=zimage.TRANSFORMER, vae=zimage.VAE, text=dict(tokens=8, dim=16))
    if family == "hunyuanvideo15":  # the tiny pipeline's configs (lit_flowgrpo.tiny.hunyuanvideo15)
        from lit_flowgrpo.tiny import hunyuanvideo15 as tiny

        text = dict(
            SPECS[model]["text"], tokens=16, dim=tiny.TEXT_DIM, glyph_dim=tiny.GLYPH_DIM, image_dim=16
        )
        return dict(SPECS[model], transformer=tiny.transformer_config(), vae=tiny.VAE, text=text)
    if family != "wan":
        return TINY[model]
    from lit_flowgrpo.tiny import wan

    transformer = wan.transformer_config(wan.VAE["z_dim"])
    experts = (
        dict(experts=2, boundary_ratio=wan.A14B_BOUNDARY_RATIO) if SPECS[model].get("experts", 1) == 2 else {}
    )
    return dict(
        SPECS["wan1p3b"],
        transformer=transformer,
        vae=wan.VAE,
        text=dict(tokens=8, dim=transformer["text_dim"]),
        **experts,
    )


@contextmanager
def building_on(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Modules built inside get their (random) weights directly on ``device`` in ``dtype``: a 20B
    model is never materialised in fp32 or on the host, and every buffer is computed as usual."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def frozen(module: nn.Module) -> nn.Module:
    return module.requires_grad_(False).eval()


def random_rows(key: str, shape: Sequence[int], device: torch.device, dtype: torch.dtype) -> Tensor:
    """A fixed random tensor per prompt (the same prompt always gets the same embedding)."""
    gen = torch.Generator(device=device).manual_seed(zlib.crc32(key.encode()))
    return torch.randn(tuple(shape), generator=gen, device=device, dtype=torch.float32).to(dtype)


class RandomWeights:
    """What the benchmark policies share: the spec, the device and the dtype to build with."""

    def _setup(self, spec: dict[str, Any], device: str, dtype: str) -> None:
        self.spec = spec
        self.build_device = torch.device(device)
        self.build_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]

    def problems(self) -> list[str]:
        return []  # nothing to read from disk

    def decode(self, latents: Tensor) -> Tensor:
        # Marked for the profile (its "decode" part); a range costs microseconds per rollout chunk.
        with torch.profiler.record_function(profiling.DECODE_RANGE):
            return super().decode(latents)  # type: ignore[misc]

    def _build(
        self, transformer_cls: type, vae_cls: type, vae_dtype: torch.dtype | None = None
    ) -> tuple[nn.Module, nn.Module, Any]:
        import diffusers

        scheduler_cls = getattr(
            diffusers, self.spec.get("scheduler_class", "FlowMatchEulerDiscreteScheduler")
        )
        with self._seeded(0):
            with building_on(self.build_device, self.build_dtype):
                transformer = frozen(transformer_cls(**self.spec["transformer"]))
            with building_on(self.build_device, vae_dtype or self.build_dtype):
                vae = frozen(vae_cls(**self.spec["vae"]))
        return transformer, vae, scheduler_cls(**self.spec["scheduler"])

    @contextmanager
    def _seeded(self, seed: int) -> Iterator[None]:
        """The global RNGs seeded with ``seed`` inside, restored after. Seeded alike in every process:
        the ranks of a sharded run hold one model, and a resumed run the model its checkpoint's adapter
        was trained on."""
        cuda = [self.build_device] if self.build_device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seed)
            yield


class BenchSD3Policy(RandomWeights, SD3Policy):
    """:class:`SD3Policy` on random weights from the config; prompts map to fixed random embeddings."""

    def __init__(self, spec: dict[str, Any], device: str, dtype: str = "bfloat16") -> None:
        SD3Policy.__init__(self, "random/sd3", dtype=dtype)
        self._setup(spec, device, dtype)

    def load(self) -> None:
        if self.pipe is not None:
            return
        from diffusers import AutoencoderKL, SD3Transformer2DModel, StableDiffusion3Pipeline

        transformer, vae, scheduler = self._build(SD3Transformer2DModel, AutoencoderKL)
        none = dict.fromkeys(
            ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3")
        )
        self.pipe = StableDiffusion3Pipeline(transformer=transformer, vae=vae, scheduler=scheduler, **none)
        self._transformer, self.vae, self.text_encoders = transformer, vae, nn.ModuleList()

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> Embeds:
        text, device, dtype = self.spec["text"], self.device, self.build_dtype
        for p in prompts:
            if p not in self._cache:  # cached like the real encoder's output (velocity asks for "" each call)
                self._cache[p] = (
                    random_rows(p, (text["tokens"], text["dim"]), device, dtype),
                    random_rows("pooled:" + p, (text["pooled"],), device, dtype),
                )
        rows = [self._cache[p] for p in prompts]
        return {
            "prompt_embeds": torch.stack([r[0] for r in rows]),
            "pooled_prompt_embeds": torch.stack([r[1] for r in rows]),
        }


class BenchFluxPolicy(RandomWeights, FluxPolicy):
    """:class:`FluxPolicy` on random weights from the config; T5 and CLIP rows are random."""

    def __init__(self, spec: dict[str, Any], device: str, dtype: str = "bfloat16") -> None:
        FluxPolicy.__init__(self, "random/flux", dtype=dtype, max_sequence_length=spec["text"]["tokens"])
        self._setup(spec, device, dtype)

    def load(self) -> None:
        if self.pipe is not None:
            return
        from diffusers import AutoencoderKL, FluxPipeline, FluxTransformer2DModel

        transformer, vae, scheduler = self._build(FluxTransformer2DModel, AutoencoderKL)
        none = dict.fromkeys(("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"))
        self.pipe = FluxPipeline(transformer=transformer, vae=vae, scheduler=scheduler, **none)
        self._transformer, self.vae = transformer, vae

    def _encode_one(self, prompt: str) -> Embeds:
        text, device, dtype = self.spec["text"], self.build_device, self.build_dtype
        return {
            "prompt_embeds": random_rows(prompt, (1, text["tokens"], text["dim"]), device, dtype),
            "pooled_prompt_embeds": random_rows("pooled:" + prompt, (1, text["pooled"]), device, dtype),
        }


class BenchQwenImagePolicy(RandomWeights, QwenImagePolicy):
    """:class:`QwenImagePolicy` on random weights from the config; Qwen2.5-VL rows are random."""

    def __init__(self, spec: dict[str, Any], device: str, dtype: str = "bfloat16") -> None:
        QwenImagePolicy.__init__(self, "random/qwenimage", dtype=dtype)
        self._setup(spec, device, dtype)

    def load(self) -> None:
        if self.pipe is not None:
            return
        from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel

        transformer, vae, scheduler = self._build(QwenImageTransformer2DModel, AutoencoderKLQwenImage)
        none = dict.fromkeys(("text_encoder", "tokenizer"))
        self.pipe = QwenImagePipeline(transformer=transformer, vae=vae, scheduler=scheduler, **none)
        self._transformer, self.vae = transformer, vae

    def _encode_one(self, prompt: str) -> Embeds:
        text, device, dtype = self.spec["text"], self.build_device, self.build_dtype
        # the negative prompt " " is one token after the template; other prompts take the spec's length
        tokens = 1 if not prompt.strip() else text["tokens"]
        return {"prompt_embeds": random_rows(prompt, (1, tokens, text["dim"]), device, dtype)}


class BenchWanPolicy(RandomWeights, WanPolicy):
    """:class:`WanPolicy` on random weights from the config; UMT5 states are random rows of the padded
    length (the pipeline pads every prompt to ``max_sequence_length``, so the cross-attention costs
    the same whatever the prompt). The VAE in the policy's ``vae_dtype`` (float32, as the recipe).

    A spec with ``experts=2`` (Wan 2.2 A14B) gets a second transformer of the same config, the
    low-noise expert, switched at the spec's ``boundary_ratio``; ``guidance_scale_2`` is its CFG scale.
    """

    def __init__(
        self,
        spec: dict[str, Any],
        device: str,
        dtype: str = "bfloat16",
        guidance_scale_2: float | None = None,
    ) -> None:
        WanPolicy.__init__(
            self,
            "random/wan",
            dtype=dtype,
            max_sequence_length=spec["text"]["tokens"],
            guidance_scale_2=guidance_scale_2,
        )
        self._setup(spec, device, dtype)

    def problems(self) -> list[str]:
        experts = self.spec.get("experts", 1)
        if experts not in (1, 2):
            return [f"the spec's experts ({experts}) must be 1 (Wan 2.1) or 2 (Wan 2.2 A14B)"]
        ratio = self.spec.get("boundary_ratio")
        if experts == 2 and not (isinstance(ratio, float) and 0 < ratio < 1):
            return [f"a two-expert spec needs a boundary_ratio in (0, 1), not {ratio}"]
        return []

    @property
    def declared_networks(self) -> int:
        """The spec's experts: the module refuses a full fine-tune of two before anything is built."""
        return self.spec.get("experts", 1)

    def load(self) -> None:
        if self.pipe is not None:
            return
        from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

        transformer, vae, scheduler = self._build(
            WanTransformer3DModel, AutoencoderKLWan, resolve_dtype(self.vae_dtype_name)
        )
        transformer_2, boundary = None, None
        if self.spec.get("experts", 1) == 2:
            # Another expert than the first (seed 1), the same one in every process and every run.
            with self._seeded(1), building_on(self.build_device, self.build_dtype):
                transformer_2 = frozen(WanTransformer3DModel(**self.spec["transformer"]))
            boundary = self.spec["boundary_ratio"]
        none = dict.fromkeys(("text_encoder", "tokenizer"))
        self.pipe = WanPipeline(
            transformer=transformer,
            transformer_2=transformer_2,
            boundary_ratio=boundary,
            vae=vae,
            scheduler=scheduler,
            **none,
        )
        self.pipe.set_progress_bar_config(disable=True)
        self._transformer, self._transformer_2 = transformer, transformer_2
        self.vae, self.text_encoder = vae, None

    def _encode_one(self, prompt: str) -> Embeds:
        text, device, dtype = self.spec["text"], self.build_device, self.build_dtype
        return {"prompt_embeds": random_rows(prompt, (1, text["tokens"], text["dim"]), device, dtype)}


class _BenchFlux2(RandomWeights):
    """What the FLUX.2 benchmark policies share: the spec's pipeline class (klein or dev) on random weights,
    no text encoder; every prompt (the empty negative one too) maps to random rows of the padded length,
    as the pipelines pad every prompt to ``max_sequence_length``."""

    def load(self) -> None:
        if self.pipe is not None:
            return
        import diffusers
        from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

        transformer, vae, scheduler = self._build(Flux2Transformer2DModel, AutoencoderKLFlux2)
        pipeline = getattr(diffusers, self.spec["pipeline"])
        self.pipe = pipeline(
            transformer=transformer, vae=vae, scheduler=scheduler, text_encoder=None, tokenizer=None
        )
        self._transformer, self.vae, self.text_encoder = transformer, vae, None

    def _encode_one(self, prompt: str) -> Embeds:
        text, device, dtype = self.spec["text"], self.build_device, self.build_dtype
        return {"prompt_embeds": random_rows(prompt, (1, text["tokens"], text["dim"]), device, dtype)}


class BenchFlux2KleinPolicy(_BenchFlux2, Flux2KleinPolicy):
    """:class:`Flux2KleinPolicy` on random weights from the config (CFG with the empty prompt)."""

    def __init__(self, spec: dict[str, Any], device: str, dtype: str = "bfloat16") -> None:
        Flux2KleinPolicy.__init__(
            self, "random/flux2", dtype=dtype, max_sequence_length=spec["text"]["tokens"]
        )
        self._setup(spec, device, dtype)


class BenchFlux2DevPolicy(_BenchFlux2, Flux2DevPolicy):
    """:class:`Flux2DevPolicy` on random weights from the config (the guidance embedding at 4.0)."""

    def __init__(self, spec: dict[str, Any], device: str, dtype: str = "bfloat16") -> None:
        Flux2DevPolicy.__init__(self, "random/flux2", dtype=dtype, max_sequence_length=spec["text"]["tokens"])
        self._setup(spec, device, dtype)


def bench_flux2_policy(spec: dict[str, Any], device: str, dtype: str = "bfloat16") -> FlowPolicy:
    """The FLUX.2 benchmark policy of the spec's pipeline: klein (``Flux2KleinPipeline``) or dev."""
    dev = spec["pipeline"] == "Flux2Pipeline"
    return (BenchFlux2DevPolicy if dev else BenchFlux2KleinPolicy)(spec, device, dtype)


class BenchZImagePolicy(RandomWeights, ZImagePolicy):
    """:class:`ZImagePolicy` on random weights from the config; each prompt maps to random rows of the
    spec's length, the empty negative prompt to 8 (the chat template's tokens around it)."""

    def __init__(self, spec: dict[str, Any], device: str, dtype: str = "bfloat16") -> None:
        ZImagePolicy.__init__(self, "random/zimage", dtype=dtype, max_sequence_length=spec["text"]["tokens"])
        self._setup(spec, device, dtype)

    def load(self) -> None:
        if self.pipe is not None:
            return
        from diffusers import AutoencoderKL, ZImagePipeline, ZImageTransformer2DModel

        transformer, vae, scheduler = self._build(ZImageTransformer2DModel, AutoencoderKL)
        self.pipe = ZImagePipeline(
            transformer=transformer, vae=vae, scheduler=scheduler, text_encoder=None, tokenizer=None
        )
        self._transformer, self.vae, self.text_encoder = transformer, vae, None

    def _encode_one(self, prompt: str) -> Embeds:
        text, device, dtype = self.spec["text"], self.build_device, self.build_dtype
        tokens = text["tokens"] if prompt else min(8, text["tokens"])
        return {"prompt_embeds": random_rows(prompt, (1, tokens, text["dim"]), device, dtype)}


class BenchHunyuanVideo15Policy(RandomWeights, HunyuanVideo15Policy):
    """:class:`HunyuanVideo15Policy` on random weights from the config; the Qwen2.5-VL states are random
    rows of the padded length (1000), the first 128 valid (a long prompt; the transformer attends over
    all of them, masked or not, so the cost is the same), and the ByT5 glyph rows zeros and masked, as
    the pipeline encodes a prompt that quotes no text. The VAE in the model's dtype, as the recipe."""

    #: Qwen2.5-VL tokens marked valid in the mask.
    valid_tokens = 128

    def __init__(self, spec: dict[str, Any], device: str, dtype: str = "bfloat16") -> None:
        HunyuanVideo15Policy.__init__(
            self,
            "random/hunyuanvideo15",
            dtype=dtype,
            vae_dtype=dtype,
            max_sequence_length=spec["text"]["tokens"],
        )
        self._setup(spec, device, dtype)

    def load(self) -> None:
        if self.pipe is not None:
            return
        from diffusers import (
            AutoencoderKLHunyuanVideo15,
            ClassifierFreeGuidance,
            HunyuanVideo15Pipeline,
            HunyuanVideo15Transformer3DModel,
        )

        transformer, vae, scheduler = self._build(
            HunyuanVideo15Transformer3DModel, AutoencoderKLHunyuanVideo15
        )
        none = dict.fromkeys(("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"))
        guider = ClassifierFreeGuidance(**self.spec["guider"])
        self.pipe = HunyuanVideo15Pipeline(
            transformer=transformer, vae=vae, scheduler=scheduler, guider=guider, **none
        )
        self.pipe.set_progress_bar_config(disable=True)
        self.enable_context_parallel(transformer)  # as HunyuanVideo15Policy.load gives the loaded one
        self._transformer, self.vae = transformer, vae
        self.text_encoder = self.text_encoder_2 = None

    def _encode_one(self, prompt: str) -> Embeds:
        text, device, dtype = self.spec["text"], self.build_device, self.build_dtype
        mask = torch.zeros(1, text["tokens"], device=device, dtype=dtype)
        mask[:, : self.valid_tokens] = 1
        return {
            "prompt_embeds": random_rows(prompt, (1, text["tokens"], text["dim"]), device, dtype),
            "prompt_embeds_mask": mask,
            "prompt_embeds_2": torch.zeros(
                1, text["glyph_tokens"], text["glyph_dim"], device=device, dtype=dtype
            ),
            "prompt_embeds_mask_2": torch.zeros(1, text["glyph_tokens"], device=device, dtype=dtype),
        }


POLICIES = {
    "sd3": BenchSD3Policy,
    "flux": BenchFluxPolicy,
    "flux2": bench_flux2_policy,
    "qwenimage": BenchQwenImagePolicy,
    "wan": BenchWanPolicy,
    "hunyuanvideo15": BenchHunyuanVideo15Policy,
    "zimage": BenchZImagePolicy,
}


# --------------------------------------------------------------------------------------------------
# Rewards (--reward): free, or the real reward code at its real cost.
# --------------------------------------------------------------------------------------------------


def brightness(images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
    """A reward computed on the GPU at no cost, so the step measures the RL machinery alone; a video's
    is the mean over its frames."""
    return images.float().flatten(1).mean(1)


brightness.modalities = frozenset({"image", "video"})  # type: ignore[attr-defined]


#: PickScore's model: CLIP ViT-H/14 (laion/CLIP-ViT-H-14-laion2B-s32B-b79K, config.json), and a tiny
#: CLIP of the same class for the CPU smoke run.
CLIP_SPECS: dict[str, dict[str, Any]] = {
    "full": dict(
        vision=dict(
            hidden_size=1280,
            num_hidden_layers=32,
            num_attention_heads=16,
            intermediate_size=5120,
            patch_size=14,
            image_size=224,
        ),
        text=dict(
            hidden_size=1024,
            num_hidden_layers=24,
            num_attention_heads=16,
            intermediate_size=4096,
            vocab_size=49408,
        ),
        projection_dim=1024,
    ),
    "tiny": dict(
        vision=dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            patch_size=8,
            image_size=32,
        ),
        text=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64),
        projection_dim=16,
    ),
}


def clip_sized(spec: dict[str, Any], device: torch.device) -> tuple[nn.Module, Any]:
    """A ``CLIPModel`` of ``spec``'s shape with random weights on ``device`` (fp32), and a processor
    built here: CLIP's image preprocessing at the model's size, a character-level CLIP tokenizer (the
    real one's merges are a download; prompts then run longer, up to the same 77 tokens)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from lit_flowgrpo.tiny.tokenizers import clip_tokenizer

    tokenizer = clip_tokenizer()
    size = spec["vision"]["image_size"]
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    )
    text = {
        "vocab_size": len(tokenizer),  # CLIP-H's own where the spec gives it
        **spec["text"],
        "max_position_embeddings": 77,
        "hidden_act": "gelu",
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    vision = dict(spec["vision"], hidden_act="gelu")
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=spec["projection_dim"])
    with building_on(device, torch.float32):
        model = CLIPModel(config)
    return model, CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)


class TextDrawn:
    """The OCR reward on each image with its prompt's quoted text drawn in, so that the engine has
    text to find and read, as on a trained model's images. Part of the target is drawn (how much
    varies with the image), so the scores vary within a group, as a reward's must for GRPO."""

    def __init__(self, reward: Any) -> None:
        self.reward = reward

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        from PIL import ImageDraw, ImageFont

        from lit_flowgrpo.rewards.images import to_pil
        from lit_flowgrpo.rewards.ocr import quoted_text

        size = images.shape[-1]
        font = ImageFont.load_default(size=max(size // 10, 8))
        drawn = []
        for image, prompt in zip(to_pil(images), prompts, strict=True):
            target = quoted_text(prompt) or ""
            shown = target[: 1 + zlib.crc32(image.tobytes()) % max(len(target), 1)]
            ImageDraw.Draw(image).text((size // 10, size // 3), shown, fill=(255, 255, 255), font=font)
            drawn.append(torch.from_numpy(np.array(image)).permute(2, 0, 1))
        return self.reward(torch.stack(drawn).float() / 255, prompts, metadata)


def judge_server(latency_ms: float) -> Any:
    """An OpenAI-compatible chat endpoint on 127.0.0.1 that answers each request after ``latency_ms``
    with ``Final Score: s``, s in 1..5 from the request's bytes (each image its own score)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Judge(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the reward's start-up check reads /models
            self._send(b'{"data": []}')

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            time.sleep(latency_ms / 1000)
            text = f"Final Score: {1 + zlib.crc32(body) % 5}"
            self._send(json.dumps({"choices": [{"message": {"content": text}}]}).encode())

        def _send(self, payload: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


#: Prompts per reward: the OCR reward reads the text between double quotes.
PROMPTS = {"ocr": 'a shop sign that says "open {i} days"'}


@contextmanager
def reward_parts(args: argparse.Namespace) -> Iterator[tuple[dict[str, float], dict[str, Any]]]:
    """``(weights, rewards)`` of ``--reward`` for :class:`MultiReward`, built once for every variant
    (a remote reward's server runs while they do)."""
    kind = args.reward
    if kind == "brightness":
        yield {"brightness": 1.0}, {"brightness": brightness}
    elif kind == "pickscore_sized":
        from lit_flowgrpo.rewards.pickscore import PickScoreReward

        model, processor = clip_sized(CLIP_SPECS["tiny" if args.tiny else "full"], torch.device(args.device))
        yield {"pickscore": 1.0}, {"pickscore": PickScoreReward.from_modules(model, processor)}
    elif kind == "ocr":
        from lit_flowgrpo.errors import SettingsError
        from lit_flowgrpo.rewards.ocr import OCRReward

        reward = OCRReward()
        try:
            reward.check()  # builds the engine: fails here, in one line, where rapidocr is absent
        except SettingsError as err:
            raise SystemExit(f"--reward ocr runs the real OCR engine on the CPU: {err}") from err
        yield {"ocr": 1.0}, {"ocr": TextDrawn(reward)}
    else:
        from lit_flowgrpo.rewards.vlm_judge import VLMJudgeReward

        server = judge_server(float(kind.split(":", 1)[1]))
        try:
            url = f"http://127.0.0.1:{server.server_address[1]}/v1"
            # Tiny images go as they are: resizing them to 512 px would measure PNG encoding alone.
            judge = VLMJudgeReward(base_url=url, model="benchmark", resize=None if args.tiny else 512)
            judge.check()
            yield {"vlm_judge": 1.0}, {"vlm_judge": judge}
        finally:
            server.shutdown()
            server.server_close()


# --------------------------------------------------------------------------------------------------
# The profile's ranges: the real module and sampler, their stages marked on the profiler's timelines
# (here rather than in the package: the benchmark is what reads them). Each range costs microseconds a
# step whether a profiler runs or not.
# --------------------------------------------------------------------------------------------------


class MarkedSampler(Sampler):
    """:class:`Sampler` with each rollout marked (the profile's "rollout" part: sampling, decoding and
    handing each chunk to the reward; the reward itself scores in a worker thread, unmarked)."""

    def rollout(self, *args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(profiling.ROLLOUT_RANGE):
            return super().rollout(*args, **kwargs)


# --------------------------------------------------------------------------------------------------
# Variants: each lever switched on after the ones before it.
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Variant:
    name: str
    what: str
    performance: PerformanceSettings
    rollout_batch_size: int | None = None
    fast: bool = False
    micro_batch: int | None = None  # None: --micro-batch
    reward_overlap: bool = True  # score each rollout chunk beside the next one's sampling


#: The full step's objective (``--objective``), each with its recipe's settings; the step runs with no
#: KL term (``kl.coef`` 0): the comparison is of the update's own cost.
OBJECTIVES: dict[str, Callable[[], Objective]] = {
    "flow_grpo": lambda: FlowGRPO(clip_range=1e-4),
    "flow_dppo": lambda: FlowDPPO(),
    "diffusion_nft": lambda: DiffusionNFT(),
}


def variants(micro_batch: int) -> list[Variant]:
    """The eager baseline, then one lever more per variant (compilation last: it is the costly one to
    warm up, and it then compiles the fastest eager settings)."""
    eager = PerformanceSettings(compute_dtype="float32")
    bf16 = PerformanceSettings()
    cudnn = PerformanceSettings(attention_backend="cudnn")
    compiled = PerformanceSettings(attention_backend="cudnn", compile_blocks=True)
    batch = f"rollout batch {micro_batch} = update micro-batch"
    return [
        Variant("eager", "fp32 LoRA compute, eager, whole-batch rollout (the defaults before this)", eager),
        Variant("bf16_compute", "+ LoRA computes in bf16 under autocast (fp32 master weights)", bf16),
        Variant("rollout_batch", f"+ {batch} (same forward shapes)", bf16, rollout_batch_size=micro_batch),
        Variant("cudnn_attention", "+ cuDNN attention kernel", cudnn, rollout_batch_size=micro_batch),
        Variant(
            "compile", "+ torch.compile of each transformer block", compiled, rollout_batch_size=micro_batch
        ),
        Variant("compile_whole_rollout", "compile, rollout of the whole batch in one forward", compiled),
        Variant(
            "compile_batch16",
            "compile, rollout batch = update micro-batch = 16 images (32 per forward with CFG); exact bf16",
            compiled,
            rollout_batch_size=16,
            micro_batch=16,
        ),
        Variant(
            "compile_batch16_decoder",
            "compile_batch16 + the VAE decoder compiled; exact bf16 (the SD3 recipes' speed settings)",
            dataclasses.replace(compiled, compile_decoder=True),
            rollout_batch_size=16,
            micro_batch=16,
        ),
        # The next levers on the fastest exact setting (no float8, no merged weights). The CUDA graph
        # modes replay each compiled block's kernels in one launch; autotuning benchmarks Triton
        # templates against cuBLAS for each product while compiling (minutes more).
        Variant(
            "compile_batch16_decoder_cudagraphs",
            "compile_batch16_decoder + CUDA graphs (compile mode reduce-overhead); bf16, no float8",
            dataclasses.replace(compiled, compile_decoder=True, compile_mode="reduce-overhead"),
            rollout_batch_size=16,
            micro_batch=16,
        ),
        Variant(
            "compile_batch16_decoder_autotune",
            "compile_batch16_decoder + compile mode max-autotune-no-cudagraphs; bf16, no float8",
            dataclasses.replace(compiled, compile_decoder=True, compile_mode="max-autotune-no-cudagraphs"),
            rollout_batch_size=16,
            micro_batch=16,
        ),
        Variant(
            "compile_fp8",
            "compile + frozen base weights multiply in float8 (e4m3, a scale per row; not exact)",
            dataclasses.replace(compiled, fp8_base_matmuls=True),
            rollout_batch_size=micro_batch,
        ),
        Variant(
            "compile_fp8_batch16",
            "compile_fp8, rollout batch = update micro-batch = 16 images (32 per forward with CFG)",
            dataclasses.replace(compiled, fp8_base_matmuls=True),
            rollout_batch_size=16,
            micro_batch=16,
        ),
        Variant(
            "compile_decoder",
            "compile_fp8_batch16 + the VAE decoder compiled",
            dataclasses.replace(compiled, fp8_base_matmuls=True, compile_decoder=True),
            rollout_batch_size=16,
            micro_batch=16,
        ),
        Variant(
            "merged_rollout",
            "+ LoRA merged into a copy of the weights for sampling (not exact)",
            dataclasses.replace(compiled, rollout_merged_lora=True),
            rollout_batch_size=micro_batch,
        ),
        # Video sizes: a CFG pair of Wan 2.1 1.3B at 480x832 keeps ~78 GB (33 frames) or ~180 GB (81
        # frames) of activations for the update's backward; recomputing each block keeps ~1/15 of it.
        Variant(
            "activation_checkpointing",
            "bf16 compute, whole-batch rollout, each transformer block recomputed in the update's backward",
            dataclasses.replace(bf16, activation_checkpointing=True),
        ),
        Variant(
            "compile_activation_checkpointing",
            "activation_checkpointing + torch.compile of each transformer block",
            PerformanceSettings(compile_blocks=True, activation_checkpointing=True),
        ),
    ]


# --------------------------------------------------------------------------------------------------
# Reading the callback's figures
# --------------------------------------------------------------------------------------------------


class MemoryLogger(Logger):
    """Keeps every logged row in memory: ``rows[step]`` merges what the module and the callbacks log."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[int, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.setdefault(-1 if step is None else int(step), {}).update(
            {k: float(v) for k, v in metrics.items()}
        )

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class SyncCounter(L.Callback):
    """Counts the host-device synchronisations of one training batch (CUDA's sync debug mode), by the
    line of code that asked for them. The counted batch is left out of the timings."""

    def __init__(self, batch_idx: int) -> None:
        self.batch_idx = batch_idx
        self.sites: Counter[str] = Counter()
        self._catcher: Any = None
        self._caught: list[Any] = []

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int
    ) -> None:
        if i != self.batch_idx or not torch.cuda.is_available():
            return
        self._catcher = warnings.catch_warnings(record=True)
        self._caught = self._catcher.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, out: Any, batch: Any, i: int
    ) -> None:
        if self._catcher is None:
            return
        torch.cuda.set_sync_debug_mode(0)
        self._catcher.__exit__(None, None, None)
        self._catcher = None
        for w in self._caught:
            if "synchroniz" in str(w.message):
                self.sites[f"{_import_path(w.filename)}:{w.lineno}"] += 1


def _import_path(filename: str) -> str:
    """``filename`` relative to the outermost ``sys.path`` entry holding it (``lightning/...``)."""
    path = os.path.abspath(filename)
    if "site-packages" + os.sep in path:
        return path.rsplit("site-packages" + os.sep, 1)[1]
    roots = [os.path.abspath(r or ".") for r in sys.path]
    roots = [r for r in roots if path.startswith(r.rstrip(os.sep) + os.sep)]
    return os.path.relpath(path, min(roots, key=len)) if roots else os.path.basename(path)


def _peak(rows: list[dict[str, float]], key: str) -> float | None:
    return max((r[key] for r in rows if key in r), default=None)


def _median(rows: list[dict[str, float]], key: str) -> float | None:
    values = [r[key] for r in rows if key in r and math.isfinite(r[key])]
    return statistics.median(values) if values else None


_STAGES = ("gen", "reward", "adv", "update_actor", "step")


def summarise(rows: dict[int, dict[str, float]], warmup: int, steps: int, frames: int = 1) -> dict[str, Any]:
    """Medians over the measured steps of the callback's keys; the ratio check over every step.

    Videos (``frames`` > 1): the image keys count frames (``images_per_gpu_s`` is frames/GPU/s, as the
    callback's ``perf/throughput``), and the ``video`` keys count videos."""
    ordered = [rows[s] for s in sorted(k for k in rows if k >= 0)]
    measured = ordered[warmup : warmup + steps]
    out: dict[str, Any] = {
        "images_per_gpu_s": _median(measured, "perf/throughput"),
        "step_s": _median(measured, "perf/time_per_step"),
        "mfu_infer": _median(measured, "perf/mfu/actor_infer"),
        "mfu_actor": _median(measured, "perf/mfu/actor"),
        "peak_memory_gb": _peak(ordered, "perf/max_memory_allocated_gb"),
        "peak_reserved_gb": _peak(ordered, "perf/max_memory_reserved_gb"),
        "ms_per_image": {stage: _median(measured, f"timing_per_image_ms/{stage}") for stage in _STAGES},
    }
    if frames > 1:
        out |= {
            "frames_per_gpu_s": out["images_per_gpu_s"],
            "videos_per_gpu_s": _median(measured, "perf/video_throughput"),
            "ms_per_video": {stage: _median(measured, f"timing_per_video_ms/{stage}") for stage in _STAGES},
        }
    # The reward: the step's wait for it after the rollout (its stage), and its own compute time.
    shares = [r["timing_s/reward"] / r["timing_s/step"] for r in measured if r.get("timing_s/step")]
    out["reward_share"] = statistics.median(shares) if shares else None
    out["reward_exposed_s"] = _median(measured, "reward/exposed_s")
    out["reward_compute_s"] = _median(measured, "reward/latency_s")
    ratio_errs = [
        r["actor/on_policy_ratio_err"] for r in ordered[: warmup + steps] if "actor/on_policy_ratio_err" in r
    ]
    out["onpolicy_ratio_abs_dev"] = max(ratio_errs) if ratio_errs else None
    out["onpolicy_ratio_abs_dev_first_step"] = ratio_errs[0] if ratio_errs else None
    # The transformer's MFU over the step's two transformer stages (rollout incl. VAE, and update),
    # time-weighted: (F_fwd·n_gen + F_fwd+bwd·n_update) / ((t_gen + t_update) · peak).
    t_gen, t_upd = _median(measured, "timing_s/gen"), _median(measured, "timing_s/update_actor")
    if None not in (out["mfu_infer"], out["mfu_actor"], t_gen, t_upd):
        out["mfu_transformer"] = (out["mfu_infer"] * t_gen + out["mfu_actor"] * t_upd) / (t_gen + t_upd)
    else:
        out["mfu_transformer"] = None
    return out


# --------------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------------


def measuring_trainer(
    root: str,
    device: str,
    rollouts: int,
    logger: Logger,
    callbacks: list[L.Callback],
    devices: int = 1,
    strategy: str = "auto",
) -> L.Trainer:
    """The Trainer of a measured run: ``rollouts`` training steps on ``device`` ("cuda..." or "cpu"), one
    epoch, no validation, checkpoint or progress output, every step logged to ``logger``."""
    return L.Trainer(
        accelerator="gpu" if device.startswith("cuda") else "cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=1,
        limit_train_batches=rollouts,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=logger,
        callbacks=callbacks,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )


def conditioned_records(root: Path, prompts: Sequence[str], width: int, height: int) -> str:
    """A ``.jsonl`` of one record per prompt, each with its own smooth random ``width`` x ``height`` PNG
    (an 8 x 8 grid of colours, resized bilinearly) in ``condition_images``: the data module reads and
    checks them as it reads a user's."""
    rng = np.random.default_rng(0)
    lines = []
    for i, prompt in enumerate(prompts):
        small = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
        small.resize((width, height), Image.Resampling.BILINEAR).save(root / f"src{i}.png")
        lines.append(json.dumps({"prompt": prompt, "condition_images": [f"src{i}.png"]}))
    path = root / "records.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_training(
    spec: dict[str, Any],
    variant: Variant,
    args: argparse.Namespace,
    prompt_file: str,
    monitor_state: dict[str, Any] | None,
    rewards: tuple[dict[str, float], dict[str, Any]],
    count_syncs: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``warmup + steps`` full training steps (rollout, reward, advantages, update) under a Trainer."""
    _free()
    size = _sample_settings(args)
    if variant.fast:
        # flow_grpo's pickscore_sd3_fast_nocfg: CPS noise 0.8 in a window of 3 steps starting in
        # [0, 2], no CFG in rollout or update, clip 1e-5.
        window = min(3, args.num_steps)
        sampler = MarkedSampler(
            num_steps=args.num_steps,
            noise_level=0.8,
            sde_type="cps",
            guidance_scale=1.0,
            sde_window_size=window,
            sde_window_range=(0, max(args.num_steps // 2, window)),
            batch_size=variant.rollout_batch_size,
            **size,
        )
        objective, train_cfg = FlowGRPO(clip_range=1e-5), False
    else:
        # DiffusionNFT trains and samples CFG-free (its rollout runs the old policy at guidance 1);
        # the ratio objectives take CFG 4.5 in rollout and update, as flow_grpo's SD3 recipe.
        # --sde-window-size: only that many steps (in the first half) are stochastic and trained, so
        # that a video step's update fits the time of one benchmark call.
        nft = args.objective == "diffusion_nft"
        window = args.sde_window_size
        sampler = MarkedSampler(
            num_steps=args.num_steps,
            noise_level=0.7,
            guidance_scale=1.0 if nft else 4.5,
            timestep_fraction=0.99,
            sde_window_size=window,
            sde_window_range=None if window is None else (0, max(args.num_steps // 2, window)),
            batch_size=variant.rollout_batch_size,
            **size,
        )
        objective, train_cfg = OBJECTIVES[args.objective](), not nft
    weights, built = rewards
    # The module marks its update as the profile's "update" part (lit_flowgrpo.update, its stage clock).
    module = FlowGRPOModule(
        policy=POLICIES[spec["family"]](spec, args.device, args.dtype),
        reward=MultiReward(weights, rewards=built, overlap=variant.reward_overlap),
        objective=objective,
        sampler=sampler,
        update=UpdateSettings(
            micro_batch_size=variant.micro_batch or args.micro_batch,
            optimizer_steps_per_rollout=2,
            train_cfg=train_cfg,
        ),
        weights=WeightsSettings(lora=LoraSettings(rank=32, alpha=64)),
        kl=KLSettings(coef=0.0),  # no KL term (OBJECTIVES)
        performance=variant.performance,
        seed=0,
    )
    monitor = RLThroughputMonitor()
    if monitor_state is not None:
        # The FLOPs per forward do not depend on the variant: counted once, in the first run.
        monitor.load_state_dict(monitor_state)
    sync_counter = SyncCounter(args.warmup + args.steps)
    callbacks: list[L.Callback] = [monitor, sync_counter] if count_syncs else [monitor]
    # Extra steps after the measured ones (and the one whose syncs are counted): the profiler slows
    # the steps it records, so they stay out of the medians.
    extra = 1 if count_syncs else 0
    profiler = None
    if args.profile:
        profiler = profiling.ProfileSteps(
            profile_folder(args, variant.name),
            first=args.warmup + args.steps + extra,
            count=args.profile_steps,
            gzip=True,
            record_shapes=args.profile_shapes,
        )
        callbacks.append(profiler)
        extra += args.profile_steps
    logger = MemoryLogger()
    counts_before = compile_counts()
    with tempfile.TemporaryDirectory() as root:
        trainer = measuring_trainer(root, args.device, args.warmup + args.steps + extra, logger, callbacks)
        data = PromptDataModule(
            train=prompt_file, prompts_per_step=args.prompts, group_size=args.group, seed=0
        )
        start = time.perf_counter()
        try:
            trainer.fit(module, datamodule=data)
        except Exception:
            # A profiled step that fails (the profiler's memory, say) keeps the measured figures.
            # (ProfileSteps.on_exception has stopped the profiler and says why in its error.)
            measured = sum(1 for k in logger.rows if k >= 0) >= args.warmup + args.steps
            if profiler is None or profiler.error is None or not measured:
                raise
            warnings.warn(f"{variant.name}: {profiler.error}", stacklevel=1)
        wall = time.perf_counter() - start
    result = summarise(logger.rows, args.warmup, args.steps, size["frames"])
    if result["reward_compute_s"] is not None:
        result["reward_compute_ms_per_image"] = (
            1000 * result["reward_compute_s"] / (args.prompts * args.group)
        )
    result.update(
        name=variant.name,
        what=variant.what,
        performance=dataclasses.asdict(variant.performance),
        rollout_batch_size=variant.rollout_batch_size,
        micro_batch=variant.micro_batch or args.micro_batch,
        reward_overlap=variant.reward_overlap,
        wall_s=wall,
        flops_per_image_forward=monitor.flops_per_forward,
    )
    if count_syncs:
        result["host_syncs_per_step"] = sum(sync_counter.sites.values())
        result["host_sync_sites"] = dict(sync_counter.sites.most_common(8))
    if profiler is not None:
        result["profile"] = profile_headline(profiler)
    counts = compile_counts() - counts_before
    if counts:
        result["compile_counts"] = dict(counts)
    state = monitor.state_dict()
    del module, trainer, monitor
    _free()
    return result, state


def run_rollout(spec: dict[str, Any], variant: Variant, args: argparse.Namespace) -> dict[str, Any]:
    """Timed rollouts (sampling with recorded log-probs, and decoding) of the real module's sampler."""
    _free()
    from lightning.fabric.utilities.throughput import measure_flops

    size = _sample_settings(args)
    family = spec["family"]
    policy = POLICIES[family](spec, args.device, args.dtype)
    guidance = {"sd3": 4.5, "flux": 3.5, "qwenimage": 4.0, "wan": 4.5, "hunyuanvideo15": 6.0}[family]
    module = FlowGRPOModule(
        policy=policy,
        reward=brightness,
        sampler=Sampler(num_steps=args.num_steps, guidance_scale=guidance, **size),
        weights=WeightsSettings(lora=LoraSettings()),  # the family's default rank and targets
        performance=variant.performance,
    )
    module.configure_model()
    device = torch.device(args.device)
    n = args.rollout_images
    embeds = policy.encode_prompts([f"prompt {i}" for i in range(n)])
    seeds = torch.arange(n)
    rows = 2 if (guidance > 1 and policy.uses_cfg_batch) else 1
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(args.warmup + args.steps):
        _sync(device)
        t = time.perf_counter()
        module.sampler.rollout(policy, embeds, seeds, step=i, seed=0)
        _sync(device)
        times.append(time.perf_counter() - t)
    t_rollout = statistics.median(times[args.warmup :])
    with torch.no_grad():
        forward = (
            policy.flops_forward(size["height"], size["width"])
            if size["frames"] == 1
            else policy.flops_forward(size["height"], size["width"], size["frames"])
        )
        flops = measure_flops(policy.transformer, forward)
    peak = available_flops(device, torch.bfloat16) if device.type == "cuda" else None
    forwards = n * args.num_steps * rows
    result = {
        "name": variant.name,
        "what": variant.what,
        "performance": dataclasses.asdict(variant.performance),
        "images_per_gpu_s": n * size["frames"] / t_rollout,
        "rollout_ms_per_image": 1000 * t_rollout / (n * size["frames"]),
        "flops_per_image_forward": flops,
        "mfu_infer": flops * forwards / (t_rollout * peak) if peak else None,
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "parameters_b": sum(p.numel() for p in policy.transformer.parameters()) / 1e9,
    }
    del module, policy
    _free()
    return result


def config_name(args: argparse.Namespace) -> str:
    """The run's configuration in a name: model, size, and the objective and reward where not the default."""
    config = f"{args.model}{'_tiny' if args.tiny else ''}_{_size_name(args)}"
    if args.objective != "flow_grpo":
        config += f"_{args.objective}"
    if args.reward != "brightness":
        config += (
            "_reward_" + args.reward.replace(":", "").replace(".", "_") + ("ms" if ":" in args.reward else "")
        )
    return config


def compile_counts() -> Counter[str]:
    """torch.compile's process-wide counts that say whether compiled code ran as it was meant to:
    graph breaks, distinct graphs, and inductor's CUDA graph counts (``cudagraph_skips``: graphs that
    run without CUDA graphs; torch logs why). A run's are the difference over it."""
    from torch._dynamo.utils import counters

    out: Counter[str] = Counter(
        graph_breaks=sum(counters["graph_break"].values()), unique_graphs=counters["stats"]["unique_graphs"]
    )
    out.update({k: v for k, v in counters["inductor"].items() if "cudagraph" in k})
    return out


def results_name(args: argparse.Namespace) -> str:
    """``<device>_<config>[_<tag>]``: the results file's name, and the profile's folder."""
    device = torch.device(args.device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"{device_name.replace(' ', '_')}_{config_name(args)}" + (f"_{args.tag}" if args.tag else "")


def profile_folder(args: argparse.Namespace, variant: str) -> Path:
    return Path(args.profile) / results_name(args) / variant


def profile_headline(profiler: Any) -> dict[str, Any]:
    """The profile's figures for the results file: per part of the step its window, GPU busy share and
    time per kernel category, and the five costliest kernels (the full lists are in the summary)."""
    # the folder under --profile: the results file says where to look without naming this machine's paths
    folder = Path(*profiler.folder.parts[-2:])
    out: dict[str, Any] = {"folder": str(folder), "steps": profiler.steps}
    if profiler.summary is None:
        out["error"] = profiler.error or "no profiled step"
        return out
    out["source"] = profiler.summary["source"]
    for part, b in profiler.summary["parts"].items():
        out[part] = (
            None
            if b is None
            else {
                "window_ms": b["window_ms"],
                "gpu_busy_fraction": b["gpu_busy_fraction"],
                "by_category_ms": b["by_category_ms"],
                "top5": [(r["name"][:100], r["total_ms"], r["count"]) for r in b["top_kernels"][:5]],
                "thin_products": {k: v for k, v in b["thin_products"].items() if k != "shapes"}
                if b.get("thin_products")
                else None,
            }
        )
    return out


def write_profiles(args: argparse.Namespace) -> None:
    """``profiles.txt`` beside the variants' folders: their summaries one after the other."""
    root = Path(args.profile) / results_name(args)
    texts = []
    for path in sorted(root.glob("*/rank*_summary.txt"), key=lambda p: p.stat().st_mtime):
        texts.append(f"######## {path.parent.name}\n{path.read_text()}")
    if texts:
        (root / "profiles.txt").write_text("\n".join(texts))


def _sample_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The sampler's height, width, frames and record dtype of this run."""
    return dict(height=args.height, width=args.width, frames=args.frames, record_dtype=args.record_dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e-2 else f"{x:.{digits}f}"
    return str(x)


def table(result: dict[str, Any]) -> str:
    """The markdown table of one results file."""
    base = result.get("baseline_images_per_gpu_s")
    first = result["variants"][0]["name"] if result["variants"] else "first"
    height, width, frames = result["resolution"], result.get("width"), result.get("frames", 1)
    size = f"{height} px" if width in (None, height) else f"{height}×{width} px"
    if frames > 1:
        size += f", {frames} frames"
    lines = [f"### {result['config']} on {result['device_name']} (1 GPU), {size}", ""]
    # Videos: the image columns count frames, and one column more counts videos.
    unit, video = ("frame", " videos/GPU/s |") if frames > 1 else ("image", "")
    rollout = result["mode"] == "rollout"
    reward = result.get("setup", {}).get("reward", "brightness")
    # A reward of real cost: the step's wait for it after the rollout, and its own time (ms per image).
    costly = not rollout and reward != "brightness"
    if costly:
        lines[0] += f", reward {reward}"
    if rollout:
        lines += [
            f"| variant | {unit}s/GPU/s (rollout only) | × {first} | rollout ms/{unit} | MFU | peak GiB |",
            "|---|---|---|---|---|---|",
        ]
    else:
        lines += [
            f"| variant | {unit}s/GPU/s |{video} × {first} | × previous | rollout ms/{unit} | update ms/{unit} "
            "| MFU rollout / update | max mean\\|ratio−1\\| | peak GiB |" + (_REWARD_HEAD if costly else ""),
            "|---|---|---|---|---|---|---|---|---|"
            + ("---|" if video else "")
            + ("---|" * 3 if costly else ""),
        ]
    previous = None
    for v in result["variants"]:
        ips = v.get("images_per_gpu_s")
        if ips is None:
            # one table row: the error on one line, without the table's separators
            error = " ".join((v.get("error") or "?").split()).replace("|", "/")
            lines.append(f"| {v['name']} | failed: {error[:160]} |")
            continue
        over_base = _ratio(ips, base)
        if rollout:
            lines.append(
                f"| {v['name']} | {_fmt(ips)} | {over_base} | {_fmt(v['rollout_ms_per_image'], 1)} | "
                f"{_pct(v['mfu_infer'])} | {_fmt(v['peak_memory_gb'], 1)} |"
            )
            continue
        step = "—" if v.get("fast") else _ratio(ips, previous)
        ms = v["ms_per_image"]
        videos = f" {_fmt(v.get('videos_per_gpu_s'))} |" if video else ""
        lines.append(
            f"| {v['name']} | {_fmt(ips)} |{videos} {over_base} | {step} | {_fmt(ms['gen'], 1)} | "
            f"{_fmt(ms['update_actor'], 1)} | {_pct(v['mfu_infer'])} / {_pct(v['mfu_actor'])} | "
            f"{_fmt(v['onpolicy_ratio_abs_dev'], 2)} | {_fmt(v['peak_memory_gb'], 1)} |"
            + (_reward_cells(v) if costly else "")
        )
        if not v.get("fast"):
            previous = ips
    return "\n".join(lines)


_REWARD_HEAD = " reward waited ms/image | reward computed ms/image | reward share of step |"


def _reward_cells(v: dict[str, Any]) -> str:
    waited, computed = v["ms_per_image"].get("reward"), v.get("reward_compute_ms_per_image")
    return f" {_fmt(waited, 1)} | {_fmt(computed, 1)} | {_pct(v.get('reward_share'))} |"


def _ratio(x: float, ref: float | None) -> str:
    return "—" if not ref else f"{x / ref:.2f}"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def write_readme(out: Path) -> None:
    """``README.md`` of the results folder: one table per results file."""
    sections = [
        "# Throughput benchmark results",
        "",
        "Written by `benchmarks/throughput.py`; one section per JSON file here. The policy is built from the",
        "public config with random weights and prompt embeddings of the real shapes (no text encoders); the",
        "real `FlowGRPOModule` runs under a `lightning.Trainer` and every figure is `RLThroughputMonitor`'s",
        "(medians over the measured rollouts after warm-up, where compilation happens). Training runs: 512 px,",
        "10 steps, CFG 4.5 in rollout and update (`train_cfg`), `timestep_fraction` 0.99, clip 1e-4, β 0,",
        "16 images per GPU (2 prompts × 8), update micro-batch 8 (where a variant says otherwise, its own),",
        "2 optimizer steps per rollout, bf16 base,",
        "fp32 LoRA r32 α64 on the 8 attention projections, a brightness reward computed on the GPU.",
        "Rollout-only runs (FLUX.1-dev, Qwen-Image sized): 4 images of 10 steps, the family's LoRA (r64).",
        "MFU is against 989.4 TFLOP/s dense bf16; `max mean|ratio−1|` is `actor/on_policy_ratio_err`, the",
        "largest over the run's rollouts (each read before that rollout's first optimizer step).",
        "A section that names a reward (`--reward`) scores with it instead of brightness: `reward waited` is",
        "the step's wait for the reward once the rollout was done (`timing_per_image_ms/reward`), `reward",
        "computed` the reward's own time (`reward/latency_s`), both per image, and the share is",
        "`timing_s/reward / timing_s/step`; a name ending `_overlap_on` scored each rollout chunk beside the",
        "sampling of the next, `_overlap_off` after the rollout. A `failed:` row is a variant that raised (its",
        "error in full in the JSON); the run went on with the next.",
        "Video sections (`--frames`): the image columns count frames, `videos/GPU/s` whole videos; their",
        "setup (steps, trained window, videos per step, micro-batch) is in the section's command.",
        "",
    ]
    for path in sorted(out.glob("*.json")):
        result = json.loads(path.read_text())
        if "variants" not in result:
            continue  # another benchmark's results (benchmarks/scaling.py)
        note = [result["note"], ""] if result.get("note") else []
        sections += [table(result), "", *note, f"Command: `{result['command']}`", ""]
    (out / "README.md").write_text("\n".join(sections))


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", choices=sorted(SPECS), default="sd35m")
    p.add_argument("--tiny", action="store_true", help="tiny configs on the CPU (the smoke test)")
    p.add_argument(
        "--rollout-only", action="store_true", help="time the rollout only (FLUX / Qwen-Image sizes)"
    )
    p.add_argument("--variants", default=None, help="comma-separated subset of the variants (default: all)")
    p.add_argument("--no-fast", dest="fast", action="store_false", help="skip the Flow-GRPO-Fast run")
    p.add_argument(
        "--objective", choices=sorted(OBJECTIVES), default="flow_grpo", help="the full step's objective"
    )
    p.add_argument(
        "--reward",
        default="brightness",
        help="brightness (free), pickscore_sized, ocr (RapidOCR on the CPU), or remote:<latency_ms>",
    )
    p.add_argument(
        "--reward-overlap",
        choices=("on", "off", "both"),
        default="on",
        help="score each rollout chunk beside the next one's sampling, after the rollout, or each variant both ways",
    )
    p.add_argument(
        "--warmup", type=int, default=2, help="rollouts before measuring (compilation happens here)"
    )
    p.add_argument("--steps", type=int, default=3, help="measured rollouts (the median is reported)")
    p.add_argument("--resolution", type=int, default=512, help="height, and width unless --width")
    p.add_argument("--width", type=int, default=None, help="default: --resolution")
    p.add_argument("--frames", type=int, default=1, help="frames per sample (video models: 4k + 1)")
    p.add_argument(
        "--record-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the latents the rollout records (Sampler.record_dtype)",
    )
    p.add_argument(
        "--sde-window-size",
        type=int,
        default=None,
        help="train only this many consecutive steps, starting in the first half (default: all but the last)",
    )
    p.add_argument("--num-steps", type=int, default=10, help="denoising steps")
    p.add_argument("--prompts", type=int, default=2, help="prompts per rollout (M)")
    p.add_argument("--group", type=int, default=8, help="images per prompt (K)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--rollout-images", type=int, default=4, help="images per timed rollout (--rollout-only)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument(
        "--count-syncs",
        action="store_true",
        help="count host syncs in one extra step of the last variant (CUDA)",
    )
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument(
        "--tag", default=None, help="appended to the results file's name (<device>_<config>_<tag>.json)"
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="profile --profile-steps more steps of each variant (not measured); traces and summaries here",
    )
    p.add_argument("--profile-steps", type=int, default=1, help="steps profiled per variant (--profile)")
    p.add_argument(
        "--profile-shapes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="record the operators' shapes in the profile (its thin products: LoRA's adapters)",
    )
    args = p.parse_args(argv)
    if args.profile and args.rollout_only:
        p.error("--profile profiles training steps: drop --rollout-only")
    if args.profile_steps < 1:
        p.error(f"--profile-steps ({args.profile_steps}) must be at least 1")
    if args.tag is not None and not args.tag.replace("_", "").replace("-", "").isalnum():
        p.error(f"--tag {args.tag!r}: letters, digits, - and _ only (it becomes part of a file name)")
    kind, _, latency = args.reward.partition(":")
    if args.reward not in ("brightness", "pickscore_sized", "ocr") and not (
        kind == "remote" and latency.replace(".", "", 1).isdigit()
    ):
        p.error(f"--reward {args.reward!r}: choose brightness, pickscore_sized, ocr or remote:<latency_ms>")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    video = SPECS[args.model]["family"] in ("wan", "hunyuanvideo15")
    if args.frames > 1 and not video:
        p.error(f"--frames {args.frames}: --model {args.model} draws images; choose a video model")
    if video and args.reward != "brightness":
        p.error(f"--reward {args.reward}: scores images; --model {args.model} draws videos (use brightness)")
    if args.tiny:
        args.resolution = min(args.resolution, 32 if args.model != "qwenimage" else 64)
        args.width = None if args.width is None else min(args.width, args.resolution)
        args.num_steps = min(args.num_steps, 3)
    args.height = args.resolution
    args.width = args.width or args.resolution
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    spec = tiny_spec(args.model) if args.tiny else SPECS[args.model]
    device = torch.device(args.device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    config, name = config_name(args), results_name(args)
    chosen = variants(args.micro_batch)
    if args.variants:
        names = args.variants.split(",")
        unknown = set(names) - {v.name for v in chosen}
        if unknown:
            raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {[v.name for v in chosen]}")
        chosen = [next(v for v in chosen if v.name == name) for name in names]  # in the order given
    if args.reward_overlap == "both":
        chosen = [
            dataclasses.replace(v, name=f"{v.name}_overlap_{state}", reward_overlap=state == "on")
            for v in chosen
            for state in ("off", "on")
        ]
    else:
        chosen = [dataclasses.replace(v, reward_overlap=args.reward_overlap == "on") for v in chosen]
    if device.type == "cpu":
        # inductor on the CPU needs a compiler toolchain and minutes: the smoke run traces with
        # aot_eager, which ignores inductor's compile modes (the CUDA graph modes' step marks still
        # run); cuDNN attention is CUDA-only
        for v in chosen:
            v.performance = dataclasses.replace(
                v.performance,
                compile_backend="aot_eager",
                attention_backend="auto"
                if v.performance.attention_backend == "cudnn"
                else v.performance.attention_backend,
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {
        "device": device_name.replace(" ", "_"),
        "device_name": device_name,
        "num_gpus": 1,
        "config": config,
        "mode": "rollout" if args.rollout_only else "training",
        "resolution": args.resolution,
        "width": args.width,
        "frames": args.frames,
        "setup": {
            k: getattr(args, k)
            for k in (
                "num_steps",
                "sde_window_size",
                "record_dtype",
                "prompts",
                "group",
                "micro_batch",
                "rollout_images",
                "warmup",
                "steps",
                "dtype",
                "objective",
                "reward",
                "reward_overlap",
            )
        },
        "torch": torch.__version__,
        "command": "python benchmarks/throughput.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "variants": [],
    }
    print(f"{config} on {device_name}: {', '.join(v.name for v in chosen)}", flush=True)

    def record(result: dict[str, Any]) -> None:
        # written after every variant, so a run cut short keeps what it measured
        summary["variants"].append(result)
        print(json.dumps(result), flush=True)
        _finish(summary)
        (out / f"{name}.json").write_text(json.dumps(summary, indent=2) + "\n")
        write_readme(out)
        if args.profile:
            write_profiles(args)

    if args.rollout_only:
        for v in chosen:
            try:
                record(run_rollout(spec, v, args))
            except Exception as err:
                record(_failed(v, err))
    else:
        with tempfile.TemporaryDirectory() as tmp, reward_parts(args) as rewards:
            prompt_file = os.path.join(tmp, "prompts.txt")
            prompt = PROMPTS.get(args.reward, "prompt number {i}")
            Path(prompt_file).write_text("\n".join(prompt.format(i=i) for i in range(64)) + "\n")
            state = None
            for i, v in enumerate(chosen):
                _adapt_to_this_run(v, summary["variants"])
                last = i == len(chosen) - 1
                try:
                    result, state = run_training(
                        spec, v, args, prompt_file, state, rewards, args.count_syncs and last
                    )
                except Exception as err:  # a lever that fails here is reported, the others still run
                    result = _failed(v, err)
                record(result)
            best = max(summary["variants"], key=lambda r: r["images_per_gpu_s"] or 0.0)
            if args.fast and best["images_per_gpu_s"] is not None:  # not when every variant failed
                source = next(v for v in chosen if v.name == best["name"])
                fast = dataclasses.replace(
                    source,
                    name="fast_nocfg",
                    what=f"Flow-GRPO-Fast (CPS, window 3, no CFG) with {best['name']}'s settings",
                    fast=True,
                )
                try:
                    result, _ = run_training(spec, fast, args, prompt_file, state, rewards)
                except Exception as err:
                    result = _failed(fast, err)
                result["fast"] = True
                record(result)
    print(table(summary), flush=True)
    return summary


def _size_name(args: argparse.Namespace) -> str:
    """``512px`` (square images, the names of the recorded results), else ``480x832`` and ``_81f``."""
    name = f"{args.height}px" if args.width == args.height else f"{args.height}x{args.width}"
    return name + (f"_{args.frames}f" if args.frames > 1 else "")


def _failed(variant: Variant, err: Exception) -> dict[str, Any]:
    import traceback

    traceback.print_exc()
    _free()
    return {
        "name": variant.name,
        "what": variant.what,
        "performance": dataclasses.asdict(variant.performance),
        "error": f"{type(err).__name__}: {err}"[:2000],
        "images_per_gpu_s": None,
    }


def _adapt_to_this_run(variant: Variant, done: list[dict[str, Any]]) -> None:
    """Compile with the forced attention kernel only if it beat PyTorch's own choice in this run; merge
    on top of the faster rollout batch of this run."""
    by_name = {r["name"]: r.get("images_per_gpu_s") for r in done}
    if variant.name == "merged_rollout":
        split, whole = by_name.get("compile"), by_name.get("compile_whole_rollout")
        if whole is not None and (split is None or whole > split):
            variant.rollout_batch_size = None
            variant.what += ", whole-batch rollout"
    if not variant.performance.compile_blocks or variant.performance.attention_backend == "auto":
        return
    forced, chosen = by_name.get("cudnn_attention"), by_name.get("rollout_batch")
    if forced is not None and (chosen is None or forced >= chosen):
        return
    if "cudnn_attention" not in by_name:
        return  # not measured in this run: keep the setting as asked
    variant.performance = dataclasses.replace(variant.performance, attention_backend="auto")
    variant.what += " (PyTorch's attention kernel: cuDNN was not faster here)"


def _finish(summary: dict[str, Any]) -> None:
    """The headline keys, from the variants measured so far."""
    results = summary["variants"]
    full = [r for r in results if not r.get("fast")]
    best = max(full, key=lambda r: r["images_per_gpu_s"] or 0.0)
    if best["images_per_gpu_s"] is None:
        return
    fast = next((r for r in results if r.get("fast")), None)
    summary.update(
        images_per_gpu_s=best["images_per_gpu_s"],
        best_variant=best["name"],
        baseline_images_per_gpu_s=full[0]["images_per_gpu_s"],
        speedup=best["images_per_gpu_s"] / full[0]["images_per_gpu_s"]
        if full[0]["images_per_gpu_s"]
        else None,
        mfu_transformer=best.get("mfu_transformer", best.get("mfu_infer")),
        videos_per_gpu_s=best.get("videos_per_gpu_s"),
        onpolicy_ratio_abs_dev=best.get("onpolicy_ratio_abs_dev"),
        peak_memory_gb=best.get("peak_memory_gb"),
        fast_images_per_gpu_s=None if fast is None else fast["images_per_gpu_s"],
        fast_over_full=None
        if fast is None or fast["images_per_gpu_s"] is None
        else fast["images_per_gpu_s"] / best["images_per_gpu_s"],
    )


if __name__ == "__main__":
    main()
