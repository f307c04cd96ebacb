"""Toy pretraining: the data stream, the flow-matching loss, EMA, and a 2-step run through the CLI."""

from __future__ import annotations

import itertools
import os
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lit_flowgrpo.cli import main as cli_main
from lit_flowgrpo.toy import world
from lit_flowgrpo.toy.model import ToyModelConfig, predict_velocity, read_checkpoint_metadata
from lit_flowgrpo.toy.policy import ToyPolicy
from lit_flowgrpo.toy.pretrain import (
    ToyPretrainModule,
    ToyShapesDataModule,
    ToyShapesDataset,
    swap_bound_colors,
)

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "toy_pretrain.yaml")
TINY = ToyModelConfig(
    block_out_channels=(8, 16), attention_heads=2, norm_num_groups=4, text_dim=16, text_layers=1, text_heads=2
)


def _take(dataset: ToyShapesDataset, n: int) -> list[dict]:
    return list(itertools.islice(iter(dataset), n))


def test_stream_renders_train_prompts_only_and_is_seeded() -> None:
    records = world.load_prompts("train")
    val_only = {r["prompt"] for r in world.load_prompts("val")} - {r["prompt"] for r in records}
    items = _take(ToyShapesDataset(records, seed=3), 40)
    assert all(it["pixels"].shape == (3, 32, 32) for it in items)
    pixels = torch.stack([it["pixels"] for it in items])
    assert pixels.min() == -1.0 and pixels.max() <= 1.0  # black background maps to -1
    assert not {it["prompt"] for it in items} & val_only
    # Same seed: same stream, picture for picture; another rank: another stream.
    again = _take(ToyShapesDataset(records, seed=3), 40)
    assert all(
        torch.equal(a["pixels"], b["pixels"]) and a["prompt"] == b["prompt"]
        for a, b in zip(items, again, strict=True)
    )
    other = _take(ToyShapesDataset(records, seed=3, rank=1), 40)
    assert not all(torch.equal(a["pixels"], b["pixels"]) for a, b in zip(items, other, strict=True))


def test_pixels_are_the_world_render() -> None:
    record = world.load_prompts("train")[0]
    item = _take(ToyShapesDataset([record], seed=5), 1)[0]
    rng = np.random.default_rng([5, 0, 0])
    rng.choice(1, p=[1.0])  # the stream draws the record index first
    expected = world.render(world.sample_scene(record, rng)).astype(np.float32) / 127.5 - 1.0
    np.testing.assert_array_equal(item["pixels"].permute(1, 2, 0).numpy(), expected)  # the same fp32 ops


def test_data_noise_mirrors_scenes_and_swaps_bound_colours() -> None:
    """flip_prob mirrors the rendered scene, swap_colors_prob exchanges the colours a caption binds; the
    caption stays. The first item of a stream is drawn from the same generator state either way."""
    record = world.make_record("color_attr", [("circle", 1, "red"), ("square", 1, "green")])
    plain = _take(ToyShapesDataset([record], seed=5), 1)[0]
    flipped = _take(ToyShapesDataset([record], seed=5, flip_prob=1.0), 1)[0]
    assert flipped["prompt"] == plain["prompt"] == "a red circle and a green square"
    assert torch.equal(flipped["pixels"], plain["pixels"].flip(-1))

    swapped = _take(ToyShapesDataset([record], seed=5, swap_colors_prob=1.0), 1)[0]
    rng = np.random.default_rng([5, 0, 0])
    rng.choice(1, p=[1.0])
    scene = world.sample_scene(record, rng)
    assert [(o["shape"], o["color"]) for o in scene] == [("circle", "red"), ("square", "green")]
    exchanged = swap_bound_colors(record, scene)
    assert [(o["shape"], o["color"]) for o in exchanged] == [("circle", "green"), ("square", "red")]
    assert [o["center"] for o in exchanged] == [o["center"] for o in scene]
    expected = world.render(exchanged).astype(np.float32) / 127.5 - 1.0
    np.testing.assert_array_equal(swapped["pixels"].permute(1, 2, 0).numpy(), expected)
    assert swapped["prompt"] == record["prompt"]

    # Nothing to swap with fewer than two coloured entries: counting has one, two_object none.
    counting = world.make_record("counting", [("triangle", 2, "blue")])
    scene = world.sample_scene(counting, np.random.default_rng(0))
    assert swap_bound_colors(counting, scene) == scene
    for name in ("flip_prob", "swap_colors_prob", "relation_noise_prob", "count_noise_prob"):
        with pytest.raises(ValueError, match=rf"--data\.init_args\.{name} \(1\.5\) must be a probability"):
            ToyShapesDataModule(**{name: 1.5})


