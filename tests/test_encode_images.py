"""Each family's ``encode_images`` against its own diffusers pipeline: the latents it gives are the ones the
family's image-conditioned pipeline computes for the same image (its ``_encode_vae_image`` or the lines of
its ``prepare_latents``, with the VAE's mean, ``sample_mode="argmax"``), packed by the pipeline's own
``_pack_latents``; the pipeline's own unpacking gives back the VAE's grid, and ``decode`` takes them
(the layout ``velocity`` takes). Then SFT and offline Diffusion-DPO take a step on the tiny FLUX.1 and
Qwen-Image.

The two sides run the same operations on the same tensors in the same order, so they agree bit for bit
(tests/tolerances.py: same shapes through the same kernels give the same bits).
"""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from test_datasets_images import write_images
from test_module import brightness, make_trainer

from lit_flowgrpo import FlowGRPOModule, KLSettings, Sampler, UpdateSettings
from lit_flowgrpo.data_batch import encode_images
from lit_flowgrpo.data_objective import SFT, DiffusionDPO
from lit_flowgrpo.image_data import ImageDataModule
from lit_flowgrpo.policies.base import FlowPolicy, vae_pixels
from lit_flowgrpo.weights import LoraSettings, WeightsSettings

SIZE = 32


def _images(batch: int = 2, size: int = SIZE, frames: int | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    shape = (batch, 3, size, size) if frames is None else (batch, frames, 3, size, size)
    return torch.rand(shape, generator=gen)


def _mode(vae, pixels: torch.Tensor) -> torch.Tensor:
    from diffusers.pipelines.flux.pipeline_flux_kontext import retrieve_latents

    return retrieve_latents(vae.encode(pixels), sample_mode="argmax")


@pytest.fixture(scope="module")
def flux(tiny_flux_path):
    from lit_flowgrpo.policies import FluxPolicy

    p = FluxPolicy(tiny_flux_path, dtype="float32", max_sequence_length=16)
    p.load()
    return p


@pytest.fixture(scope="module")
def qwen(tiny_qwenimage_path):
    from lit_flowgrpo.policies import QwenImagePolicy

    p = QwenImagePolicy(tiny_qwenimage_path, dtype="float32", max_sequence_length=16)
    p.load()
    return p


@torch.no_grad()
@pytest.mark.parametrize("family", ["sd3", "zimage"])
def test_unpacked_latents_are_the_img2img_normalisation(family, request):
    # StableDiffusion3Img2ImgPipeline.prepare_latents and ZImageImg2ImgPipeline.prepare_latents alike:
    # (z - shift) * scale of the VAE's latent, unpacked
    from lit_flowgrpo.policies import SD3Policy, ZImagePolicy

    path = request.getfixturevalue(f"tiny_{family}_path")
    policy = (
        SD3Policy(path, dtype="float32")
        if family == "sd3"
        else ZImagePolicy(path, dtype="float32", max_sequence_length=16)
    )
    policy.load()
    images = _images()
    x0 = encode_images(policy, images)
    vae = policy.vae
    want = (_mode(vae, vae_pixels(vae, images)) - vae.config.shift_factor) * vae.config.scaling_factor
    assert torch.equal(x0, want)
    assert tuple(x0.shape[1:]) == policy.latent_shape(SIZE, SIZE)
    assert policy.decode(x0).shape == images.shape


@torch.no_grad()
def test_flux_is_kontexts_encoding_packed_by_the_pipeline(flux):
    from diffusers import FluxKontextPipeline

    images = _images(size=SIZE)
    x0 = encode_images(flux, images)
    pipe, vae = flux.pipe, flux.vae
    # FluxKontextPipeline encodes its conditioning image so (it reads only self.vae), then packs it.
    z = FluxKontextPipeline._encode_vae_image(pipe, image=vae_pixels(vae, images), generator=None)
    assert torch.equal(x0, pipe._pack_latents(z, *z.shape))
    # The pipeline's own unpacking gives the VAE grid back, and the layout is the one velocity takes.
    assert torch.equal(pipe._unpack_latents(x0, SIZE, SIZE, pipe.vae_scale_factor), z)
    assert tuple(x0.shape[1:]) == flux.latent_shape(SIZE, SIZE)
    assert flux.decode(x0).shape == images.shape


@torch.no_grad()
def test_flux_remembers_a_non_square_grid(flux):
    images = torch.rand(1, 3, 32, 64)
    x0 = encode_images(flux, images)
    assert flux.decode(x0).shape == images.shape  # decoded at 32x64, not at a square guess


@torch.no_grad()
def test_qwenimage_is_the_edit_pipelines_encoding_packed_by_the_pipeline(qwen):
    from diffusers import QwenImageEditPipeline

    images = _images()
    x0 = encode_images(qwen, images)
    pipe, vae = qwen.pipe, qwen.vae
    # QwenImageEditPipeline.prepare_latents: a frame axis of 1, the VAE's mean, (z - mean) / std.
    edit = SimpleNamespace(vae=vae, latent_channels=vae.config.z_dim)  # what the edit pipeline's method reads
    z = QwenImageEditPipeline._encode_vae_image(
        edit, image=vae_pixels(vae, images)[:, :, None], generator=None
    )
    assert torch.equal(x0, pipe._pack_latents(z[:, :, 0], z.shape[0], z.shape[1], *z.shape[-2:]))
    assert torch.equal(pipe._unpack_latents(x0, SIZE, SIZE, pipe.vae_scale_factor), z)
    assert tuple(x0.shape[1:]) == qwen.latent_shape(SIZE, SIZE)
    assert qwen.decode(x0).shape == images.shape


@pytest.mark.parametrize("family", ["flux", "qwen"])
@torch.no_grad()
def test_the_pipeline_decodes_the_latents_to_the_image_decode_gives(family, request):
    """The family's own pipeline, handed the encoded latents (non-square) and a schedule whose one step has
    dt = 0 (sigmas [0, 0]), decodes them through its own unpacking and VAE tail: the image the policy's
    decode gives, bit for bit. Qwen-Image's scheduler stretches its sigmas to shift_terminal 0.02, which
    would make that step move: the pipeline gets the scheduler without it."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    policy = request.getfixturevalue(family)
    images = _images(batch=1).repeat(1, 1, 1, 2)  # 32 x 64
    x0 = encode_images(policy, images)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(policy.pipe.scheduler.config, shift_terminal=None)
    pipe = type(policy.pipe)(**{**policy.pipe.components, "scheduler": scheduler})
    pipe.set_progress_bar_config(disable=True)
    extra = {"true_cfg_scale": 1.0} if family == "qwen" else {}
    with warnings.catch_warnings():  # the shift of sigma 0 divides by zero on its way to 0
        warnings.simplefilter("ignore", RuntimeWarning)
        out = pipe(
            prompt="a cat",
            height=SIZE,
            width=2 * SIZE,
            latents=x0.clone(),
            sigmas=[0.0],
            num_inference_steps=1,
            max_sequence_length=16,
            output_type="pt",
            **extra,
        ).images
    assert torch.equal(out.float(), policy.decode(x0))


@torch.no_grad()
def test_flux2_is_the_reference_image_encoding(tiny_flux2_path):
    from diffusers import Flux2KleinPipeline

    from lit_flowgrpo.policies import Flux2KleinPolicy

    policy = Flux2KleinPolicy(tiny_flux2_path, dtype="float32", max_sequence_length=16)
    policy.load()
    images = _images()
    x0 = encode_images(policy, images)
    pipe, vae = policy.pipe, policy.vae
    # Flux2KleinPipeline: patchify, batch-norm statistics, then its _pack_latents
    z = Flux2KleinPipeline._encode_vae_image(pipe, image=vae_pixels(vae, images), generator=None)
    assert torch.equal(x0, pipe._pack_latents(z))
    assert tuple(x0.shape[1:]) == policy.latent_shape(SIZE, SIZE)
    assert policy.decode(x0).shape == images.shape


@torch.no_grad()
def test_wan_is_the_image_to_video_encoding(tmp_path):
    from lit_flowgrpo.policies import WanPolicy
    from lit_flowgrpo.tiny.wan import build_tiny_wan

    policy = WanPolicy(build_tiny_wan(tmp_path / "wan", "2.1"), dtype="float32", max_sequence_length=16)
    policy.load()
    frames = 5
    videos = _images(frames=frames)
    x0 = encode_images(policy, videos)
    vae = policy.vae
    # WanImageToVideoPipeline.prepare_latents: (B, 3, F, H, W), the mean, (z - mean) * (1 / std)
    z = _mode(vae, vae_pixels(vae, videos).transpose(1, 2))
    mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
    assert torch.equal(x0, (z - mean) * inv_std)
    assert tuple(x0.shape[1:]) == policy.latent_shape(SIZE, SIZE, frames)
    assert policy.decode(x0).shape == videos.shape
    # An image is a clip of one frame.
    one = encode_images(policy, videos[:, 0])
    assert tuple(one.shape[1:]) == policy.latent_shape(SIZE, SIZE, 1)


@torch.no_grad()
def test_hunyuanvideo15_is_the_image_to_video_encoding(tmp_path):
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    from lit_flowgrpo.policies import HunyuanVideo15Policy
    from lit_flowgrpo.tiny.hunyuanvideo15 import build_tiny_hunyuanvideo15

    path = build_tiny_hunyuanvideo15(tmp_path / "hv15")
    policy = HunyuanVideo15Policy(path, dtype="float32", vae_dtype="float32", max_sequence_length=16)
    policy.load()
    videos = (_images(frames=1) * 255).round() / 255  # 8-bit values: the pipeline takes PIL images
    x0 = encode_images(policy, videos)
    # HunyuanVideo15ImageToVideoPipeline._get_image_latents: (1, 3, 1, H, W), the mean, × scaling_factor,
    # one image at a time; its processor's resize and normalisation are the identity and 2x - 1 at this size.
    vae, processor = policy.vae, policy.pipe.video_processor
    pil = processor.numpy_to_pil(videos[:, 0].permute(0, 2, 3, 1).numpy())
    want = torch.cat(
        [
            HunyuanVideo15ImageToVideoPipeline._get_image_latents(vae, processor, p, SIZE, SIZE, "cpu")
            for p in pil
        ]
    )
    assert torch.equal(x0, want)
    assert tuple(x0.shape[1:]) == policy.latent_shape(SIZE, SIZE, 1)
    assert policy.decode(x0).shape == videos.shape


def test_a_family_without_encode_images_says_which_and_why():
    class NoEncoder(FlowPolicy):  # the interface only: nothing here needs weights
        load = encode_prompts = velocity = decode = sigmas = latent_shape = lambda self, *a: None
        transformer = None

    with pytest.raises(NotImplementedError, match="NoEncoder cannot learn from images"):
        encode_images(NoEncoder(), torch.zeros(1, 3, 8, 8))


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    from lit_flowgrpo.policies import WanPolicy
    from lit_flowgrpo.tiny.wan import build_tiny_wan

    p = WanPolicy(
        build_tiny_wan(tmp_path_factory.mktemp("wan"), "2.1"), dtype="float32", max_sequence_length=16
    )
    p.load()
    return p


def _learner(policy, objective, frames: int = 1, **kl):
    from lit_flowgrpo.rewards.video import PerFrame

    return FlowGRPOModule(
        policy=policy,
        reward=PerFrame(brightness) if policy.modality == "video" else brightness,
        objective=objective,
        sampler=Sampler(num_steps=2, guidance_scale=1.0, height=SIZE, width=SIZE, frames=frames),
        update=UpdateSettings(micro_batch_size=2, optimizer_steps_per_rollout=1),
        weights=WeightsSettings(lora=LoraSettings(rank=4, alpha=8)),
        kl=KLSettings(coef=0.0, **kl),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )


@pytest.mark.parametrize("family", ["flux", "qwen", "wan"])
def test_sft_and_offline_dpo_take_a_step(family, request, tmp_path):
    policy = request.getfixturevalue(family)
    index = write_images(tmp_path / "data", 2, size=SIZE, pairs=True)
    for objective, key in ((SFT(), "actor/sft_loss"), (DiffusionDPO(beta=50.0), "actor/dpo_reward_accuracy")):
        module = _learner(type(policy)(policy.pretrained, dtype="float32", max_sequence_length=16), objective)
        trainer = make_trainer(tmp_path / type(objective).__name__, max_steps=1, logger=False)
        dm = ImageDataModule(train=index, prompts_per_step=2, height=SIZE, width=SIZE, pairs=True, seed=0)
        trainer.fit(module, datamodule=dm)
        logged = trainer.logged_metrics
        assert trainer.global_step == 1 and key in logged
        assert math.isfinite(float(logged["actor/loss"])) and float(logged["actor/grad_norm"]) > 0


def test_a_video_family_sampling_clips_is_refused_before_weights_load(wan, tmp_path):
    from lit_flowgrpo.errors import SettingsError

    index = write_images(tmp_path / "data", 2, size=SIZE)
    policy = type(wan)(wan.pretrained, dtype="float32", max_sequence_length=16)  # not loaded
    module = _learner(policy, SFT(), frames=5)
    dm = ImageDataModule(train=index, prompts_per_step=2, height=SIZE, width=SIZE, seed=0)
    with pytest.raises(
        SettingsError, match=r"sampler.frames \(5\) must be 1 with SFT: the data module's records"
    ):
        make_trainer(tmp_path / "run", max_steps=1, logger=False).fit(module, datamodule=dm)
    assert policy.pipe is None  # no weight was read
