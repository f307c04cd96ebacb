"""Video RL end to end on the CPU, through the real CLI, on the toy video world.

A toy video checkpoint is pretrained in-process for a couple of steps (``configs/toy_video_pretrain.yaml``,
shrunk), then ``configs/quickstart_video.yaml`` runs on it, shortened: the base model's held-out
evaluation, 2 rollouts (rollout, ``shapes_video`` reward, Flow-GRPO update), the evaluation after
them, sample GIFs, the checkpoint; a resumed run goes one rollout further from that checkpoint, and
``export`` writes the fine-tuned network as a diffusers model folder that loads back.

Whether RL learns is measured by the full run (the README), not here: a two-step checkpoint draws
noise, so the values asserted are ranges and consistency, not gains.
"""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

import pytest
import torch
from PIL import Image

from lit_flowgrpo.cli import main
from lit_flowgrpo.toy.video_model import ToyVideoNet, read_video_checkpoint_metadata
from lit_flowgrpo.toy.video_policy import ToyVideoPolicy

REPO = Path(__file__).resolve().parents[2]
FRAMES = 4


def _pretrain(folder: Path) -> Path:
    path = folder / "video_base.safetensors"
    main(
        [
            "fit",
            "--config",
            str(REPO / "configs" / "toy_video_pretrain.yaml"),
            "--trainer.max_steps=2",
            "--trainer.accelerator=cpu",
            f"--trainer.logger.init_args.save_dir={folder}",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            "--model.init_args.architecture.block_out_channels=[16, 16, 16]",
            f"--model.init_args.architecture.frames={FRAMES}",
            f"--model.init_args.export_path={path}",
            "--model.init_args.export_dtype=float32",
            "--data.init_args.batch_size=4",
            "--data.init_args.num_workers=0",
        ]
    )
    return path


def _quickstart_args(checkpoint: Path, root: Path, max_steps: int) -> list[str]:
    return [
        "--config",
        str(REPO / "configs" / "quickstart_video.yaml"),
        f"--model.init_args.policy.init_args.pretrained={checkpoint}",
        f"--trainer.max_steps={max_steps}",
        "--trainer.val_check_interval=2",
        f"--trainer.default_root_dir={root}",
        f"--trainer.logger.init_args.save_dir={root}",
        f"--model.init_args.sampler.frames={FRAMES}",
        "--model.init_args.sampler.num_steps=4",
        "--model.init_args.sampler.eval_num_steps=4",
        "--model.init_args.sampler.sde_window_size=2",
        "--model.init_args.sampler.sde_window_range=[0, 3]",
        "--model.init_args.update.micro_batch_size=4",
        "--model.init_args.advantage.filter_zero=false",  # a noise model's groups may all score 0
        "--data.init_args.prompts_per_step=2",
        "--data.init_args.group_size=4",
        "--data.init_args.max_val_prompts=4",
        "--data.init_args.val_seeds=1",
        "--data.init_args.val_batch_size=4",
    ]


@pytest.mark.slow
def test_video_quickstart_rollout_update_validation_resume_export(tmp_path: Path, capsys) -> None:
    checkpoint = _pretrain(tmp_path / "pretrain")
    assert read_video_checkpoint_metadata(str(checkpoint))["steps"] == "2"
    root = tmp_path / "run"
    main(["fit", *_quickstart_args(checkpoint, root, max_steps=2)])
    out = capsys.readouterr().out
    line = re.search(r"held-out strict accuracy: (\d\.\d{3}) -> (\d\.\d{3})", out)
    assert line, out[-2000:]
    assert "held-out strict accuracy of the base model" in out

    (metrics,) = root.glob("quickstart_video/version_0/metrics.csv")
    with open(metrics) as f:
        rows = list(csv.DictReader(f))

    def values(key: str) -> list[float]:
        return [float(r[key]) for r in rows if r.get(key)]

    # The held-out keys: the base model's (logged by HeldOutReport at step 0) and the tuned one's;
    # 4 prompts x 1 seed of 0/1 scores, so each strict mean is a multiple of 1/4, and a clip that
    # passes strict passes every partial condition too.
    strict, partial = (
        values("val-core/shapes_video/strict/mean@1"),
        values("val-aux/shapes_video/partial/mean@1"),
    )
    assert len(strict) == 2 and len(partial) == 2
    assert all(4 * v == round(4 * v) for v in strict)
    assert all(0.0 <= s <= p <= 1.0 for s, p in zip(strict, partial, strict=True))
    assert float(line.group(1)) == pytest.approx(strict[0], abs=5e-4)
    assert float(line.group(2)) == pytest.approx(strict[1], abs=5e-4)
    # Rollouts scored and updated: rewards in range, finite losses, videos counted as videos.
    rewards = values("critic/rewards/shapes_video/strict/mean") + values(
        "critic/rewards/shapes_video/partial/mean"
    )
    assert rewards and all(0.0 <= r <= 1.0 for r in rewards)
    losses = values("actor/loss")
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    # The config's OverOptimizationMonitor on clips: a diversity per rollout, and the drift from the
    # base's clips (0 at the base, logged at step 0) at each validation.
    assert len(values("rollout/diversity")) == 2 and all(v > 0 for v in values("rollout/diversity"))
    drift = values("val-aux/drift")
    assert len(drift) == 2 and drift[0] == 0.0 and math.isfinite(drift[1])
    assert values("perf/total_num_videos") == [8.0, 8.0]
    assert values("perf/total_num_images") == [8.0 * FRAMES] * 2
    # Sample GIFs: the training samples of the first rollout and each validation's, FRAMES frames each.
    gifs = sorted(p.name for p in metrics.parent.glob("images/*.gif"))
    assert "train_samples_step0000000.gif" in gifs and any(g.startswith("val_samples") for g in gifs), gifs
    with Image.open(metrics.parent / "images" / "train_samples_step0000000.gif") as gif:
        assert gif.n_frames == FRAMES
    assert (metrics.parent / "base_vs_tuned.png").is_file()

    # Resume from the checkpoint: one more rollout, the base value kept from the first session.
    last = root / "checkpoints" / "last.ckpt"
    assert last.is_file()
    main(["fit", *_quickstart_args(checkpoint, root, max_steps=3), f"--ckpt_path={last}"])
    out = capsys.readouterr().out
    assert re.search(r"held-out strict accuracy: \d\.\d{3} -> \d\.\d{3} .*after 3 rollouts", out), out[-2000:]

    # Export the full fine-tune as a diffusers model folder; it loads back with from_pretrained.
    exported = tmp_path / "exported"
    config = next(root.glob("quickstart_video/version_0/config.yaml"))
    main(["export", "--config", str(config), "--ckpt_path", str(last), "--out", str(exported)])
    net = ToyVideoNet.from_pretrained(str(exported))
    assert net.config.frames == FRAMES
    state = torch.load(last, map_location="cpu", weights_only=False)["state_dict"]
    tuned = {k.split("policy.net.", 1)[1]: v for k, v in state.items() if "policy.net." in k}
    assert tuned and all(torch.equal(net.state_dict()[k], v) for k, v in tuned.items())