def test_caption_noise_drops_relations_and_changes_counts() -> None:
    """relation_noise_prob places a relation's objects as unrelated ones; count_noise_prob draws a
    counting caption's objects in another count; the caption stays, and other families are untouched."""
    from lit_flowgrpo.toy.pretrain import with_other_count, without_relation

    left = world.make_record("position", [("circle", 1, "red"), ("square", 1, "green")], "left of")
    free = without_relation(left)
    assert [e.get("position") for e in left["include"]] == [None, ["left of", 0]]
    assert all("position" not in e for e in free["include"]) and free["prompt"] == left["prompt"]
    assert [(e["class"], e["color"]) for e in free["include"]] == [("square", "green"), ("circle", "red")]

    def rate(items: list[dict], record: dict) -> float:
        # the dataset's scenes are not exposed, so read each image with the verifier
        from lit_flowgrpo.toy.verifier import ShapeVerifier

        images = np.stack(
            [((it["pixels"].permute(1, 2, 0) + 1) * 127.5).round().byte().numpy() for it in items]
        )
        strict, _ = ShapeVerifier().score_batch(images, [record] * len(items))
        return float(np.mean(strict))

    assert rate(_take(ToyShapesDataset([left], seed=1), 40), left) == 1.0  # clean renders always hold it
    # Placed as unrelated objects, "left of" with its margins holds about 0.3 of the time.
    assert rate(_take(ToyShapesDataset([left], seed=1, relation_noise_prob=1.0), 200), left) < 0.5
    # With the colours swapped too, the named colours sit on the wrong shapes: nothing passes.
    both = ToyShapesDataset([left], seed=1, relation_noise_prob=1.0, swap_colors_prob=1.0)
    assert rate(_take(both, 40), left) == 0.0

    three = world.make_record("counting", [("triangle", 3, "blue")])
    rng = np.random.default_rng(0)
    counts = Counter(with_other_count(three, rng)["include"][0]["count"] for _ in range(400))
    assert set(counts) == {1, 2} and min(counts.values()) > 150  # uniform over the other counts
    # In the stream every scene of the caption has another count: none passes the verifier, every
    # clean one does, and the caption stays.
    for prob, passes in ((0.0, 1.0), (1.0, 0.0)):
        items = _take(ToyShapesDataset([three], seed=2, count_noise_prob=prob), 20)
        assert all(it["prompt"] == three["prompt"] for it in items)
        assert rate(items, three) == passes
    with pytest.raises(ValueError, match="not a counting record"):
        with_other_count(left, rng)
    # Noise settings leave records they do not apply to drawn as a clean stream draws them.
    single = world.make_record("colors", [("circle", 1, "red")])
    clean = _take(ToyShapesDataset([single], seed=3), 3)
    noisy = _take(ToyShapesDataset([single], seed=3, relation_noise_prob=1.0, count_noise_prob=1.0), 3)
    assert all(torch.equal(a["pixels"], b["pixels"]) for a, b in zip(clean, noisy, strict=True))


def test_family_weights() -> None:
    records = world.load_prompts("train")
    items = _take(ToyShapesDataset(records, seed=0, family_weights={"counting": 1.0}), 30)
    counting = {r["prompt"] for r in records if r["tag"] == "counting"}
    assert {it["prompt"] for it in items} <= counting
    with pytest.raises(ValueError, match=r"--data.init_args.family_weights.*unknown: \['shapes'\]"):
        ToyShapesDataModule(family_weights={"shapes": 1.0})
    with pytest.raises(ValueError, match=r"--data\.init_args\.batch_size"):
        ToyShapesDataModule(batch_size=0)


