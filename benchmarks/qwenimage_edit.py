"""Qwen-Image-Edit LoRA Flow-GRPO steps at real model scale: images/GPU/s, MFU, peak memory, on-policy error.

The policy is :class:`~lit_flowgrpo.policies.qwenimage_edit.QwenImageEditPlusPolicy` on random weights of the
public configs (``lit_flowgrpo.tiny.specs``: Qwen-Image's 20B transformer and VAE, and the Qwen2.5-VL-7B text
encoder *with its vision tower*, so that the prompt encoding sees the sources as the real model does), all
in bf16, with a locally made tokenizer (the edit template's 64-token prefix, real token ids for the vision
markers' roles) and the real Qwen2-VL image processor sizes. Each record is an instruction and one source of
the output's size; the reward is the images' brightness on the GPU, so a step times the RL machinery alone.
The real ``FlowGRPOModule`` runs under a real ``lightning.Trainer`` with ``RLThroughputMonitor``; the figures
are the callback's own logged keys (``throughput.summarise``).

    python benchmarks/qwenimage_edit.py --out benchmarks/results/qwenimage_edit_lora_1xH200.json
    python benchmarks/qwenimage_edit.py --tiny --out /tmp/edit_tiny.json    # the CPU check of the script
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

import torch
from throughput import (  # benchmarks/ siblings
    MemoryLogger,
    brightness,
    building_on,
    conditioned_records,
    measuring_trainer,
    summarise,
)

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
from lit_flowgrpo.policies.qwenimage_edit import ImageOnlyQwen2VLProcessor, QwenImageEditPlusPolicy
from lit_flowgrpo.tiny import qwenimage as tiny_qwen
from lit_flowgrpo.tiny import qwenimage_edit as tiny_edit
from lit_flowgrpo.tiny.specs import SPECS


def tiny_spec() -> dict[str, Any]:
    """The public spec with the tiny pipeline's sizes (``lit_flowgrpo.tiny.qwenimage_edit``): a CPU run of this
    script's code, in seconds."""
    return dict(
        SPECS["qwenimage_edit_2509"],
        transformer=tiny_qwen.TRANSFORMER,
        vae=tiny_qwen.VAE,
        text_encoder=dict(text_config=tiny_edit.TEXT, vision_config=tiny_edit.VISION),
        processor=tiny_edit.PROCESSOR,
    )


