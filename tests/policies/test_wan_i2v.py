"""WanImageToVideoPolicy against diffusers' own WanImageToVideoPipeline, on tiny random pipelines saved to
disk (Wan 2.1 I2V with a CLIP image encoder; Wan 2.2 TI2V-5B's form), with first frames read from PNGs that
a .jsonl names."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
from lightning.pytorch.loggers import CSVLogger
from PIL import Image
from tolerances import depth, network_atol, sampling_layers

from lit_flowgrpo import (
    FlowDPPO,
    FlowGRPO,
    FlowGRPOModule,
    GRPOGuard,
    LoraSettings,
    PromptDataModule,
    Sampler,
    UpdateSettings,
    WeightsSettings,
)
from lit_flowgrpo.conditioning import Condition, read_rgb
from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.objective import DiffusionNFT
from lit_flowgrpo.policies.wan import WanPolicy
from lit_flowgrpo.policies.wan_i2v import WanImageToVideoPolicy
from lit_flowgrpo.rollout import sample_trajectory
from lit_flowgrpo.tiny.wan_i2v import build_tiny_wan_i2v

PROMPTS = ["a red cat", "two blue dogs"]
FRAMES, STEPS, MAX_LEN = 5, 4, 16
#: Output sizes: 2 × 2 × 2 = 8 tokens for each (Wan 2.1's 8× VAE at 32 px, TI2V's 16× at 64 px; the
#: Wan 2.2 I2V-A14B form, two experts without CLIP, has Wan 2.1's VAE).
SIZE = {"2.1": 32, "ti2v": 64, "a14b": 32}
RECIPE = (
    Path(__file__).resolve().parents[2] / "lit_flowgrpo" / "configs" / "wan21_i2v_14b_pickscore_flowgrpo.yaml"
)


@pytest.fixture(scope="module")
def tiny_i2v(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {v: build_tiny_wan_i2v(tmp_path_factory.mktemp(f"tiny_wan_i2v_{v}"), v) for v in SIZE}


def _frame(path: Path, width: int, height: int, seed: int) -> Path:
    """A smooth random picture (an upscaled 4 × 4 grid of colours), as a PNG."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randint(0, 256, (4, 4, 3), generator=g, dtype=torch.uint8).numpy()
    Image.fromarray(coarse).resize((width, height), Image.BICUBIC).save(path)
    return path


