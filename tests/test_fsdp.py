"""Sharded training (``--trainer.strategy=fsdp2``) on 2 CPU processes (gloo), launched by torchrun.

FSDP2 runs the same arithmetic as one process, in fp32: each rank all-gathers the exact weights, so
the only differences are the order of float sums (the rollout chunks of one process are the ranks'
batches, see ``fsdp_worker.build``) and the cross-rank gradient reduction. Tolerances below follow
from that: a few fp32 roundings on each reward, propagated through the advantage normalisation.
"""

from __future__ import annotations

import glob
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import fsdp_worker
import pytest
import torch
from torch import nn

from lit_flowgrpo import FlowGRPOModule, LoraSettings, PromptDataModule, WeightsSettings
from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.policies import SD3Policy
from lit_flowgrpo.strategies import FSDP2Strategy, transformer_blocks

EPS32 = torch.finfo(torch.float32).eps
WORKER = str(Path(fsdp_worker.__file__))


def torchrun(config: dict, tmp: Path, name: str) -> subprocess.Popen:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(config))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        WORKER,
        str(path),
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-6000:]


def rows(out: Path) -> dict[int, dict[int, tuple[float, float]]]:
    """{step: {sample id: (reward, advantage)}} over all ranks."""
    steps: dict[int, dict[int, tuple[float, float]]] = {}
    for f in glob.glob(str(out / "adv_rank*_step*.json")):
        step = int(f.rsplit("step", 1)[1].split(".")[0])
        for sample, reward, adv in json.loads(Path(f).read_text()):
            steps.setdefault(step, {})[sample] = (reward, adv)
    return steps


def metrics(out: Path) -> dict[int, dict[str, float]]:
    return {int(k): v for k, v in json.loads((out / "metrics.json").read_text()).items()}


