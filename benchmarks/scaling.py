"""DDP against FSDP2 on several GPUs: throughput, peak memory, save / resume / export, and the first
rollout's equality with one GPU.

The policy is SD3.5-Medium-sized: the public transformer and VAE configs with random weights (seeded,
so every rank and every run builds the same ones), no text encoders (prompts map to fixed random
embeddings of the real shapes, 333 × 4096 and a 2048 pooled vector); the reward is the images'
brightness, computed on the GPU, so a step times the RL machinery alone. The real ``FlowGRPOModule``
runs under a real ``lightning.Trainer`` with ``RLThroughputMonitor``, whose logged keys give the figures.

One run per launch; ``report`` turns the runs' folders into the results JSON::

    torchrun --standalone --nproc_per_node=2 benchmarks/scaling.py run --strategy fsdp2 --out R/fsdp2_lora \\
        --save_at 2 --save_trained --export
    torchrun --standalone --nproc_per_node=2 benchmarks/scaling.py run --strategy fsdp2 --out R/fsdp2_lora_resumed \\
        --resume R/fsdp2_lora/ckpt/step=2.ckpt --compare_to R/fsdp2_lora
    python benchmarks/scaling.py run --strategy single --rollouts 1 --out R/single_lora
    python benchmarks/scaling.py report R --out benchmarks/results/scaling_2xH100.json

``--size`` chooses the model: ``sd35m`` (the default), ``flux12b`` (FLUX.1-dev, 11.9B) or ``qwenimage20b``
(Qwen-Image, 20.4B: with its recipe's CFG, GRPO-Guard, 2 trained steps and LoRA r64 unless told
otherwise), ``wan14b`` (Wan 2.1 T2V 14B) or ``wan22a14b`` (Wan 2.2 T2V A14B: two 14B experts, each
with its own LoRA, CFG 4.0 / 3.0); ``tiny``, ``flux_tiny``, ``qwen_tiny``, ``wan_tiny`` and
``wan_tiny_a14b`` build tiny models of the same classes, for a CPU check of the script (gloo).
``--profile DIR`` profiles the run's last rollouts (``profiling.py``).
``benchmarks/big_runs.sh`` is the plan of the big-model runs on 4 GPUs.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from profiling import ProfileSteps  # benchmarks/ siblings: the script's folder is on sys.path
from throughput import (
    TINY,
    BenchHunyuanVideo15Policy,
    BenchWanPolicy,
    BenchZImagePolicy,
    bench_flux2_policy,
    tiny_spec,
)
from torch import Tensor, nn

from lit_flowgrpo import (
    FlowGRPO,
    FlowGRPOModule,
    KLSettings,
    LoraSettings,
    PromptDataModule,
    ReferenceSettings,
    Sampler,
    UpdateSettings,
    WeightsSettings,
)
from lit_flowgrpo.callbacks import RLThroughputMonitor
from lit_flowgrpo.objective import DiffusionNFT, GRPOGuard
from lit_flowgrpo.performance import PerformanceSettings
from lit_flowgrpo.policies.base import Embeds
from lit_flowgrpo.policies.flux import FluxPolicy
from lit_flowgrpo.policies.qwenimage import QwenImagePolicy
from lit_flowgrpo.policies.sd3 import SD3Policy
from lit_flowgrpo.strategies import FSDP2Strategy, end_distributed_process
from lit_flowgrpo.tiny.specs import SPECS
from lit_flowgrpo.weights import LORA_WEIGHTS_FILE

# The public configs (transformer, VAE, scheduler, conditioning shapes) live once, in lit_flowgrpo.tiny.specs
# (SPECS): stabilityai/stable-diffusion-3.5-medium, black-forest-labs/FLUX.1-dev (11.9B), Qwen/Qwen-Image
# (20.4B), Wan 2.1 T2V 14B, Wan 2.2 T2V A14B. The tiny sizes are benchmarks/throughput.py's tiny configs
# (the same classes shrunk for a CPU check), with the changes noted.
SIZES: dict[str, dict[str, Any]] = {
    "sd35m": dict(SPECS["sd35m"], resolution=512),
    "flux12b": dict(SPECS["flux"], resolution=512),
    "qwenimage20b": dict(SPECS["qwenimage"], resolution=512),
    # throughput.py's tiny SD3.5-M with 2 blocks
    "tiny": dict(TINY["sd35m"], transformer=dict(TINY["sd35m"]["transformer"], num_layers=2), resolution=32),
    # throughput.py's tiny FLUX.1 with one single-stream block and 12 prompt tokens
    "flux_tiny": dict(
        TINY["flux"],
        transformer=dict(TINY["flux"]["transformer"], num_single_layers=1),
        text=dict(TINY["flux"]["text"], tokens=12),
        resolution=32,
    ),
    # Qwen-Image's classes and public in/out channels, VAE latent statistics and scheduler; 2 blocks.
    "qwen_tiny": dict(TINY["qwenimage"], resolution=64),
    # Wan 2.1 T2V 14B at 480 x 832 px (--resolution sets the height), 33 frames (--frames): videos.
    "wan14b": dict(SPECS["wan14b"], resolution=480, width=832, frames=33),
    # the tiny Wan pipeline the tests build (2 heads, 8 tokens at 32 px and 5 frames): sp 2 splits it
    "wan_tiny": dict(tiny_spec("wan1p3b"), resolution=32, frames=5),
    # Wan 2.2 T2V A14B, two 14B experts (high-noise above the boundary σ, low-noise below), as wan14b
    "wan22a14b": dict(SPECS["wan22a14b"], resolution=480, width=832, frames=33, recipe="wan22a14b"),
    # the tiny pipeline's two-expert variant; its boundary (σ 0.875, flow shift 3) splits a rollout's
    # trained steps between the experts: of 10 steps, 4 high-noise and 5 low-noise; of 3, one each
    "wan_tiny_a14b": dict(tiny_spec("wan22a14b"), resolution=32, frames=5, recipe="wan22a14b"),
    # Stable Diffusion 3.5 Large (8.1B), FLUX.2 klein 4B / 9B and dev (32B), Z-Image-Turbo (6.2B) at 512 px,
    # and the tiny FLUX.2 / Z-Image pipelines' configs for a CPU check
    "sd35l": dict(SPECS["sd35l"], resolution=512),
    "flux2_klein4b": dict(SPECS["flux2_klein4b"], resolution=512),
    "flux2_klein9b": dict(SPECS["flux2_klein9b"], resolution=512),
    "flux2_dev": dict(SPECS["flux2_dev"], resolution=512),
    "zimage_turbo": dict(SPECS["zimage_turbo"], resolution=512),
    "flux2_tiny": dict(tiny_spec("flux2_klein4b"), resolution=32),
    "flux2_dev_tiny": dict(tiny_spec("flux2_dev"), resolution=32),
    "zimage_tiny": dict(tiny_spec("zimage_turbo"), resolution=32),
    # HunyuanVideo 1.5 T2V at its smallest published size (480 x 848 px, 33 frames), and its tiny
    # pipeline's configs at 32 px and 5 frames for a CPU check (sp 2 splits either)
    "hunyuanvideo15_480p": dict(SPECS["hunyuanvideo15_480p"], resolution=480, width=848, frames=33),
    "hunyuanvideo15_tiny": dict(tiny_spec("hunyuanvideo15_480p"), resolution=32, frames=5),
}

# What the family's recipe samples and trains with where it differs from the script's defaults
# (Flow-GRPO, every step of 10 trained, noise 0.7, LoRA r32 α64): configs/qwenimage_ocr_grpoguard.yaml
# trains 2 steps drawn from the first 5 with GRPO-Guard (so an update costs far fewer forwards than a
# rollout), LoRA r64 α128 on the attention and MLP projections of both streams.
RECIPES: dict[str, dict[str, Any]] = {
    "qwenimage": dict(
        objective="grpo_guard",
        sde_window_size=2,
        sde_window_range=(0, 5),
        noise_level=1.2,
        guidance=4.0,
        lora_rank=64,
        lora_alpha=128,
    ),
    # Wan 2.2 A14B (configs/wan22_a14b_flowgrpo.yaml): CFG 4.0 for the high-noise expert, 3.0 for the
    # low-noise one (Wan 2.2's diffusers example; Wan-Video/Wan2.2's sample_guide_scale (3.0, 4.0)).
    "wan22a14b": dict(guidance=4.0, guidance_2=3.0),
}
# FLUX.1-dev: guidance is an input embedding; Wan: the Wan recipes' 4.5; FLUX.2 klein's CFG 4.0 (dev
# ignores it: an input embedding); Z-Image-Turbo samples without CFG
DEFAULT_GUIDANCE = {
    "sd3": 4.5,
    "flux": 1.0,
    "qwenimage": 4.0,
    "wan": 4.5,
    "flux2": 4.0,
    "zimage": 1.0,
    "hunyuanvideo15": 6.0,  # the 480p checkpoint's guider (configs/hunyuanvideo15_480p_flowgrpo.yaml)
}


def recipe_of(size: str) -> dict[str, Any]:
    """The recipe a size names (``recipe``), else its family's; empty where the defaults apply."""
    spec = SIZES[size]
    return RECIPES.get(spec.get("recipe", spec["family"]), {})