def first_frames(folder: Path, n: int = 3, size: tuple[int, int] = (40, 36)) -> str:
    """``n`` records of their own first frame (PNGs beside the .jsonl, named relative to it)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        _frame(folder / f"frame{i}.png", *size, seed=i)
        lines.append(
            json.dumps({"prompt": f"prompt number {i} moves", "condition_images": [f"frame{i}.png"]})
        )
    path = folder / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _load(path: str, **kwargs) -> WanImageToVideoPolicy:
    policy = WanImageToVideoPolicy(path, dtype="float32", max_sequence_length=MAX_LEN, **kwargs)
    policy.load()
    return policy


def _conditions(
    tmp_path: Path, size: tuple[int, int] = (40, 36)
) -> tuple[list[Condition], list[Image.Image]]:
    files = [_frame(tmp_path / f"c{i}.png", *size, seed=10 + i) for i in range(len(PROMPTS))]
    conditions = [Condition([read_rgb(str(f))], str(f)) for f in files]
    return conditions, [Image.open(f).convert("RGB") for f in files]


def _pipe(path: str) -> WanImageToVideoPipeline:
    pipe = WanImageToVideoPipeline.from_pretrained(path, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# -- against the pipeline ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variant", "cfg"), [("2.1", 5.0), ("2.1", 1.0), ("ti2v", 5.0), ("a14b", 4.0)], ids=str
)
def test_noise_level_zero_sampling_reproduces_the_pipeline(
    tiny_i2v: dict, tmp_path: Path, variant: str, cfg: float
) -> None:
    policy, pipe = _load(tiny_i2v[variant]), _pipe(tiny_i2v[variant])
    # Both on diffusers' Euler scheduler: the checkpoint's UniPC is a multistep solver.
    shift = pipe.scheduler.config["flow_shift"]
    policy.pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    size = SIZE[variant]
    conditions, images = _conditions(tmp_path)
    embeds = policy.encode(PROMPTS, conditions, size, size, FRAMES)
    shape = policy.latent_shape(size, size, FRAMES)
    channels = pipe.vae.config.z_dim
    # The pipeline's noise has every latent frame; TI2V's trajectory holds the generated ones (the first is given).
    full = torch.randn(len(PROMPTS), channels, 2, 4, 4, generator=torch.Generator().manual_seed(3))
    noise = full[:, :, 1:] if variant == "ti2v" else full
    assert shape == tuple(noise.shape[1:])
    traj = sample_trajectory(
        policy,
        embeds,
        noise,
        policy.sigmas(STEPS, size, size),
        guidance_scale=cfg,
        noise_level=0.7,
        sde_type="sde",
        sde_steps=[],
        train_steps=[],
    )
    ours_videos = policy.decode_conditioned(traj.final, embeds)
    negative = policy.encode_prompts([""])["prompt_embeds"]
    ref_latents, ref_videos = [], []
    for i, image in enumerate(images):  # the pipeline conditions a whole call on one image
        # Prompt states given: the image-to-video pipeline's own text cleaning calls ftfy unguarded (see the
        # policy's _encode_one), so the prompts are encoded as WanPipeline encodes them.
        kwargs = dict(
            image=image,
            prompt_embeds=embeds["prompt_embeds"][i : i + 1],
            negative_prompt_embeds=negative,
            guidance_scale=cfg,
            height=size,
            width=size,
            num_frames=FRAMES,
            num_inference_steps=STEPS,
        )
        ref_latents.append(pipe(latents=full[i : i + 1].clone(), output_type="latent", **kwargs).frames)
        ref_videos.append(pipe(latents=full[i : i + 1].clone(), output_type="pt", **kwargs).frames)
    ref_latents, ref_videos = torch.cat(ref_latents), torch.cat(ref_videos)
    if variant == "ti2v":
        # The pipeline's last step writes the given frame in front: exactly the first frame's latent.
        torch.testing.assert_close(ref_latents[:, :, :1], embeds["first_frame"], atol=0, rtol=0)
        ref_latents = ref_latents[:, :, 1:]
    # Our CFG halves and our two samples share one batch where the pipeline runs one forward per half and
    # sample: reductions may sum in another order, amplified by the guidance along STEPS forwards, plus one
    # rounding per Euler step; then the decoder.
    experts = [pipe.transformer] + ([pipe.transformer_2] if pipe.transformer_2 is not None else [])
    layers = sampling_layers(max(depth(e) for e in experts), STEPS, cfg) + STEPS
    atol = network_atol(layers, float(ref_latents.abs().max()))
    torch.testing.assert_close(traj.final, ref_latents, atol=atol, rtol=0)
    assert ours_videos.shape == (2, FRAMES, 3, size, size) and ours_videos.dtype == torch.float32
    torch.testing.assert_close(
        ours_videos, ref_videos, atol=network_atol(layers + depth(pipe.vae.decoder), 1.0), rtol=0
    )
    assert (ours_videos[0] - ours_videos[1]).abs().max() > 1e-3


@pytest.mark.parametrize("variant", list(SIZE))
def test_the_conditioning_is_what_the_pipeline_feeds_its_transformer(
    tiny_i2v: dict, tmp_path: Path, variant: str
) -> None:
    """Bit for bit: the first frame read from its PNG (the data module's reader), resized, CLIP-encoded and
    VAE-encoded by the policy, against what the pipeline's ``__call__`` hands its transformer for that file."""
    policy, pipe = _load(tiny_i2v[variant]), _pipe(tiny_i2v[variant])
    size = SIZE[variant]
    conditions, images = _conditions(tmp_path, size=(48, 40))
    embeds = policy.encode(PROMPTS, conditions, size, size, FRAMES)
    seen: list[dict] = []
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw), with_kwargs=True)
    try:
        for image in images[:1]:
            pipe(
                image=image,
                prompt_embeds=embeds["prompt_embeds"][:1],
                guidance_scale=1.0,
                height=size,
                width=size,
                num_frames=FRAMES,
                num_inference_steps=1,
                output_type="latent",
            )
    finally:
        hook.remove()
    (call,) = seen
    channels = pipe.vae.config.z_dim
    if variant == "ti2v":
        # The first latent frame of its input is the first frame's latent, its tokens at timestep 0.
        torch.testing.assert_close(call["hidden_states"][:, :, :1], embeds["first_frame"][:1], atol=0, rtol=0)
        tokens_per_frame = (size // 16 // 2) ** 2
        assert (call["timestep"][:, :tokens_per_frame] == 0).all() and (
            call["timestep"][:, tokens_per_frame:] > 0
        ).all()
        assert set(embeds) == {"prompt_embeds", "first_frame"}
    else:
        torch.testing.assert_close(
            call["hidden_states"][:, channels:], embeds["condition"][:1], atol=0, rtol=0
        )
        if variant == "a14b":  # Wan 2.2 I2V-A14B: no image encoder, the latent channels alone
            assert call["encoder_hidden_states_image"] is None and "image_embeds" not in embeds
        else:
            torch.testing.assert_close(
                call["encoder_hidden_states_image"], embeds["image_embeds"][:1], atol=0, rtol=0
            )
        # The mask: 1 on the (folded) first frame, 0 after it.
        mask = embeds["condition"][0, :4]
        assert (mask[:, 0] == 1).all() and (mask[:, 1:] == 0).all()
    # Each sample its own first frame; a cached encoding is the one recomputed.
    key = next(iter(k for k in embeds if k != "prompt_embeds"))
    assert (embeds[key][0] - embeds[key][1]).abs().max() > 0
    again = policy.encode(PROMPTS[::-1], conditions[::-1], size, size, FRAMES)
    assert torch.equal(again[key], embeds[key].flip(0))


def test_rollout_records_only_generated_frames_and_rescores_them(tiny_i2v: dict, tmp_path: Path) -> None:
    """TI2V: the trajectory holds the generated latent frames, the video starts at the given frame; the
    recorded log-probs are recomputed bit for bit from the record (fp32)."""
    for variant in SIZE:
        policy = _load(tiny_i2v[variant])
        size = SIZE[variant]
        sampler = Sampler(num_steps=3, guidance_scale=5.0, height=size, width=size, frames=FRAMES)
        conditions, _ = _conditions(tmp_path)
        embeds = policy.encode(PROMPTS, conditions, size, size, FRAMES)
        traj, videos = sampler.rollout(policy, embeds, torch.tensor([1, 2]), step=0, seed=0)
        assert videos.shape == (2, FRAMES, 3, size, size)
        latent_frames = 1 if variant == "ti2v" else 2
        assert traj.latents.shape[3] == latent_frames
        idx = torch.arange(2)
        for j in range(traj.num_trained):
            with torch.no_grad():
                v = policy.velocity(
                    traj.latents[idx, j], torch.full((2,), float(traj.sigmas[j])), embeds, 5.0
                )
            torch.testing.assert_close(traj.score(v, j, idx).log_prob, traj.log_probs[:, j], atol=0, rtol=0)


# -- bad input, before any weight is read -------------------------------------------------------------


def _fit(policy, data: PromptDataModule, tmp_path: Path, **sampler) -> None:
    module = FlowGRPOModule(
        policy=policy,
        reward=_per_frame_brightness,
        sampler=Sampler(**{"num_steps": 2, "height": 32, "width": 32, "frames": FRAMES, **sampler}),
        weights=WeightsSettings(lora=LoraSettings(rank=2, alpha=4)),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(module, datamodule=data)


def _per_frame_brightness(videos, prompts, metadata):
    return videos.mean(dim=(1, 2, 3, 4))


_per_frame_brightness.modalities = frozenset({"video"})


def test_bad_input_is_refused_before_any_weight_is_read(
    tiny_i2v: dict, tiny_wan_paths: dict, tmp_path: Path, prompt_file: str
) -> None:
    policy = WanImageToVideoPolicy(tiny_i2v["2.1"])
    frames = first_frames(tmp_path / "ok", size=(40, 36))
    # Text-only records for an image-to-video policy.
    with pytest.raises(SettingsError, match=r"record 1 gives 0 condition_images.*takes 1 first frame"):
        _fit(policy, PromptDataModule(train=prompt_file, prompts_per_step=2, group_size=2), tmp_path)
    # A first frame stretched past max_stretch: 40 x 36 to 64 x 32 is 1.8x.
    with pytest.raises(
        SettingsError, match=r"first frame .*frame0.png: its 40x36 px would be stretched 1.80x.*max_stretch"
    ):
        _fit(policy, PromptDataModule(train=frames, prompts_per_step=2, group_size=2), tmp_path, width=64)
    # Two images a record.
    two = tmp_path / "two"
    two.mkdir()
    _frame(two / "a.png", 32, 32, 0)
    (two / "p.jsonl").write_text(
        json.dumps({"prompt": "x", "condition_images": ["a.png", "a.png"]})
        + "\n"
        + json.dumps({"prompt": "y", "condition_images": ["a.png"]})
        + "\n"
    )
    with pytest.raises(SettingsError, match=r"record 1 gives 2 condition_images"):
        _fit(policy, PromptDataModule(train=str(two / "p.jsonl"), prompts_per_step=2, group_size=2), tmp_path)
    # A text-to-video policy given first frames; the text-to-video policy given this folder.
    with pytest.raises(SettingsError, match=r"WanPolicy is a text-only policy"):
        _fit(
            WanPolicy(tiny_wan_paths["2.1"]),
            PromptDataModule(train=frames, prompts_per_step=2, group_size=2),
            tmp_path,
        )
    assert policy.pipe is None
    (wrong,) = WanPolicy(tiny_i2v["2.1"]).problems()
    assert "WanImageToVideoPipeline" in wrong and "WanPipeline" in wrong
    # One frame leaves nothing to generate; settings of the policy itself.
    (problem,) = Sampler(height=32, width=32, frames=1).image_size_problems(policy)
    assert problem.startswith(
        "--model.init_args.sampler.frames (1) must be at least 5 for WanImageToVideoPolicy"
    )
    problems = WanImageToVideoPolicy(tiny_i2v["2.1"], image_encoder_dtype="int8", max_stretch=0.5).problems()
    assert [p.split(" ")[0] for p in problems] == [
        "--model.init_args.policy.init_args.image_encoder_dtype",
        "--model.init_args.policy.init_args.max_stretch",
    ]
    assert policy.condition_size_problems(40, 36, 32, 32) == []  # 1.11x: taken
    # Sequence parallelism: read from the folder's configs (2 heads; 8 tokens at 32 px, 5 frames).
    assert policy.sequence_parallel_problems(2, 32, 32, FRAMES, "--sp") == []
    assert (
        "must divide the 2 attention heads" in policy.sequence_parallel_problems(4, 32, 32, FRAMES, "--sp")[0]
    )


def test_encoding_refuses_a_frame_count_or_image_count_it_cannot_take(tiny_i2v: dict, tmp_path: Path) -> None:
    """Called directly (not through the data module's checks): the default of one frame, which leaves nothing
    to generate, and a record of two images are refused, not encoded into conditioning of the wrong shape or
    with an image dropped."""
    policy = _load(tiny_i2v["2.1"])
    conditions, _ = _conditions(tmp_path)
    with pytest.raises(ValueError, match=r"--model.init_args.sampler.frames \(1\) must be at least 5"):
        policy.encode(PROMPTS, conditions, 32, 32)  # frames left at encode's default, 1
    two = [Condition(conditions[0].images * 2, "two"), conditions[1]]
    with pytest.raises(ValueError, match=r"takes one first frame a record, got 2 \(two\)"):
        policy.encode(PROMPTS, two, 32, 32, FRAMES)
    assert len(policy._conditions) == 0  # refused before anything was encoded


# -- training runs --------------------------------------------------------------------------------------


def _module(
    path: str, objective=None, lora: LoraSettings | None = LoraSettings(rank=4, alpha=8), **sampler
) -> FlowGRPOModule:
    size = SIZE["ti2v"] if "ti2v" in path else SIZE["2.1"]
    return FlowGRPOModule(
        policy=WanImageToVideoPolicy(path, dtype="float32", max_sequence_length=MAX_LEN),
        reward=_per_frame_brightness,
        objective=objective or FlowGRPO(clip_range=1e-2),
        sampler=Sampler(
            **{
                "num_steps": 3,
                "eval_num_steps": 2,
                "guidance_scale": 4.5,
                "height": size,
                "width": size,
                "frames": FRAMES,
                "batch_size": 4,
                **sampler,
            }
        ),
        update=UpdateSettings(micro_batch_size=4, optimizer_steps_per_rollout=2),
        weights=WeightsSettings(lora=lora),
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
        seed=0,
    )


def _data(jsonl: str) -> PromptDataModule:
    return PromptDataModule(
        train=jsonl, val=jsonl, prompts_per_step=2, group_size=2, val_batch_size=2, max_val_prompts=2, seed=3
    )


def _trainer(root: Path, max_steps: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=CSVLogger(str(root)),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        default_root_dir=str(root),
    )


def _trainable(module: FlowGRPOModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters() if v.requires_grad}


@pytest.mark.parametrize("variant", list(SIZE))
def test_a_run_trains_validates_exports_and_resumes_bit_for_bit(
    tiny_i2v: dict, tmp_path: Path, variant: str
) -> None:
    """Rollout + per-frame reward + update + validation through FlowGRPOModule; the LoRA export read back by
    the pipeline's own load_lora_weights; a run resumed from its checkpoint after one rollout equals the
    uninterrupted one bit for bit (the first-frame cache starts empty in the resumed run)."""
    jsonl = first_frames(tmp_path / "data")
    path = tiny_i2v[variant]

    def run(root: str, max_steps: int, **fit) -> tuple[FlowGRPOModule, L.Trainer]:
        module = _module(path)
        trainer = _trainer(tmp_path / root, max_steps)
        trainer.fit(module, datamodule=_data(jsonl), **fit)
        return module, trainer

    straight, trainer = run("a", 4)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert math.isfinite(metrics["actor/loss"]) and metrics[
        "actor/on_policy_ratio_err"
    ] <= UpdateSettings().on_policy_tolerance(fp32=True)
    assert any(k.startswith("val-") for k in metrics), sorted(metrics)
    _, trainer = run("b", 2)
    ckpt = tmp_path / "half.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed, _ = run("c", 4, ckpt_path=ckpt)
    a, b = _trainable(straight), _trainable(resumed)
    assert a.keys() == b.keys() and all("lora_" in k for k in a)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} of {len(a)} LoRA tensors differ after the resume, e.g. {differ[:3]}"

    out = tmp_path / "lora"
    straight.export_lora(str(out))
    pipe = WanImageToVideoPipeline.from_pretrained(path, torch_dtype=torch.float32)
    pipe.load_lora_weights(str(out), adapter_name="rl")  # the pipeline's own LoRA loader
    loaded = {f"policy._transformer.{n}": p for n, p in pipe.transformer.named_parameters()}
    if pipe.transformer_2 is not None:  # the low-noise expert's adapter, from its subfolder
        pipe.load_lora_weights(str(out / "transformer_2"), adapter_name="rl", load_into_transformer_2=True)
        loaded |= {f"policy._transformer_2.{n}": p for n, p in pipe.transformer_2.named_parameters()}
    trained = _trainable(straight)
    assert any("_transformer_2." in k for k in trained) == (variant == "a14b")
    for name, value in trained.items():
        torch.testing.assert_close(loaded[name.replace(".default.", ".rl.")], value, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("variant", "objective", "lora"),
    [
        ("2.1", FlowGRPO(clip_range=1e-2), True),
        ("2.1", FlowGRPO(clip_range=1e-2), False),
        ("2.1", GRPOGuard(clip_range=1e-2), True),
        ("2.1", FlowDPPO(), True),
        ("2.1", DiffusionNFT(), True),
        ("ti2v", FlowGRPO(clip_range=1e-2), True),
        ("ti2v", FlowGRPO(clip_range=1e-2), False),
        ("ti2v", DiffusionNFT(), True),
        ("a14b", FlowGRPO(clip_range=1e-2), True),
    ],
    ids=lambda v: (
        type(v).__name__
        if not isinstance(v, (str, bool))
        else ("lora" if v is True else "full" if v is False else v)
    ),
)
def test_every_objective_takes_a_step_with_the_first_frame(
    tiny_i2v: dict, tmp_path: Path, variant: str, objective, lora: bool
) -> None:
    module = _module(
        tiny_i2v[variant],
        objective=objective,
        lora=LoraSettings(rank=4, alpha=8) if lora else None,
        guidance_scale=1.0 if isinstance(objective, DiffusionNFT) else 4.5,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
    )
    module.configure_model()
    before = _trainable(module)
    trainer.fit(module, datamodule=_data(first_frames(tmp_path / "data")))
    after = _trainable(module)
    assert before and any(not torch.equal(before[k], after[k]) for k in before)
    assert math.isfinite(float(trainer.callback_metrics["actor/loss"]))
    # The frozen parts (CLIP, VAE, text encoder) are untouched, and the conditioned frame is no parameter.
    assert all(not p.requires_grad for p in module.policy.vae.parameters())


#: X-GenGroup/Flow-Factory examples/grpo/lora/wan21/i2v.yaml, as the recipe maps it (its header).
FLOW_FACTORY_WAN21_I2V = {
    ("trainer", "devices"): 8,  # num_processes
    ("data", "init_args", "prompts_per_step"): 48,  # unique_sample_num_per_epoch
    ("data", "init_args", "group_size"): 16,
    ("model", "init_args", "policy", "init_args", "pretrained"): "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
    ("model", "init_args", "update", "micro_batch_size"): 1,  # per_device_batch_size
    ("model", "init_args", "update", "optimizer_steps_per_rollout"): 2,  # gradient_step_per_epoch
    ("model", "init_args", "update", "max_grad_norm"): 1.0,
    ("model", "init_args", "objective", "init_args", "clip_range"): 1e-4,
    ("model", "init_args", "objective", "init_args", "adv_clip_max"): 5.0,
    ("model", "init_args", "kl", "coef"): 0.0,
    ("model", "init_args", "advantage", "std"): "group",  # global_std false
    ("model", "init_args", "sampler", "noise_level"): 0.9,
    ("model", "init_args", "sampler", "sde_type"): "sde",  # Flow-SDE
    ("model", "init_args", "sampler", "sde_window_size"): 1,  # num_sde_steps
    ("model", "init_args", "sampler", "sde_window_range"): [1, 4],  # sde_steps [1, 2, 3]
    ("model", "init_args", "sampler", "num_steps"): 10,
    ("model", "init_args", "sampler", "eval_num_steps"): 28,
    ("model", "init_args", "sampler", "guidance_scale"): 5.0,
    ("model", "init_args", "sampler", "height"): 240,
    ("model", "init_args", "sampler", "width"): 240,
    ("model", "init_args", "sampler", "frames"): 5,
    ("model", "init_args", "sampler", "eval_height"): 480,
    ("model", "init_args", "sampler", "eval_frames"): 5,
    ("model", "init_args", "weights", "lora", "rank"): 64,
    ("model", "init_args", "weights", "lora", "alpha"): 128,
    ("model", "init_args", "optimizer", "init_args", "lr"): 1e-4,
    ("model", "init_args", "optimizer", "init_args", "weight_decay"): 1e-4,
    ("seed_everything",): 42,
}


# slow: one rollout of the recipe in bf16 through the CLI (about 5 s on 2 cores)
@pytest.mark.slow
def test_the_recipe_runs_a_rollout_on_the_tiny_pipeline(tiny_i2v: dict, tmp_path: Path) -> None:
    """The shipped recipe, its sizes and batch shrunk, on the tiny Wan 2.1 I2V: one rollout (2 optimizer
    steps) through the CLI, with a per-frame reward that needs no download."""
    from lit_flowgrpo.cli import FlowGRPOCLI

    cfg = yaml.safe_load(RECIPE.read_text())
    for keys, want in FLOW_FACTORY_WAN21_I2V.items():
        got = functools.reduce(lambda tree, k: tree[k], keys, cfg)
        assert got == want, keys
    ema = next(c for c in cfg["trainer"]["callbacks"] if c["class_path"].endswith("TrainableEMA"))
    assert ema["init_args"] == {"decay": 0.9, "update_every": 8}  # ema_decay 0.9 every 4 epochs x 2 steps
    assert "ffn.net.0.proj" in cfg["model"]["init_args"]["weights"]["lora"]["target_modules"]
    cfg["trainer"].update(
        accelerator="cpu",
        devices=1,
        strategy="auto",
        max_steps=2,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        logger=False,
        callbacks=[{"class_path": "lit_flowgrpo.callbacks.RLThroughputMonitor"}],
    )
    model = cfg["model"]["init_args"]
    model["policy"]["init_args"].update(pretrained=tiny_i2v["2.1"], max_sequence_length=MAX_LEN)
    model["reward"]["init_args"]["config"]["per_frame"] = {"reward": "jpeg_compressibility", "reduce": "mean"}
    model["sampler"].update(
        height=32, width=32, eval_height=32, eval_width=32, frames=5, num_steps=4, batch_size=4
    )
    model["update"]["micro_batch_size"] = 4
    cfg["data"]["init_args"].update(
        train=first_frames(tmp_path / "data", size=(36, 36)), val=None, prompts_per_step=2, group_size=2
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli = FlowGRPOCLI(args=["fit", "--config", str(path)])
    assert cli.trainer.global_step == 2
    logged = {k: float(v) for k, v in cli.trainer.logged_metrics.items()}
    assert math.isfinite(logged["actor/loss"]) and logged["reward/failure_rate"] == 0.0
    assert cli.model.policy.transformer.dtype == torch.bfloat16  # the recipe's bf16 weights
    # bf16 weights: the update recomputes the rollout's log-probs within the module's bf16 tolerance.
    assert logged["actor/on_policy_ratio_err"] <= UpdateSettings().on_policy_tolerance(fp32=False)
