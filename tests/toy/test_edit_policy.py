"""The toy editing policy: the source reaches the U-Net (a source changes the output), guidance keeps
each sample's source, and bad input (text-only records, a source of another size, a checkpoint of
another kind) is refused before the weights load, naming the flag. A tiny editing model is built in
code, saved and loaded back through the policy's own loader."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image

from lit_flowgrpo import FlowGRPOModule, PromptDataModule, Sampler, UpdateSettings, WeightsSettings
from lit_flowgrpo.conditioning import Condition
from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.policies.base import HEIGHT_FLAG
from lit_flowgrpo.toy import ToyEditPolicy, edit_world, world
from lit_flowgrpo.toy.edit_model import build_edit_models, load_edit_checkpoint, save_edit_checkpoint
from lit_flowgrpo.toy.model import ToyModelConfig, default_checkpoint

TINY = ToyModelConfig(
    block_out_channels=(8, 16), attention_heads=2, norm_num_groups=4, text_dim=16, text_layers=1, text_heads=2
)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> str:
    torch.manual_seed(0)
    unet, text_encoder = build_edit_models(TINY)
    path = tmp_path_factory.mktemp("edit") / "tiny_edit.safetensors"
    save_edit_checkpoint(str(path), unet, text_encoder, dtype=torch.float32)
    return str(path)


def _policy(path: str) -> ToyEditPolicy:
    policy = ToyEditPolicy(pretrained=path)
    policy.load()
    return policy


def _source(seed: int) -> Condition:
    scene = edit_world.sample_source(np.random.default_rng(seed))
    image = torch.from_numpy(world.render(scene)).permute(2, 0, 1).float() / 255
    return Condition([image], f"source-{seed}")


def test_the_checkpoint_round_trips_with_its_source_channels(tiny_checkpoint):
    unet, _, metadata = load_edit_checkpoint(tiny_checkpoint)
    assert unet.config.in_channels == 3 + 3 + 2  # noisy image, source, x/y coordinates
    assert metadata["format"] == "lit_flowgrpo.toy_edit_base/1"


def test_a_source_changes_the_velocity_and_guidance_keeps_each_samples_source(tiny_checkpoint):
    policy = _policy(tiny_checkpoint)
    a, b = _source(1), _source(2)
    embeds = policy.encode(["remove the square"] * 2, [a, b], 32, 32)
    assert embeds["source"].shape == (2, 3, 32, 32)
    assert torch.equal(embeds["source"][0], a.images[0] * 2 - 1)
    latents = torch.randn(1, 3, 32, 32).expand(2, -1, -1, -1)
    sigma = torch.full((2,), 0.6)
    v = policy.velocity(latents, sigma, embeds, 1.0)
    assert not torch.allclose(v[0], v[1])  # same noise and instruction, another source
    # Guidance on the instruction: the unconditional half is the empty instruction with the same source.
    uncond = policy.encode(["", ""], [a, b], 32, 32)
    expected = policy.velocity(latents, sigma, uncond, 1.0) + 2.5 * (
        v - policy.velocity(latents, sigma, uncond, 1.0)
    )
    torch.testing.assert_close(policy.velocity(latents, sigma, embeds, 2.5), expected, rtol=0, atol=1e-5)
    # The text-only entry point is refused: this family needs a source.
    with pytest.raises(ValueError, match="needs source images"):
        policy.encode(["remove the square"])


def test_the_sampler_draws_another_image_from_another_source(tiny_checkpoint):
    policy = _policy(tiny_checkpoint)
    sampler = Sampler(eval_num_steps=2, guidance_scale=1.0, height=32, width=32)
    images = sampler.evaluate(
        policy, ["remove the square"] * 2, torch.tensor([5, 5]), [_source(1), _source(2)]
    )
    assert images.shape == (2, 3, 32, 32) and not torch.equal(images[0], images[1])


def _jsonl(tmp_path: Path, name: str, size: int = 32) -> Path:
    scene = edit_world.sample_source(np.random.default_rng(4))
    Image.fromarray(np.asarray(Image.fromarray(world.render(scene)).resize((size, size)))).save(
        tmp_path / f"{name}.png"
    )
    lines = []
    for edit in edit_world.possible_edits(scene)["recolor"][:2]:
        lines.append(json.dumps(edit_world.make_edit_record(scene, edit, f"{name}.png")))
    path = tmp_path / f"{name}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _refusal(tmp_path: Path, path: str, train: Path) -> str:
    policy = ToyEditPolicy(pretrained=path)
    module = FlowGRPOModule(
        policy=policy,
        reward={"shapes_edit": 1.0},
        sampler=Sampler(num_steps=2, eval_num_steps=2, guidance_scale=1.0, height=32, width=32),
        update=UpdateSettings(micro_batch_size=2),
        weights=WeightsSettings(lora=None),
    )
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False)
    with pytest.raises(SettingsError) as err:
        trainer.fit(module, datamodule=PromptDataModule(train=str(train), prompts_per_step=2, group_size=2))
    assert policy.unet is None  # refused before the weights were read
    return str(err.value)


def test_text_only_records_are_refused_before_load_naming_the_flag(tiny_checkpoint, tmp_path):
    # Editing records without their "condition_images": the instruction alone cannot be edited.
    scene = edit_world.sample_source(np.random.default_rng(7))
    text = tmp_path / "prompts.jsonl"
    lines = [json.dumps(edit_world.make_edit_record(scene, {"kind": "remove", "index": i})) for i in range(2)]
    text.write_text("\n".join(lines) + "\n")
    msg = _refusal(tmp_path, tiny_checkpoint, text)
    assert "--data.init_args.train" in msg and "gives 0 condition_images" in msg and "source image" in msg


def test_a_source_of_another_size_is_refused_before_load_naming_the_flag(tiny_checkpoint, tmp_path):
    msg = _refusal(tmp_path, tiny_checkpoint, _jsonl(tmp_path, "big", size=64))
    assert "64x64" in msg and HEIGHT_FLAG in msg and "--data.init_args.train" in msg


def test_a_text_to_image_checkpoint_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"toy_edit_pretrain\.yaml"):
        ToyEditPolicy(pretrained=default_checkpoint()).load()