def _seeded_random_modules(
    transformer_cls: type, vae_cls: type, spec: dict[str, Any]
) -> tuple[nn.Module, nn.Module]:
    """The transformer and VAE of ``spec`` with weights seeded alike on every rank, built in bf16
    straight on this rank's GPU (never an fp32 or host copy); fp32 on the CPU."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    dtype = torch.bfloat16 if device is not None else torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device or "cpu"), torch.random.fork_rng(devices=[device] if device else []):
            torch.manual_seed(0)
            transformer = transformer_cls(**spec["transformer"]).requires_grad_(False).eval()
            vae = vae_cls(**spec["vae"]).requires_grad_(False).eval()
    finally:
        torch.set_default_dtype(previous)
    return transformer, vae


def _prompt_rows(device: torch.device, dtype: torch.dtype, key: str, shape: tuple[int, ...]) -> Tensor:
    """A fixed random tensor per prompt (the same prompt always gets the same embedding)."""
    gen = torch.Generator(device).manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=gen, device=device).to(dtype)


class RandomFluxPolicy(FluxPolicy):
    """:class:`FluxPolicy` on seeded random weights built from a config; prompts map to fixed random
    embeddings of the real shapes (as :class:`RandomSD3Policy`)."""

    def __init__(self, size: str = "flux12b") -> None:
        cuda = torch.cuda.is_available()
        super().__init__("random/flux", dtype="bfloat16" if cuda else "float32", max_sequence_length=512)
        self.size = size

    def problems(self) -> list[str]:
        return []  # nothing to read

    def load(self) -> None:
        if self.pipe is not None:
            return
        from diffusers import (
            AutoencoderKL,
            FlowMatchEulerDiscreteScheduler,
            FluxPipeline,
            FluxTransformer2DModel,
        )

        transformer, vae = _seeded_random_modules(FluxTransformer2DModel, AutoencoderKL, SIZES[self.size])
        scheduler = FlowMatchEulerDiscreteScheduler(**SIZES[self.size]["scheduler"])
        none = dict.fromkeys(("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"))
        self.pipe = FluxPipeline(transformer=transformer, vae=vae, scheduler=scheduler, **none)
        self.pipe.set_progress_bar_config(disable=True)
        self._transformer, self.vae = transformer, vae
        self.text_encoder = self.text_encoder_2 = None

    def _encode_one(self, prompt: str) -> Embeds:
        text = SIZES[self.size]["text"]
        rows = functools.partial(_prompt_rows, self.device, next(self.vae.parameters()).dtype)
        return {
            "prompt_embeds": rows(prompt, (1, text["tokens"], text["dim"])),
            "pooled_prompt_embeds": rows("pooled:" + prompt, (1, text["pooled"])),
        }


class RandomSD3Policy(SD3Policy):
    """:class:`SD3Policy` on seeded random weights built from a config; prompts map to fixed random
    embeddings of the real shapes."""

    def __init__(self, size: str = "sd35m") -> None:
        cuda = torch.cuda.is_available()
        super().__init__("random/sd3", dtype="bfloat16" if cuda else "float32")
        self.size = size

    def problems(self) -> list[str]:
        return []  # nothing to read

    def load(self) -> None:
        if self.pipe is not None:
            return
        from diffusers import (
            AutoencoderKL,
            FlowMatchEulerDiscreteScheduler,
            SD3Transformer2DModel,
            StableDiffusion3Pipeline,
        )

        transformer, vae = _seeded_random_modules(SD3Transformer2DModel, AutoencoderKL, SIZES[self.size])
        scheduler = FlowMatchEulerDiscreteScheduler(**SIZES[self.size]["scheduler"])
        none = dict.fromkeys(
            ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3")
        )
        self.pipe = StableDiffusion3Pipeline(transformer=transformer, vae=vae, scheduler=scheduler, **none)
        self.pipe.set_progress_bar_config(disable=True)
        self._transformer, self.vae, self.text_encoders = transformer, vae, nn.ModuleList()

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> Embeds:
        text = SIZES[self.size]["text"]
        rows = functools.partial(_prompt_rows, self.device, next(self.vae.parameters()).dtype)
        return {
            "prompt_embeds": torch.stack([rows(p, (text["tokens"], text["dim"])) for p in prompts]),
            "pooled_prompt_embeds": torch.stack([rows("pooled:" + p, (text["pooled"],)) for p in prompts]),
        }


class RandomQwenImagePolicy(QwenImagePolicy):
    """:class:`QwenImagePolicy` on seeded random weights built from a config; prompts map to fixed random
    Qwen2.5-VL hidden states of the spec's length (the negative prompt " " to one token, as after the
    chat template), so CFG batches a masked, padded text axis as with the real encoder."""

    def __init__(self, size: str = "qwenimage20b") -> None:
        cuda = torch.cuda.is_available()
        tokens = SIZES[size]["text"]["tokens"]
        super().__init__(
            "random/qwenimage", dtype="bfloat16" if cuda else "float32", max_sequence_length=tokens
        )
        self.size = size

    def problems(self) -> list[str]:
        return []  # nothing to read

    def load(self) -> None:
        if self.pipe is not None:
            return
        from diffusers import (
            AutoencoderKLQwenImage,
            FlowMatchEulerDiscreteScheduler,
            QwenImagePipeline,
            QwenImageTransformer2DModel,
        )

        spec = SIZES[self.size]
        transformer, vae = _seeded_random_modules(QwenImageTransformer2DModel, AutoencoderKLQwenImage, spec)
        scheduler = FlowMatchEulerDiscreteScheduler(**spec["scheduler"])
        none = dict.fromkeys(("text_encoder", "tokenizer"))
        self.pipe = QwenImagePipeline(transformer=transformer, vae=vae, scheduler=scheduler, **none)
        self.pipe.set_progress_bar_config(disable=True)
        self._transformer, self.vae = transformer, vae
        self.text_encoder = None

    def _encode_one(self, prompt: str) -> Embeds:
        text = SIZES[self.size]["text"]
        tokens = 1 if not prompt.strip() else text["tokens"]
        rows = functools.partial(_prompt_rows, self.device, next(self.vae.parameters()).dtype)
        return {"prompt_embeds": rows(prompt, (1, tokens, text["dim"]))}


def random_wan_policy(size: str) -> BenchWanPolicy:
    """benchmarks/throughput.py's Wan on random weights, at this size's spec; built on the rank's GPU.
    Two experts (Wan 2.2 A14B): the low-noise one's CFG scale is the recipe's (unused without CFG)."""
    cuda = torch.cuda.is_available()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"
    guidance_2 = recipe_of(size).get("guidance_2")
    return BenchWanPolicy(SIZES[size], device, "bfloat16" if cuda else "float32", guidance_2)


def random_flux2_policy(size: str) -> Any:
    """benchmarks/throughput.py's FLUX.2 (klein or dev, by the spec's pipeline) on random weights, on the
    rank's GPU."""
    cuda = torch.cuda.is_available()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"
    return bench_flux2_policy(SIZES[size], device, "bfloat16" if cuda else "float32")


