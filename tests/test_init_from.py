"""Starting the trained weights from a previous run's export (``weights.init_from``): a LoRA adapter or a
transformer folder is read in bit for bit before the copies are made, the KL reference is the weights it
starts from (``init_reference: init``) or the base (``base``), and a folder that is missing or does not
fit is refused naming the flag. The slow test: SFT on the tiny SD3, its export, Flow-GRPO from it."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from test_datasets_images import write_images
from test_module import make_data, make_module, make_trainer

from lit_flowgrpo.data_objective import SFT
from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.image_data import ImageDataModule
from lit_flowgrpo.policies import SD3Policy
from lit_flowgrpo.weights import LORA_WEIGHTS_FILE, LoraSettings, TrainableWeights, WeightsSettings

FLAG = "--model.init_args.weights.init_from"
LORA = LoraSettings(rank=4, alpha=8)


def _policy(path: str) -> SD3Policy:
    policy = SD3Policy(path, dtype="float32", max_sequence_length=16)
    policy.load()
    return policy


def _adapter(policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.transformer.named_parameters() if "lora_" in n}


@pytest.fixture(scope="module")
def lora_export(tiny_sd3_path, tmp_path_factory) -> str:
    """An adapter whose A and B are both random (B is 0 at initialisation, which would hide a mix-up)."""
    policy = _policy(tiny_sd3_path)
    weights = TrainableWeights(WeightsSettings(lora=LORA))
    weights.attach(policy)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in sorted(policy.transformer.named_parameters()):
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    out = str(tmp_path_factory.mktemp("export") / "lora")
    weights.export(policy, out)
    return out


@pytest.fixture(scope="module")
def full_export(tiny_sd3_path, tmp_path_factory) -> str:
    policy = _policy(tiny_sd3_path)
    weights = TrainableWeights(WeightsSettings(lora=None))
    weights.attach(policy)
    with torch.no_grad():
        for p in policy.transformer.parameters():
            p.add_(0.01)
    out = str(tmp_path_factory.mktemp("export") / "full")
    weights.export(policy, out)
    return out


def test_bad_folders_are_refused_before_weights_load(tiny_sd3_path, lora_export, full_export, tmp_path):
    cases = [
        (WeightsSettings(lora=LORA, init_from=str(tmp_path / "nowhere")), "is not a folder"),
        (WeightsSettings(lora=LORA, init_from=full_export), "set --model.init_args.weights.lora=null"),
        (WeightsSettings(lora=None, init_from=lora_export), "holds a LoRA adapter, not a transformer folder"),
        (WeightsSettings(lora=None, init_from=str(tmp_path)), "holds no config.json and safetensors"),
    ]
    for settings, fragment in cases:
        with pytest.raises(SettingsError) as err:
            make_module(tiny_sd3_path, weights=settings, reference_copy=True)
        assert FLAG in str(err.value) and fragment in str(err.value), str(err.value)


def test_an_adapter_of_other_settings_is_refused_before_its_tensors(tiny_sd3_path, lora_export):
    weights = TrainableWeights(WeightsSettings(lora=LoraSettings(rank=2, alpha=8), init_from=lora_export))
    policy = _policy(tiny_sd3_path)
    with pytest.raises(SettingsError, match=r"is an adapter of r 4 \(this run: 2\)"):
        weights.attach(policy)
    assert not _adapter(policy)  # refused before any adapter was added


@pytest.mark.parametrize("reference", ["init", "base"])
def test_lora_starts_bit_for_bit_from_the_export(tiny_sd3_path, lora_export, reference):
    policy = _policy(tiny_sd3_path)
    weights = TrainableWeights(WeightsSettings(lora=LORA, init_from=lora_export, init_reference=reference))
    weights.attach(policy)
    saved = {
        k.removeprefix("transformer."): v for k, v in load_file(f"{lora_export}/{LORA_WEIGHTS_FILE}").items()
    }
    adapter = _adapter(policy)
    assert len(adapter) == len(saved)
    for name, value in adapter.items():
        assert torch.equal(value, saved[name.replace(".default.", ".")]), name
    # Move θ away, then compute with the reference: the export's adapter (init) or none (base).
    with torch.no_grad():
        for p in policy.transformer.parameters():
            if p.requires_grad:
                p.add_(1.0)
    x, sigma = torch.randn(1, *policy.latent_shape(32, 32)), torch.full((1,), 0.5)
    embeds = policy.encode_prompts(["a cat"])
    with weights.copies.reference():
        ref = policy.velocity(x, sigma, embeds, 1.0)
        inside = _adapter(policy)
    if reference == "init":
        assert all(torch.equal(inside[n], adapter[n]) for n in adapter)
        want = ref  # the adapter as loaded, recomputed below from a fresh run
        fresh = _policy(tiny_sd3_path)
        TrainableWeights(WeightsSettings(lora=LORA, init_from=lora_export)).attach(fresh)
        assert torch.equal(fresh.velocity(x, sigma, embeds, 1.0), want)
    else:
        base = _policy(tiny_sd3_path)
        assert torch.equal(base.velocity(x, sigma, embeds, 1.0), ref)
    # The stored reference is saved in checkpoints (a resumed run must not take it from θ again).
    assert bool(weights.copies.kl_reference.state_dict()) == (reference == "init")


@pytest.mark.parametrize("reference", ["init", "base"])
def test_a_full_fine_tune_starts_from_a_transformer_folder(tiny_sd3_path, full_export, reference):
    policy, base = _policy(tiny_sd3_path), _policy(tiny_sd3_path)
    from lit_flowgrpo.kl import ReferenceSettings

    weights = TrainableWeights(
        WeightsSettings(lora=None, init_from=full_export, init_reference=reference),
        reference=ReferenceSettings(copy=True),
    )
    weights.attach(policy)
    saved = load_file(f"{full_export}/diffusion_pytorch_model.safetensors")
    params = dict(policy.transformer.named_parameters())
    assert params and all(torch.equal(params[n], saved[n]) for n in params)
    copy = dict(weights.copies.kl_reference.network.named_parameters())
    want = saved if reference == "init" else dict(base.transformer.named_parameters())
    assert all(torch.equal(copy[n], want[n]) for n in copy)


class _FirstRollout(L.Callback):
    """The trained adapter as the first rollout samples with it."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.adapter = _adapter(pl_module.policy)