def test_training_step_is_the_flow_matching_loss() -> None:
    torch.manual_seed(0)
    module = ToyPretrainModule(architecture=TINY, cfg_dropout=0.5, ema_decay=None)
    module.log = lambda *args, **kwargs: None  # no Trainer attached
    pixels = torch.rand(6, 3, 32, 32) * 2 - 1
    prompts = [
        "a red circle",
        "two green squares",
        "a square",
        "a circle and a triangle",
        "a blue square",
        "a circle",
    ]
    torch.manual_seed(11)
    loss = module.training_step({"pixels": pixels, "prompt": prompts}, 0)

    # The same draws, in the same order, by hand: dropout mask, noise ε, then σ = sigmoid(N(0, 1)).
    torch.manual_seed(11)
    drop = torch.rand(6) < 0.5
    noise = torch.randn_like(pixels)
    sigma = torch.sigmoid(torch.randn(6))
    kept = ["" if d else p for p, d in zip(prompts, drop.tolist(), strict=True)]
    assert 0 < int(drop.sum()) < 6
    ids, mask = module.net["text_encoder"].tokenize(kept)
    hidden, pooled = module.net["text_encoder"](ids, mask)
    s = sigma.view(6, 1, 1, 1)
    x_sigma = (1 - s) * pixels + s * noise
    pred = predict_velocity(
        module.net["unet"], x_sigma, sigma, {"text_hidden": hidden, "text_mask": mask, "text_pooled": pooled}
    )
    expected = F.mse_loss(pred, noise - pixels)
    assert torch.equal(loss, expected)  # the same operations on the same draws
    loss.backward()
    assert module.net["text_encoder"].token_embedding.weight.grad.abs().sum() > 0  # the encoder learns too


def test_ema_update_math() -> None:
    module = ToyPretrainModule(architecture=TINY, ema_decay=0.9)
    ema_before = [p.clone() for p in module.ema.parameters()]
    with torch.no_grad():
        for p in module.net.parameters():
            p.add_(1.0)

    class _Trainer:  # global_step is read from the trainer
        global_step = 100

    module._trainer = _Trainer()  # type: ignore[assignment]
    module._update_ema()
    # decay = min(0.9, 101 / 110) = 0.9: ema ← 0.9·ema + 0.1·θ, and θ = ema_before + 1.
    # lerp computes b + 0.1·((b + 1) − b); with the reference's own b + 0.1 that is at most four fp32
    # roundings of numbers no larger than 1 + |b|, each within eps/2 of it.
    eps = torch.finfo(torch.float32).eps
    for before, after in zip(ema_before, module.ema.parameters(), strict=True):
        assert ((after - (before + 0.1)).abs() <= 2 * eps * (1 + before.abs())).all()


def test_bad_module_settings_are_collected() -> None:
    with pytest.raises(ValueError) as err:
        ToyPretrainModule(architecture=TINY, cfg_dropout=1.5, ema_decay=2.0, export_path="model.pt")
    message = str(err.value)
    for flag in ("cfg_dropout", "ema_decay", "export_path"):
        assert f"--model.init_args.{flag}" in message
    with pytest.raises(ValueError, match="norm_num_groups"):
        ToyPretrainModule(architecture=ToyModelConfig(block_out_channels=(8, 12), norm_num_groups=8))


def test_two_step_pretraining_through_the_cli(tmp_path: os.PathLike) -> None:
    export = str(tmp_path / "base.safetensors")
    cli_main(
        [
            "fit",
            f"--config={CONFIG}",
            "--trainer.max_steps=2",
            "--trainer.log_every_n_steps=1",
            "--trainer.accelerator=cpu",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--model.init_args.architecture.block_out_channels=[8, 16]",
            "--model.init_args.architecture.attention_heads=2",
            "--model.init_args.architecture.norm_num_groups=4",
            "--model.init_args.architecture.text_dim=16",
            "--model.init_args.architecture.text_layers=1",
            "--model.init_args.architecture.text_heads=2",
            f"--model.init_args.export_path={export}",
            "--model.init_args.export_every_n_steps=1",
            "--model.init_args.export_dtype=float32",
            "--data.init_args.batch_size=4",
            "--data.init_args.num_workers=0",
        ]
    )
    metadata = read_checkpoint_metadata(export)
    assert metadata["steps"] == "2" and metadata["weights"] == "ema"
    assert os.path.isfile(str(tmp_path / "base_step1.safetensors"))
    policy = ToyPolicy(export)
    policy.load()
    assert list(policy.transformer.config.block_out_channels) == [8, 16]
    v = policy.velocity(torch.zeros(1, 3, 32, 32), torch.ones(1), policy.encode_prompts(["a circle"]), 4.0)
    assert v.shape == (1, 3, 32, 32) and torch.isfinite(v).all()
    with open(os.path.join(tmp_path, "toy_pretrain", "version_0", "metrics.csv")) as f:
        assert "train/loss" in f.read()