def random_zimage_policy(size: str) -> BenchZImagePolicy:
    """benchmarks/throughput.py's Z-Image on random weights, on the rank's GPU."""
    cuda = torch.cuda.is_available()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"
    return BenchZImagePolicy(SIZES[size], device, "bfloat16" if cuda else "float32")


def random_hunyuanvideo15_policy(size: str) -> BenchHunyuanVideo15Policy:
    """benchmarks/throughput.py's HunyuanVideo 1.5 on random weights, on the rank's GPU."""
    cuda = torch.cuda.is_available()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"
    return BenchHunyuanVideo15Policy(SIZES[size], device, "bfloat16" if cuda else "float32")


POLICIES = {
    "sd3": RandomSD3Policy,
    "flux": RandomFluxPolicy,
    "qwenimage": RandomQwenImagePolicy,
    "wan": random_wan_policy,
    "flux2": random_flux2_policy,
    "zimage": random_zimage_policy,
    "hunyuanvideo15": random_hunyuanvideo15_policy,
}


def brightness(images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
    return images.float().flatten(1).mean(1)  # a video's: the mean over its frames


brightness.modalities = frozenset({"image", "video"})  # type: ignore[attr-defined]


class Recorder(FlowGRPOModule):
    """Writes each rank's (sample id, reward, advantage) rows of every rollout to ``out``, and counts the
    trained steps each network served (Wan 2.2 A14B: which expert the update trained)."""

    def __init__(self, out: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.out = out
        self.trained_steps_by_expert = {"transformer": 0, "transformer_2": 0}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        rows = [
            [int(s), float(r), float(a)]
            for s, r, a in zip(
                outputs["sample_ids"].tolist(),
                outputs["rewards"].tolist(),
                outputs["advantages"].tolist(),
                strict=True,
            )
        ]
        (Path(self.out) / f"rows_rank{self.global_rank}_step{batch.step}.json").write_text(json.dumps(rows))
        self._count_experts(batch.step)

    def _count_experts(self, step: int) -> None:
        # The rollout's trained steps (the sampler's own plan) and the expert of each, compared as
        # WanPolicy.velocity compares: σ·num_train_timesteps in fp32 against the boundary timestep.
        _, trained = self.sampler.plan(step, self.seed)
        boundary = self.policy.boundary_timestep
        high = len(trained)
        if boundary is not None:
            sigmas = self.policy.sigmas(self.sampler.num_steps, self.sampler.height, self.sampler.width)
            timesteps = sigmas[trained] * self.policy.pipe.scheduler.config.num_train_timesteps  # (S,) fp32
            high = int((timesteps >= boundary).sum())
        self.trained_steps_by_expert["transformer"] += high
        self.trained_steps_by_expert["transformer_2"] += len(trained) - high


class MemoryLogger(Logger):
    """Rank 0's logged rows, written to ``metrics.json`` at the end."""

    name = "memory"
    version = 0

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.rows: dict[int, dict[str, float]] = {}

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.setdefault(int(step or 0), {}).update({k: float(v) for k, v in metrics.items()})

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.path.write_text(json.dumps(self.rows))


class StepClock(Callback):
    """Wall time of each training step on this rank (after a device synchronisation)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def _now(self, trainer: L.Trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        return time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t = self._now(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seconds.append(self._now(trainer) - self._t)


def run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.text_tokens:  # the policies read SIZES[size] when they load
        SIZES[args.size] = dict(
            SIZES[args.size], text=dict(SIZES[args.size]["text"], tokens=args.text_tokens)
        )
    spec = SIZES[args.size]
    family = spec["family"]
    recipe = recipe_of(args.size)
    cuda = torch.cuda.is_available()
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    lora = not args.full
    kl_coef = args.kl_coef if args.kl_coef is not None else (0.0 if lora else 0.04)
    reference_copy = not lora and kl_coef > 0
    window = args.sde_window_size if args.sde_window_size is not None else recipe.get("sde_window_size", 0)
    objective_name = args.objective or recipe.get("objective", "flow_grpo")
    # DiffusionNFT is CFG-free; it keeps an old policy beside the weights (sharded like them under fsdp2).
    cfg_free = args.no_cfg or objective_name == "diffusion_nft"
    guidance = 1.0 if cfg_free else recipe.get("guidance", DEFAULT_GUIDANCE[family])
    objective = {
        "grpo_guard": lambda: GRPOGuard(clip_range=2e-6),
        "diffusion_nft": lambda: DiffusionNFT(),
        "flow_grpo": lambda: FlowGRPO(clip_range=1e-4),
    }[objective_name]()
    resolution = args.resolution or spec["resolution"]
    module = Recorder(
        out=str(out),
        policy=POLICIES[family](args.size),
        reward=brightness,
        objective=objective,
        sampler=Sampler(
            num_steps=args.num_steps,
            noise_level=recipe.get("noise_level", 0.7),
            guidance_scale=guidance,
            sde_window_size=window or None,
            sde_window_range=recipe.get("sde_window_range") if window else None,
            height=resolution,
            width=spec.get("width", resolution),
            frames=args.frames or spec.get("frames", 1),
            batch_size=args.per_gpu,  # one rollout chunk per rank's share: 1 GPU runs the same forwards
        ),
        # One optimizer step per rollout: every ratio of the first rollout is then computed with the
        # initial weights, per sample, whatever the number of ranks (the equality check needs it).
        update=UpdateSettings(
            micro_batch_size=args.micro_batch, optimizer_steps_per_rollout=1, train_cfg=guidance > 1
        ),
        # the family's default target modules (Qwen-Image: the recipe's 12 projections)
        weights=WeightsSettings(
            lora=LoraSettings(rank=recipe.get("lora_rank", 32), alpha=recipe.get("lora_alpha", 64))
            if lora
            else None,
            master_dtype=args.master_dtype if not lora else "float32",
        ),
        performance=PerformanceSettings(
            attention_backend=args.attention_backend,
            activation_checkpointing=args.activation_checkpointing,  # the one flag, under every strategy
            compile_blocks=args.compile_blocks,
            compile_backend=args.compile_backend,
            sequence_parallel=args.sequence_parallel,
        ),
        kl=KLSettings(
            coef=kl_coef, reference=ReferenceSettings(copy=reference_copy, offload=args.offload_reference)
        ),
        # Large enough that two updates show in bf16 weights and in the next rollout's rewards.
        optimizer=functools.partial(torch.optim.AdamW, lr=3e-4 if lora else 1e-4, weight_decay=1e-4),
    )
    prompts = out / "prompts.txt"
    prompts.write_text("\n".join(f"prompt {i}" for i in range(64)) + "\n")
    global_batch = args.per_gpu * args.global_ranks
    data = PromptDataModule(train=str(prompts), prompts_per_step=global_batch // 8, group_size=8, seed=1)
    strategy: Any = {"single": "auto", "ddp": "ddp"}.get(args.strategy)
    if args.strategy == "fsdp2":
        strategy = FSDP2Strategy(
            reshard_after_forward=args.reshard_after_forward, frozen_weights=args.frozen_weights
        )
    clock = StepClock()
    callbacks: list[Callback] = [RLThroughputMonitor(measure_flops=not args.no_flop_count), clock]
    profiler = None
    if args.profile:
        # The last rollouts of the run: the earlier ones give the unprofiled figures.
        profiler = ProfileSteps(
            args.profile, first=args.rollouts - args.profile_steps, count=args.profile_steps
        )
        callbacks.append(profiler)
    if args.save_at:
        callbacks.append(
            ModelCheckpoint(
                dirpath=out / "ckpt", filename="{step}", every_n_train_steps=args.save_at, save_top_k=-1
            )
        )
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=devices,
        strategy=strategy,
        precision="32-true",
        max_steps=args.rollouts,  # one optimizer step per rollout; a resumed run counts from its checkpoint
        logger=MemoryLogger(out / "metrics.json"),
        callbacks=callbacks,
        enable_checkpointing=bool(args.save_at),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule=data, ckpt_path=args.resume)
    fit_s = time.perf_counter() - start
    # Gathering a full fine-tune's weights on rank 0 copies the whole model to the host (24 GB for
    # FLUX.1, 41 GB for Qwen-Image): only when something reads them.
    trained = _gather_trainable(module) if (args.export or args.compare_to or args.save_trained) else {}
    rank = trainer.global_rank
    info: dict[str, Any] = {}
    if args.export:
        module.export(str(out / "export"))
        if rank == 0:
            info["exported_ok"] = _exported_ok(out / "export", trained, lora, family)
    if rank == 0 and args.compare_to:
        info["resume_weights_max_abs_diff"] = _max_diff(
            torch.load(Path(args.compare_to) / "trained.pt"), trained
        )
    if rank == 0 and args.save_trained:
        torch.save(trained, out / "trained.pt")
    info.update(
        rank=rank,
        size=args.size,
        family=family,
        world_size=trainer.world_size,
        strategy=args.strategy,
        lora=lora,
        lora_rank=recipe.get("lora_rank", 32) if lora else None,
        kl_coef=kl_coef,
        reference_copy=reference_copy,
        master_dtype=args.master_dtype if not lora else None,
        offload_reference=args.offload_reference,
        objective=objective_name,
        guidance_scale=guidance,
        # Wan 2.2 A14B: the experts, where they switch, the low-noise one's CFG and the steps each trained
        experts=spec.get("experts", 1),
        boundary_ratio=spec.get("boundary_ratio"),
        guidance_scale_2=recipe.get("guidance_2") if guidance > 1 and spec.get("experts", 1) == 2 else None,
        trained_steps_by_expert=module.trained_steps_by_expert if spec.get("experts", 1) == 2 else None,
        train_cfg=guidance > 1,
        sde_window_size=window or None,
        num_steps=args.num_steps,
        text_tokens=spec["text"]["tokens"] if "text" in spec else None,
        micro_batch=args.micro_batch,
        resolution=resolution,
        width=spec.get("width", resolution),
        frames=args.frames or spec.get("frames", 1),
        sequence_parallel=args.sequence_parallel,
        activation_checkpointing=args.activation_checkpointing,
        reshard_after_forward=args.reshard_after_forward if args.strategy == "fsdp2" else None,
        frozen_weights=strategy.frozen_weights if args.strategy == "fsdp2" else None,
        compile_blocks=args.compile_blocks,
        compile_backend=args.compile_backend if args.compile_blocks else None,
        attention_backend=args.attention_backend,
        skipped_optimizer_steps=module.counters.values["skipped_optimizer_steps"],
        nonfinite_losses=module.counters.values["nonfinite_losses"],
        step_seconds=clock.seconds,
        profiled_steps=profiler.steps if profiler else [],
        profile_dir=str(Path(args.profile).resolve()) if args.profile else None,
        per_gpu=args.per_gpu,
        global_batch=global_batch,
        peak_memory_gb_whole_run=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        gpu_memory_gb=torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None,
        fit_seconds=fit_s,
        device=torch.cuda.get_device_name() if cuda else "cpu",
        torch=torch.__version__,
        lightning=L.__version__,
    )
    (out / f"info_rank{rank}.json").write_text(json.dumps(info))


def _gather_trainable(module: nn.Module) -> dict[str, Tensor]:
    """The trainable weights, whole, on rank 0's CPU (a collective under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    names = {n for n, p in module.named_parameters() if p.requires_grad}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state = get_model_state_dict(module, options=options)
    return {k: v.detach().cpu() for k, v in state.items() if k in names}


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def _rows(folder: Path) -> dict[int, dict[int, tuple[float, float]]]:
    steps: dict[int, dict[int, tuple[float, float]]] = {}
    for f in folder.glob("rows_rank*_step*.json"):
        step = int(f.stem.rsplit("step", 1)[1])
        for sample, reward, adv in json.loads(f.read_text()):
            steps.setdefault(step, {})[sample] = (reward, adv)
    return steps


def _metrics(folder: Path) -> dict[int, dict[str, float]]:
    path = folder / "metrics.json"
    return {int(k): v for k, v in json.loads(path.read_text()).items()} if path.exists() else {}


def _infos(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(f.read_text()) for f in sorted(folder.glob("info_rank*.json"))]


def _max_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    if sorted(a) != sorted(b):
        return math.inf
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


RATIO_KEYS = ("actor/ratio", "actor/pg_clipfrac", "actor/clip_ratio", "actor/approx_kl", "actor/ppo_kl")


def first_rollout_diff(a: Path, b: Path) -> dict[str, float]:
    """Largest |a − b| of the first rollout's per-sample rewards and advantages and of its ratio /
    clip statistics."""
    ra, rb = _rows(a).get(0, {}), _rows(b).get(0, {})
    if not ra or sorted(ra) != sorted(rb):
        return {"rewards": math.inf, "advantages": math.inf, "ratio_stats": math.inf}
    ma, mb = _metrics(a).get(0, {}), _metrics(b).get(0, {})
    keys = [k for k in ma if k.startswith(RATIO_KEYS) and "by_step" not in k]
    return {
        "rewards": max(abs(ra[s][0] - rb[s][0]) for s in ra),
        "advantages": max(abs(ra[s][1] - rb[s][1]) for s in ra),
        "ratio_stats": max((abs(ma[k] - mb.get(k, math.inf)) for k in keys), default=math.inf),
    }


def summarise(root: Path, name: str, reference: str | None) -> dict[str, Any] | None:
    folder = root / name
    infos = _infos(folder)
    if not infos:
        return None
    info = infos[0]
    metrics = _metrics(folder)
    steps = sorted(metrics)
    # The first rollout carries the FLOP count, allocator warm-up and first-call compilations; a
    # profiled rollout carries the profiler's cost: the figures are the other rollouts' (or, where no
    # other is left, the profiled ones').
    profiled = set(info.get("profiled_steps") or [])
    measured = [metrics[s] for i, s in enumerate(steps) if i >= 1 and i not in profiled]
    measured = measured or [metrics[s] for s in steps[1:]] or [metrics[s] for s in steps]
    throughput = [r["perf/throughput"] for r in measured if "perf/throughput" in r]
    step_peaks = [r["perf/max_memory_allocated_gb"] for r in measured if "perf/max_memory_allocated_gb" in r]
    out: dict[str, Any] = {
        "name": name,
        "size": info.get("size", "sd35m"),
        "device": info["device"],
        "gpu_memory_gb": info.get("gpu_memory_gb"),
        "world_size": info["world_size"],
        "strategy": info["strategy"],
        "lora": info["lora"],
        "lora_rank": info.get("lora_rank"),
        "kl_coef": info["kl_coef"],
        "reference_copy": info.get("reference_copy"),
        # A full fine-tune's trained weights: float32 masters (the default since they exist) or the
        # model's bf16 (runs recorded before the setting trained bf16 in place).
        "master_dtype": info.get("master_dtype", None if info["lora"] else "model"),
        "offload_reference": info.get("offload_reference", False),
        "objective": info.get("objective", "flow_grpo"),
        "guidance_scale": info.get("guidance_scale"),
        "experts": info.get("experts", 1),  # 2: Wan 2.2 A14B, each expert a LoRA of its own
        "boundary_ratio": info.get("boundary_ratio"),
        "guidance_scale_2": info.get("guidance_scale_2"),
        "trained_steps_by_expert": info.get("trained_steps_by_expert"),
        "train_cfg": info.get("train_cfg"),
        "sde_window_size": info.get("sde_window_size"),
        "num_steps": info.get("num_steps", 10),  # runs recorded before the flag sampled 10 steps
        "text_tokens": info.get("text_tokens"),
        "images_per_gpu": info["per_gpu"],
        "global_batch": _global_batch(info),
        "micro_batch": info["micro_batch"],
        "resolution": info.get("resolution"),
        "width": info.get("width", info.get("resolution")),
        "frames": info.get("frames", 1),
        "sequence_parallel": info.get("sequence_parallel", 1),
        "activation_checkpointing": info["activation_checkpointing"],
        "reshard_after_forward": info.get("reshard_after_forward"),
        "frozen_weights": info.get("frozen_weights"),
        "compile_blocks": info.get("compile_blocks", False),
        "attention_backend": info.get("attention_backend", "auto"),
        # A step whose gradient was not finite is skipped (the weights stay): a run that trains has none.
        "skipped_optimizer_steps": info.get("skipped_optimizer_steps"),
        "nonfinite_losses": info.get("nonfinite_losses"),
        "rollouts": len(steps),
        "profiled_rollouts": sorted(profiled),
        "images_per_gpu_s": statistics.median(throughput) if throughput else None,
        "step_seconds_rank0": info["step_seconds"],
        # The training step's peak (rank 0); the whole run's peak (FLOP count, checkpoint, export) over ranks.
        "peak_memory_gb": max(step_peaks) if step_peaks else None,
        "peak_memory_gb_whole_run_max_over_ranks": max((i["peak_memory_gb_whole_run"] or 0.0) for i in infos),
        "fit_seconds": info.get("fit_seconds"),
        "torch": info["torch"],
        "lightning": info["lightning"],
    }
    out["profile"] = _profile(info.get("profile_dir"))
    resumed = root / f"{name}_resumed"
    resumed_infos = _infos(resumed)
    ra = _rows(folder)
    # `<name>_repeat`: the same command again, uninterrupted. How far its rewards land from this run's
    # is the run's own repeatability on this machine (compiled kernels whose configuration inductor picks
    # by timing each process, for one, can round differently from one process to the next).
    repeat = _rows(root / f"{name}_repeat")
    if repeat:
        out["repeat_rewards_max_abs_diff_by_rollout"] = {
            step: max(abs(ra[step][s][0] - repeat[step][s][0]) for s in repeat[step])
            if step in ra
            else math.inf
            for step in sorted(repeat)
        }
    if resumed_infos:
        rb = _rows(resumed)
        last = max(rb) if rb else None
        out["resume_started_at_rollout"] = min(rb) if rb else None
        out["resume_weights_max_abs_diff"] = resumed_infos[0].get("resume_weights_max_abs_diff")
        out["resume_last_rollout_rewards_max_abs_diff"] = (
            max(abs(ra[last][s][0] - rb[last][s][0]) for s in rb[last]) if last in ra else math.inf
        )
        # The resumed run restores the weights of rollout 2 and draws rollout 3 (prompts, noise) afresh:
        # its rollout is a forward pass of the same weights on the same inputs, so its rewards equal the
        # uninterrupted run's (the weights after its update differ only by the backward's
        # non-deterministic kernels, reported for information). Equal means within 1e-6, or, where a
        # repeat was run, within what a second uninterrupted run differs by at that rollout: a resume
        # cannot be checked more finely than the run repeats.
        tolerance = 1e-6
        if repeat and last is not None:
            tolerance = max(tolerance, out["repeat_rewards_max_abs_diff_by_rollout"].get(last, 0.0))
        out["resume_tolerance"] = tolerance
        out["resumed_ok"] = bool(
            out["resume_started_at_rollout"] == len(steps) - 1
            and out["resume_last_rollout_rewards_max_abs_diff"] <= tolerance
        )
    else:
        out["resumed_ok"] = None
    out["exported_ok"] = info.get("exported_ok")
    reference = reference if reference is not None else _matching_single(root, name, out)
    same_kind = reference is not None and any(i["lora"] == info["lora"] for i in _infos(root / reference))
    if same_kind:
        diff = first_rollout_diff(root / reference, folder)
        out["first_rollout_reference"] = reference
        out["first_rollout_max_abs_diff_vs_1gpu"] = max(diff.values())
        out["first_rollout_diffs_vs_1gpu"] = diff
    else:
        out["first_rollout_max_abs_diff_vs_1gpu"] = None
    return out


def _matching_single(root: Path, name: str, run: dict[str, Any]) -> str | None:
    """A one-process run of the same size, kind (LoRA or full) and global batch, to compare the first
    rollout with (``None`` for a one-process run itself, or where there is none)."""
    if run["world_size"] == 1 or name.endswith(
        ("_resumed", "_repeat")
    ):  # a resumed run starts past rollout 0
        return None
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name != name):
        infos = _infos(folder)
        if not infos or folder.name.endswith("_resumed"):
            continue
        i = infos[0]
        if (
            i["world_size"] == 1
            and i.get("size", "sd35m") == run["size"]
            and i["lora"] == run["lora"]
            and _global_batch(i) == run["global_batch"]
        ):
            return folder.name
    return None


def _global_batch(info: dict[str, Any]) -> int:
    # Runs before the field was recorded: their per-GPU batch times their ranks (the old default).
    return info.get("global_batch") or info["per_gpu"] * info["world_size"]


def _profile(folder: str | None) -> dict[str, Any] | None:
    """Rank 0's profile summary (benchmarks/profiling.py) without its kernel list: the communication
    figures of the whole profiled window and of the update inside it."""
    path = Path(folder) / "rank0_summary.json" if folder else None
    if path is None or not path.exists():
        return None
    summary = json.loads(path.read_text())
    out: dict[str, Any] = {"source": summary["source"]}
    for part in ("whole", "update"):
        if summary.get(part):
            out[part] = {k: v for k, v in summary[part].items() if k != "top"}
            out[part]["top5"] = [r["name"][:80] for r in summary[part]["top"][:5]]
    return out


def line(r: dict[str, Any]) -> str:
    """One line of a run's figures."""
    diff = r["first_rollout_max_abs_diff_vs_1gpu"]
    prof = (r.get("profile") or {}).get("update") or (r.get("profile") or {}).get("whole") or {}
    comm = (
        f" comm {prof['comm_ms']:.0f}ms overlapped {prof['comm_overlapped_fraction']:.0%}"
        if prof.get("comm_overlapped_fraction") is not None
        else ""
    )
    experts = r.get("trained_steps_by_expert")
    experts = f" steps by expert {experts['transformer']}/{experts['transformer_2']}" if experts else ""
    return (
        f"{r['name']}: {r['size']} {r['strategy']} W{r['world_size']} "
        f"{'lora' if r['lora'] else 'full ' + str(r.get('master_dtype'))}{experts}"
        f"{' ref-offloaded' if r.get('offload_reference') else ''}"
        f" {r['images_per_gpu_s'] or float('nan'):.3f} img/GPU/s peak {r['peak_memory_gb'] or float('nan'):.1f} GiB"
        f" steps {[round(x, 1) for x in r['step_seconds_rank0']]}s resumed {r['resumed_ok']} exported"
        f" {r['exported_ok']} d1gpu {diff if diff is not None else '-'}{comm}"
    )


# The family's pipeline (whose LoRA loader reads the adapter) and transformer class.
EXPORT_CLASSES = {
    "sd3": ("StableDiffusion3Pipeline", "SD3Transformer2DModel"),
    "flux": ("FluxPipeline", "FluxTransformer2DModel"),
    "qwenimage": ("QwenImagePipeline", "QwenImageTransformer2DModel"),
    "wan": ("WanPipeline", "WanTransformer3DModel"),
}


# Where a LoRA export holds each trained network's adapter: the (first) transformer's in the folder,
# Wan 2.2 A14B's low-noise expert's in transformer_2/ (WanPolicy.lora_subfolders), which diffusers
# loads with `load_lora_weights(folder / "transformer_2", load_into_transformer_2=True)`.
ADAPTER_FOLDERS = {"policy._transformer.": "", "policy._transformer_2.": "transformer_2"}


def _exported_ok(path: Path, trained: dict[str, Tensor], lora: bool, family: str = "sd3") -> bool:
    """The export loads with diffusers' own loaders and holds the trained weights, exactly: every trained
    network's adapter (both experts' of Wan 2.2 A14B), none missing, none extra."""
    import diffusers

    pipeline_name, transformer_name = EXPORT_CLASSES[family]
    prefix = "policy._transformer."
    if lora:
        ours: dict[str, Tensor] = {}
        for network, folder in ADAPTER_FOLDERS.items():
            if not (path / folder / LORA_WEIGHTS_FILE).is_file():
                continue  # a missing expert's adapter leaves its trained weights unmatched below
            state = getattr(diffusers, pipeline_name).lora_state_dict(str(path / folder))
            state = state[0] if isinstance(state, tuple) else state
            # diffusers: transformer.<module>.lora_A.weight (either expert's file);
            # ours: policy._transformer[_2].<module>.lora_A.default.weight
            ours |= {
                network + k.removeprefix("transformer.")[: -len("weight")] + "default.weight": v
                for k, v in state.items()
            }
        return sorted(ours) == sorted(trained) and _max_diff(ours, trained) == 0.0
    loaded = getattr(diffusers, transformer_name).from_pretrained(str(path)).state_dict()
    # Written in the model's dtype (bf16 on GPUs, as the random policies build it): the float32 masters
    # rounded once; compared in that dtype whatever dtype from_pretrained loads it in.
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return all(torch.equal(loaded[k.removeprefix(prefix)].to(dtype), v.to(dtype)) for k, v in trained.items())


def report(args: argparse.Namespace) -> None:
    root = Path(args.root)
    names = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.endswith("_resumed"))
    runs = [
        r for r in (summarise(root, n, args.reference if n != args.reference else None) for n in names) if r
    ]
    comparison: dict[str, Any] = {}
    for fsdp in runs:
        if fsdp["strategy"] != "fsdp2" or not fsdp["images_per_gpu_s"]:
            continue
        same = ("size", "lora", "world_size", "images_per_gpu", "micro_batch")
        ddp = next(
            (
                r
                for r in runs
                if r["strategy"] == "ddp" and r["images_per_gpu_s"] and all(r[k] == fsdp[k] for k in same)
            ),
            None,
        )
        if ddp is None:
            continue
        comparison[f"{fsdp['name']} / {ddp['name']}"] = entry = {
            "throughput": fsdp["images_per_gpu_s"] / ddp["images_per_gpu_s"]
        }
        if fsdp["peak_memory_gb"] and ddp["peak_memory_gb"]:
            entry["peak_memory"] = fsdp["peak_memory_gb"] / ddp["peak_memory_gb"]
    result = {"runs": runs, "comparison": comparison}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(
        f"{'run':<32}{'device':<24}{'W':>3}{'img/GPU/s':>11}{'peak GB':>9}{'resumed':>9}{'exported':>10}{'Δ1gpu':>10}"
    )
    for r in runs:
        diff = r["first_rollout_max_abs_diff_vs_1gpu"]
        print(
            f"{r['name']:<32}{r['device'][:23]:<24}{r['world_size']:>3}"
            f"{r['images_per_gpu_s'] or float('nan'):>11.3f}{r['peak_memory_gb'] or float('nan'):>9.2f}"
            f"{r['resumed_ok']!s:>9}{r['exported_ok']!s:>10}{diff if diff is not None else float('nan'):>10.2e}"
        )
    print(json.dumps(comparison))