# slow: five processes import the package and run two rollouts each (about a minute on 2 shared cores).
@pytest.mark.slow
def test_fsdp2_two_processes_equal_single_process(tiny_sd3_path, prompt_file, tmp_path):
    """Rewards, advantages, ratio statistics, the clipped global gradient norm, the LoRA weights and
    their EMA after 2 steps, and the validations in between (run with the EMA swapped in, as every
    recipe does), in both sharding modes: units resharded after each forward (the default, here with
    activation checkpointing) and kept gathered until their backward (``reshard_after_forward=False``),
    and with every sharded block compiled (``compile_blocks``); the adapter exported from the sharded
    run loads into the diffusers pipeline."""
    # Clipping is active (norms are ~5e-3) and the optimizer is SGD, so a wrong global norm (a
    # rank-local one, say) changes the weights; Adam would hide any gradient scale.
    config = dict(pipeline=tiny_sd3_path, prompts=prompt_file, max_grad_norm=1e-3, lr=0.1, max_steps=2)
    lr, max_norm, steps = 0.1, 1e-3, 2
    strategies = {
        "fsdp": dict(),  # with activation checkpointing (the performance flag): recomputation is exact
        # Units stay gathered after every forward (the FLOP count's, the rollout's, validation's): code
        # that reads parameters outside a forward/backward pair sees the gathered copies unless it
        # reshards first (the FLOP count's backward once leaked into step 0's gradient so).
        "zero2": dict(reshard_after_forward=False),
        # Each block compiled (dynamo's "eager" backend runs the captured ops unchanged: this checks
        # that compiled blocks trace through FSDP2's units and compute what the plain blocks do).
        "compiled": dict(),
        # The frozen base whole on every rank, the adapter sharded as one unit per transformer.
        "replicated": dict(frozen_weights="replicate"),
    }
    performance = {
        "fsdp": dict(activation_checkpointing=True),
        "compiled": dict(compile_blocks=True, compile_backend="eager"),
    }
    procs = [
        torchrun(
            dict(
                config,
                out=str(tmp_path / name),
                devices=2,
                export=name == "fsdp",
                strategy=s,
                performance=performance.get(name, {}),
            ),
            tmp_path,
            name,
        )
        for name, s in strategies.items()
    ]
    fsdp_worker.run(dict(config, out=str(tmp_path / "single")))
    for proc in procs:
        finish(proc)
    for name in strategies:
        check_equal_single(tmp_path / "single", tmp_path / name, lr=lr, max_norm=max_norm, steps=steps)
    info = json.loads((tmp_path / "fsdp" / "info.json").read_text())
    flops = info.pop("flops")
    assert info == {
        "sharded_blocks": 2,
        "dtensor_params": True,
        "dtensor_trainable": True,
        "gradient_checkpointing": True,
        "compiled_blocks": 0,
    }
    # RLThroughputMonitor counted the sharded transformer's FLOPs: the unsharded model's, forward and
    # forward + backward alike; the blocks' recomputation (activation checkpointing) is left out, so
    # perf/mfu/actor stays model FLOPs utilisation.
    fwd, fwd_bwd = json.loads((tmp_path / "single" / "info.json").read_text())["flops"]
    assert flops[0] == fwd > 0
    assert flops[1] == fwd_bwd
    # Without recomputation the sharded counts are the unsharded model's (gathers are no FLOPs).
    zero2 = json.loads((tmp_path / "zero2" / "info.json").read_text())
    assert zero2 == {
        "sharded_blocks": 2,
        "dtensor_params": True,
        "dtensor_trainable": True,
        "gradient_checkpointing": False,
        "compiled_blocks": 0,
        "flops": [fwd, fwd_bwd],
    }
    compiled = json.loads((tmp_path / "compiled" / "info.json").read_text())
    assert compiled["sharded_blocks"] == compiled["compiled_blocks"] == 2
    # Replicated: no block is a unit of its own, and only the adapter's parameters are sharded.
    replicated = json.loads((tmp_path / "replicated" / "info.json").read_text())
    assert (replicated["sharded_blocks"], replicated["dtensor_params"]) == (0, False)
    assert replicated["dtensor_trainable"] and replicated["flops"] == [fwd, fwd_bwd]
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_path)
    pipe.load_lora_weights(str(tmp_path / "fsdp" / "export"))
    w2 = torch.load(tmp_path / "fsdp" / "trained.pt")

    # Keys without the adapter's name ("default" in training, "default_0" once loaded).
    def plain(key: str) -> str:
        return re.sub(r"\.(lora_[AB])\.[^.]+\.", r".\1.", key.removeprefix("policy._transformer."))

    loaded = {plain(k): v for k, v in pipe.transformer.named_parameters() if "lora_" in k}
    assert sorted(loaded) == sorted(plain(k) for k in w2)
    for key, value in w2.items():
        assert torch.equal(loaded[plain(key)], value), key


