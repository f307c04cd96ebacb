"""FLUX.1 Kontext-sized editing steps on one GPU: images/GPU/s, MFU, peak memory and the on-policy error.

FLUX.1 Kontext [dev] is FLUX.1-dev's network (the same transformer config, VAE and scheduler; only the
pipeline class and the weights differ), so the model here is FLUX.1-dev's public config
(:data:`lit_flowgrpo.tiny.specs.SPECS` ``"flux"``, 11.9B) with random weights, inside a
``FluxKontextPipeline``: :class:`~lit_flowgrpo.policies.flux_kontext.FluxKontextPolicy`'s own encode,
velocity and decode run, the source's packed latent beside the noisy one (1024 + 1024 image tokens at
512 px, and 128 T5 tokens as flow_grpo's Kontext script encodes them, random rows of the real width). The records are real editing records: a
prompt and a 512 x 512 source PNG each, read by the data module; the reward is 1 − mean |result −
source| on the GPU (free, so a step times the RL machinery alone), which sees the sources through
``uses_sources``. The real ``FlowGRPOModule`` runs Flow-GRPO with a LoRA of rank 32 under a real
``lightning.Trainer`` with ``RLThroughputMonitor``; the figures are the callback's logged keys
(:func:`throughput.summarise`: medians over the measured steps, the on-policy check over every step).

    python benchmarks/flux_kontext.py --out benchmarks/results/flux_kontext_1xH200.json
    python benchmarks/flux_kontext.py --tiny --out /tmp/flux_kontext_tiny.json   # the CPU check, seconds
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from throughput import (  # benchmarks/ siblings
    TINY,
    BenchFluxPolicy,
    MemoryLogger,
    conditioned_records,
    measuring_trainer,
    summarise,
)
from torch import Tensor

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
from lit_flowgrpo.callbacks import RLThroughputMonitor
from lit_flowgrpo.performance import PerformanceSettings
from lit_flowgrpo.policies.base import PromptCache
from lit_flowgrpo.policies.flux_kontext import FluxKontextPolicy
from lit_flowgrpo.tiny.specs import SPECS


class BenchFluxKontextPolicy(BenchFluxPolicy, FluxKontextPolicy):
    """:class:`FluxKontextPolicy` on random weights of FLUX.1-dev's config (T5 and CLIP rows random, as
    :class:`throughput.BenchFluxPolicy`); the source goes through the pipeline's own encoding."""

    def __init__(self, spec: dict[str, Any], device: str, dtype: str = "bfloat16") -> None:
        BenchFluxPolicy.__init__(self, spec, device, dtype)
        self.guidance_scale = 2.5  # FluxKontextPolicy's default (flow_grpo's Kontext recipe)
        self._sources = PromptCache(self.prompt_cache_size)

    def load(self) -> None:
        if self.pipe is not None:
            return
        from diffusers import AutoencoderKL, FluxKontextPipeline, FluxTransformer2DModel

        transformer, vae, scheduler = self._build(FluxTransformer2DModel, AutoencoderKL)
        none = dict.fromkeys(("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"))
        self.pipe = FluxKontextPipeline(transformer=transformer, vae=vae, scheduler=scheduler, **none)
        self.pipe.set_progress_bar_config(disable=True)
        self._transformer, self.vae = transformer, vae