def _bool(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"{text!r}: give true or false")
    return text.lower() == "true"


def problems(args: argparse.Namespace) -> list[str]:
    """Every problem with the run's flags, before anything is loaded."""
    p = []
    if args.num_steps < 2:
        p.append(f"--num_steps ({args.num_steps}) must be 2 or more")
    if args.text_tokens is not None and (args.text_tokens < 1 or "text" not in SIZES[args.size]):
        p.append(
            f"--text_tokens ({args.text_tokens}) must be 1 or more, with an image size that has text embeddings"
        )
    if args.per_gpu * args.global_ranks % 8:
        p.append("--per_gpu × --global_ranks must be a multiple of the group size 8")
    if args.frozen_weights != "auto" and args.strategy != "fsdp2":
        p.append(f"--frozen_weights {args.frozen_weights} is an fsdp2 setting: use it with --strategy fsdp2")
    if not args.reshard_after_forward and args.strategy != "fsdp2":
        p.append("--reshard_after_forward false is an fsdp2 setting: use it with --strategy fsdp2")
    if args.profile and not 1 <= args.profile_steps <= args.rollouts:
        p.append(f"--profile_steps ({args.profile_steps}) must be in [1, --rollouts ({args.rollouts})]")
    if args.profile and args.resume:
        p.append("--profile with --resume: profile the uninterrupted run (it profiles the last rollouts)")
    if args.no_cfg and SIZES[args.size]["family"] == "flux":
        p.append("--no_cfg with a FLUX size: FLUX.1-dev has no CFG batch (its guidance is an input)")
    if args.compile_backend != "inductor" and not args.compile_blocks:
        p.append("--compile_backend needs --compile_blocks")
    if args.master_dtype != "float32" and not args.full:
        p.append("--master_dtype model is for --full: a LoRA adapter is always float32")
    if args.offload_reference and not (
        args.full and args.strategy == "fsdp2" and (args.kl_coef is None or args.kl_coef > 0)
    ):
        p.append(
            "--offload_reference offloads a full fine-tune's reference copy: use it with --full, --strategy fsdp2, β > 0"
        )
    return p


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="one training run (launch with torchrun for several GPUs)")
    p.add_argument("--strategy", choices=("single", "ddp", "fsdp2"), required=True)
    p.add_argument("--full", action="store_true", help="full fine-tune (default: LoRA r32)")
    p.add_argument(
        "--kl_coef", type=float, default=None, help="default: 0 for LoRA, 0.04 for a full fine-tune"
    )
    p.add_argument("--size", choices=sorted(SIZES), default="sd35m")
    p.add_argument("--resolution", type=int, default=None, help="image side in pixels (default: the size's)")
    p.add_argument("--per_gpu", type=int, default=16, help="images per GPU per rollout")
    p.add_argument(
        "--frames",
        type=int,
        default=None,
        help="frames per video (Wan, HunyuanVideo 1.5; default: the size's)",
    )
    p.add_argument(
        "--num_steps",
        type=int,
        default=10,
        help="sampling steps per rollout (flow_grpo's FLUX recipe: 6, with --sde_window_size 0 training 5)",
    )
    p.add_argument(
        "--text_tokens",
        type=int,
        default=None,
        help="prompt tokens of the random text embeddings (default: the size's; FLUX.1-dev 512, flow_grpo's "
        "FLUX recipe 128)",
    )
    p.add_argument(
        "--sequence_parallel",
        type=int,
        default=1,
        help="PerformanceSettings.sequence_parallel: ranks that split each sample's tokens (Wan, HunyuanVideo 1.5)",
    )
    p.add_argument("--global_ranks", type=int, default=2, help="ranks the global batch is sized for")
    p.add_argument("--micro_batch", type=int, default=8)
    p.add_argument("--rollouts", type=int, default=3)
    p.add_argument("--save_at", type=int, default=0, help="checkpoint every this many rollouts")
    p.add_argument("--resume", default=None)
    p.add_argument(
        "--export", action="store_true", help="export, then check the export loads and holds the weights"
    )
    p.add_argument("--save_trained", action="store_true", help="keep the trained weights for a resumed run")
    p.add_argument(
        "--compare_to", default=None, help="a run with --save_trained whose weights to compare with"
    )
    p.add_argument(
        "--master_dtype",
        choices=("float32", "model"),
        default="float32",
        help="--full: keep float32 master weights (the default) or train the bf16 weights in place (model)",
    )
    p.add_argument(
        "--offload_reference",
        action="store_true",
        help="--full with --kl_coef > 0 under fsdp2: keep the frozen reference copy's shards in pinned host "
        "memory (FSDP2's CPUOffloadPolicy)",
    )
    p.add_argument("--activation_checkpointing", action="store_true")
    p.add_argument(
        "--frozen_weights",
        choices=("auto", "shard", "replicate"),
        default="auto",
        help="fsdp2: the frozen base sharded per block or replicated on every GPU (FSDP2Strategy.frozen_weights)",
    )
    p.add_argument(
        "--reshard_after_forward",
        type=_bool,
        default=True,
        help="fsdp2: free each block's gathered weights after its forward (true, ZeRO-3) or keep them "
        "until its backward (false, ZeRO-2: fewer all-gathers, the whole model's memory)",
    )
    p.add_argument("--compile_blocks", action="store_true", help="PerformanceSettings.compile_blocks")
    p.add_argument("--compile_backend", default="inductor", help="PerformanceSettings.compile_backend")
    p.add_argument(
        "--no_cfg", action="store_true", help="sample and train without CFG (guidance 1; SD3 and Qwen-Image)"
    )
    p.add_argument(
        "--sde_window_size",
        type=int,
        default=None,
        help="trained steps per rollout (0: all but the last; default: the family's recipe, Qwen-Image 2)",
    )
    p.add_argument(
        "--objective",
        choices=("flow_grpo", "grpo_guard", "diffusion_nft"),
        default=None,
        help="default: the family's recipe (Qwen-Image: GRPO-Guard), else Flow-GRPO; diffusion_nft samples "
        "without CFG and keeps an old-policy copy (its sharded resume is what --resume checks)",
    )
    p.add_argument("--profile", default=None, help="profile the last rollouts; traces and summaries here")
    p.add_argument("--profile_steps", type=int, default=1, help="rollouts to profile (the run's last)")
    p.add_argument(
        "--attention_backend",
        default="auto",
        choices=("auto", "cudnn", "flash", "efficient", "math"),
        help="PerformanceSettings.attention_backend",
    )
    p.add_argument(
        "--no_flop_count", action="store_true", help="skip the MFU's FLOP count (one extra forward+backward)"
    )
    p.add_argument("--out", required=True)
    r = sub.add_parser("report", help="the results JSON from the runs' folders")
    r.add_argument("root")
    r.add_argument(
        "--reference",
        default=None,
        help="the 1-GPU run the first rollouts are compared with (default: each run's one-process run of "
        "the same size, kind and global batch)",
    )
    r.add_argument("--out", required=True)
    o = sub.add_parser("line", help="one line of one run's figures")
    o.add_argument("root")
    o.add_argument("name")
    args = parser.parse_args(argv)
    if args.command == "run":
        found = problems(args)
        if found:
            sys.exit("; ".join(found))
        run(args)
        distributed = torch.distributed.is_initialized()
        rank = torch.distributed.get_rank() if distributed else 0
        if distributed:
            torch.distributed.barrier()  # every rank's files are written before rank 0 reads them
        if rank == 0:
            out = Path(args.out)
            try:  # the line benchmarks/big_runs.sh prints per run; never the run's failure
                print("RESULT:", line(summarise(out.parent, out.name, None) or {}), flush=True)
            except Exception as err:
                print(f"RESULT: {out.name}: no summary ({type(err).__name__}: {err})", flush=True)
        if distributed:
            # Lightning leaves the group open; closed here, and the process leaves without the
            # interpreter's teardown, where gloo's background thread aborted a finished rank now and
            # then (signal 6 in 1 of 8 runs of the scaling smoke test on a loaded 2-core machine).
            end_distributed_process()
    elif args.command == "line":
        r = summarise(Path(args.root), args.name, None)
        print(line(r) if r else f"{args.name}: no result")
    else:
        report(args)


if __name__ == "__main__":
    main()