def check_equal_single(
    single_out: Path, sharded_out: Path, lr: float, max_norm: float, steps: int, validated: bool = True
) -> None:
    """A sharded run's numbers against the single process's, within the fp32 arithmetic bounds below."""
    single, fsdp = rows(single_out), rows(sharded_out)
    assert sorted(single) == sorted(fsdp) == [0, 1]
    m1, m2 = metrics(single_out), metrics(sharded_out)
    for step in single:
        assert sorted(single[step]) == sorted(fsdp[step]) == list(range(8))
        r = torch.tensor([single[step][s][0] for s in range(8)], dtype=torch.float64)
        r2 = torch.tensor([fsdp[step][s][0] for s in range(8)], dtype=torch.float64)
        a = torch.tensor([single[step][s][1] for s in range(8)], dtype=torch.float64)
        a2 = torch.tensor([fsdp[step][s][1] for s in range(8)], dtype=torch.float64)
        # A reward is a mean over the image after 3 denoising steps and the VAE: allow 16 roundings.
        tol_r = 16 * EPS32 * float(r.abs().max())
        assert float((r - r2).abs().max()) <= tol_r
        # a = (r − mean) / std: an error δ in the rewards moves a by at most 2δ(1 + |a|) / std.
        tol_a = 2 * tol_r * (1 + float(a.abs().max())) / float(r.std(unbiased=False))
        assert float((a - a2).abs().max()) <= tol_a
        # The gradient is linear in the advantages (ratio 1 on-policy); its norm moves relatively by
        # at most the advantages' relative error.
        rel_g = tol_a * 8**0.5 / float(a.norm())
        assert m2[step]["actor/grad_norm"] == pytest.approx(m1[step]["actor/grad_norm"], rel=rel_g)
        assert m1[step]["actor/grad_norm"] > max_norm  # so clipping was active
    # Ratio and clip statistics of the first rollout: every ratio is computed with the initial weights
    # (one optimizer step per rollout), per sample, exactly as in one process.
    ratio_keys = [k for k in m1[0] if k.startswith(("actor/ratio", "actor/pg_clipfrac", "actor/clip_ratio"))]
    assert len(ratio_keys) >= 8
    for key in [*ratio_keys, "actor/on_policy_ratio_err"]:
        # ratios are exp(log p − log p_old) of equal per-sample numbers: a few roundings around 1.
        assert m2[0][key] == pytest.approx(m1[0][key], abs=8 * EPS32), key

    w1 = torch.load(single_out / "trained.pt")
    w2 = torch.load(sharded_out / "trained.pt")
    assert sorted(w1) == sorted(w2) and w1  # the adapter, or a full fine-tune's transformer
    # SGD with a clipped step: each update is lr·max_norm·g/|g|, so per step it moves by at most
    # 2·lr·max_norm·(relative gradient error).
    tol_w = steps * 2 * lr * max_norm * rel_g
    for key in w1:
        assert float((w1[key] - w2[key]).abs().max()) <= tol_w, key
    # The EMA is a convex combination of the weights after each step (within tol_w of each other), plus
    # two roundings of the weights' size per update.
    e1, e2 = torch.load(single_out / "ema.pt"), torch.load(sharded_out / "ema.pt")
    assert sorted(e1) == sorted(e2) == sorted(w1)
    for key in e1:
        tol_e = tol_w + steps * 2 * EPS32 * float(e1[key].abs().max())
        assert float((e1[key] - e2[key]).abs().max()) <= tol_e, key
    assert any(not torch.equal(e2[k], w2[k]) for k in w2)  # the EMA differs from the trained weights
    if not validated:
        return
    # Each validation ran on the EMA: its mean reward, of images made through the same arithmetic.
    val_key = "val-aux/reward/mean@1"
    val_steps = sorted(k for k in m1 if val_key in m1[k])
    assert len(val_steps) == steps and val_steps == sorted(k for k in m2 if val_key in m2[k])
    for step in val_steps:
        v = m1[step][val_key]
        assert m2[step][val_key] == pytest.approx(v, abs=16 * EPS32 * abs(v)), step


