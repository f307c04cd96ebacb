"""FLUX.1 and Qwen-Image: a full fine-tune's float32 master weights and its bf16 frozen KL reference
compute the same velocity before any update, so the first update's KL is exactly 0 (SD3's is checked in
tests/test_master_weights.py).

The tiny pipelines' norm scales are all 1, which no trained model's are: here they are drawn (bf16
values), so that a scale multiplying in float32 in one network and in bf16 in the other shows. Two
things made the KL rounding-sized: the inputs fed in each network's own dtype (float32 to the masters,
bf16 to the reference: Qwen-Image's RMS norm of the prompt, and a timestep before the model casts it,
then saw other tensors), and the norm scales, multiplied outside autocast, in float32 in the masters
and in bf16 in the reference.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from lit_flowgrpo import (
    FlowGRPO,
    FlowGRPOModule,
    KLSettings,
    PromptDataModule,
    ReferenceSettings,
    Sampler,
    UpdateSettings,
    WeightsSettings,
)
from lit_flowgrpo.policies import FluxPolicy, QwenImagePolicy

FAMILIES = {"flux": FluxPolicy, "qwenimage": QwenImagePolicy}


def brightness(images, prompts, metadata):
    return images.mean(dim=(1, 2, 3))


def with_drawn_norm_scales(path: str, out: Path) -> str:
    """A copy of the pipeline folder whose transformer's parameters outside matrix products (the norm
    scales) are drawn around 1, as bf16 values."""
    shutil.copytree(path, out)
    folder = out / "transformer"
    config = json.loads((folder / "config.json").read_text())
    import diffusers

    cls = getattr(diffusers, config["_class_name"])
    transformer = cls.from_pretrained(str(folder))
    generator = torch.Generator().manual_seed(0)
    drawn = 0
    with torch.no_grad():
        for module in transformer.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                continue
            for param in module.parameters(recurse=False):
                param.copy_((1 + 0.25 * torch.randn(param.shape, generator=generator)).bfloat16())
                drawn += 1
    assert drawn >= 6  # the attention's q/k norms at least
    transformer.save_pretrained(str(folder))
    return str(out)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_float32_masters_and_the_bf16_reference_give_a_first_kl_of_exactly_zero(
    family, tiny_flux_path, tiny_qwenimage_path, prompt_file, tmp_path
):
    source = {"flux": tiny_flux_path, "qwenimage": tiny_qwenimage_path}[family]
    path = with_drawn_norm_scales(source, tmp_path / family)
    module = FlowGRPOModule(
        policy=FAMILIES[family](path, dtype="bfloat16", max_sequence_length=16),
        reward=brightness,
        objective=FlowGRPO(clip_range=1e-2),
        sampler=Sampler(num_steps=3, guidance_scale=1.0, height=32, width=32),
        update=UpdateSettings(micro_batch_size=4, optimizer_steps_per_rollout=1),
        weights=WeightsSettings(lora=None),
        kl=KLSettings(coef=0.1, reference=ReferenceSettings(copy=True)),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-5),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(
        module, datamodule=PromptDataModule(train=prompt_file, prompts_per_step=2, group_size=4, seed=3)
    )
    assert {p.dtype for p in module.policy.transformer.parameters()} == {torch.float32}
    assert torch.bfloat16 in {p.dtype for p in module.copies.kl_reference.network.parameters()}
    # The one update's every KL is taken at the initial weights: the reference computes what the masters
    # compute there, bit for bit.
    assert float(trainer.callback_metrics["actor/kl_loss"]) == 0.0
    assert float(trainer.callback_metrics["actor/on_policy_ratio_err"]) == 0.0
