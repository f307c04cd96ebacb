"""HunyuanVideo15Policy against diffusers' own HunyuanVideo15Pipeline, on a tiny random pipeline saved to disk."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline
from recipe_run import fit_export_resume
from tolerances import depth, network_atol, sampling_layers

from lit_flowgrpo.policies.base import latent_shape_of
from lit_flowgrpo.policies.hunyuanvideo15 import HunyuanVideo15Policy
from lit_flowgrpo.rollout import Sampler, sample_trajectory
from lit_flowgrpo.tiny.hunyuanvideo15 import TEMPLATE_TOKENS, build_tiny_hunyuanvideo15, template_prefix
from lit_flowgrpo.weights import LORA_WEIGHTS_FILE, LoraSettings, TrainableWeights, WeightsSettings

# The second prompt quotes a text: the glyph (ByT5) encoder runs for it, and is zeros for the first.
PROMPTS = ["a red cat", 'two dogs hold a "sign"']
SIZE, FRAMES, STEPS, MAX_LEN = 32, 5, 3, 16


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_hunyuanvideo15(tmp_path_factory.mktemp("tiny_hunyuanvideo15"))


def _load(path: str, **kwargs) -> HunyuanVideo15Policy:
    policy = HunyuanVideo15Policy(
        path, dtype="float32", vae_dtype="float32", max_sequence_length=MAX_LEN, **kwargs
    )
    policy.load()
    return policy


@pytest.mark.parametrize("cfg", [6.0, 1.0])
def test_noise_level_zero_sampling_reproduces_the_pipeline(tiny_path: str, cfg: float) -> None:
    policy = _load(tiny_path)
    pipe = HunyuanVideo15Pipeline.from_pretrained(tiny_path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.tokenizer_max_length = MAX_LEN  # what the policy's max_sequence_length sets
    pipe.guider = ClassifierFreeGuidance(guidance_scale=cfg)  # the pipeline's guidance is its guider's
    shape = policy.latent_shape(SIZE, SIZE, FRAMES)
    assert shape == (4, 2, 2, 2)  # 16× in space, 4× in time: 8 video tokens
    noise = torch.randn(len(PROMPTS), *shape, generator=torch.Generator().manual_seed(3))
    traj = sample_trajectory(
        policy,
        policy.encode_prompts(PROMPTS),
        noise,
        policy.sigmas(STEPS, SIZE, SIZE),
        guidance_scale=cfg,
        noise_level=0.7,  # no SDE step: noise level 0 everywhere
        sde_type="sde",
        sde_steps=[],
        train_steps=[],
    )
    kwargs = dict(height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=STEPS)
    ref = pipe(prompt=PROMPTS, latents=noise.clone(), output_type="latent", **kwargs).frames
    # Our CFG halves share one batch where the pipeline runs two forwards: each forward's reductions may
    # sum in another order, amplified by the guidance along the loop, plus one rounding per Euler step.
    # Measured: 1.5e-6 at cfg 6 and exactly 0 without CFG (the same forwards).
    layers = sampling_layers(depth(pipe.transformer), STEPS, cfg) + STEPS
    atol = network_atol(layers, float(ref.abs().max())) if cfg > 1 else 0.0
    torch.testing.assert_close(traj.final, ref, atol=atol, rtol=0)
    # Videos: the pipeline decodes one at a time here, as the policy does (diffusers 0.42's VAE fails on a
    # batch of two: its causal mask broadcasts against the batch).
    videos = policy.decode(traj.final)
    assert videos.shape == (2, FRAMES, 3, SIZE, SIZE) and videos.dtype == torch.float32
    ref_videos = torch.cat(
        [
            pipe(prompt=[p], latents=noise[i : i + 1].clone(), output_type="pt", **kwargs).frames
            for i, p in enumerate(PROMPTS)
        ]
    )
    atol = network_atol(layers + depth(pipe.vae.decoder), 1.0)
    torch.testing.assert_close(videos, ref_videos, atol=atol, rtol=0)
    assert (videos[0] - videos[1]).abs().max() > 1e-3


def test_sigmas_are_the_pipelines_shifted_schedule(tiny_path: str) -> None:
    policy = _load(tiny_path)
    assert isinstance(policy.pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    # The pipeline's own path: linspace(1, 0, T + 1)[:-1] handed to its scheduler, which shifts it.
    reference = FlowMatchEulerDiscreteScheduler.from_config(policy.pipe.scheduler.config)
    reference.set_timesteps(sigmas=np.linspace(1.0, 0.0, 21)[:-1])
    sigmas = policy.sigmas(20, 480, 848)
    torch.testing.assert_close(sigmas, reference.sigmas.float(), atol=0, rtol=0)
    assert sigmas.shape == (21,) and sigmas[0] == 1 and sigmas[-1] == 0
    shift = policy.pipe.scheduler.config.shift  # 5.0 at 480p: σ' = sσ / (1 + (s − 1)σ)
    assert float(sigmas[10]) == pytest.approx(shift * 0.5 / (1 + (shift - 1) * 0.5), rel=1e-6)


def test_the_tiny_template_is_cropped_where_the_released_ones_is(tiny_path: str) -> None:
    """The tiny tokenizer's chat template is the 108 tokens the pipeline crops, so the encoder's kept
    states are the prompt's own (then the template's closing tokens and padding), as with Qwen2.5-VL's."""
    pipe = HunyuanVideo15Pipeline.from_pretrained(tiny_path)
    assert (
        len(pipe.tokenizer(template_prefix()).input_ids)
        == TEMPLATE_TOKENS
        == pipe.prompt_template_encode_start_idx
    )
    policy = _load(tiny_path)
    embeds = policy.encode_prompts(PROMPTS)
    assert embeds["prompt_embeds"].shape == (2, MAX_LEN, 32)
    # "a red cat" is 3 + 3 + 3 characters-or-words; then <|im_end|>, <|im_start|>, "assistant".
    kept = len(pipe.tokenizer("a red cat").input_ids) + 3
    assert embeds["prompt_embeds_mask"][0].sum() == kept
    # Glyph states only for the prompt that quotes a text.
    assert embeds["prompt_embeds_mask_2"][0].sum() == 0 and embeds["prompt_embeds_mask_2"][1].sum() > 0