class BenchQwenImageEditPolicy(QwenImageEditPlusPolicy):
    """:class:`QwenImageEditPlusPolicy` on random weights from the spec: the pipeline is built, not read."""

    def __init__(self, spec: dict[str, Any], device: str, dtype: str = "bfloat16", **kwargs: Any) -> None:
        super().__init__("random/qwenimage_edit", dtype=dtype, **kwargs)
        self.spec, self.build_device = spec, torch.device(device)

    def problems(self) -> list[str]:
        return []  # nothing to read from disk

    def load(self) -> None:
        if self.pipe is not None:
            return
        from diffusers import (
            AutoencoderKLQwenImage,
            FlowMatchEulerDiscreteScheduler,
            QwenImageEditPlusPipeline,
            QwenImageTransformer2DModel,
        )
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        spec, dtype = self.spec, {"bfloat16": torch.bfloat16, "float32": torch.float32}[self.dtype_name]
        tokenizer = tiny_edit.edit_tokenizer()
        ids = tokenizer.convert_tokens_to_ids
        config = Qwen2_5_VLConfig(
            text_config=dict(
                spec["text_encoder"]["text_config"],
                eos_token_id=ids("<|im_end|>"),
                pad_token_id=tokenizer.pad_token_id,
                bos_token_id=None,
            ),
            vision_config=spec["text_encoder"]["vision_config"],
            image_token_id=ids("<|image_pad|>"),
            video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"),
            vision_end_token_id=ids("<|vision_end|>"),
        )
        with torch.random.fork_rng(devices=[self.build_device] if self.build_device.type == "cuda" else []):
            torch.manual_seed(0)
            with building_on(self.build_device, dtype):
                transformer = QwenImageTransformer2DModel(**spec["transformer"])
                text_encoder = Qwen2_5_VLForConditionalGeneration(config)
                vae = AutoencoderKLQwenImage(**spec["vae"])
        processor = ImageOnlyQwen2VLProcessor(Qwen2VLImageProcessorPil(**spec["processor"]), tokenizer)
        pipe = QwenImageEditPlusPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(**spec["scheduler"]),
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            processor=processor,
            transformer=transformer,
        )
        pipe.set_progress_bar_config(disable=True)
        for name in ("text_encoder", "vae", "transformer"):
            module = getattr(pipe, name).requires_grad_(False).eval()
            setattr(self, "_transformer" if name == "transformer" else name, module)
        self.pipe = pipe


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU (a check of the script)")
    parser.add_argument("--variant", choices=("2509", "2511"), default="2509")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--records", type=int, default=2, help="records per rollout (M)")
    parser.add_argument("--group", type=int, default=2, help="samples per record (K)")
    parser.add_argument("--num_steps", type=int, default=6)
    parser.add_argument("--window", type=int, default=2, help="trained (SDE) steps per rollout")
    parser.add_argument("--micro_batch", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="measured rollouts")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available() and not args.tiny
    spec = tiny_spec() if args.tiny else SPECS[f"qwenimage_edit_{args.variant}"]
    size = 32 if args.tiny else args.resolution
    vision = 32 * 32 if args.tiny else 384 * 384  # the pipeline's CONDITION_IMAGE_SIZE at full size
    policy = BenchQwenImageEditPolicy(
        spec,
        "cuda" if cuda else "cpu",
        dtype="bfloat16" if cuda else "float32",
        vision_area=vision,
        max_sequence_length=1024,
    )
    group = args.records * args.group
    module = FlowGRPOModule(
        policy=policy,
        reward=brightness,
        objective=FlowGRPO(clip_range=1e-4),
        sampler=Sampler(
            num_steps=args.num_steps,
            eval_num_steps=2,
            guidance_scale=4.0,  # true CFG 4 in rollout and update, as the recipe
            noise_level=0.9,
            sde_window_size=args.window,
            sde_window_range=(0, args.num_steps // 2 + 1),
            height=size,
            width=size,
            batch_size=min(group, 4),
        ),
        update=UpdateSettings(micro_batch_size=args.micro_batch, optimizer_steps_per_rollout=1),
        weights=WeightsSettings(lora=LoraSettings(rank=64, alpha=128)),
        kl=KLSettings(coef=0.0),
        performance=PerformanceSettings(activation_checkpointing=True),
        optimizer=lambda p: torch.optim.AdamW(p, lr=3e-4),
    )
    logger = MemoryLogger()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        device = "cuda" if cuda else "cpu"
        trainer = measuring_trainer(root, device, args.warmup + args.steps, logger, [RLThroughputMonitor()])
        prompts = [f"make the object number {i} red" for i in range(args.records)]
        data = PromptDataModule(
            train=conditioned_records(Path(root), prompts, size, size),
            prompts_per_step=args.records,
            group_size=args.group,
            seed=0,
        )
        trainer.fit(module, datamodule=data)
    figures = summarise(logger.rows, args.warmup, args.steps)
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "gpus": 1,
        "strategy": "single",
        "model": "tiny" if args.tiny else f"Qwen-Image-Edit-{args.variant} (random weights, public configs)",
        "dtype": "bfloat16" if cuda else "float32",
        "resolution": size,
        "sources_per_record": 1,
        "source_size": f"{size}x{size} (the policy's default: the VAE copy at the output size)",
        "vision_area": vision,
        "lora": {"rank": 64, "alpha": 128},
        "true_cfg_scale": 4.0,
        "num_steps": args.num_steps,
        "trained_steps": args.window,
        "images_per_rollout": group,
        "micro_batch": args.micro_batch,
        "activation_checkpointing": True,
        "warmup_rollouts": args.warmup,
        "measured_rollouts": args.steps,
        "wall_s": round(time.perf_counter() - start, 1),
        "command": "python benchmarks/qwenimage_edit.py " + " ".join(sys.argv[1:] if argv is None else argv),
        **figures,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
