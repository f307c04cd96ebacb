"""FluxKontextPolicy against diffusers' own FluxKontextPipeline, on a tiny random Kontext saved to disk; editing
records (a prompt and a source image each) end to end through FlowGRPOModule and the CLI."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from diffusers import FluxKontextPipeline
from diffusers.pipelines.flux.pipeline_flux_kontext import retrieve_latents
from edit_run import (
    CONFIGS,
    OBJECTIVES,
    assert_resume_is_exact,
    condition,
    edit_data,
    fit_moving_the_adapter,
    recipe_on_two_processes,
    sample_at_noise_level_zero,
    step_with_the_conditioning,
    write_source,
    write_sources,
)
from PIL import Image
from recipe_run import fit_export_resume
from test_module import logged, make_trainer
from tolerances import depth, network_atol, sampling_layers

from lit_flowgrpo import (
    FlowGRPOModule,
    KLSettings,
    LoraSettings,
    Sampler,
    UpdateSettings,
    WeightsSettings,
)
from lit_flowgrpo.conditioning import Condition
from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.kl import ReferenceSettings
from lit_flowgrpo.objective import FlowGRPO
from lit_flowgrpo.policies.base import HEIGHT_FLAG, pretrained_dtype_kwargs
from lit_flowgrpo.policies.flux_kontext import FluxKontextPolicy
from lit_flowgrpo.tiny.flux_kontext import build_tiny_flux_kontext

FLAG = "--model.init_args.policy.init_args.pretrained"
PROMPTS = ["make the sky red", "add two blue birds"]
SIZE = 32
STEPS = 4
MAX_LEN = 24
RECIPE = "flux_kontext_geneval_flowgrpo.yaml"


@pytest.fixture(scope="module")
def tiny_kontext_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_flux_kontext(tmp_path_factory.mktemp("tiny_flux_kontext"))


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    sizes = {"a": (SIZE, SIZE), "b": (SIZE, SIZE), "big": (2 * SIZE, 2 * SIZE)}
    return write_sources(tmp_path_factory.mktemp("sources"), sizes)


@pytest.fixture(scope="module")
def policy(tiny_kontext_path: str) -> FluxKontextPolicy:
    # Not the default guidance, so the pipeline comparison shows that this value is the one used.
    p = FluxKontextPolicy(tiny_kontext_path, dtype="float32", guidance_scale=5.0, max_sequence_length=MAX_LEN)
    p.load()
    return p


@pytest.fixture(scope="module")
def pipe(tiny_kontext_path: str) -> FluxKontextPipeline:
    pipe = FluxKontextPipeline.from_pretrained(tiny_kontext_path, **pretrained_dtype_kwargs(torch.float32))
    pipe.set_progress_bar_config(disable=True)
    return pipe


# --------------------------------------------------------------------------------------------------
# The policy against the pipeline
# --------------------------------------------------------------------------------------------------


def sample(policy: FluxKontextPolicy, x1: torch.Tensor, conditions: list[Condition]) -> torch.Tensor:
    # The loop's CFG scale (4.5), which Kontext ignores: its guidance is the policy's.
    return sample_at_noise_level_zero(policy, PROMPTS, x1, conditions, SIZE, STEPS, guidance_scale=4.5)


def test_noise_level_zero_sampling_reproduces_the_pipeline(
    policy: FluxKontextPolicy, pipe: FluxKontextPipeline, sources: dict[str, str]
) -> None:
    shape = policy.latent_shape(SIZE, SIZE)
    generator = torch.Generator().manual_seed(7)
    # The pipeline's initial noise for this seed (drawn unpacked, then packed); no source: noise only.
    x1, _, _, _ = pipe.prepare_latents(None, 2, shape[1] // 4, SIZE, SIZE, torch.float32, "cpu", generator)
    assert tuple(x1.shape[1:]) == shape == (64, 16)
    ours = sample(policy, x1, [condition(sources["a"]), condition(sources["b"])])
    kwargs = dict(
        image=[Image.open(sources["a"]).convert("RGB"), Image.open(sources["b"]).convert("RGB")],
        prompt=PROMPTS,
        height=SIZE,
        width=SIZE,
        max_area=SIZE * SIZE,  # else __call__ rescales the output to a megapixel
        _auto_resize=False,  # else the source is snapped to a preferred Kontext size; here it is the output's
        num_inference_steps=STEPS,
        guidance_scale=policy.guidance_scale,
        max_sequence_length=MAX_LEN,
    )
    ref_latents = pipe(latents=x1.clone(), output_type="latent", **kwargs).images
    ref_images = pipe(latents=x1.clone(), output_type="pt", **kwargs).images
    # The same forwards, but two codes (the SDE step at η = 0 and the scheduler's Euler step) that need
    # not order each step's arithmetic alike: STEPS forwards and one step's rounding each; then the decoder.
    layers = sampling_layers(depth(pipe.transformer), STEPS) + STEPS
    torch.testing.assert_close(
        ours, ref_latents, atol=network_atol(layers, float(ref_latents.abs().max())), rtol=0
    )
    images = policy.decode(ours)
    assert images.shape == (2, 3, SIZE, SIZE) and images.dtype == torch.float32
    atol = network_atol(layers + depth(pipe.vae.decoder), 1.0)
    torch.testing.assert_close(images, ref_images, atol=atol, rtol=0)
    # The comparison means something only if the images are not clamped flat and the sources matter.
    assert ((ref_images > 0.01) & (ref_images < 0.99)).float().mean() > 0.9
    swapped = sample(policy, x1, [condition(sources["b"]), condition(sources["a"])])
    assert (swapped - ours).abs().max() > 1e-3


def test_the_source_tokens_are_the_pipelines_own(
    policy: FluxKontextPolicy, pipe: FluxKontextPipeline, sources: dict[str, str]
) -> None:
    """Bit for bit: the pipeline's image processor (Lanczos resize of the 8-bit image, [-1, 1]), then its
    prepare_latents (the VAE's mean, FLUX's shift and scale, 2x2 packing); a source twice the output's size
    is resized to it."""
    processor = pipe.image_processor
    vae = pipe.vae
    for name in ("a", "big"):
        ours = policy.encode(["p"], [condition(sources[name])], SIZE, SIZE)["image_latents"]
        pil = Image.open(sources[name]).convert("RGB")
        pixels = processor.preprocess(processor.resize(pil, SIZE, SIZE), SIZE, SIZE)
        placeholder = torch.zeros(1, 64, 16)
        _, theirs, _, ids = pipe.prepare_latents(
            pixels, 1, 4, SIZE, SIZE, torch.float32, "cpu", None, placeholder
        )
        assert ours.shape == (1, 64, 16) and ours.dtype == torch.float32
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
        # The same thing from the pipeline's parts one by one.
        z = retrieve_latents(vae.encode(pixels), sample_mode="argmax")
        z = (z - vae.config.shift_factor) * vae.config.scaling_factor
        torch.testing.assert_close(ours, pipe._pack_latents(z, 1, 4, SIZE // 2, SIZE // 2), atol=0, rtol=0)
        assert (ids[:, 0] == 1).all()  # the ids the policy gives the source tokens (first coordinate 1)


def test_prompts_and_sources_are_encoded_once_per_size(
    policy: FluxKontextPolicy, sources: dict[str, str]
) -> None:
    policy._cache.clear()
    policy._sources.clear()
    a, b = condition(sources["a"]), condition(sources["b"])
    alone = policy.encode(["p"], [a], SIZE, SIZE)
    mixed = policy.encode(["q", "p", "p"], [b, a, a], SIZE, SIZE)
    assert set(mixed) == {"prompt_embeds", "pooled_prompt_embeds", "image_latents"}
    assert mixed["image_latents"].shape == (3, 64, 16) and mixed["prompt_embeds"].shape == (3, MAX_LEN, 32)
    assert len(policy._sources) == 2 and len(policy._cache) == 2
    for key in alone:  # a row is a function of its prompt and source, not of the batch it came in
        torch.testing.assert_close(mixed[key][1], alone[key][0], atol=0, rtol=0)
        torch.testing.assert_close(mixed[key][2], alone[key][0], atol=0, rtol=0)
    assert not torch.equal(mixed["image_latents"][0], mixed["image_latents"][1])
    larger = policy.encode(["p"], [condition(sources["big"])], 2 * SIZE, 2 * SIZE)
    assert larger["image_latents"].shape == (1, 4 * 64, 16) and len(policy._sources) == 3


def test_the_source_is_required(policy: FluxKontextPolicy, sources: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="needs source images"):
        policy.encode(["p"], None, SIZE, SIZE)
    with pytest.raises(ValueError, match="takes one source image a record, got 2"):
        policy.encode(["p"], [condition(sources["a"], sources["b"])], SIZE, SIZE)
    x = torch.zeros(1, *policy.latent_shape(SIZE, SIZE))
    with pytest.raises(ValueError, match="image_latents"):
        policy.velocity(x, torch.ones(1), policy.encode_prompts(["p"]), 1.0)


def test_source_sizes_that_cannot_be_taken(tiny_kontext_path: str) -> None:
    policy = FluxKontextPolicy(tiny_kontext_path)  # nothing loaded: the check runs before load
    assert policy.condition_size_problems(512, 512, 512, 512) == []
    assert policy.condition_size_problems(1024, 1024, 512, 512) == []  # downsampled, as flow_grpo does
    assert policy.condition_size_problems(1000, 600, 480, 800) == []  # 5:3 both (to 0.01 in log)
    (small,) = policy.condition_size_problems(256, 512, 512, 512)
    assert "256x512 pixels, smaller than the 512x512 outputs" in small and HEIGHT_FLAG in small
    (stretched,) = policy.condition_size_problems(1024, 512, 512, 512)
    assert "aspect ratio (1024x512)" in stretched and "crop the sources" in stretched
    assert policy.pipe is None


def test_a_text_to_image_checkpoint_is_refused(tiny_flux_path: str) -> None:
    (problem,) = FluxKontextPolicy(tiny_flux_path).problems()
    assert re.search(f"{FLAG}.*FluxPipeline.*FluxKontextPipeline", problem), problem


def test_attention_and_flops_count_the_source_tokens(policy: FluxKontextPolicy) -> None:
    assert policy.attention_shape(SIZE, SIZE).tokens == MAX_LEN + 2 * 64  # prompt, noisy and source tokens
    out = policy.flops_forward(SIZE, SIZE)()
    assert out.shape == (1, 64, 16) and torch.isfinite(out).all()


# --------------------------------------------------------------------------------------------------
# Editing records through FlowGRPOModule
# --------------------------------------------------------------------------------------------------


class Preservation:
    """1 − mean |result − source| (the source resized to the result): a reward that sees the sources."""

    uses_sources = True
    needs_sources = True

    def __init__(self) -> None:
        self.seen: list[tuple[int, ...]] = []

    def __call__(self, images, prompts, metadata, sources):
        self.seen += [tuple(s[0].shape) for s in sources]
        size = images.shape[-2:]
        resized = [
            F.interpolate(s[0][None].to(images), size=size, mode="bilinear", antialias=True) for s in sources
        ]
        return 1.0 - (images - torch.cat(resized)).abs().mean(dim=(1, 2, 3))


def edit_records(root: Path, n: int = 4, size: int = SIZE, name: str = "edits.jsonl") -> str:
    """``n`` records, each an instruction and its own source PNG (the first one twice the output's size)."""
    root.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        side = 2 * size if i == 0 else size
        write_source(root / f"src{i}.png", side, side, seed=10 + i)
        lines.append(
            json.dumps({"prompt": f"edit number {i}", "condition_images": [f"src{i}.png"], "tag": i})
        )
    path = root / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def kontext_module(
    path: str, objective=None, lora: bool = True, reward=None, kl_coef: float = 0.01, **sampler
):
    return FlowGRPOModule(
        policy=FluxKontextPolicy(path, dtype="float32", max_sequence_length=16),
        reward=reward or Preservation(),
        objective=objective or FlowGRPO(clip_range=1e-2),
        sampler=Sampler(
            **{
                "num_steps": 3,
                "eval_num_steps": 2,
                "guidance_scale": 1.0,
                "height": SIZE,
                "width": SIZE,
                **sampler,
            }
        ),
        update=UpdateSettings(micro_batch_size=4, optimizer_steps_per_rollout=2),
        weights=WeightsSettings(lora=LoraSettings(rank=4, alpha=8) if lora else None),
        # A full fine-tune's KL reference is a frozen copy of the initial transformer (LoRA's: the adapter off).
        kl=KLSettings(coef=kl_coef, reference=ReferenceSettings(copy=not lora)),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
    )


@pytest.mark.slow
def test_one_rollout_scores_the_sources_updates_and_validates(tiny_kontext_path: str, tmp_path: Path) -> None:
    records = edit_records(tmp_path / "data")
    reward = Preservation()
    module = kontext_module(tiny_kontext_path, reward=reward)
    trainer = make_trainer(tmp_path, max_steps=2, limit_val_batches=1, val_check_interval=1)
    trainer.check_val_every_n_epoch = None
    fit_moving_the_adapter(module, trainer, edit_data(records))
    row = next(r for r in logged(trainer) if "actor/loss" in r)
    assert math.isfinite(row["actor/loss"]) and row["reward/failure_rate"] == 0.0
    assert row["actor/on_policy_ratio_err"] <= UpdateSettings().on_policy_tolerance(fp32=True)
    # The reward saw each sample's source at its file's size (the first record's is 64 px).
    assert set(reward.seen) <= {(3, SIZE, SIZE), (3, 2 * SIZE, 2 * SIZE)} and len(reward.seen) >= 8
    assert any(k.startswith("val-") for r in logged(trainer) for k in r), "no validation was logged"


@pytest.mark.slow
def test_resume_is_exact(tiny_kontext_path: str, tmp_path: Path) -> None:
    """With validation on and the prompt and source caches on: the uninterrupted run's second rollout finds
    records cached that the resumed run, whose caches start empty, encodes afresh."""
    assert_resume_is_exact(
        lambda: kontext_module(tiny_kontext_path), edit_records(tmp_path / "data", n=3), tmp_path
    )


@pytest.mark.slow
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_every_objective_takes_a_step_with_the_source(
    name: str, lora: bool, tiny_kontext_path: str, tmp_path: Path
) -> None:
    records = edit_records(tmp_path / "data", n=2)
    module = kontext_module(tiny_kontext_path, objective=OBJECTIVES[name](), lora=lora)
    step_with_the_conditioning(module, records, tmp_path, {"image_latents"}, lora, max_steps=2)


# --------------------------------------------------------------------------------------------------
# Bad input, refused before any weight loads
# --------------------------------------------------------------------------------------------------


def test_text_only_records_are_refused_before_load(
    tiny_kontext_path: str, prompt_file: str, tmp_path
) -> None:
    module = kontext_module(tiny_kontext_path)
    trainer = make_trainer(tmp_path, max_steps=1)
    with pytest.raises(
        (SettingsError, ValueError), match=r"--data.init_args.train.*FluxKontextPolicy.*source image"
    ):
        trainer.fit(module, datamodule=edit_data(prompt_file, val=None))
    assert module.policy.pipe is None


def test_a_source_smaller_than_the_output_is_refused_before_load(
    tiny_kontext_path: str, tmp_path: Path
) -> None:
    records = edit_records(tmp_path / "data", n=2, size=SIZE // 2)  # the second source is 16 px
    module = kontext_module(tiny_kontext_path)
    trainer = make_trainer(tmp_path, max_steps=1)
    with pytest.raises((SettingsError, ValueError), match=r"src1\.png.*16x16 pixels, smaller than the 32x32"):
        trainer.fit(module, datamodule=edit_data(records, val=None))
    assert module.policy.pipe is None


def test_a_source_too_small_for_validation_names_the_validation_size(
    tiny_kontext_path: str, tmp_path: Path
) -> None:
    """Validation samples at eval_height x eval_width: a source that fits the rollout's 32 px but not
    validation's 64 px is refused for the validation set, and the fix names the settings of that size."""
    records = edit_records(tmp_path / "data", n=2)  # sources of 64 and 32 px
    module = kontext_module(tiny_kontext_path, eval_height=2 * SIZE, eval_width=2 * SIZE)
    trainer = make_trainer(tmp_path, max_steps=1)
    with pytest.raises((SettingsError, ValueError)) as refused:
        trainer.fit(module, datamodule=edit_data(records))
    message = str(refused.value)
    assert re.search(
        r"--data.init_args.val: record 2: source image \S*src1\.png: .*smaller than the 64x64", message
    )
    assert "--data.init_args.train:" not in message
    assert (
        "--model.init_args.sampler.eval_height" in message
        and "--model.init_args.sampler.eval_width" in message
    )
    assert module.policy.pipe is None


# --------------------------------------------------------------------------------------------------
# The recipe
# --------------------------------------------------------------------------------------------------


def test_the_recipe_holds_the_published_numbers() -> None:
    """flow_grpo config/grpo.py counting_flux_kontext(): 28 GPUs x train_batch_size 3, 21 per record, 48
    records, pushed through its own arithmetic (lcm, then batches per epoch, then accumulation)."""
    cfg = yaml.safe_load((CONFIGS / RECIPE).read_text())
    gpus, per_gpu, group, unique = 28, 3, 21, 48
    images = math.lcm(group * unique, gpus * per_gpu)
    batches = images // (gpus * per_gpu)
    model, data = cfg["model"]["init_args"], cfg["data"]["init_args"]
    trainer = cfg["trainer"]
    assert trainer["devices"] * trainer["num_nodes"] == gpus
    assert (data["prompts_per_step"], data["group_size"]) == (images // group, group) == (48, 21)
    assert model["update"]["micro_batch_size"] == per_gpu
    assert model["update"]["optimizer_steps_per_rollout"] == batches // (batches // 2) == 2
    assert model["policy"]["init_args"]["guidance_scale"] == 2.5
    assert model["policy"]["init_args"]["max_sequence_length"] == 128
    sampler = model["sampler"]
    assert (sampler["num_steps"], sampler["eval_num_steps"], sampler["noise_level"]) == (6, 28, 0.9)
    assert (sampler["height"], sampler["width"], sampler["timestep_fraction"]) == (512, 512, 0.99)
    assert model["objective"]["init_args"]["clip_range"] == 1e-4 and model["kl"]["coef"] == 0.0
    lora = model["weights"]["lora"]
    assert (lora["rank"], lora["alpha"], len(lora["target_modules"])) == (64, 128, 13)
    assert model["optimizer"]["init_args"]["lr"] == 3e-4


@pytest.mark.slow
def test_the_recipe_trains_exports_and_resumes_on_the_tiny_pipeline(
    tiny_kontext_path: str, tmp_path: Path
) -> None:
    """configs/flux_kontext_geneval_flowgrpo.yaml end to end on the tiny Kontext, on the CPU: fit (rollout
    with the sources, reward, update, checkpoint), export (read back by FluxKontextPipeline.load_lora_weights,
    bit for bit), resume."""
    records = edit_records(tmp_path / "data")
    fit_export_resume(RECIPE, tiny_kontext_path, FluxKontextPipeline, records, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_the_recipe_runs_on_two_processes(strategy: str, tiny_kontext_path: str, tmp_path: Path) -> None:
    """The recipe under its own strategy (DDP, as users run it: no search for unused parameters) and under
    fsdp2 (the transformer sharded per block), on 2 CPU processes (gloo) launched by torchrun: one rollout
    with the sources, two optimizer steps, the on-policy ratio within the fp32 tolerance."""
    recipe_on_two_processes(
        RECIPE,
        strategy,
        edit_records(tmp_path / "data"),
        tmp_path,
        policy=dict(pretrained=tiny_kontext_path, dtype="float32", max_sequence_length=16),
        sampler=dict(height=SIZE, width=SIZE, num_steps=3, eval_num_steps=2, batch_size=2),
    )


@pytest.mark.slow
def test_the_benchmark_runs_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/flux_kontext.py --tiny: the GPU figure's script (random weights, the real module, data
    module with source PNGs and throughput callback) on the tiny sizes."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from flux_kontext import main  # benchmarks/flux_kontext.py

    out = tmp_path / "kontext.json"
    main(["--tiny", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["images_per_gpu_s"] > 0 and result["measured_steps"] == 2
    assert result["onpolicy_ratio_abs_dev"] <= UpdateSettings().on_policy_tolerance(fp32=True)