class Preservation:
    """1 − mean |result − source| (the source resized to the result on the result's device)."""

    uses_sources = True

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict], sources: list) -> Tensor:
        size = images.shape[-2:]
        resized = [
            F.interpolate(s[0][None].to(images), size=size, mode="bilinear", antialias=True) for s in sources
        ]
        return 1.0 - (images - torch.cat(resized)).abs().flatten(1).mean(1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = TINY["flux"] if args.tiny else SPECS["flux"]
    if args.text_tokens and not args.tiny:  # T5 tokens per prompt (the recipe's max_sequence_length)
        spec = dict(spec, text=dict(spec["text"], tokens=args.text_tokens))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = "float32" if device == "cpu" else "bfloat16"
    size = 32 if args.tiny else args.resolution
    args.attention_backend = args.attention_backend or ("flash" if device.startswith("cuda") else "auto")
    steps_total = args.warmup + args.steps
    module = FlowGRPOModule(
        policy=BenchFluxKontextPolicy(spec, device, dtype),
        reward=Preservation(),
        objective=FlowGRPO(clip_range=1e-4),
        # flow_grpo's counting_flux_kontext: 6 steps, noise 0.9, 5 trained; Kontext's guidance is embedded.
        sampler=Sampler(
            num_steps=args.num_steps,
            noise_level=0.9,
            timestep_fraction=0.99,
            guidance_scale=1.0,
            height=size,
            width=size,
            batch_size=args.rollout_batch,
        ),
        update=UpdateSettings(micro_batch_size=args.micro_batch, optimizer_steps_per_rollout=2),
        weights=WeightsSettings(lora=LoraSettings(rank=32, alpha=64)),
        kl=KLSettings(coef=0.0),
        performance=PerformanceSettings(attention_backend=args.attention_backend),
        seed=0,
    )
    logger = MemoryLogger()
    with tempfile.TemporaryDirectory() as root:
        prompts = [f"make object {i} red" for i in range(args.prompts)]
        records = conditioned_records(Path(root), prompts, size, size)
        trainer = measuring_trainer(root, device, steps_total, logger, [RLThroughputMonitor()])
        data = PromptDataModule(train=records, prompts_per_step=args.prompts, group_size=args.group, seed=0)
        start = time.perf_counter()
        trainer.fit(module, datamodule=data)
        wall = time.perf_counter() - start
    result = summarise(logger.rows, args.warmup, args.steps)
    lora = sum(p.numel() for p in module.policy.transformer.parameters() if p.requires_grad)
    result.update(
        model="FLUX.1 Kontext [dev] sized (FLUX.1-dev public config, random weights)"
        if not args.tiny
        else "tiny",
        transformer_params=sum(p.numel() for p in module.policy.transformer.parameters()),
        lora_params=lora,
        lora_rank=32,
        resolution=size,
        image_tokens=2 * module.policy.latent_shape(size, size)[0],  # noisy + source
        text_tokens=spec["text"]["tokens"],
        images_per_rollout=args.prompts * args.group,
        num_steps=args.num_steps,
        trained_steps=int(args.num_steps * 0.99),
        micro_batch=args.micro_batch,
        attention_backend=args.attention_backend,
        rollout_batch=args.rollout_batch,
        warmup=args.warmup,
        measured_steps=args.steps,
        wall_s=wall,
        device=torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu",
        torch=torch.__version__,
        command="python " + " ".join(sys.argv),
    )
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny configs on the CPU (a check of the script)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument(
        "--text-tokens",
        type=int,
        default=128,
        help="T5 tokens (flow_grpo's Kontext script: 128; FLUX.1: 512)",
    )
    p.add_argument("--num-steps", type=int, default=6, help="denoising steps (flow_grpo's Kontext recipe: 6)")
    p.add_argument("--prompts", type=int, default=1, help="records per rollout (M)")
    p.add_argument("--group", type=int, default=4, help="edits per record (K)")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--rollout-batch", type=int, default=4, help="samples per rollout chunk")
    # auto let PyTorch take cuDNN's attention, which ended in an illegal memory access at this shape on an
    # H200 (24 heads x 128, 128 + 2048 tokens; FLUX.1's known cuDNN fault is at 1536 tokens).
    p.add_argument(
        "--attention-backend",
        default=None,
        help="auto, cudnn, flash or efficient (default: flash on a GPU, else auto)",
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="measured rollouts (the median is reported)")
    p.add_argument("--out", default=None, help="the results JSON (default: print only)")
    args = p.parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