@pytest.mark.slow
def test_fsdp2_full_finetune_saves_resumes_and_exports(tiny_sd3_path, prompt_file, tmp_path):
    """A full fine-tune with the frozen reference copy (sharded too) and β > 0: a run resumed from its
    step-1 checkpoint ends with the uninterrupted run's weights and EMA, bit for bit; the checkpoint folder
    holds the trainable tensors only; the transformer exported in the run, and offline from the
    checkpoint by a single process, is the trained one. The resumed run keeps its reference copy in
    host memory (``reference.offload``, FSDP2's ``CPUOffloadPolicy``; on CPUs an exact copy from the
    CPU to the CPU, on GPUs to the device): its KL and weights are still the straight run's, bit for
    bit."""
    base = dict(
        pipeline=tiny_sd3_path, prompts=prompt_file, strategy="fsdp2", devices=2, lora=False, kl_coef=0.1
    )
    base.update(max_grad_norm=1.0, lr=0.05, max_steps=2)
    straight = tmp_path / "straight"
    straight_config = dict(base, out=str(straight), save_every=1, export=True, save_in_validation=True)
    finish(torchrun(straight_config, tmp_path, "straight"))
    ckpt = straight / "ckpt" / "epoch=0-step=1.ckpt"
    resumed = tmp_path / "resumed"
    resumed_config = dict(base, out=str(resumed), resume=str(ckpt), offload_reference=True, dtypes=True)
    finish(torchrun(resumed_config, tmp_path, "resumed"))
    assert json.loads((resumed / "info.json").read_text())["reference_offloaded"] is True

    a, b = torch.load(straight / "trained.pt"), torch.load(resumed / "trained.pt")
    assert sorted(a) == sorted(b) and all(k.startswith("policy._transformer.") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    ema_a, ema_b = torch.load(straight / "ema.pt"), torch.load(resumed / "ema.pt")
    assert sorted(ema_a) == sorted(a)
    for key in a:
        assert torch.equal(ema_a[key], ema_b[key]), key
    # The folder's metadata holds the EMA whole, keyed like the weights, for an offline export.
    from lit_flowgrpo.callbacks import TrainableEMA

    offline_ema = TrainableEMA.weights_from_checkpoint(straight / "ckpt" / "epoch=0-step=2.ckpt")
    for key in a:
        assert torch.equal(offline_ema[key], ema_a[key]), key
    # A checkpoint saved during validation, with the EMA swapped in, holds the training weights: those
    # of the checkpoint saved just before the validation, not the EMA.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    def weights(folder: Path) -> dict[str, torch.Tensor]:
        dcp_to_torch_save(folder, tmp_path / f"{folder.name}.pt")
        return torch.load(tmp_path / f"{folder.name}.pt")["state_dict"]

    before = weights(straight / "ckpt" / "epoch=0-step=1.ckpt")
    during = weights(straight / "ckpt" / "in_validation-step=1.ckpt")
    ema_during = TrainableEMA.weights_from_checkpoint(straight / "ckpt" / "in_validation-step=1.ckpt")
    assert sorted(before) == sorted(during) == sorted(a)
    for key in a:
        assert torch.equal(before[key], during[key]), key
    assert any(not torch.equal(during[k], ema_during[k]) for k in a)  # the EMA was swapped in then
    assert sorted(rows(resumed)) == [1]  # the resumed run drew step 1, not step 0 again
    assert rows(resumed)[1] == rows(straight)[1]
    assert metrics(resumed)[1]["actor/kl_loss"] == metrics(straight)[1]["actor/kl_loss"]
    assert metrics(straight)[1]["actor/kl_loss"] > 0  # the policy left its sharded frozen reference

    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    weights = {k.removeprefix("state_dict.") for k in saved if k.startswith("state_dict.")}
    assert weights and all(k.startswith("policy._transformer.") for k in weights)  # no encoder, no VAE

    from diffusers import SD3Transformer2DModel

    prefix = "policy._transformer."
    exported = SD3Transformer2DModel.from_pretrained(str(straight / "export")).state_dict()
    assert {k[len(prefix) :] for k in a} <= set(exported)  # every weight (and the buffers)
    for key, value in a.items():
        assert torch.equal(exported[key[len(prefix) :]], value), key

    # Offline, one process: the checkpoint folder read whole, then exported as the CLI does.
    module, _ = fsdp_worker.build(dict(base, out=str(tmp_path / "offline")))
    module.load_trainable_checkpoint(str(straight / "ckpt" / "epoch=0-step=2.ckpt"), use_ema=False)
    module.export(str(tmp_path / "offline_export"))
    offline = SD3Transformer2DModel.from_pretrained(str(tmp_path / "offline_export")).state_dict()
    for key, value in a.items():
        assert torch.equal(offline[key[len(prefix) :]], value), key


def _assert_same(a, b, where: str = "") -> None:
    """``a`` and ``b`` (nested dicts and lists of tensors and plain values) equal, tensors bit for bit."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)


# slow: four 2-process runs of DiffusionNFT, 2 + 2 + 4 + 2 rollouts (a few minutes on 2 shared cores).
@pytest.mark.slow
def test_fsdp2_resume_restores_every_stateful_part(tiny_sd3_path, prompt_file, tmp_path):
    """A 2-process fsdp2 run resumed from its step-2 checkpoint is the uninterrupted run, bit for bit:
    the rollouts, rewards, advantages and logged values of steps 2 and 3, the trained weights, and
    every part with state (DiffusionNFT's old policy, the moving KL reference and its refresh
    schedule, AdamW's moments, the decaying learning rate, GARDO's KL-gate controller, the trainable
    EMA, the module's counters, the data position).

    Two runs of each kind: a LoRA whose copies are stored adapter tensors (sharded like the adapter,
    over a replicated frozen base), checkpointed as a folder of per-rank shards, with GARDO's gated KL and a reference refreshed every
    2 optimizer steps (the checkpoint falls on a refresh, the resumed run refreshes again at step 4);
    and a full fine-tune whose copies are whole sharded transformers, checkpointed as one file gathered
    on rank 0 (``save_distributed_checkpoint=False``), with an EMA reference. The copies are not
    replicated: a copy saved as rank 0's shard alone would give rank 1 rank 0's values on resume."""
    base = dict(
        pipeline=tiny_sd3_path, prompts=prompt_file, devices=2, objective="nft", kl_coef=0.1,
        optimizer="adamw", lr=1e-3, lr_decay=0.8, max_grad_norm=1.0, parts=True,
    )  # fmt: skip
    runs = {
        # The frozen base replicated, the adapter sharded as one unit: what "auto" gives a small LoRA
        # run on GPUs (the blocks' sharding is the full fine-tune's, below).
        "lora": dict(
            base,
            strategy=dict(frozen_weights="replicate"),
            gardo=True,
            reference=dict(mode="refreshed", refresh_every=2),
        ),
        "full": dict(
            base,
            strategy=dict(save_distributed_checkpoint=False),
            lora=False,
            reference=dict(mode="ema", ema_decay=0.5),
            validate=False,
        ),
    }
    straight = {
        name: torchrun(dict(c, out=str(tmp_path / name), max_steps=4, save_every=1), tmp_path, name)
        for name, c in runs.items()
    }
    for proc in straight.values():
        finish(proc)
    resumed = {}
    for name, c in runs.items():
        ckpt = tmp_path / name / "ckpt" / "epoch=0-step=2.ckpt"
        assert ckpt.is_dir() == (name == "lora")  # a folder of shards, or one gathered file
        config = dict(c, out=str(tmp_path / f"{name}_resumed"), max_steps=4, resume=str(ckpt))
        resumed[name] = torchrun(config, tmp_path, f"{name}_resumed")
    for proc in resumed.values():
        finish(proc)

    for name in runs:
        a, b = tmp_path / name, tmp_path / f"{name}_resumed"
        assert sorted(rows(b)) == [2, 3]  # the resumed run drew steps 2 and 3, not 0 again
        for step in (2, 3):
            assert rows(b)[step] == rows(a)[step], (name, step)
            logged = {
                k: v for k, v in metrics(a)[step].items() if k.startswith(("actor/", "critic/", "val-"))
            }
            assert logged and {k: metrics(b)[step].get(k) for k in logged} == logged, (name, step)
        for file in ("trained.pt", "ema.pt", "parts.pt"):
            _assert_same(torch.load(a / file), torch.load(b / file), f"{name}/{file}")
        parts = torch.load(a / "parts.pt")
        assert parts["old_policy"] and parts["reference"]["tensors"] and parts["optimizer"]["state"]
        assert parts["global_step"] == 4 and parts["data"]["next_step"] == 4
    lora = metrics(tmp_path / "lora")
    assert [lora[s]["actor/reference_refreshes"] for s in range(4)] == [0, 1, 1, 2]
    assert lora[3]["actor/kl_loss"] > 0  # the copies are used: the policy left its reference


def one_process(config: dict, tmp: Path, name: str) -> None:
    """``fsdp_worker`` in a process of its own (the run opens a process group)."""
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, WORKER, str(path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]


# slow: two one-process fsdp2 runs of DiffusionNFT (about 30 s on 2 shared cores).
@pytest.mark.slow
def test_fsdp2_units_left_gathered_compute_with_the_copies_swapped_in(tiny_sd3_path, prompt_file, tmp_path):
    """DiffusionNFT's old policy and a moving (EMA) KL reference are swapped into the adapter's shards
    for their forwards. With ``reshard_after_forward=false`` a unit stays gathered after a forward
    without gradient, and its next forward uses the gathered weights: a swap written to the shards then
    went unseen (the old-policy forward computed with the trained weights, the next trained forward with
    the old policy's). On one rank the gather is a copy, so both modes compute the same numbers: the
    trained weights, the old policy and the reference after 3 rollouts are bit-equal."""
    base = dict(
        pipeline=tiny_sd3_path, prompts=prompt_file, devices=1, objective="nft", kl_coef=0.1,
        reference=dict(mode="ema", ema_decay=0.5), max_steps=3, validate=False, ema=False, parts=True,
    )  # fmt: skip
    for name, strategy in (("resharded", {}), ("gathered", {"reshard_after_forward": False})):
        one_process(dict(base, out=str(tmp_path / name), strategy=strategy), tmp_path, name)
    a, b = tmp_path / "resharded", tmp_path / "gathered"
    _assert_same(torch.load(a / "trained.pt"), torch.load(b / "trained.pt"), "trained")
    parts_a, parts_b = torch.load(a / "parts.pt"), torch.load(b / "parts.pt")
    for part in ("old_policy", "reference"):
        _assert_same(parts_a[part], parts_b[part], part)
    assert metrics(a)[2]["actor/kl_loss"] > 0  # the copies moved away from the trained weights


# slow: a sharded run and a single-process run of a bf16 full fine-tune (about a minute on 2 cores).
@pytest.mark.slow
def test_fsdp2_float32_masters_equal_single_process(tiny_sd3_path, prompt_file, tmp_path):
    """A full fine-tune of the bf16 tiny SD3 with float32 master weights and a frozen reference (β > 0):
    sharded on two ranks (float32 shards, blocks gathered in bf16, gradients reduced in float32) it
    ends with the single process's weights within the float32 bounds of :func:`check_equal_single`
    (the offloaded reference is checked by the save/resume test above).

    Why float32 bounds hold over bf16 compute: with one sample per micro-batch every forward and
    backward of a rank is the single process's (the same rows, the same shapes; the rollout chunks are
    the ranks' batches), bf16 gathered weights are the masters rounded to bf16 as autocast rounds them,
    and the tiny SD3 has no parameter outside a matrix product (no RMSNorm scale); what differs is the
    order of the float32 sums of the per-sample gradients. Validation is left out: one process
    validates two prompts in one batch, the ranks one each, and bf16 matrix products may round a row
    differently with the batch's size.
    """
    lr, max_norm, steps = 0.1, 1e-3, 2
    base = dict(
        pipeline=tiny_sd3_path, prompts=prompt_file, lora=False, dtype="bfloat16", kl_coef=0.1,
        micro_batch_size=1, max_grad_norm=max_norm, lr=lr, max_steps=steps, validate=False,
    )  # fmt: skip
    sharded = dict(base, strategy="fsdp2", devices=2, dtypes=True)
    proc = torchrun(dict(sharded, out=str(tmp_path / "fsdp")), tmp_path, "fsdp")
    fsdp_worker.run(dict(base, out=str(tmp_path / "single")))
    finish(proc)
    check_equal_single(
        tmp_path / "single", tmp_path / "fsdp", lr=lr, max_norm=max_norm, steps=steps, validated=False
    )
    single = torch.load(tmp_path / "single" / "trained.pt")
    assert {v.dtype for v in single.values()} == {torch.float32}
    # The masters kept what bf16 weights would have rounded away (SGD's clipped steps are ~1e-5).
    assert any(not torch.equal(v, v.bfloat16().float()) for v in single.values())
    info = json.loads((tmp_path / "fsdp" / "info.json").read_text())
    assert info["param_dtypes"] == ["torch.float32"]
    assert info["gather_dtype"] == "torch.bfloat16" and info["root_gather_dtype"] == "None"
    assert info["reference_dtypes"] == ["torch.bfloat16"] and info["reference_offloaded"] is False
    assert info["reference_gather_dtype"] == "torch.bfloat16"  # its blocks gather as the masters' do
    # The first update's KL, at the initial weights, where the reference computes what the masters do.
    assert metrics(tmp_path / "fsdp")[0]["actor/kl_loss"] == 0.0
    assert metrics(tmp_path / "fsdp")[1]["actor/kl_loss"] > 0  # the policy left its reference


# --------------------------------------------------------------------------------------------------
# Settings the strategy or the module cannot honour fail before any weight is read.
# --------------------------------------------------------------------------------------------------


def _module(path: str) -> FlowGRPOModule:
    return FlowGRPOModule(
        policy=SD3Policy(path, dtype="float32"),
        reward=fsdp_worker.brightness,
        weights=WeightsSettings(lora=LoraSettings(rank=2)),
    )


def _setup_under(module: FlowGRPOModule, strategy, data, world_size: int = 2) -> None:
    # Lightning refuses FSDP1 and DeepSpeed on a CPU before any hook runs, so the hook is called with
    # a stand-in trainer that has the strategy.
    module._trainer = SimpleNamespace(strategy=strategy, world_size=world_size, datamodule=data)
    module.setup("fit")


@pytest.mark.parametrize(
    ("strategy", "message"),
    [
        ("fsdp", r"--trainer.strategy=fsdp \(Lightning's FSDPStrategy.*use --trainer.strategy=fsdp2"),
        ("deepspeed", r"--trainer.strategy=deepspeed is not supported.*--trainer.strategy=fsdp2"),
        ("model_parallel", r"applies no tensor parallelism; use --trainer.strategy=fsdp2"),
    ],
)
def test_unsupported_strategies_fail_in_setup_naming_fsdp2(tiny_sd3_path, prompt_file, strategy, message):
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    instance = {
        "fsdp": FSDPStrategy,
        "deepspeed": lambda: DeepSpeedStrategy.__new__(DeepSpeedStrategy),  # needs no deepspeed install
        "model_parallel": ModelParallelStrategy,
    }[strategy]()
    instance.strategy_name = getattr(instance, "strategy_name", strategy)
    module = _module(tiny_sd3_path)
    with pytest.raises(ValueError, match=message):
        _setup_under(module, instance, PromptDataModule(train=prompt_file, prompts_per_step=2, group_size=4))
    assert module.policy.pipe is None  # nothing was loaded


def test_fsdp2_needs_validation_evenly_split(tiny_sd3_path, prompt_file):
    def data(prompts_per_step: int) -> PromptDataModule:
        return PromptDataModule(
            train=prompt_file,
            val=prompt_file,
            prompts_per_step=prompts_per_step,
            group_size=4,
            max_val_prompts=3,
        )

    with pytest.raises(
        ValueError,
        match=r"--data.init_args.val prompts × --data.init_args.val_seeds \(3\) must be a multiple of",
    ):
        _setup_under(_module(tiny_sd3_path), FSDP2Strategy(), data(2), world_size=2)
    _setup_under(_module(tiny_sd3_path), FSDP2Strategy(), data(3), world_size=3)  # 3 on 3 ranks: fine


def test_cpu_offload_needs_gpus(tiny_sd3_path, prompt_file):
    import lightning as L

    module = _module(tiny_sd3_path)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=FSDP2Strategy(cpu_offload=True), logger=False)
    with pytest.raises(ValueError, match=r"--trainer.strategy.cpu_offload=true needs GPUs"):
        trainer.fit(module, datamodule=PromptDataModule(train=prompt_file, prompts_per_step=2, group_size=4))
    assert module.policy.pipe is None


def test_the_strategy_refuses_a_setting_it_does_not_own():
    """Activation checkpointing has one flag, the performance settings' (any strategy honours it)."""
    with pytest.raises(
        SettingsError,
        match=r"--trainer\.strategy\.activation_checkpointing is no longer a setting of the strategy: use "
        r"--model\.init_args\.performance\.activation_checkpointing=true",
    ):
        FSDP2Strategy(activation_checkpointing=True)
    with pytest.raises(
        SettingsError, match=r"frozen_weights=replicate .*cpu_offload=true .*memory: choose one"
    ):
        FSDP2Strategy(frozen_weights="replicate", cpu_offload=True)
    with pytest.raises(SettingsError, match=r"frozen_weights \('all'\) must be auto, shard or replicate"):
        FSDP2Strategy(frozen_weights="all")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Linear has no nn.ModuleList of blocks"):
        FSDP2Strategy().shard(nn.Linear(2, 2))


def test_a_small_frozen_base_is_replicated_on_gpus_only(monkeypatch):
    """``frozen_weights="auto"``: the frozen base of the trained networks stays whole on every rank when
    it takes at most a quarter of a GPU's memory; on CPUs, with cpu_offload, or with nothing frozen (a
    full fine-tune), the blocks are sharded."""
    lora = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 2))  # 263 KB frozen, a small trained head
    lora[0].requires_grad_(False)
    full = nn.Linear(256, 256)

    def strategy(device: str, memory: int = 0, **settings) -> FSDP2Strategy:
        s = FSDP2Strategy(**settings)
        s.parallel_devices = [torch.device(device)]
        # The GPU's memory is the one number read from the hardware here.
        monkeypatch.setattr(
            torch.cuda, "get_device_properties", lambda _: SimpleNamespace(total_memory=memory)
        )
        return s

    frozen = 256 * 257 * 4
    assert strategy("cuda", 4 * frozen).replicates_frozen([lora])
    assert not strategy("cuda", 4 * frozen - 1).replicates_frozen([lora])
    assert not strategy("cuda", 4 * frozen, cpu_offload=True).replicates_frozen([lora])
    assert not strategy("cpu").replicates_frozen([lora])
    assert strategy("cpu", frozen_weights="replicate").replicates_frozen([lora])
    assert not strategy("cuda", 10**12, frozen_weights="shard").replicates_frozen([lora])
    assert not strategy("cuda", 10**12).replicates_frozen([full])
    assert not strategy("cpu", frozen_weights="replicate").replicates_frozen([full])


def test_transformer_blocks_of_every_family():
    from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel, SD3Transformer2DModel

    sd3 = SD3Transformer2DModel(
        sample_size=8, patch_size=1, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8, out_channels=4,
        pos_embed_max_size=8,
    )  # fmt: skip
    flux = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4),
    )  # fmt: skip
    qwen = QwenImageTransformer2DModel(
        patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, axes_dims_rope=(2, 2, 4),
    )  # fmt: skip
    assert transformer_blocks(sd3) == list(sd3.transformer_blocks)
    assert transformer_blocks(flux) == [*flux.transformer_blocks, *flux.single_transformer_blocks]
    assert transformer_blocks(qwen) == list(qwen.transformer_blocks)


def test_fp8_base_is_refused_under_fsdp2_before_any_weight_loads(tiny_sd3_path, prompt_file):
    from lit_flowgrpo.performance import PerformanceSettings

    module = FlowGRPOModule(
        policy=SD3Policy(tiny_sd3_path, dtype="float32"),
        reward=fsdp_worker.brightness,
        weights=WeightsSettings(lora=LoraSettings(rank=2)),
        performance=PerformanceSettings(fp8_base_matmuls=True),
    )
    data = PromptDataModule(train=prompt_file, prompts_per_step=2, group_size=4)
    with pytest.raises(ValueError, match=r"--model\.init_args\.performance\.fp8_base_matmuls .*use ddp"):
        _setup_under(module, FSDP2Strategy(), data)
    assert module.policy.pipe is None