@pytest.mark.slow
def test_sft_then_flow_grpo_from_its_export(tiny_sd3_path, prompt_file, tmp_path):
    index = write_images(tmp_path / "data", 4, size=32)
    sft = make_module(
        tiny_sd3_path, objective=SFT(), kl_coef=0.0, guidance_scale=1.0, optimizer_steps_per_rollout=1
    )
    data = ImageDataModule(train=index, prompts_per_step=4, height=32, width=32, seed=0)
    make_trainer(tmp_path / "sft", max_steps=2, logger=False).fit(sft, datamodule=data)
    export = str(tmp_path / "sft_export")
    sft.export(export)
    saved = {k.removeprefix("transformer."): v for k, v in load_file(f"{export}/{LORA_WEIGHTS_FILE}").items()}
    assert any(v.abs().max() > 0 for k, v in saved.items() if "lora_B" in k)  # SFT moved the adapter

    grpo = make_module(tiny_sd3_path, weights=WeightsSettings(lora=LORA, init_from=export), reference_kl=True)
    first = _FirstRollout()
    make_trainer(tmp_path / "grpo", max_steps=2, logger=False, callbacks=[first]).fit(
        grpo, datamodule=make_data(prompt_file)
    )
    assert len(first.adapter) == len(saved)
    assert all(torch.equal(v, saved[n.replace(".default.", ".")]) for n, v in first.adapter.items())
    # The reference is the SFT model: the export's adapter, still, after the RL updates moved θ.
    reference = grpo.copies.kl_reference.tensors()
    assert all(torch.equal(v, saved[n.replace(".default.", ".")]) for n, v in reference.items())
    moved = _adapter(grpo.policy)
    assert any(not torch.equal(moved[n], first.adapter[n]) for n in moved)


@pytest.mark.slow
def test_the_shapes_world_recipe_pair_through_the_cli(tmp_path, monkeypatch):
    """configs/quickstart_sft.yaml one step, `lit-flowgrpo export`, then configs/quickstart_sft_then_grpo.yaml
    reads that export (its relative init_from, from the folder the commands run in) and takes a rollout."""
    from lit_flowgrpo.cli import FlowGRPOCLI
    from lit_flowgrpo.toy.make_image_data import write_image_data

    monkeypatch.chdir(tmp_path)
    write_image_data("runs/shapes_data", count=8, seed=0)
    short = ["--trainer.max_steps=1", "--trainer.num_sanity_val_steps=0", "--trainer.limit_val_batches=0"]
    short += ["--trainer.logger=false", "--model.init_args.sampler.num_steps=4"]
    short += [
        "--model.init_args.sampler.sde_window_range=[0,3]",
        "--model.init_args.sampler.sde_window_size=2",
    ]
    FlowGRPOCLI(args=["fit", "--config", "quickstart_sft", *short[:4], "--data.init_args.prompts_per_step=4"])
    export = "runs/quickstart_sft_export"
    FlowGRPOCLI(
        args=[
            "export",
            "--config",
            "quickstart_sft",
            "--ckpt_path",
            "runs/quickstart_sft/checkpoints/last.ckpt",
            "--out",
            export,
        ]
    )
    saved = load_file(f"{export}/diffusion_pytorch_model.safetensors")
    cli = FlowGRPOCLI(
        args=[
            *("fit", "--config", "quickstart_sft_then_grpo", *short),
            *(
                "--data.init_args.prompts_per_step=2",
                "--data.init_args.group_size=4",
                "--data.init_args.val=null",
            ),
            "--trainer.callbacks+=test_init_from.FirstUNet",
        ]
    )
    (first,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "FirstUNet"]
    assert cli.trainer.global_step == 1
    assert first.unet and all(torch.equal(v, saved[n]) for n, v in first.unet.items())
    from lit_flowgrpo.toy import ToyPolicy

    base = ToyPolicy()
    base.load()
    assert any(not torch.equal(p, saved[n]) for n, p in base.unet.named_parameters())  # SFT moved it


class FirstUNet(L.Callback):
    """The trained U-Net as the first rollout samples with it."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.unet = {n: p.detach().clone() for n, p in pl_module.policy.transformer.named_parameters()}