def test_bad_frames_and_sizes_name_the_flag(tmp_path: Path) -> None:
    from lit_flowgrpo.toy.video_model import ToyVideoModelConfig, build_video_models, save_video_checkpoint

    path = tmp_path / "base.safetensors"
    net, text_encoder = build_video_models(
        ToyVideoModelConfig(block_out_channels=(16, 16), frames=6, size=16)
    )
    save_video_checkpoint(str(path), net, text_encoder)
    policy = ToyVideoPolicy(str(path))
    (problem,) = policy.frame_problems(4)
    assert problem.startswith("--model.init_args.sampler.frames (4) must be 6 for ToyVideoPolicy")
    (problem,) = policy.frame_problems(1)
    assert "--model.init_args.sampler.frames (1) must be a whole number of at least 2" in problem
    assert policy.frame_problems(6) == []
    policy.load()
    with pytest.raises(
        ValueError, match=r"--model.init_args.sampler.height/--model.init_args.sampler.width \(15x16\)"
    ):
        policy.latent_shape(15, 16, 6)
    assert policy.latent_shape(16, 16, 6) == (6, 3, 16, 16)
    with pytest.raises(ValueError, match="outside the toy world's video vocabulary"):
        policy.encode_prompts(["a red circle moving sideways"])
    # One clip's velocity has the clip's shape; decode gives (B, F, 3, H, W) in [0, 1].
    embeds = policy.encode_prompts(["a red circle moving up", "a blue square moving down"])
    latents = torch.randn(2, 6, 3, 16, 16)
    v = policy.velocity(latents, torch.full((2,), 0.5), embeds, guidance_scale=3.0)
    assert v.shape == latents.shape and v.dtype == torch.float32
    video = policy.decode(latents)
    assert video.shape == (2, 6, 3, 16, 16) and float(video.min()) >= 0 and float(video.max()) <= 1
    assert (
        ToyVideoPolicy(str(tmp_path / "missing.safetensors"))
        .problems()[0]
        .startswith("--model.init_args.policy.init_args.pretrained")
    )


@pytest.mark.slow
def test_video_nft_quickstart_trains_and_evaluates_cfg_free(tmp_path: Path, capsys) -> None:
    """``configs/quickstart_video_nft.yaml``, shortened as above: DiffusionNFT's CFG-free rollout of
    clips, its update of the video network (the NFT statistics logged, the weights moved), and the
    held-out evaluation before and after."""
    checkpoint = _pretrain(tmp_path / "pretrain")
    root = tmp_path / "run"
    args = _quickstart_args(checkpoint, root, max_steps=2)
    args[1] = str(REPO / "configs" / "quickstart_video_nft.yaml")
    args = [a for a in args if "sde_window" not in a]  # DiffusionNFT records only the final clip
    main(["fit", *args])
    out = capsys.readouterr().out
    assert re.search(r"held-out strict accuracy: \d\.\d{3} -> \d\.\d{3}", out), out[-2000:]
    (metrics,) = root.glob("quickstart_video_nft/version_0/metrics.csv")
    with open(metrics) as f:
        rows = list(csv.DictReader(f))

    def values(key: str) -> list[float]:
        return [float(r[key]) for r in rows if r.get(key)]

    assert len(values("val-core/shapes_video/strict/mean@1")) == 2
    r_mean = values("actor/nft_r_mean")
    assert len(r_mean) == 2 and all(0.0 < r < 1.0 for r in r_mean)
    assert all(math.isfinite(v) for v in values("actor/loss")) and len(values("actor/loss")) == 2
    last = root / "checkpoints" / "last.ckpt"
    state = torch.load(last, map_location="cpu", weights_only=False)["state_dict"]
    base = ToyVideoPolicy(str(checkpoint))
    base.load()
    tuned = {k.split("policy.net.", 1)[1]: v for k, v in state.items() if "policy.net." in k}
    assert tuned and any(not torch.equal(base.net.state_dict()[k], v) for k, v in tuned.items())
