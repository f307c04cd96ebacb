"""SFT and Diffusion-DPO steps at real model scale: images/GPU/s, MFU and memory, through
``benchmarks/throughput.py``'s spec path (the public config on random weights, its benchmark policy with
fixed random prompt embeddings, ``RLThroughputMonitor`` read back from an in-memory logger, its summary).

    # SD3.5-Medium at 512 px, LoRA r32, one GPU: SFT and offline Diffusion-DPO
    python benchmarks/data_throughput.py --model sd35m --out benchmarks/results
    # the CPU smoke run (tiny configs, seconds)
    python benchmarks/data_throughput.py --tiny --device cpu --resolution 32 --out tiny_results

The data are ``--records`` records of smooth random images written to a temporary folder (an
``ImageDataModule`` index), encoded by the model's VAE each step (the ``gen`` stage here). A step is
``--batch`` records; an image is one trained image (a Diffusion-DPO pair is two images, each with a
reference forward; the monitor counts records, so `images_per_gpu_s` of Diffusion-DPO is pairs/GPU/s). Results: ``<out>/<device>_<model>_<resolution>px_data_objectives.json``.
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

import lightning as L
import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import throughput as tp

from lit_flowgrpo import FlowGRPOModule, KLSettings, LoraSettings, Sampler, UpdateSettings, WeightsSettings
from lit_flowgrpo.callbacks import RLThroughputMonitor
from lit_flowgrpo.data_objective import SFT, DiffusionDPO
from lit_flowgrpo.image_data import ImageDataModule
from lit_flowgrpo.tiny.specs import SPECS


def write_records(root: Path, count: int, size: int) -> str:
    """``count`` pair records over 8 smooth random images (they compress: the folder stays small)."""
    rng = np.random.default_rng(0)
    ys, xs = np.mgrid[0:size, 0:size] / size
    for i in range(8):
        a, b, c = rng.uniform(0.5, 4.0, 3)
        image = np.stack([np.sin(a * xs + i), np.cos(b * ys), np.sin(c * (xs + ys))], -1) * 127.5 + 127.5
        Image.fromarray(image.astype(np.uint8)).save(root / f"{i}.png")
    lines = [
        json.dumps({"prompt": f"prompt {i}", "chosen": f"{i % 8}.png", "rejected": f"{(i + 3) % 8}.png"})
        for i in range(count)
    ]
    (root / "index.jsonl").write_text("\n".join(lines) + "\n")
    return str(root / "index.jsonl")


def run_one(name: str, spec: dict[str, Any], args: argparse.Namespace, index: str) -> dict[str, Any]:
    objective = SFT() if name == "sft" else DiffusionDPO()
    size = args.resolution
    module = FlowGRPOModule(
        policy=tp.POLICIES[spec["family"]](spec, args.device, args.dtype),
        reward=tp.brightness,
        objective=objective,
        sampler=Sampler(num_steps=10, guidance_scale=1.0, height=size, width=size),
        update=UpdateSettings(micro_batch_size=args.micro_batch, optimizer_steps_per_rollout=1),
        weights=WeightsSettings(lora=LoraSettings(rank=32, alpha=64)),
        kl=KLSettings(coef=0.0),
        seed=0,
    )
    monitor, logger = RLThroughputMonitor(), tp.MemoryLogger()
    data = ImageDataModule(
        train=index, prompts_per_step=args.batch, height=size, width=size, pairs=True, seed=0
    )
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            accelerator="gpu" if args.device.startswith("cuda") else "cpu",
            devices=1,
            max_steps=args.warmup + args.steps,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=logger,
            callbacks=[monitor],
            log_every_n_steps=1,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        )
        start = time.perf_counter()
        trainer.fit(module, datamodule=data)
        wall = time.perf_counter() - start
    result = tp.summarise(logger.rows, args.warmup, args.steps)
    result.update(
        objective=name,
        settings=objective.settings(),
        wall_s=wall,
        flops_per_image_forward=monitor.flops_per_forward,
    )
    last = [logger.rows[k] for k in sorted(logger.rows) if k >= 0][-1]
    result["loss_last"] = last.get("actor/loss")
    del module, trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="sd35m", choices=["sd35m"])
    p.add_argument("--tiny", action="store_true", help="the tiny config of the family (CPU smoke run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--batch", type=int, default=16, help="records per step")
    p.add_argument("--micro-batch", dest="micro_batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--objectives", nargs="+", default=["sft", "diffusion_dpo"])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    spec = tp.tiny_spec(args.model) if args.tiny else SPECS[args.model]
    results: list[dict[str, Any]] = []
    device = torch.cuda.get_device_name().replace(" ", "_") if args.device.startswith("cuda") else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    tiny = "_tiny" if args.tiny else ""
    path = args.out / f"{device}_{args.model}{tiny}_{args.resolution}px_data_objectives.json"
    command = "python benchmarks/data_throughput.py " + " ".join(sys.argv[1:])
    keys = ("objective", "images_per_gpu_s", "step_s", "mfu_actor", "peak_memory_gb")
    with tempfile.TemporaryDirectory() as folder:
        index = write_records(Path(folder), args.batch * (args.warmup + args.steps), args.resolution)
        for name in args.objectives:
            results.append(run_one(name, spec, args, index))
            print(json.dumps({k: results[-1].get(k) for k in keys}), flush=True)
            # Written after each objective, so that a run cut short keeps what it measured.
            record = {"command": command, "device": device, "results": results}
            path.write_text(json.dumps(record, indent=1, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
