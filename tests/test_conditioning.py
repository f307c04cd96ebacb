"""The conditioning seam: records with images, their checks before load, and the path of a sample's
conditioning through encode -> rollout -> reward -> update -> validation.

The conditioned policy here is the toy policy with one change, written in the test: ``encode_conditioned``
adds each sample's source image (resized to the output) to its Embeds, and ``velocity`` adds a small
multiple of it. That is enough to show the seam carries each sample's own source to every place that
needs it (the families' own conditioning is tested with each family).
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from PIL import Image

from lit_flowgrpo import FlowGRPOModule, PromptDataModule, Sampler, UpdateSettings, WeightsSettings
from lit_flowgrpo.callbacks import SampleImageLogger
from lit_flowgrpo.callbacks.images import beside_sources
from lit_flowgrpo.conditioning import CONDITION_KEY, Condition, read_rgb
from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.policies.base import cat_embeds
from lit_flowgrpo.rewards import MultiReward
from lit_flowgrpo.toy import ToyPolicy


class SourceToyPolicy(ToyPolicy):
    """The toy policy conditioned on one or two source images: their mean, resized to the output."""

    condition_images = (1, 2)
    condition_name = "source image"
    encoded: list[str]

    def __init__(self) -> None:
        super().__init__()
        self.encoded = []  # the condition keys encoded, in order (what the test reads)

    def condition_size_problems(self, width: int, height: int, out_height: int, out_width: int) -> list[str]:
        if width < 8 or height < 8:
            return [f"{width}x{height} is smaller than 8x8"]
        return []

    def encode_conditioned(self, prompts, conditions, height, width, frames=1):
        rows = []
        for c in conditions:
            self.encoded.append(c.key)
            mean = torch.stack(
                [F.interpolate(i[None], size=(height, width), mode="area")[0] for i in c.images]
            )
            rows.append({"source": mean.mean(0, keepdim=True)})
        return {**self.encode_prompts(prompts), **cat_embeds(rows)}

    def velocity(self, latents, sigma, embeds, guidance_scale):
        text = {k: v for k, v in embeds.items() if k != "source"}
        v = super().velocity(latents, sigma, text, guidance_scale)
        return v + 0.5 * (embeds["source"].to(v) * 2 - 1)


def _png(path: Path, color: tuple[int, int, int], size: tuple[int, int] = (32, 32)) -> str:
    Image.fromarray(np.full((size[1], size[0], 3), color, dtype=np.uint8)).save(path)
    return path.name


def _records(tmp_path: Path, name: str, n: int, *, images: int = 1, size=(32, 32)) -> Path:
    """``n`` records of shapes-world prompts, each with ``images`` sources of its own colour."""
    prompts = ["a red circle", "a blue square", "two green triangles", "a yellow circle"]
    lines = []
    for i in range(n):
        files = [
            _png(tmp_path / f"{name}_{i}_{j}.png", (40 * i, 200 - 30 * j, 90), size) for j in range(images)
        ]
        lines.append(json.dumps({"prompt": prompts[i % 4], CONDITION_KEY: files, "tag": "single_object"}))
    path = tmp_path / f"{name}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


class SourceBrightness:
    """A reward that sees the source: minus the mean |result − source|, and a record of what it was given."""

    uses_sources = True

    def __init__(self) -> None:
        self.seen: list[list[torch.Tensor]] = []

    def __call__(self, images, prompts, metadata, sources):
        self.seen.extend([[s.cpu() for s in row] for row in sources])
        out = []
        for image, row in zip(images, sources, strict=True):
            src = F.interpolate(row[0][None].to(image), size=image.shape[-2:], mode="area")[0]
            out.append(-(image - src).abs().mean())
        return torch.stack(out)


def _module(policy, reward, **sampler) -> FlowGRPOModule:
    return FlowGRPOModule(
        policy=policy,
        reward=reward,
        sampler=Sampler(
            **{**dict(num_steps=3, eval_num_steps=2, guidance_scale=1.0, height=32, width=32), **sampler}
        ),
        update=UpdateSettings(micro_batch_size=4),
        weights=WeightsSettings(lora=None),
    )


def _fit(module, dm, tmp_path, steps=1):
    trainer = L.Trainer(
        callbacks=[SampleImageLogger(every_n_steps=1, max_images=4)],
        max_steps=steps,
        accelerator="cpu",
        logger=CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        val_check_interval=1,
    )
    trainer.fit(module, datamodule=dm)
    return trainer


# ------------------------------------------------------------------------------------------------
# Records and batches
# ------------------------------------------------------------------------------------------------


def test_records_resolve_relative_paths_and_batches_carry_each_records_sources(tmp_path):
    train = _records(tmp_path, "train", 4)
    dm = PromptDataModule(train=str(train), val=str(train), prompts_per_step=2, group_size=3)
    assert all(Path(r[CONDITION_KEY][0]).is_absolute() for r in dm.train_records)
    assert set(dm.condition_sizes.values()) == {(32, 32)}
    batch = next(iter(dm.train_stream(_sampler(dm), 0)))
    assert batch.conditions is not None and len(batch.conditions) == len(batch) == 6
    for prompt, meta, cond, group in zip(
        batch.prompts, batch.metadata, batch.conditions, batch.group_ids.tolist(), strict=True
    ):
        record = next(r for r in dm.train_records if r[CONDITION_KEY][0] == cond.key)
        assert record["prompt"] == prompt and CONDITION_KEY not in meta  # the paths travel apart
        assert torch.equal(cond.images[0], read_rgb(cond.key))
        # a group is a record: every sample of it carries the same sources
        same = [c.key for c, g in zip(batch.conditions, batch.group_ids.tolist(), strict=True) if g == group]
        assert set(same) == {cond.key}


def _sampler(dm):
    from lit_flowgrpo.data import GroupSampler

    return GroupSampler(len(dm.train_records), dm.prompts_per_step, dm.group_size, 1, 0, dm.seed)


def test_text_only_records_have_no_conditions(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("a red circle\na blue square\n")
    dm = PromptDataModule(train=str(path), prompts_per_step=2, group_size=2)
    assert dm.condition_sizes == {} and dm.condition_images is None
    assert next(iter(dm.train_stream(_sampler(dm), 0))).conditions is None


@pytest.mark.parametrize(
    "lines, message",
    [
        ([{"prompt": "a", CONDITION_KEY: "missing.png"}], "missing.png does not exist"),
        ([{"prompt": "a", CONDITION_KEY: 3}], "must be an image path or a non-empty list"),
        ([{"prompt": "a", CONDITION_KEY: []}], "must be an image path or a non-empty list"),
        ([{"prompt": "a", CONDITION_KEY: "bad.png"}], "bad.png cannot be read"),
        ([{"prompt": "a", CONDITION_KEY: "ok.png"}, {"prompt": "b"}], "record 2 has no condition_images"),
    ],
)
def test_bad_condition_records_are_refused_naming_the_file_record_and_flag(tmp_path, lines, message):
    _png(tmp_path / "ok.png", (1, 2, 3))
    (tmp_path / "bad.png").write_bytes(b"not an image")
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines))
    with pytest.raises(SettingsError, match=message) as err:
        PromptDataModule(train=str(path), prompts_per_step=1, group_size=2)
    assert "--data.init_args.train" in str(err.value) and str(path) in str(err.value)


# ------------------------------------------------------------------------------------------------
# The checks before load
# ------------------------------------------------------------------------------------------------


def _setup_problems(tmp_path, policy, reward, train) -> str:
    dm = PromptDataModule(train=str(train), prompts_per_step=2, group_size=2)
    module = _module(policy, reward)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False)
    with pytest.raises(SettingsError) as err:
        trainer.fit(module, datamodule=dm)
    assert policy.unet is None  # refused before the weights were read
    return str(err.value)


def test_a_text_only_policy_refuses_conditioned_records_before_load(tmp_path):
    msg = _setup_problems(tmp_path, ToyPolicy(), {"shapes": 1.0}, _records(tmp_path, "t", 2))
    assert "--data.init_args.train" in msg and "ToyPolicy is a text-only policy" in msg


def test_a_conditioned_policy_refuses_text_only_records_too_many_images_and_small_ones(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("a red circle\na blue square\n")
    msg = _setup_problems(tmp_path, SourceToyPolicy(), {"shapes": 1.0}, text)
    assert "gives 0 condition_images" in msg and "takes 1 to 2 source image(s)" in msg
    msg = _setup_problems(
        tmp_path, SourceToyPolicy(), {"shapes": 1.0}, _records(tmp_path, "three", 2, images=3)
    )
    assert "gives 3 condition_images" in msg
    msg = _setup_problems(
        tmp_path, SourceToyPolicy(), {"shapes": 1.0}, _records(tmp_path, "s", 2, size=(4, 4))
    )
    assert "4x4 is smaller than 8x8" in msg and "source image" in msg


def test_a_family_that_batches_source_tokens_refuses_records_whose_counts_differ(tmp_path):
    class Agreeing(SourceToyPolicy):
        condition_counts_agree = True

    one, two = _records(tmp_path, "one", 2, images=1), _records(tmp_path, "two", 2, images=2)
    mixed = tmp_path / "mixed.jsonl"
    rows = one.read_text().splitlines()[:1] + two.read_text().splitlines()[:1]
    mixed.write_text("\n".join(rows) + "\n")
    msg = _setup_problems(tmp_path, Agreeing(), {"shapes": 1.0}, mixed)
    assert "give [1, 2] condition_images each" in msg and "same number of images" in msg
    # the same file is fine for a family that takes each record's count alone
    dm = PromptDataModule(train=str(mixed), prompts_per_step=2, group_size=2)
    from lit_flowgrpo.conditioning import condition_problems

    sets = {"--data.init_args.train": dm.train_records}
    assert condition_problems(SourceToyPolicy(), sets, dm.condition_sizes, {}) == []


def test_a_reward_that_needs_sources_refuses_text_only_records(tmp_path):
    class Needs(SourceBrightness):
        needs_sources = True

    text = tmp_path / "p.txt"
    text.write_text("a red circle\na blue square\n")
    msg = _setup_problems(tmp_path, ToyPolicy(), Needs(), text)
    assert "needs each sample's source images" in msg


def test_the_encode_entry_point_dispatches_and_refuses_missing_conditions():
    policy = SourceToyPolicy()
    policy.load()
    with pytest.raises(ValueError, match="needs source images"):
        policy.encode(["a red circle"])
    cond = Condition([torch.rand(3, 16, 16)], "k")
    embeds = policy.encode(["a red circle"], [cond], 32, 32)
    assert embeds["source"].shape == (1, 3, 32, 32) and policy.encoded == ["k"]
    with pytest.raises(NotImplementedError, match="text-only policy"):
        ToyPolicy().encode_conditioned(["a"], [cond], 32, 32)


# ------------------------------------------------------------------------------------------------
# A conditioned fit: each sample's own source reaches the rollout, the reward, the update and validation
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_conditioned_fit_carries_each_samples_source_everywhere(tmp_path):
    train = _records(tmp_path, "train", 4)
    val = _records(tmp_path, "val", 2)
    dm = PromptDataModule(train=str(train), val=str(val), prompts_per_step=2, group_size=2, val_batch_size=2)
    reward = SourceBrightness()
    policy = SourceToyPolicy()
    module = _module(policy, MultiReward({"src": 1.0}, rewards={"src": reward}))
    trainer = _fit(module, dm, tmp_path, steps=1)
    assert trainer.global_step > 0
    # One rollout (max_steps=1) of 2 records x 2 samples, then one validation of the 2 held-out records.
    train_keys = {r[CONDITION_KEY][0] for r in dm.train_records}
    val_keys = {r[CONDITION_KEY][0] for r in dm.val_records}
    assert set(policy.encoded) <= train_keys | val_keys and set(policy.encoded) & val_keys
    # The reward saw, for every sample, the very file its record names, at the file's size.
    files = {tuple(read_rgb(k).flatten()[:8].tolist()): k for k in train_keys | val_keys}
    assert len(reward.seen) == 4 + 2
    for row in reward.seen:
        assert len(row) == 1 and row[0].shape == (3, 32, 32)
        assert tuple(row[0].flatten()[:8].tolist()) in files
    # The source changes the samples: the same prompt and noise with another source draws otherwise.
    policy.eval()
    seeds = torch.tensor([7, 7])
    two = [Condition([torch.zeros(3, 32, 32)], "black"), Condition([torch.ones(3, 32, 32)], "white")]
    images = module.sampler.evaluate(policy, ["a red circle"] * 2, seeds, conditions=two)
    assert not torch.equal(images[0], images[1])
    # The sample logger showed each sample after its source: the grids of the rollout and of validation.
    logged = sorted(p.name for p in tmp_path.rglob("images/*.png"))
    assert any(n.startswith("train_samples") for n in logged) and any(
        n.startswith("val_samples") for n in logged
    )


def test_samples_are_shown_after_their_sources():
    images = torch.rand(2, 3, 8, 8)
    src = [[torch.ones(3, 16, 16)], [torch.zeros(3, 4, 4), torch.full((3, 8, 8), 0.5)]]
    shown = beside_sources(images, src)
    assert shown.shape == (2, 3, 8, 24)  # the widest record: two sources and the sample
    assert torch.equal(shown[0, :, :, 16:], images[0]) and torch.equal(
        shown[0, :, :, 8:16], torch.ones(3, 8, 8)
    )
    assert torch.equal(shown[0, :, :, :8], torch.zeros(3, 8, 8))  # padded left
    assert torch.equal(shown[1, :, :, 8:16], torch.full((3, 8, 8), 0.5)) and torch.equal(
        shown[1, :, :, 16:], images[1]
    )
    assert beside_sources(images, None) is images
    video = torch.rand(2, 5, 3, 8, 8)
    assert beside_sources(video, src) is video


def test_per_frame_gives_each_frame_its_videos_sources():
    from lit_flowgrpo.rewards.video import PerFrame

    class FirstFrameMatch:
        uses_sources = True

        def __call__(self, images, prompts, metadata, sources):
            return torch.stack([-(i - s[0]).abs().mean() for i, s in zip(images, sources, strict=True)])

    videos = torch.rand(2, 3, 3, 4, 4)
    first = [[videos[0, 0].clone()], [videos[1, 0].clone()]]
    wrapped = PerFrame(FirstFrameMatch(), reduce="min")
    assert wrapped.uses_sources and not wrapped.needs_sources
    out = MultiReward({"f": 1.0}, rewards={"f": wrapped})(videos, ["a", "b"], [{}, {}], sources=first)
    # min over frames of -|frame - first frame|: frame 0 matches exactly, so the min is over the other two
    want = torch.stack(
        [torch.stack([-(videos[b, t] - videos[b, 0]).abs().mean() for t in range(3)]).min() for b in range(2)]
    )
    assert torch.equal(out.total, want)