def test_one_lora_step_trains_only_the_adapters_and_exports_for_the_transformer(
    tiny_path: str, tmp_path
) -> None:
    policy = _load(tiny_path)
    weights = TrainableWeights(WeightsSettings(lora=LoraSettings(rank=4, alpha=8)), seed=0)
    weights.attach(policy)
    lora = {n: p for n, p in policy.named_parameters() if "lora_" in n}
    # The 8 joint-attention projections of each of 2 blocks but the last block's text queries and text
    # output (the text stream ends there: they would get no gradient), and q, k, v, out of the refiner.
    assert len({n.split(".lora_")[0] for n in lora}) == 8 * 2 - 2 + 4
    assert not any(
        "transformer_blocks.1.attn.add_q_proj" in n or "transformer_blocks.1.attn.to_add_out" in n
        for n in lora
    )
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(2, *policy.latent_shape(SIZE, SIZE, FRAMES), generator=g)
    noise = torch.randn(x0.shape, generator=g)
    embeds = policy.encode_prompts(PROMPTS)
    s = torch.full((2,), 0.6)
    loss = (policy.velocity(0.4 * x0 + 0.6 * noise, s, embeds, 1.0) - (noise - x0)).pow(2).mean()
    loss.backward()
    for name, param in policy.named_parameters():
        if "lora_" in name:
            # Gaussian init: B = 0, so A's first gradient is 0 too; B's is not; every adapter is used.
            assert param.requires_grad and param.grad is not None, name
            assert "lora_A" in name or param.grad.abs().sum() > 0, name
        else:
            assert not param.requires_grad and param.grad is None, name
    torch.optim.SGD(lora.values(), lr=0.1).step()
    with torch.no_grad():
        trained = policy.velocity(noise, s, embeds, 1.0)
        with weights.copies.reference():
            reference = policy.velocity(noise, s, embeds, 1.0)
        base = _load(tiny_path).velocity(noise, s, embeds, 1.0)
    # The adapters off compute the base layers alone: the same computation as the base model, exactly.
    torch.testing.assert_close(reference, base, atol=0, rtol=0)
    assert (trained - reference).abs().max() > 1e-4
    # The export: diffusers 0.42 gives the pipeline no LoRA loader, so the transformer's own
    # load_lora_adapter reads it back, and the loaded transformer computes what the trained one does.
    out = tmp_path / "lora"
    weights.export(policy, str(out))
    pipe = HunyuanVideo15Pipeline.from_pretrained(tiny_path)
    pipe.transformer.load_lora_adapter(
        str(out), weight_name=LORA_WEIGHTS_FILE, prefix="transformer", adapter_name="rl"
    )
    loaded = {n for n, _ in pipe.transformer.named_parameters() if "lora_" in n}
    assert len(loaded) == len(lora)
    fresh = _load(tiny_path)
    fresh._transformer = fresh.pipe.transformer = pipe.transformer
    with torch.no_grad():
        again = fresh.velocity(noise, s, embeds, 1.0)
    torch.testing.assert_close(again, trained, atol=0, rtol=0)


