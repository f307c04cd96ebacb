"""WanPolicy against diffusers' own WanPipeline, on tiny random Wan pipelines saved to disk."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanPipeline
from tolerances import depth, network_atol, sampling_layers

from lit_flowgrpo.parts import AfterUpdate
from lit_flowgrpo.policies.base import latent_shape_of
from lit_flowgrpo.policies.wan import WanPolicy
from lit_flowgrpo.rollout import Sampler
from lit_flowgrpo.tiny.wan import A14B_BOUNDARY_RATIO
from lit_flowgrpo.weights import LoraSettings, TrainableWeights, WeightsSettings

PROMPTS = ["a red cat", "two blue dogs"]
SIZE, FRAMES, STEPS, MAX_LEN = 32, 5, 4, 16


def _load(path: str, **kwargs) -> WanPolicy:
    policy = WanPolicy(path, dtype="float32", max_sequence_length=MAX_LEN, **kwargs)
    policy.load()
    return policy


def _euler(pipe: WanPipeline) -> FlowMatchEulerDiscreteScheduler:
    """diffusers' Euler flow scheduler with the checkpoint's shift: the pipeline's ODE is then an Euler loop."""
    return FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config["flow_shift"])


def _ours_and_pipelines(
    policy: WanPolicy, pipe: WanPipeline, cfg: float, size: int = SIZE
) -> dict[str, torch.Tensor]:
    shape = policy.latent_shape(size, size, FRAMES)
    # 8 tokens: Wan 2.1's VAE (8× in space, 4 channels) at 32 px, the TI2V's (16×, 8 channels) at 64 px
    assert shape == (policy.pipe.vae.config.z_dim, 2, 4, 4)
    noise = torch.randn(len(PROMPTS), *shape, generator=torch.Generator().manual_seed(3))
    sampler = Sampler(num_steps=STEPS, guidance_scale=cfg, height=size, width=size, frames=FRAMES)
    from lit_flowgrpo.rollout import sample_trajectory

    traj = sample_trajectory(
        policy,
        policy.encode_prompts(PROMPTS),
        noise,
        policy.sigmas(STEPS, size, size),
        guidance_scale=cfg,
        noise_level=sampler.noise_level,
        sde_type="sde",
        sde_steps=[],
        train_steps=[],
    )
    kwargs = dict(
        prompt=PROMPTS,
        negative_prompt="",
        guidance_scale=cfg,
        height=size,
        width=size,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        max_sequence_length=MAX_LEN,
    )
    return {
        "ours_latents": traj.final,
        "ours_videos": policy.decode(traj.final),
        "ref_latents": pipe(latents=noise.clone(), output_type="latent", **kwargs).frames,
        "ref_videos": pipe(latents=noise.clone(), output_type="pt", **kwargs).frames,
    }


