"""QwenImageEditPlusPolicy against diffusers' own QwenImageEditPlusPipeline, on tiny random Qwen-Image-Edit-2509
and 2511 pipelines saved to disk; editing records (an instruction and one or two source images each) end to end
through FlowGRPOModule and the CLI."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from diffusers import QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus
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
from lit_flowgrpo.objective import FlowGRPO
from lit_flowgrpo.policies.base import HEIGHT_FLAG, pretrained_dtype_kwargs
from lit_flowgrpo.policies.qwenimage_edit import QwenImageEditPlusPolicy, load_processor
from lit_flowgrpo.tiny.qwenimage_edit import build_tiny_qwenimage_edit

FLAG = "--model.init_args.policy.init_args.pretrained"
PROMPTS = ["make the sky red", "add two blue birds"]
SIZE = 32
STEPS = 4
MAX_LEN = 192  # two 32 px sources are 2 x 64 vision tokens, plus the prompt and the template's tail
VISION = SIZE * SIZE  # the vision encoder's copy of a source: 32 x 32, 64 tokens of the tiny vision tower
RECIPE = "qwenimage_edit_geneval_flowgrpo.yaml"


class EditPipeline:
    """``QwenImageEditPlusPipeline.from_pretrained`` with the folder's processor read as the policy reads it
    (transformers' own Qwen2VLProcessor needs torchvision for its video processor)."""

    @staticmethod
    def from_pretrained(path: str, **kwargs) -> QwenImageEditPlusPipeline:
        return QwenImageEditPlusPipeline.from_pretrained(path, processor=load_processor(path), **kwargs)


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {
        v: build_tiny_qwenimage_edit(tmp_path_factory.mktemp(f"tiny_qwen_edit_{v}"), v)
        for v in ("2509", "2511")
    }


@pytest.fixture(scope="module")
def tiny_path(tiny_paths: dict[str, str]) -> str:
    return tiny_paths["2509"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    sizes = {"a": (SIZE, SIZE), "b": (SIZE, SIZE), "big": (2 * SIZE, 2 * SIZE), "wide": (2 * SIZE, SIZE)}
    return write_sources(tmp_path_factory.mktemp("sources"), sizes)


def make_policy(path: str, **overrides) -> QwenImageEditPlusPolicy:
    settings = dict(dtype="float32", max_sequence_length=MAX_LEN, vision_area=VISION)
    settings.update(overrides)
    policy = QwenImageEditPlusPolicy(path, **settings)
    policy.load()
    return policy


@pytest.fixture(scope="module")
def policy(tiny_path: str) -> QwenImageEditPlusPolicy:
    return make_policy(tiny_path)


@pytest.fixture()
def pipeline_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline's two source sizes, module constants it reads on every call (384² for the vision
    encoder, 1024² for the VAE), set to the policy's: the vision encoder's 32², the VAE's the output's."""
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "CONDITION_IMAGE_SIZE", VISION)
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", SIZE * SIZE)


def pipeline_of(path: str) -> QwenImageEditPlusPipeline:
    pipe = EditPipeline.from_pretrained(path, **pretrained_dtype_kwargs(torch.float32))
    pipe.set_progress_bar_config(disable=True)
    return pipe


# --------------------------------------------------------------------------------------------------
# The policy against the pipeline
# --------------------------------------------------------------------------------------------------


def sample(policy, x1: torch.Tensor, conditions: list[Condition], cfg: float) -> torch.Tensor:
    return sample_at_noise_level_zero(policy, PROMPTS, x1, conditions, SIZE, STEPS, guidance_scale=cfg)


@pytest.mark.parametrize(
    ("variant", "names", "cfg"),
    [
        ("2509", ("a",), 4.0),
        ("2509", ("a",), 1.0),
        ("2509", ("big", "b"), 4.0),
        ("2511", ("a", "b"), 4.0),
    ],
    ids=["2509-1src-cfg", "2509-1src-nocfg", "2509-2src-cfg", "2511-2src-cfg"],
)
def test_noise_level_zero_sampling_reproduces_the_pipeline(
    variant: str, names: tuple[str, ...], cfg: float, tiny_paths: dict[str, str], sources, pipeline_sizes
) -> None:
    """Each prompt with its sources, 4 steps at noise level 0 against ``QwenImageEditPlusPipeline.__call__``
    (which takes one prompt a call) from the pipeline's own noise; the "big" source is resized to the output."""
    policy = make_policy(tiny_paths[variant], true_cfg_scale=cfg)
    pipe = pipeline_of(tiny_paths[variant])
    assert pipe.transformer.config.zero_cond_t == (variant == "2511")
    shape = policy.latent_shape(SIZE, SIZE)
    x1, _ = pipe.prepare_latents(
        None, 2, shape[1] // 4, SIZE, SIZE, torch.float32, "cpu", torch.Generator().manual_seed(7)
    )
    assert tuple(x1.shape[1:]) == shape == (64, 16)
    paths = [sources[n] for n in names]
    ours = sample(policy, x1, [condition(*paths)] * 2, cfg)
    ref_latents, ref_images = [], []
    for i, prompt in enumerate(PROMPTS):
        kwargs = dict(
            image=[Image.open(p).convert("RGB") for p in paths],
            prompt=prompt,
            negative_prompt=" ",
            true_cfg_scale=cfg,
            height=SIZE,
            width=SIZE,
            num_inference_steps=STEPS,
        )
        ref_latents.append(pipe(latents=x1[i : i + 1].clone(), output_type="latent", **kwargs).images)
        ref_images.append(pipe(latents=x1[i : i + 1].clone(), output_type="pt", **kwargs).images)
    ref_latents, ref_images = torch.cat(ref_latents), torch.cat(ref_images)
    torch.testing.assert_close(policy.sigmas(STEPS, SIZE, SIZE), pipe.scheduler.sigmas, atol=1e-7, rtol=0)
    # Our CFG halves share one padded batch, the pipeline runs two unpadded ones (each forward's sums may
    # be ordered differently); the SDE step at η = 0 and the scheduler's Euler step need not order their
    # arithmetic alike. Along the loop: STEPS forwards, each rounding amplified by the guidance, and one
    # rounding per step; then the decoder (images in [0, 1]).
    layers = sampling_layers(depth(pipe.transformer), STEPS, cfg) + STEPS
    torch.testing.assert_close(
        ours, ref_latents, atol=network_atol(layers, float(ref_latents.abs().max())), rtol=0
    )
    images = policy.decode(ours)
    assert images.shape == (2, 3, SIZE, SIZE) and images.dtype == torch.float32
    torch.testing.assert_close(
        images, ref_images, atol=network_atol(layers + depth(pipe.vae.decoder), 1.0), rtol=0
    )
    # The comparison means something only if the images are not clamped flat and the sources matter.
    assert ((ref_images > 0.01) & (ref_images < 0.99)).float().mean() > 0.9
    other = [sources["b"] if paths[0] != sources["b"] else sources["a"], *paths[1:]]
    assert (sample(policy, x1, [condition(*other)] * 2, cfg) - ours).abs().max() > 1e-3


def test_the_conditioning_rows_are_the_pipelines_own(
    policy: QwenImageEditPlusPolicy, sources, pipeline_sizes
) -> None:
    """Bit for bit: the prompt and the negative prompt encoded with the sources by ``encode_prompt(image=...)``
    on the pipeline's resized copies, and the sources' latents from its ``prepare_latents``."""
    pipe = policy.pipe
    processor = pipe.image_processor
    paths = [sources["big"], sources["a"]]
    embeds = policy.encode(PROMPTS[:1], [condition(*paths)], SIZE, SIZE)
    pils = [Image.open(p).convert("RGB") for p in paths]
    vision = [processor.resize(p, SIZE, SIZE) for p in pils]
    for key, prompt in (("prompt_embeds", PROMPTS[0]), ("negative_prompt_embeds", " ")):
        ref, mask = pipe.encode_prompt(prompt=[prompt], image=vision, device="cpu")
        assert mask is None  # one prompt: the pipeline drops an all-ones mask
        n = ref.shape[1]
        assert int(embeds[f"{key}_mask"].sum()) == n and n > 2 * 64  # both sources' 64 vision tokens
        torch.testing.assert_close(embeds[key][:, :n], ref, atol=0, rtol=0)
        assert not embeds[key][:, n:].any()
    pixels = [processor.preprocess(p, SIZE, SIZE).unsqueeze(2) for p in pils]
    _, ref = pipe.prepare_latents(
        pixels, 1, 4, SIZE, SIZE, torch.float32, "cpu", None, torch.zeros(1, 64, 16)
    )
    assert ref.shape == (1, 2 * 64, 16)
    torch.testing.assert_close(embeds["source_latents"], ref, atol=0, rtol=0)
    assert embeds["source_shapes"].tolist() == [[[8, 8], [8, 8]]]
    # The negative prompt's rows depend on the sources: another source, other rows.
    other = policy.encode(PROMPTS[:1], [condition(sources["b"], sources["a"])], SIZE, SIZE)
    assert not torch.equal(other["negative_prompt_embeds"], embeds["negative_prompt_embeds"])


def test_records_are_encoded_once_per_size(policy: QwenImageEditPlusPolicy, sources) -> None:
    policy._cache.clear()
    a, b = condition(sources["a"]), condition(sources["b"])
    alone = policy.encode(["p"], [a], SIZE, SIZE)
    mixed = policy.encode(["q", "p", "p", "p"], [a, a, b, a], SIZE, SIZE)
    assert set(mixed) == {
        "prompt_embeds",
        "prompt_embeds_mask",
        "negative_prompt_embeds",
        "negative_prompt_embeds_mask",
        "source_latents",
        "source_shapes",
    }
    assert mixed["source_latents"].shape == (4, 64, 16) and mixed["prompt_embeds"].shape == (4, MAX_LEN, 32)
    assert len(policy._cache) == 3  # (q, a), (p, a), (p, b)
    for key in alone:  # a row is a function of its record, not of the batch it came in
        torch.testing.assert_close(mixed[key][1], alone[key][0], atol=0, rtol=0)
        torch.testing.assert_close(mixed[key][3], alone[key][0], atol=0, rtol=0)
    assert not torch.equal(mixed["source_latents"][1], mixed["source_latents"][2])
    larger = policy.encode(["p"], [condition(sources["big"])], 2 * SIZE, 2 * SIZE)
    assert larger["source_latents"].shape == (1, 4 * 64, 16) and len(policy._cache) == 4


def test_cfg_is_one_batched_forward(policy: QwenImageEditPlusPolicy, sources) -> None:
    embeds = policy.encode(PROMPTS, [condition(sources["a"]), condition(sources["b"])], SIZE, SIZE)
    x = torch.randn(2, *policy.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(0))
    calls = []
    hook = policy.transformer.register_forward_hook(lambda m, args, out: calls.append(args))
    try:
        with torch.no_grad():
            guided = policy.velocity(x, torch.tensor([0.9, 0.4]), embeds, 4.0)
    finally:
        hook.remove()
    assert len(calls) == 1 and guided.shape == x.shape and torch.isfinite(guided).all()


def test_the_sources_are_required_and_counts_must_agree(policy: QwenImageEditPlusPolicy, sources) -> None:
    with pytest.raises(ValueError, match="needs source images"):
        policy.encode(["p"], None, SIZE, SIZE)
    x = torch.zeros(1, *policy.latent_shape(SIZE, SIZE))
    with pytest.raises(ValueError, match="sources' latents"):
        policy.velocity(x, torch.ones(1), policy.encode_prompts(["p"]), 1.0)
    with pytest.raises(ValueError, match=r"give \[1, 2\] source images.*same number"):
        policy.encode(
            ["p", "q"], [condition(sources["a"]), condition(sources["a"], sources["b"])], SIZE, SIZE
        )
    short = make_policy(policy.pretrained, max_sequence_length=32)
    with pytest.raises(ValueError, match=r"max_sequence_length \(32\) is shorter than the \d+ tokens"):
        short.encode(["p"], [condition(sources["a"])], SIZE, SIZE)


def test_source_sizes_that_cannot_be_taken(tiny_path: str) -> None:
    policy = QwenImageEditPlusPolicy(tiny_path)  # nothing loaded: the check runs before load
    assert policy.condition_size_problems(512, 512, 512, 512) == []
    assert policy.condition_size_problems(300, 300, 512, 512) == []  # resized to the output, as flow_grpo
    assert policy.condition_size_problems(1000, 600, 480, 800) == []  # 5:3 both (to 0.01 in log)
    (stretched,) = policy.condition_size_problems(1024, 512, 512, 512)
    assert "aspect ratio (1024x512)" in stretched and "crop or pad" in stretched and HEIGHT_FLAG in stretched
    pipeline_rule = QwenImageEditPlusPolicy(tiny_path, source_area=1024 * 1024)
    assert pipeline_rule.condition_size_problems(700, 700, 512, 512) == []
    assert policy.pipe is None and pipeline_rule.pipe is None
    problems = QwenImageEditPlusPolicy(tiny_path, source_area=100, vision_area=0).problems()
    assert [p.split(" ")[0] for p in problems] == [
        "--model.init_args.policy.init_args.source_area",
        "--model.init_args.policy.init_args.vision_area",
    ]


def test_a_text_to_image_checkpoint_is_refused(tiny_qwenimage_path: str) -> None:
    (problem,) = QwenImageEditPlusPolicy(tiny_qwenimage_path).problems()
    assert re.search(f"{FLAG}.*QwenImagePipeline.*QwenImageEditPlusPipeline", problem), problem


def test_attention_and_flops_count_the_source_tokens(policy: QwenImageEditPlusPolicy) -> None:
    assert policy.attention_shape(SIZE, SIZE).tokens == MAX_LEN + 2 * 64  # prompt, output and source tokens
    out = policy.flops_forward(SIZE, SIZE)()
    assert out.shape == (1, 64, 16) and torch.isfinite(out).all()


# --------------------------------------------------------------------------------------------------
# Editing records through FlowGRPOModule
# --------------------------------------------------------------------------------------------------


class Preservation:
    """1 − mean |result − first source| (the source resized to the result): a reward that sees the sources."""

    uses_sources = True
    needs_sources = True

    def __init__(self) -> None:
        self.seen: list[tuple[tuple[int, ...], ...]] = []

    def __call__(self, images, prompts, metadata, sources):
        self.seen += [tuple(tuple(s.shape) for s in record) for record in sources]
        resized = [
            F.interpolate(s[0][None].to(images), size=images.shape[-2:], mode="bilinear") for s in sources
        ]
        return 1.0 - (images - torch.cat(resized)).abs().mean(dim=(1, 2, 3))


def edit_records(
    root: Path, n: int = 4, per_record: int = 1, size: int = SIZE, name: str = "edits.jsonl"
) -> str:
    """``n`` records, each an instruction and ``per_record`` source PNGs of its own (the first record's first
    source twice the output's size)."""
    root.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        files = []
        for j in range(per_record):
            side = 2 * size if i == j == 0 else size
            files.append(Path(write_source(root / f"src{i}_{j}.png", side, side, seed=10 * i + j)).name)
        lines.append(json.dumps({"prompt": f"edit number {i}", "condition_images": files, "tag": i}))
    path = root / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def edit_module(
    path: str,
    objective=None,
    lora: bool = True,
    reward=None,
    cfg: float = 2.0,
    kl_coef: float = 0.01,
    **sampler,
):
    return FlowGRPOModule(
        policy=QwenImageEditPlusPolicy(
            path, dtype="float32", true_cfg_scale=cfg, max_sequence_length=MAX_LEN, vision_area=VISION
        ),
        reward=reward or Preservation(),
        objective=objective or FlowGRPO(clip_range=1e-2),
        sampler=Sampler(
            **{
                "num_steps": 3,
                "eval_num_steps": 2,
                "guidance_scale": cfg,
                "height": SIZE,
                "width": SIZE,
                **sampler,
            }
        ),
        update=UpdateSettings(micro_batch_size=4, optimizer_steps_per_rollout=2),
        weights=WeightsSettings(lora=LoraSettings(rank=4, alpha=8) if lora else None),
        kl=KLSettings(coef=kl_coef),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
    )


@pytest.mark.slow
@pytest.mark.parametrize("per_record", [1, 2], ids=["1src", "2src"])
def test_one_rollout_scores_the_sources_updates_and_validates(
    per_record: int, tiny_path: str, tmp_path: Path
) -> None:
    records = edit_records(tmp_path / "data", per_record=per_record)
    reward = Preservation()
    module = edit_module(tiny_path, reward=reward)
    trainer = make_trainer(tmp_path, max_steps=2, limit_val_batches=1, val_check_interval=1)
    trainer.check_val_every_n_epoch = None
    fit_moving_the_adapter(module, trainer, edit_data(records))
    row = next(r for r in logged(trainer) if "actor/loss" in r)
    assert math.isfinite(row["actor/loss"]) and row["reward/failure_rate"] == 0.0
    assert row["actor/on_policy_ratio_err"] <= UpdateSettings().on_policy_tolerance(fp32=True)
    # The reward saw each sample's sources at their files' sizes (the first record's first is 64 px).
    shapes = {(3, SIZE, SIZE), (3, 2 * SIZE, 2 * SIZE)}
    assert len(reward.seen) >= 8 and all(len(r) == per_record and set(r) <= shapes for r in reward.seen)
    assert any(k.startswith("val-") for r in logged(trainer) for k in r), "no validation was logged"


@pytest.mark.slow
def test_resume_is_exact(tiny_path: str, tmp_path: Path) -> None:
    """With validation and the record cache on: the uninterrupted run's second rollout finds records cached
    that the resumed run, whose cache starts empty, encodes afresh."""
    records = edit_records(tmp_path / "data", n=3, per_record=2)
    assert_resume_is_exact(lambda: edit_module(tiny_path), records, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_every_objective_takes_a_step_with_the_sources(
    name: str, lora: bool, tiny_path: str, tmp_path: Path
) -> None:
    records = edit_records(tmp_path / "data", n=2, per_record=2)
    cfg = 1.0 if name == "diffusion_nft" else 2.0  # DiffusionNFT is CFG-free: no negative rows then
    # A full fine-tune's KL reference would be a copy of the transformer: measured with LoRA only.
    module = edit_module(
        tiny_path, objective=OBJECTIVES[name](), lora=lora, cfg=cfg, kl_coef=0.01 if lora else 0.0
    )
    wanted = {"source_latents", "source_shapes"} | ({"negative_prompt_embeds"} if cfg > 1 else set())
    step_with_the_conditioning(module, records, tmp_path, wanted, lora, max_steps=1)


# --------------------------------------------------------------------------------------------------
# Bad input, refused before any weight loads
# --------------------------------------------------------------------------------------------------


def refused(tiny_path: str, tmp_path: Path, records: str, match: str) -> None:
    module = edit_module(tiny_path)
    trainer = make_trainer(tmp_path, max_steps=1)
    with pytest.raises((SettingsError, ValueError), match=match):
        trainer.fit(module, datamodule=edit_data(records, val=None))
    assert module.policy.pipe is None


def test_text_only_records_are_refused_before_load(tiny_path: str, prompt_file: str, tmp_path: Path) -> None:
    refused(
        tiny_path, tmp_path, prompt_file, r"--data.init_args.train.*QwenImageEditPlusPolicy.*source image"
    )


def test_four_sources_are_refused_before_load(tiny_path: str, tmp_path: Path) -> None:
    records = edit_records(tmp_path / "data", n=2, per_record=4)
    refused(tiny_path, tmp_path, records, r"record 1 gives 4 condition_images.*takes 1 to 3 source image")


def test_sources_of_another_aspect_ratio_are_refused_before_load(tiny_path: str, tmp_path: Path) -> None:
    records = edit_records(tmp_path / "data", n=2)
    write_source(tmp_path / "data" / "src1_0.png", SIZE, SIZE // 2, seed=0)  # the second record's: 32x16
    refused(
        tiny_path, tmp_path, records, r"src1_0\.png.*aspect ratio \(32x16\) is not the outputs' \(32x32\)"
    )


def test_sources_of_another_aspect_ratio_than_validation_name_the_validation_size(
    tiny_path: str, tmp_path: Path
) -> None:
    """Validation samples at eval_height x eval_width: square sources fit the rollout's 32 x 32 but not
    validation's 64 x 32, and the fix names the settings of that size."""
    records = edit_records(tmp_path / "data", n=2)
    module = edit_module(tiny_path, eval_height=SIZE, eval_width=2 * SIZE)
    trainer = make_trainer(tmp_path, max_steps=1)
    with pytest.raises((SettingsError, ValueError)) as refused:
        trainer.fit(module, datamodule=edit_data(records))
    message = str(refused.value)
    assert re.search(
        r"--data.init_args.val: record 1: source image \S*src0_0\.png: its aspect ratio", message
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
    """flow_grpo config/grpo.py repairany_qwenimage_edit_plus_fast(): 2 GPUs x train_batch_size 4, 4 per
    record, 32 records an epoch, pushed through its own arithmetic (batches per epoch, then accumulation)."""
    cfg = yaml.safe_load((CONFIGS / RECIPE).read_text())
    gpus, per_gpu, group, unique = 2, 4, 4, 32
    batches = int(unique / (gpus * per_gpu / group))  # num_batches_per_epoch = 16
    images = gpus * per_gpu * batches
    model, data, trainer = cfg["model"]["init_args"], cfg["data"]["init_args"], cfg["trainer"]
    assert trainer["devices"] * trainer["num_nodes"] == gpus and trainer["strategy"] == "fsdp2"
    assert (data["prompts_per_step"], data["group_size"]) == (images // group, group) == (32, 4)
    assert model["update"]["micro_batch_size"] == per_gpu
    assert model["update"]["optimizer_steps_per_rollout"] == batches // (batches // 2) == 2
    policy = model["policy"]["init_args"]
    assert policy["true_cfg_scale"] == 4 and policy["pretrained"] == "Qwen/Qwen-Image-Edit-2509"
    # flow_grpo: the VAE copy at the output's size, the vision encoder shown the 512 x 512 source.
    assert policy["source_area"] is None and policy["vision_area"] == 512 * 512
    assert model["reward"]["init_args"]["weights"] == {"geneval": 0.8, "preservation": 0.2}
    sampler = model["sampler"]
    assert (sampler["num_steps"], sampler["eval_num_steps"], sampler["noise_level"]) == (10, 50, 0.9)
    assert (sampler["height"], sampler["width"], sampler["guidance_scale"]) == (512, 512, 4)
    assert (sampler["sde_window_size"], sampler["sde_window_range"]) == (4, [0, 5])
    assert model["objective"]["init_args"]["clip_range"] == 1e-4 and model["kl"]["coef"] == 0.0
    lora = model["weights"]["lora"]
    assert (lora["rank"], lora["alpha"], len(lora["target_modules"])) == (64, 128, 12)
    assert model["optimizer"]["init_args"]["lr"] == 3e-4
    assert model["performance"]["activation_checkpointing"] is True


@pytest.mark.slow
def test_the_recipe_trains_exports_and_resumes_on_the_tiny_pipeline(tiny_path: str, tmp_path: Path) -> None:
    """The recipe end to end on the tiny Qwen-Image-Edit on the CPU: fit (rollout with the sources, reward,
    update, checkpoint), export (read back by QwenImageEditPlusPipeline.load_lora_weights, bit for bit),
    resume."""
    records = edit_records(tmp_path / "data")
    # The recipe's 512² vision copy: the tiny processor's 64 x 64 at most, 256 vision tokens a source.
    fit_export_resume(RECIPE, tiny_path, EditPipeline, records, tmp_path, max_len=320)


@pytest.mark.slow
def test_the_benchmark_runs_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/qwenimage_edit.py --tiny: the GPU figure's script (random weights built from the spec, the
    real module and throughput callback) on the tiny sizes."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from qwenimage_edit import main  # benchmarks/qwenimage_edit.py

    out = tmp_path / "edit.json"
    main(["--tiny", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["images_per_gpu_s"] > 0 and result["measured_rollouts"] == 2
    assert result["onpolicy_ratio_abs_dev"] <= UpdateSettings().on_policy_tolerance(fp32=True)


@pytest.mark.slow
# DDP as users run it (no search for unused parameters): the adapter leaves out the last block's text-stream
# output and MLP, which get no gradient (QwenImagePolicy.unused_modules).
@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_the_recipe_runs_on_two_processes(strategy: str, tiny_path: str, tmp_path: Path) -> None:
    """The recipe under its own strategy (fsdp2: the transformer sharded per block) and under DDP, on 2 CPU
    processes (gloo) launched by torchrun: one rollout with two sources a record, two optimizer steps, the
    on-policy ratio exact (fp32)."""
    recipe_on_two_processes(
        RECIPE,
        strategy,
        edit_records(tmp_path / "data", per_record=2),
        tmp_path,
        policy=dict(pretrained=tiny_path, dtype="float32", max_sequence_length=MAX_LEN, vision_area=VISION),
        sampler=dict(height=SIZE, width=SIZE, num_steps=5, eval_num_steps=2, batch_size=2),
    )