def test_rollout_decodes_videos_and_rescores_its_records(tiny_path: str) -> None:
    policy = _load(tiny_path)
    sampler = Sampler(num_steps=2, guidance_scale=1.0, height=SIZE, width=SIZE, frames=FRAMES)
    traj, videos = sampler.rollout(
        policy, policy.encode_prompts(PROMPTS), torch.tensor([1, 2]), step=0, seed=0
    )
    assert videos.shape == (2, FRAMES, 3, SIZE, SIZE) and 0 <= float(videos.min()) <= float(videos.max()) <= 1
    # Re-scoring the record under the same weights gives the recorded log-probs back (fp32 model).
    embeds = policy.encode_prompts(PROMPTS)
    idx = torch.arange(2)
    for j in range(traj.num_trained):
        with torch.no_grad():
            v = policy.velocity(
                traj.latents[idx, j].float(), torch.full((2,), float(traj.sigmas[j])), embeds, 1.0
            )
        torch.testing.assert_close(traj.score(v, j, idx).log_prob, traj.log_probs[:, j], atol=0, rtol=0)


def test_bad_settings_frames_sizes_and_sequence_parallelism_name_the_flag(
    tiny_path: str, tiny_sd3_path: str
) -> None:
    policy = HunyuanVideo15Policy(tiny_path)  # nothing loaded
    problems = Sampler(height=250, width=416, frames=32).image_size_problems(policy)
    assert len(problems) == 2
    assert problems[0].startswith("--model.init_args.sampler.height (250) must be a positive multiple of 16")
    assert (
        problems[1].startswith("--model.init_args.sampler.frames (32) must be 4k + 1")
        and "use 33" in problems[1]
    )
    assert Sampler(height=480, width=848, frames=33).image_size_problems(policy) == []
    # Sequence parallelism, from the folder's transformer config before any weight: the tiny model's 2
    # heads and the video tokens must split (its text is padded to fit).
    flag = "--model.init_args.performance.sequence_parallel"
    assert policy.sequence_parallel_problems(2, 480, 848, 33, flag) == []
    (problem,) = policy.sequence_parallel_problems(2, 48, 48, 1, flag)
    assert problem.startswith(f"{flag} (2) must divide the 9 video tokens per sample (1 × 3 × 3 patches")
    (problem,) = policy.sequence_parallel_problems(4, 64, 64, 5, flag)
    assert problem.startswith(f"{flag} (4) must divide the 2 attention heads")
    assert policy.pipe is None
    problems = HunyuanVideo15Policy(tiny_path, max_sequence_length=1001, vae_dtype="int8").problems()
    assert [p.split(" ")[0] for p in problems] == [
        "--model.init_args.policy.init_args.vae_dtype",
        "--model.init_args.policy.init_args.max_sequence_length",
    ]
    (wrong,) = HunyuanVideo15Policy(tiny_sd3_path).problems()
    assert "StableDiffusion3Pipeline" in wrong and "HunyuanVideo15Pipeline" in wrong
    loaded = _load(tiny_path)
    with pytest.raises(ValueError, match=r"--model.init_args.sampler.frames \(6\).*4k \+ 1"):
        latent_shape_of(loaded, SIZE, SIZE, 6)
    with pytest.raises(ValueError, match=r"--model.init_args.sampler.width \(24\) must be a multiple of 16"):
        loaded.latent_shape(SIZE, 24, FRAMES)


