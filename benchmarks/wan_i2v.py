"""Throughput, MFU, peak memory and the on-policy ratio of Flow-GRPO steps of Wan image-to-video.

The policy is :class:`~lit_flowgrpo.policies.wan_i2v.WanImageToVideoPolicy` built from the public config
alone (``lit_flowgrpo.tiny.specs``: Wan 2.1 I2V-14B-480P's transformer, VAE, CLIP ViT-H/14 image encoder
and image processor, or Wan 2.2 TI2V-5B's), random weights, UMT5 states as random rows of the padded 512
tokens (as :mod:`throughput` measures Wan). The first frame is a real PNG named by a ``.jsonl`` record, so
the data module, the policy's first-frame encoding (CLIP states, the VAE latent of the conditioning clip)
and the concatenated transformer input are the product's own path. The real ``FlowGRPOModule`` runs under
a ``lightning.Trainer`` with ``RLThroughputMonitor``; the figures are its logged keys (``throughput``'s
summary: frames/GPU/s, MFU, peak memory, the on-policy ratio error).

    # Wan 2.1 I2V-14B at 480x832, 33 frames, LoRA, one GPU: 2 videos of 4 steps, 1 trained, CFG 5
    python benchmarks/wan_i2v.py --model wan21_i2v_14b_480p --height 480 --width 832 --frames 33
    # the CPU smoke run (the tiny pipeline's configs, seconds)
    python benchmarks/wan_i2v.py --tiny --height 32 --width 32 --frames 5 --out /tmp/wan_i2v

Results: ``<out>/wan_i2v_<model>_<height>x<width>_<frames>f_sp<sp>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import throughput as tp  # the random-weight helpers, the in-memory logger and the summary of the Wan benchmark
import torch

from lit_flowgrpo import FlowGRPO, FlowGRPOModule, LoraSettings, PromptDataModule, Sampler, UpdateSettings
from lit_flowgrpo.callbacks import RLThroughputMonitor
from lit_flowgrpo.kl import KLSettings
from lit_flowgrpo.performance import PerformanceSettings
from lit_flowgrpo.policies.base import Embeds
from lit_flowgrpo.policies.wan_i2v import WanImageToVideoPolicy
from lit_flowgrpo.rewards import MultiReward
from lit_flowgrpo.tiny.specs import SPECS
from lit_flowgrpo.weights import WeightsSettings


class BenchWanI2VPolicy(tp.RandomWeights, WanImageToVideoPolicy):
    """:class:`WanImageToVideoPolicy` on random weights from a spec; the CLIP image encoder (where the spec
    has one) random too, in float32 as the policy loads it; UMT5 states are random rows."""

    def __init__(self, spec: dict[str, Any], device: str, dtype: str = "bfloat16") -> None:
        WanImageToVideoPolicy.__init__(
            self, "random/wan_i2v", dtype=dtype, max_sequence_length=spec["text"]["tokens"], max_stretch=4.0
        )
        self._setup(spec, device, dtype)

    def load(self) -> None:
        if self.pipe is not None:
            return
        from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanTransformer3DModel
        from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

        transformer, vae, scheduler = self._build(WanTransformer3DModel, AutoencoderKLWan, torch.float32)
        encoder = processor = None
        if "image_encoder" in self.spec:
            with self._seeded(2), tp.building_on(self.build_device, torch.float32):
                encoder = tp.frozen(CLIPVisionModel(CLIPVisionConfig(**self.spec["image_encoder"])))
            processor = CLIPImageProcessor(**self.spec["image_processor"])
        self.pipe = WanImageToVideoPipeline(
            tokenizer=None,
            text_encoder=None,
            vae=vae,
            scheduler=scheduler,
            image_processor=processor,
            image_encoder=encoder,
            transformer=transformer,
            expand_timesteps=self.spec.get("expand_timesteps", False),
        )
        self.pipe.set_progress_bar_config(disable=True)
        self._transformer, self._transformer_2 = transformer, None
        self.vae, self.text_encoder, self.image_encoder = vae, None, encoder

    def _encode_one(self, prompt: str) -> Embeds:
        text, device, dtype = self.spec["text"], self.build_device, self.build_dtype
        return {"prompt_embeds": tp.random_rows(prompt, (1, text["tokens"], text["dim"]), device, dtype)}


def tiny_spec(model: str) -> dict[str, Any]:
    """The tiny pipeline's configs (:mod:`lit_flowgrpo.tiny.wan_i2v`) in the shape of ``model``'s spec."""
    from lit_flowgrpo.tiny import wan, wan_i2v

    if SPECS[model].get("expand_timesteps"):
        transformer = wan.transformer_config(wan.TI2V_LATENT_CHANNELS)
        return dict(SPECS[model], transformer=transformer, vae=wan.TI2V_VAE, text=dict(tokens=8, dim=32))
    transformer = wan_i2v.i2v_transformer_config(wan.VAE["z_dim"], wan_i2v.VISION["hidden_size"])
    return dict(
        SPECS[model],
        transformer=transformer,
        vae=wan.VAE,
        image_encoder=wan_i2v.VISION,
        image_processor=wan_i2v.IMAGE_PROCESSOR,
        text=dict(tokens=8, dim=32),
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = tiny_spec(args.model) if args.tiny else SPECS[args.model]
    sampler = Sampler(
        num_steps=args.num_steps,
        noise_level=0.7,
        guidance_scale=5.0,
        sde_window_size=1,
        sde_window_range=(0, max(args.num_steps // 2, 1)),
        height=args.height,
        width=args.width,
        frames=args.frames,
        record_dtype="bfloat16",
        batch_size=1,
    )
    module = FlowGRPOModule(
        policy=BenchWanI2VPolicy(spec, args.device, args.dtype),
        reward=MultiReward({"brightness": 1.0}, rewards={"brightness": tp.brightness}),
        objective=FlowGRPO(clip_range=1e-4),
        sampler=sampler,
        update=UpdateSettings(micro_batch_size=1, optimizer_steps_per_rollout=1, train_cfg=True),
        weights=WeightsSettings(lora=LoraSettings(rank=64, alpha=128)),
        kl=KLSettings(coef=0.0),
        performance=PerformanceSettings(activation_checkpointing=not args.tiny, sequence_parallel=args.sp),
        seed=0,
    )
    monitor = RLThroughputMonitor()
    logger = tp.MemoryLogger()
    with tempfile.TemporaryDirectory() as root:
        trainer = tp.measuring_trainer(
            root,
            args.device,
            args.warmup + args.steps,
            logger,
            [monitor],
            devices=args.sp,
            strategy="ddp" if args.sp > 1 else "auto",
        )
        # One record whose first frame has the output's size.
        records = tp.conditioned_records(Path(root), ["a red fox runs through snow"], args.width, args.height)
        data = PromptDataModule(
            train=records,
            prompts_per_step=1,
            group_size=args.group,
            seed=0,
        )
        start = time.perf_counter()
        trainer.fit(module, datamodule=data)
        wall = time.perf_counter() - start
    result = tp.summarise(logger.rows, args.warmup, args.steps, args.frames)
    result.update(
        model=args.model,
        tiny=args.tiny,
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        size=dict(height=args.height, width=args.width, frames=args.frames),
        sequence_parallel=args.sp,
        videos_per_rollout=args.group,
        num_steps=args.num_steps,
        trained_steps=1,
        guidance_scale=5.0,
        lora=dict(rank=64, alpha=128),
        activation_checkpointing=not args.tiny,
        wall_s=wall,
        flops_per_video_forward=monitor.flops_per_forward,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="wan21_i2v_14b_480p", choices=["wan21_i2v_14b_480p", "wan22_ti2v_5b"]
    )
    parser.add_argument("--tiny", action="store_true", help="the tiny pipeline's configs (CPU smoke run)")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--num-steps", type=int, default=4)
    parser.add_argument("--group", type=int, default=2, help="videos per rollout (one record's group)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--sp", type=int, default=1, help="sequence-parallel ranks (devices, under DDP)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    result = run(args)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        name = f"wan_i2v_{args.model}_{args.height}x{args.width}_{args.frames}f_sp{args.sp}{'_tiny' if args.tiny else ''}"
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