@pytest.mark.parametrize(
    ("variant", "cfg"), [("2.1", 4.5), ("2.1", 1.0), ("a14b", 4.0), ("ti2v", 5.0)], ids=lambda v: str(v)
)
def test_noise_level_zero_sampling_reproduces_the_pipeline(
    tiny_wan_paths: dict, variant: str, cfg: float
) -> None:
    policy = _load(tiny_wan_paths[variant])
    pipe = WanPipeline.from_pretrained(tiny_wan_paths[variant], torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    # Both on diffusers' Euler scheduler: the checkpoint's UniPC is a multistep solver (tested below).
    policy.pipe.scheduler = _euler(pipe)
    pipe.scheduler = _euler(pipe)
    size = 64 if variant == "ti2v" else SIZE
    out = _ours_and_pipelines(policy, pipe, cfg, size)
    # Our CFG halves share one batch where the pipeline runs two: each forward's reductions may sum in
    # another order. Along the loop: STEPS forwards of one expert each (the deeper, for A14B), each
    # rounding amplified by the guidance, and one rounding per Euler step; then the decoder (videos in
    # [0, 1]). Measured: 1.7e-6 (latents), 1.8e-7 (videos) on AVX-512, AVX2 and the default kernels.
    experts = [pipe.transformer] + ([pipe.transformer_2] if pipe.transformer_2 is not None else [])
    layers = sampling_layers(max(depth(e) for e in experts), STEPS, cfg) + STEPS
    atol = network_atol(layers, float(out["ref_latents"].abs().max()))  # 2.1 at cfg 4.5: 7.2e-4
    torch.testing.assert_close(out["ours_latents"], out["ref_latents"], atol=atol, rtol=0)
    assert (
        out["ours_videos"].shape == (2, FRAMES, 3, size, size) and out["ours_videos"].dtype == torch.float32
    )
    atol = network_atol(layers + depth(pipe.vae.decoder), 1.0)
    torch.testing.assert_close(out["ours_videos"], out["ref_videos"], atol=atol, rtol=0)
    assert (out["ours_videos"][0] - out["ours_videos"][1]).abs().max() > 1e-3


def test_sigmas_are_the_checkpoints_unipc_flow_sigmas(tiny_wan_paths: dict) -> None:
    policy = _load(tiny_wan_paths["2.1"])
    assert isinstance(policy.pipe.scheduler, UniPCMultistepScheduler)
    reference = UniPCMultistepScheduler.from_config(policy.pipe.scheduler.config)
    reference.set_timesteps(20)
    sigmas = policy.sigmas(20, 240, 416)
    torch.testing.assert_close(sigmas, reference.sigmas.float(), atol=0, rtol=0)
    assert sigmas.shape == (21,) and sigmas[-1] == 0 and bool((sigmas[:-1] > sigmas[1:]).all())


def test_the_two_experts_switch_at_the_boundary(tiny_wan_paths: dict) -> None:
    policy = _load(tiny_wan_paths["a14b"])
    high, low = policy.trainable_networks
    assert high is policy.transformer and low is policy.pipe.transformer_2
    assert policy.boundary_timestep == pytest.approx(A14B_BOUNDARY_RATIO * 1000)
    calls: list[str] = []
    hooks = [
        net.register_forward_hook(lambda m, a, o, name=name: calls.append(name))
        for name, net in (("high", high), ("low", low))
    ]
    x = torch.randn(3, *policy.latent_shape(SIZE, SIZE, FRAMES), generator=torch.Generator().manual_seed(0))
    embeds = policy.encode_prompts(["a", "b", "c"])
    try:
        with torch.no_grad():
            for sigma, expert in ((0.876, "high"), (0.875, "high"), (0.874, "low"), (0.2, "low")):
                calls.clear()
                policy.velocity(x, torch.full((3,), sigma), embeds, 4.0)
                assert calls == [expert], sigma  # CFG: one batched forward of the one expert
            # A batch across the boundary: each expert its own rows, the same values as alone.
            calls.clear()
            sigma = torch.tensor([0.9, 0.3, 0.95])
            mixed = policy.velocity(x, sigma, embeds, 4.0)
            assert sorted(calls) == ["high", "low"]
            alone = torch.cat(
                [
                    policy.velocity(
                        x[i : i + 1],
                        sigma[i : i + 1],
                        {"prompt_embeds": embeds["prompt_embeds"][i : i + 1]},
                        4.0,
                    )
                    for i in range(3)
                ]
            )
    finally:
        for h in hooks:
            h.remove()
    # Rows of a batch of 3 (2 + 1 per expert, CFG doubling each) against batches of one: each forward's
    # reductions may sum in another order, amplified by the guidance's |1 − 4| + 4 = 7.
    layers = 7 * max(depth(high), depth(low))
    torch.testing.assert_close(mixed, alone, atol=network_atol(layers, float(alone.abs().max())), rtol=0)
    # With one transformer there is no boundary.
    assert _load(tiny_wan_paths["2.1"]).boundary_timestep is None


@pytest.mark.parametrize("variant", ["2.1", "a14b"])
def test_one_lora_step_trains_only_the_adapters(tiny_wan_paths: dict, variant: str) -> None:
    policy = _load(tiny_wan_paths[variant])
    weights = TrainableWeights(WeightsSettings(lora=LoraSettings(rank=4, alpha=8)), seed=0)
    weights.attach(policy)
    networks = policy.trainable_networks
    assert len(networks) == (2 if variant == "a14b" else 1)
    lora = {n: p for n, p in policy.named_parameters() if "lora_" in n}
    # attn1 and attn2 × (q, k, v, out) in each of 2 blocks, on every expert.
    assert len({n.split(".lora_")[0] for n in lora}) == 8 * 2 * len(networks)
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(2, *policy.latent_shape(SIZE, SIZE, FRAMES), generator=g)
    noise = torch.randn(x0.shape, generator=g)
    embeds = policy.encode_prompts(PROMPTS)
    for sigma in (0.95, 0.3):  # the high- and the low-noise expert of A14B
        s = torch.full((2,), sigma)
        xt = (1 - sigma) * x0 + sigma * noise
        loss = (policy.velocity(xt, s, embeds, 4.5) - (noise - x0)).pow(2).mean()
        loss.backward()
    for name, param in policy.named_parameters():
        if "lora_" in name:
            # Gaussian init: B = 0, so A's first gradient is 0 too; B's is not.
            assert param.requires_grad and param.grad is not None, name
            assert "lora_A" in name or param.grad.abs().sum() > 0, name
        else:
            assert not param.requires_grad and param.grad is None, name
    # The KL reference is every expert with its adapter off: the base model's output.
    before = {n: p.detach().clone() for n, p in lora.items()}
    torch.optim.SGD(lora.values(), lr=0.1).step()
    s = torch.full((2,), 0.3)
    with torch.no_grad():
        trained = policy.velocity(noise, s, embeds, 4.5)
        with weights.copies.reference():
            reference = policy.velocity(noise, s, embeds, 4.5)
        base = _load(tiny_wan_paths[variant]).velocity(noise, s, embeds, 4.5)
    # The adapters off compute the base layers alone: the same computation as the base model, exactly.
    torch.testing.assert_close(reference, base, atol=0, rtol=0)
    assert (trained - reference).abs().max() > 1e-4
    assert all((lora[n] != before[n]).any() for n in lora if "lora_B" in n)


def test_a14b_full_fine_tune_is_refused(tiny_wan_paths: dict) -> None:
    policy = _load(tiny_wan_paths["a14b"])
    with pytest.raises(
        ValueError,
        match=r"--model.init_args.weights.lora=null.*2 networks.*set --model.init_args.weights.lora",
    ):
        TrainableWeights(WeightsSettings(lora=None)).attach(policy)
    # ... and before any weight is read, from the folder's model_index.json.
    from lit_flowgrpo.errors import SettingsError
    from lit_flowgrpo.module import FlowGRPOModule

    assert WanPolicy(tiny_wan_paths["a14b"]).declared_networks == 2
    assert WanPolicy(tiny_wan_paths["2.1"]).declared_networks == 1
    with pytest.raises(SettingsError, match=r"--model.init_args.weights.lora=null.*2 networks"):
        FlowGRPOModule(
            WanPolicy(tiny_wan_paths["a14b"]),
            lambda images, prompts, metadata: images.mean(),
            sampler=Sampler(height=32, width=32, frames=5),
            weights=WeightsSettings(lora=None),
        )


def test_bad_frames_and_sizes_name_the_flag(tiny_wan_paths: dict, tiny_sd3_path: str) -> None:
    policy = WanPolicy(tiny_wan_paths["2.1"])  # nothing loaded
    sampler = Sampler(height=250, width=416, frames=32)
    problems = sampler.image_size_problems(policy)
    assert len(problems) == 2
    assert problems[0].startswith("--model.init_args.sampler.height (250) must be a positive multiple of 16")
    assert (
        problems[1].startswith("--model.init_args.sampler.frames (32) must be 4k + 1")
        and "use 33" in problems[1]
    )
    assert Sampler(height=240, width=416, frames=33).image_size_problems(policy) == []
    # Validation clips of their own length are held to the same rule, under their own flag.
    (problem,) = Sampler(height=240, width=416, frames=33, eval_frames=80).image_size_problems(policy)
    assert (
        problem.startswith("--model.init_args.sampler.eval_frames (80) must be 4k + 1")
        and "use 81" in problem
    )
    assert Sampler(height=240, width=416, frames=33, eval_frames=81).image_size_problems(policy) == []
    (problem,) = Sampler(eval_frames=0).problems()
    assert problem == "--model.init_args.sampler.eval_frames (0) must be at least 1, or null to use frames"
    # An image policy draws one frame.
    from lit_flowgrpo.policies.sd3 import SD3Policy

    (problem,) = Sampler(height=32, width=32, frames=5).image_size_problems(SD3Policy(tiny_sd3_path))
    assert problem.startswith("--model.init_args.sampler.frames (5) must be 1 for SD3Policy")
    (problem,) = Sampler(height=32, width=32, eval_frames=5).image_size_problems(SD3Policy(tiny_sd3_path))
    assert problem.startswith("--model.init_args.sampler.eval_frames (5) must be 1 for SD3Policy")
    # Once loaded, the checkpoint's own factors are checked too.
    policy = _load(tiny_wan_paths["2.1"])
    with pytest.raises(ValueError, match=r"--model.init_args.sampler.frames \(6\).*4k \+ 1"):
        latent_shape_of(policy, SIZE, SIZE, 6)
    with pytest.raises(ValueError, match=r"--model.init_args.sampler.width \(24\) must be a multiple of 16"):
        policy.latent_shape(SIZE, 24, FRAMES)
    # Wan 2.2's 16× VAE (the TI2V form): multiples of 32, read from its config before any weight.
    ti2v = WanPolicy(tiny_wan_paths["ti2v"])
    (problem,) = Sampler(height=48, width=64, frames=5).image_size_problems(ti2v)
    assert problem.startswith("--model.init_args.sampler.height (48) must be") and "32" in problem
    assert Sampler(height=64, width=96, frames=5).image_size_problems(ti2v) == []
    # Settings of the policy itself, before any weight.
    problems = WanPolicy(tiny_wan_paths["2.1"], max_sequence_length=600, guidance_scale_2=0.0).problems()
    assert [p.split(" ")[0] for p in problems] == [
        "--model.init_args.policy.init_args.max_sequence_length",
        "--model.init_args.policy.init_args.guidance_scale_2",
    ]
    (wrong,) = WanPolicy(tiny_sd3_path).problems()
    assert "StableDiffusion3Pipeline" in wrong and "WanPipeline" in wrong


def test_rollout_decodes_videos_and_keeps_bf16_records(tiny_wan_paths: dict) -> None:
    policy = _load(tiny_wan_paths["2.1"])
    sampler = Sampler(
        num_steps=3, guidance_scale=4.5, height=SIZE, width=SIZE, frames=FRAMES, record_dtype="bfloat16"
    )
    traj, videos = sampler.rollout(
        policy, policy.encode_prompts(PROMPTS), torch.tensor([1, 2]), step=0, seed=0
    )
    assert videos.shape == (2, FRAMES, 3, SIZE, SIZE)
    assert traj.latents.shape == (2, 2, 4, 2, 4, 4) and traj.latents.dtype == torch.bfloat16
    assert traj.final.dtype == torch.float32 and traj.log_probs.dtype == torch.float32
    # Re-scoring the record under the same weights gives the recorded log-probs back (fp32 model).
    embeds = policy.encode_prompts(PROMPTS)
    idx = torch.arange(2)
    for j in range(traj.num_trained):
        x = traj.latents[idx, j].float()
        with torch.no_grad():
            v = policy.velocity(x, torch.full((2,), float(traj.sigmas[j])), embeds, 4.5)
        torch.testing.assert_close(traj.score(v, j, idx).log_prob, traj.log_probs[:, j], atol=0, rtol=0)


def test_validation_draws_eval_frames(tiny_wan_paths: dict) -> None:
    """Rollouts at ``frames``, validation at ``eval_frames``: the same prompts and seeds give clips
    of each length."""
    policy = _load(tiny_wan_paths["2.1"])
    sampler = Sampler(num_steps=2, eval_num_steps=2, height=SIZE, width=SIZE, frames=FRAMES, eval_frames=9)
    seeds = torch.tensor([1, 2])
    _, rollout = sampler.rollout(policy, policy.encode_prompts(PROMPTS), seeds, step=0, seed=0)
    assert rollout.shape == (2, FRAMES, 3, SIZE, SIZE)
    assert sampler.evaluate(policy, PROMPTS, seeds).shape == (2, 9, 3, SIZE, SIZE)
    assert Sampler(height=SIZE, width=SIZE, frames=FRAMES).eval_frame_count == FRAMES


def test_flops_forward_runs_the_first_expert(tiny_wan_paths: dict) -> None:
    from lit_flowgrpo.callbacks.throughput import measure_transformer_flops

    policy = _load(tiny_wan_paths["a14b"])
    TrainableWeights(WeightsSettings(lora=LoraSettings(rank=4))).attach(policy)
    fwd, fwd_bwd = measure_transformer_flops(policy, SIZE, SIZE, frames=FRAMES)
    one_frame, _ = measure_transformer_flops(policy, SIZE, SIZE, frames=1)
    assert fwd_bwd > fwd > one_frame > 0
    # The count's backward left no gradient on either expert.
    assert all(p.grad is None for n in policy.trainable_networks for p in n.parameters())


def test_old_policy_keeps_and_restores_both_experts(tiny_wan_paths: dict) -> None:
    """DiffusionNFT's old policy over two experts: stored, swapped in and back, averaged, checkpointed."""
    policy = _load(tiny_wan_paths["a14b"])
    weights = TrainableWeights(WeightsSettings(lora=LoraSettings(rank=4)), old_policy=lambda steps: 0.5)
    weights.attach(policy)
    old = weights.copies.old_policy.state_dict()
    assert any(k.startswith("network1.") for k in old) and any(not k.startswith("network1.") for k in old)
    trained = [p for n in policy.trainable_networks for p in n.parameters() if p.requires_grad]
    with torch.no_grad():
        for p in trained:
            p.add_(1.0)
    now = [p.detach().clone() for p in trained]
    with weights.copies.old():
        inside = [p.detach().clone() for p in trained]
    assert all(
        torch.allclose(a, b - 1.0, atol=1e-6) for a, b in zip(inside, now, strict=True)
    )  # the old values, both experts
    assert all(torch.equal(p, b) for p, b in zip(trained, now, strict=True))  # and back
    weights.copies.old_policy.after_update(AfterUpdate(policy, optimizer_steps=1, update_steps=1))  # η = 0.5
    assert all(torch.allclose(weights.copies.old_policy.state_dict()[k], v + 0.5) for k, v in old.items())


def test_a_reward_that_cannot_score_video_is_refused(tiny_wan_paths: dict) -> None:
    from lit_flowgrpo.errors import SettingsError
    from lit_flowgrpo.module import FlowGRPOModule
    from lit_flowgrpo.policies.base import reward_modality_problems
    from lit_flowgrpo.rewards.base import MultiReward

    policy = WanPolicy(tiny_wan_paths["2.1"])
    sampler = Sampler(height=32, width=32, frames=5, num_steps=2)
    with pytest.raises(SettingsError) as err:
        FlowGRPOModule(policy, {"jpeg_compressibility": 1.0}, sampler=sampler)
    message = str(err.value)
    assert "'jpeg_compressibility'" in message and "lit_flowgrpo.rewards.video.PerFrame" in message

    class Both:
        modalities = frozenset({"image", "video"})

        def __call__(self, images, prompts, metadata):
            return images.flatten(1).mean(1)

    assert reward_modality_problems(policy, MultiReward({"r": 1.0}, rewards={"r": Both()})) == []
    assert reward_modality_problems(policy, Both()) == []
    FlowGRPOModule(policy, Both(), sampler=sampler)  # a plain callable that declares video
