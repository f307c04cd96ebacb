"""One training run of the tiny SD3 pipeline, as the sharded-training tests launch it.

Run in-process (``run(config)``) or once per rank by torchrun
(``python -m torch.distributed.run --nproc_per_node=2 tests/fsdp_worker.py CONFIG.json``). It writes
to ``config["out"]``: each rank's (sample id, reward, advantage) rows per step, rank 0's logged
metrics, the trained weights and their EMA gathered whole on rank 0, and (optionally) the exported
weights.

Validation and the EMA callback are on by default, as in every shipped recipe (configs/tiny_sd3.yaml,
configs/sd35m_*.yaml): a validation after every rollout with the EMA swapped in, the EMA updated after
every optimizer step, so each validation runs on averaged weights that differ from the trained ones.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lit_flowgrpo import (
    FlowGRPO,
    FlowGRPOModule,
    LoraSettings,
    PromptDataModule,
    Sampler,
    UpdateSettings,
    WeightsSettings,
)
from lit_flowgrpo.advantages import AdvantageSettings, DiversityBonus
from lit_flowgrpo.callbacks import RLThroughputMonitor, TrainableEMA
from lit_flowgrpo.kl import KLGate, KLSettings, ReferenceSettings
from lit_flowgrpo.objective import DiffusionNFT
from lit_flowgrpo.performance import PerformanceSettings
from lit_flowgrpo.policies import SD3Policy
from lit_flowgrpo.rewards import MultiReward
from lit_flowgrpo.rewards.base import register_reward
from lit_flowgrpo.strategies import (  # also registers "fsdp2"
    FSDP2Strategy,
    end_distributed_process,
    transformer_blocks,
)


def brightness(images, prompts, metadata):
    return images.mean(dim=(1, 2, 3))


@register_reward("fsdp_worker_brightness")
def _brightness_reward():
    return brightness


@register_reward("fsdp_worker_redness")
def _redness_reward():
    return lambda images, prompts, metadata: images[:, 0].mean(dim=(1, 2))


# GARDO's controls (configs/hacking_gardo.yaml) on the tiny pipeline: trained on brightness, the KL
# gated by how much more brightness than redness rates a sample (redness scored, weight 0).
GARDO_REWARD = {"fsdp_worker_brightness": 1.0, "fsdp_worker_redness": 0.0}


class RecordingModule(FlowGRPOModule):
    def __init__(self, out: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.out = out

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
        (Path(self.out) / f"adv_rank{self.global_rank}_step{batch.step}.json").write_text(json.dumps(rows))


class MemoryLogger(Logger):
    """Rank 0's logged rows, written to ``metrics.json`` at the end."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.rows: dict[int, dict[str, float]] = {}

    name = "memory"
    version = 0

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.setdefault(int(step or 0), {}).update({k: float(v) for k, v in metrics.items()})

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.path.write_text(json.dumps(self.rows))