@pytest.mark.slow
def test_the_recipe_trains_exports_and_resumes_on_the_tiny_pipeline(
    tiny_path: str, prompt_file: str, tmp_path
) -> None:
    """configs/hunyuanvideo15_480p_flowgrpo.yaml end to end on the tiny pipeline, on the CPU: fit (rollout,
    per-frame reward, update, checkpoint), export (read back by the transformer's load_lora_adapter), resume."""

    def load_adapter(pipe: HunyuanVideo15Pipeline, folder: str) -> None:
        # diffusers 0.42 gives the pipeline no LoRA loader: the transformer reads the export itself.
        pipe.transformer.load_lora_adapter(
            folder, weight_name=LORA_WEIGHTS_FILE, prefix="transformer", adapter_name="rl"
        )

    fit_export_resume(
        "hunyuanvideo15_480p_flowgrpo.yaml",
        tiny_path,
        HunyuanVideo15Pipeline,
        prompt_file,
        tmp_path,
        size=SIZE,
        max_len=MAX_LEN,
        frames=FRAMES,
        # The recipe's per-frame wrapper around a reward that needs no weights.
        reward={
            "weights": {"per_frame": 1.0},
            "config": {"per_frame": {"reward": "jpeg_compressibility", "reduce": "mean"}},
        },
        load_adapter=load_adapter,
    )


# slow: one run of two processes beside one in-process run, each two rollouts
@pytest.mark.slow
def test_two_ranks_splitting_each_sample_equal_one_process(
    tiny_path: str, prompt_file: str, tmp_path
) -> None:
    """sp = 2 under DDP (gloo) against one process, through the policy's context-parallel plan and its
    key-masked joint attention: the same rollouts, rewards, advantages and, after two SGD steps, LoRA
    weights, within the bounds of computing them in another order.

    Not bitwise, unlike Wan's split: the split text is padded with one masked row (729 + 256 + 16 = 1001
    rows do not halve), and the attention masks keys only, so each softmax runs over another row length
    with another mask layout; each reducing layer may then round by about eps of its scale, through the
    sampling loop (3 steps at guidance 4.5) for the latents, then the decoder for the rewards."""
    import sp_worker
    from test_ddp import assert_rewards_and_advantages_close
    from test_sequence_parallel import finish, rewards, rollouts, torchrun
    from tolerances import EPS32, sum_rtol

    config = dict(pipeline=tiny_path, prompts=prompt_file, sp=2, family="hunyuanvideo15")
    proc = torchrun(dict(config, strategy="ddp"), tmp_path, "ddp_sp2", 2)
    sp_worker.run(dict(config, sp=1, out=str(tmp_path / "single")))
    finish(proc)

    policy = _load(tiny_path)
    layers = sampling_layers(depth(policy.transformer), 3, 4.5) + 3
    reward_atol = network_atol(layers + depth(policy.vae.decoder), 1.0) + sum_rtol(3 * FRAMES * SIZE * SIZE)
    single, split = tmp_path / "single", tmp_path / "ddp_sp2"
    for step in (0, 1):
        ref, got = rollouts(single, step), rollouts(split, step)
        assert sorted(ref) == sorted(got) == list(range(8))
        for sample, (final, log_prob) in ref.items():
            torch.testing.assert_close(
                got[sample][0], final, rtol=0, atol=network_atol(layers, float(final.abs().max()))
            )
            torch.testing.assert_close(
                got[sample][1], log_prob, rtol=0, atol=network_atol(layers, float(log_prob.abs().max()))
            )
        assert_rewards_and_advantages_close(rewards(single, step), rewards(split, step), reward_atol)
    init, trained = torch.load(single / "rank0_lora_init.pt"), torch.load(single / "rank0_lora.pt")
    moved = max(float((trained[k] - init[k]).abs().max()) for k in trained)

    def close(weights: dict[str, torch.Tensor]) -> bool:
        # each gradient element: the rollouts' rounding above, through the update's forward and backward
        tol = dict(rtol=EPS32, atol=2 * layers * EPS32 * moved)
        return all(torch.allclose(weights[k], v, **tol) for k, v in trained.items())

    # The check can see a gradient off by the factor sp (the partial gradients averaged, not summed).
    assert not close({k: init[k] + (trained[k] - init[k]) / 2 for k in trained})
    for rank in range(2):
        assert close(torch.load(split / f"rank{rank}_lora.pt")), rank