class SaveInValidation(L.Callback):
    """Saves a checkpoint at the end of each validation while the EMA is still swapped in (this
    callback's hook runs before TrainableEMA's, which comes after it in the list)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.folder / f"in_validation-step={trainer.global_step}.ckpt")


def build(config: dict[str, Any]) -> tuple[RecordingModule, PromptDataModule]:
    """The module and data of ``config``; beside the defaults (Flow-GRPO, a LoRA, SGD), the stateful
    parts a resume must bring back: ``objective: nft`` (DiffusionNFT's old policy), ``reference`` (a
    moving KL reference), ``gardo`` (GARDO's gated KL and diversity bonus on a two-component reward),
    ``optimizer: adamw`` (moments) and ``lr_decay`` (a scheduler whose rate moves each step)."""
    lora = config.get("lora", True)
    kl_coef = config.get("kl_coef", 0.0)
    nft = config.get("objective") == "nft"
    objective = DiffusionNFT() if nft else FlowGRPO(clip_range=1e-2)
    lr = config.get("lr", 0.1)
    if config.get("optimizer", "sgd") == "adamw":
        optimizer = functools.partial(torch.optim.AdamW, lr=lr, weight_decay=1e-4)
    else:
        optimizer = functools.partial(torch.optim.SGD, lr=lr)
    scheduler = None
    if config.get("lr_decay"):
        scheduler = functools.partial(torch.optim.lr_scheduler.ExponentialLR, gamma=config["lr_decay"])
    advantage = AdvantageSettings()
    reward: Any = brightness
    gate = None
    if config.get("gardo"):
        reward = MultiReward(GARDO_REWARD)
        gate = KLGate(
            proxy="fsdp_worker_brightness",
            auxiliary=["fsdp_worker_redness"],
            fraction=0.5,
            fraction_range=(0.1, 0.9),
        )
        advantage = AdvantageSettings(diversity_bonus=DiversityBonus(pool=4))
    module = RecordingModule(
        out=config["out"],
        policy=SD3Policy(config["pipeline"], dtype=config.get("dtype", "float32"), max_sequence_length=16),
        reward=reward,
        objective=objective,
        # One rollout chunk per rank's share of the batch: a single process then runs exactly the
        # forwards the two ranks run. DiffusionNFT samples without CFG.
        sampler=Sampler(
            num_steps=3,
            eval_num_steps=2,
            height=32,
            width=32,
            batch_size=4,
            **({"guidance_scale": 1.0} if nft else {}),
        ),
        advantage=advantage,
        update=UpdateSettings(
            micro_batch_size=config.get("micro_batch_size", 2),
            optimizer_steps_per_rollout=1,
            max_grad_norm=config.get("max_grad_norm"),
        ),
        weights=WeightsSettings(
            lora=LoraSettings(rank=2, alpha=4) if lora else None,
            master_dtype=config.get("master_dtype", "float32"),
        ),
        kl=KLSettings(
            coef=kl_coef,
            gate=gate,
            reference=ReferenceSettings(
                **config.get("reference", {}),
                copy=not lora and kl_coef > 0,
                offload=config.get("offload_reference", False),
            ),
        ),
        optimizer=optimizer,
        lr_scheduler=scheduler,
        performance=PerformanceSettings(**config.get("performance", {})),
    )
    # Two validation prompts: one per rank on two ranks, one batch of two in one process.
    val = config["prompts"] if config.get("validate", True) else None
    data = PromptDataModule(
        train=config["prompts"],
        val=val,
        prompts_per_step=2,
        group_size=4,
        seed=5,
        val_batch_size=2,
        max_val_prompts=2,
    )
    return module, data


def run(config: dict[str, Any]) -> None:
    out = Path(config["out"])
    out.mkdir(parents=True, exist_ok=True)
    module, data = build(config)
    throughput = RLThroughputMonitor()
    ema = TrainableEMA(decay=0.9, update_every=1) if config.get("ema", True) else None
    callbacks: list[L.Callback] = [throughput]
    if config.get("save_in_validation"):
        callbacks.append(SaveInValidation(out / "ckpt"))
    callbacks += [ema] if ema is not None else []
    if config.get("save_every"):
        callbacks.append(
            ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=config["save_every"], save_top_k=-1)
        )
    strategy = config.get("strategy", "auto")
    if isinstance(strategy, dict):  # FSDP2Strategy's arguments
        strategy = FSDP2Strategy(**strategy)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=config.get("devices", 1),
        strategy=strategy,
        max_steps=config.get("max_steps", 2),
        logger=MemoryLogger(out / "metrics.json"),
        callbacks=callbacks,
        enable_checkpointing=bool(config.get("save_every")),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,  # as the recipes: the first validation comes after the first rollout
        val_check_interval=1,  # rollouts between validations
        check_val_every_n_epoch=None,
    )
    trainer.fit(module, datamodule=data, ckpt_path=config.get("resume"))
    # A collective under FSDP2: every rank takes part, rank 0 gets the whole tensors.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    state = {k: v for k, v in get_model_state_dict(module, options=options).items() if k in trainable}
    # The callback's checkpoint state: every shadow whole (a collective too).
    averaged = ema.state_dict()["ema_state_dict"] if ema is not None else None
    if config.get("export"):
        module.export(str(out / "export"))
    parts = stateful_parts(module, trainer) if config.get("parts") else None
    if trainer.global_rank == 0:
        torch.save({k: v.detach().cpu() for k, v in state.items()}, out / "trained.pt")
        if averaged is not None:
            torch.save(averaged, out / "ema.pt")
        if parts is not None:
            torch.save(parts, out / "parts.pt")
    if trainer.global_rank == 0:
        transformer = module.policy.transformer
        info = {
            "sharded_blocks": sum(isinstance(b, FSDPModule) for b in transformer_blocks(transformer)),
            "dtensor_params": all(isinstance(p, DTensor) for p in transformer.parameters()),
            "dtensor_trainable": all(
                isinstance(p, DTensor) for p in transformer.parameters() if p.requires_grad
            ),
            "gradient_checkpointing": bool(transformer.gradient_checkpointing),
            "compiled_blocks": sum(
                getattr(b, "_compiled_call_impl", None) is not None for b in transformer_blocks(transformer)
            ),
            "flops": [throughput.flops_per_forward, throughput.flops_per_train_forward],
        }
        if config.get("dtypes"):  # how the trained network and the reference copy are sharded
            from torch.distributed.fsdp import CPUOffloadPolicy

            def group(block):
                return block._get_fsdp_state()._fsdp_param_group

            first = transformer_blocks(transformer)[0]
            info["param_dtypes"] = sorted({str(p.dtype) for p in transformer.parameters()})
            info["gather_dtype"] = str(group(first).mp_policy.param_dtype)
            info["root_gather_dtype"] = str(group(transformer).mp_policy.param_dtype)
            reference = module.copies.kl_reference.network
            if reference is not None:
                info["reference_dtypes"] = sorted({str(p.dtype) for p in reference.parameters()})
                info["reference_gather_dtype"] = str(
                    group(transformer_blocks(reference)[0]).mp_policy.param_dtype
                )
                info["reference_offloaded"] = all(
                    isinstance(group(b).offload_policy, CPUOffloadPolicy)
                    for b in [*transformer_blocks(reference), reference]
                )
        (out / "info.json").write_text(json.dumps(info))


def _whole(value: Any) -> Any:
    """``value`` with every tensor whole and on the host (a collective for a DTensor)."""
    if isinstance(value, dict):
        return {k: _whole(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_whole(v) for v in value)
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def stateful_parts(module: RecordingModule, trainer: L.Trainer) -> dict[str, Any]:
    """Every part of the run's state that a resume must bring back, whole (collectives: every rank
    calls it): the copies beside the trained weights (DiffusionNFT's old policy, a moving KL
    reference), the optimizer's and scheduler's state, the KL gate's controller, the module's counters,
    the data position and the optimizer-step count."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    optimizer = trainer.optimizers[0]
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        # Every part's state (the old policy, a moving reference, the KL gate, counters, idle guard).
        **{key: _whole(state) for key, state in module.parts.state_dict().items()},
        "optimizer": _whole(get_optimizer_state_dict(module, optimizer, options=options)),
        "scheduler": _whole(trainer.lr_scheduler_configs[0].scheduler.state_dict()),
        "data": trainer.datamodule.state_dict(),
        "global_step": trainer.global_step,
    }


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()))
    end_distributed_process()  # the results are on disk: no interpreter teardown to abort on
