"""Wan image-to-video behind the :class:`~lit_flowgrpo.policies.base.FlowPolicy` interface: Wan 2.1 I2V
(14B, 480P / 720P) and Wan 2.2 TI2V-5B given a first frame, through diffusers' ``WanImageToVideoPipeline``.

Everything of :class:`~lit_flowgrpo.policies.wan.WanPolicy` holds (UMT5 prompts, σ·1000 timesteps, batched
CFG, the experts of a two-expert checkpoint, the UniPC noise levels stepped by this package's Euler / SDE
step); the first frame is encoded with the pipeline's own functions and put into the Embeds, as the
pipeline's ``__call__`` prepares it, once per (first frame, output size):

- the first frame is resized to the output's (height, width) by the pipeline's video processor
  (``video_processor.preprocess``), and, for Wan 2.1, also handed at its file's size to the CLIP image
  encoder (``encode_image``: its image processor, the penultimate hidden states, 257 × 1280 for ViT-H/14),
  exactly what the pipeline does with an image given to it;
- Wan 2.1 I2V (``condition``): ``prepare_latents``' conditioning, 4 mask channels (1 on the first frame's
  latent, 0 after) and the VAE latent of the first frame followed by zeros, normalised; :meth:`velocity`
  concatenates it to the noisy latent along the channels (16 + 4 + 16 = 36, the transformer's
  ``in_channels``) and passes the CLIP states as ``encoder_hidden_states_image``, for the conditional and
  the unconditional half alike, as the pipeline's loop does;
- Wan 2.2 TI2V-5B (``first_frame``, the pipeline's ``expand_timesteps`` branch): the first frame's
  latent replaces the first latent frame of the transformer's input, and the timestep is 0 on that frame's
  tokens (σ·1000 on the others).

The conditioned frame of TI2V-5B is never trained, and its log-prob never counted: the trajectory holds
only the latent frames after it (:meth:`latent_shape` has (F − 1)/4 frames, not (F − 1)/4 + 1), so the
noise, the SDE step, its log-prob (the mean over the generated frames' elements, Flow-GRPO's unit), the KL
and DiffusionNFT's regression all run over what is generated. :meth:`velocity` puts the first frame in
front of the latent for the transformer and drops that frame's output; :meth:`decode` puts it back in front
before the VAE, which is what the pipeline does at its end (``latents = (1 − mask)·condition + mask·latents``).
The pipeline also steps its first latent frame with the model's output there, but that frame is replaced at
every forward and at the end, so it never reaches the output: dropping it changes no generated value (the
Euler step is elementwise), which the tests check against the pipeline.

Wan 2.1 keeps every latent frame: its first latent frame is generated (conditioned by the mask channels),
as in the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lit_flowgrpo.conditioning import Condition
from lit_flowgrpo.policies.base import (
    FRAMES_FLAG,
    DType,
    Embeds,
    PromptCache,
    cat_embeds,
    check_one_image_each,
    resolve_dtype,
    video_latent_shape,
)
from lit_flowgrpo.policies.wan import WanPolicy

_FLAG = "--model.init_args.policy.init_args"


class WanImageToVideoPolicy(WanPolicy):
    """Wan image-to-video: Wan 2.1 I2V-14B (480P, 720P) with its CLIP image encoder, Wan 2.2 TI2V-5B
    given a first frame (and Wan 2.2 I2V-A14B's two experts, which need neither change).

    Each record gives one first frame (``"condition_images": ["frame.png"]``). Embeds: ``prompt_embeds``
    (B, max_sequence_length, D) as :class:`WanPolicy`; Wan 2.1: ``image_embeds`` (B, 257, 1280), the CLIP
    states, and ``condition`` (B, 4 + C, F', H/8, W/8), the mask and the first frame's latent; TI2V-5B:
    ``first_frame`` (B, C, 1, H/16, W/16), the first frame's latent.

    Args:
        pretrained: Hub id or local folder of a ``WanImageToVideoPipeline``
            (``Wan-AI/Wan2.1-I2V-14B-480P-Diffusers``, ``Wan-AI/Wan2.2-TI2V-5B-Diffusers``).
        dtype: the transformers' and the text encoder's dtype; the step math stays fp32.
        vae_dtype: the VAE's dtype (float32, as diffusers' Wan I2V example loads it).
        image_encoder_dtype: the CLIP image encoder's dtype (float32, as diffusers' Wan I2V example).
        max_sequence_length: UMT5 tokens per prompt (the pipeline's default, 512).
        negative_prompt: the unconditional prompt of classifier-free guidance (its first frame is the
            sample's own, as in the pipeline).
        guidance_scale_2: Wan 2.2 I2V-A14B: the CFG scale of the low-noise expert; ``None`` takes the loop's.
        prompt_cache_size: encoded prompts kept (least recently used dropped).
        condition_cache_size: encoded first frames kept per output size (each the VAE latent of a whole
            clip of zeros after the frame for Wan 2.1: 20 × 21 × 60 × 104 fp32 = 10 MB at 81 frames of
            480 × 832), least recently used dropped.
        max_stretch: how far a first frame's aspect ratio may be from the output's, as a factor: the video
            processor resizes it to the output's height and width without cropping, which stretches it by
            (out_w / out_h) / (w / h). Frames stretched more are refused before any weight is read.
    """

    pipeline_name = "WanImageToVideoPipeline"
    condition_images = (1, 1)
    condition_name = "first frame"

    def __init__(
        self,
        pretrained: str,
        dtype: DType = "bfloat16",
        vae_dtype: DType = "float32",
        image_encoder_dtype: DType = "float32",
        max_sequence_length: int = 512,
        negative_prompt: str = "",
        guidance_scale_2: float | None = None,
        prompt_cache_size: int = 1024,
        condition_cache_size: int = 64,
        max_stretch: float = 1.25,
    ) -> None:
        super().__init__(
            pretrained,
            dtype=dtype,
            vae_dtype=vae_dtype,
            max_sequence_length=max_sequence_length,
            negative_prompt=negative_prompt,
            guidance_scale_2=guidance_scale_2,
            prompt_cache_size=prompt_cache_size,
        )
        self.image_encoder_dtype_name = image_encoder_dtype
        self.condition_cache_size = condition_cache_size
        self.max_stretch = max_stretch
        self.image_encoder: nn.Module | None = None
        self._conditions = PromptCache(condition_cache_size)

    # -- settings -----------------------------------------------------------------------------------

    def problems(self) -> list[str]:
        out = super().problems()
        if self.image_encoder_dtype_name not in ("float32", "bfloat16", "float16"):
            out.append(
                f"{_FLAG}.image_encoder_dtype ({self.image_encoder_dtype_name}) must be float32, bfloat16 or float16"
            )
        if self.condition_cache_size < 0:
            out.append(f"{_FLAG}.condition_cache_size ({self.condition_cache_size}) must be >= 0")
        if not self.max_stretch >= 1:
            out.append(
                f"{_FLAG}.max_stretch ({self.max_stretch}) must be at least 1 (1: the first frame's aspect ratio "
                "must be the output's)"
            )
        return out

    def frame_problems(self, frames: int, flag: str = FRAMES_FLAG) -> list[str]:
        out = super().frame_problems(frames, flag)
        if not out and frames < 5:
            out.append(
                f"{flag} ({frames}) must be at least 5 for {type(self).__name__}: the first frame is given and the "
                "VAE folds the next 4 into one latent frame, so 1 frame leaves nothing to generate; use 5, 33 or 81"
            )
        return out

    def condition_size_problems(self, width: int, height: int, out_height: int, out_width: int) -> list[str]:
        """A first frame is resized to the output's size without cropping (the pipeline's video processor):
        refused when that stretches it by more than :attr:`max_stretch`."""
        stretch = (out_width / out_height) / (width / height)
        if max(stretch, 1 / stretch) <= self.max_stretch:
            return []
        return [
            f"its {width}x{height} px would be stretched {max(stretch, 1 / stretch):.2f}x to the output's "
            f"{out_width}x{out_height} (the pipeline resizes without cropping), more "
            f"than {_FLAG}.max_stretch ({self.max_stretch}): crop the image to the output's aspect ratio, or "
            "raise the setting"
        ]

    # -- loading ------------------------------------------------------------------------------------

    def _component_dtypes(self) -> dict[str, torch.dtype]:
        return {**super()._component_dtypes(), "image_encoder": resolve_dtype(self.image_encoder_dtype_name)}

    def load(self) -> None:
        if self.pipe is not None:
            return
        super().load()
        encoder = self.pipe.image_encoder  # None for Wan 2.2 (TI2V-5B, I2V-A14B)
        if self._uses_image_encoder and (encoder is None or self.pipe.image_processor is None):
            raise ValueError(
                f"--model.init_args.policy.init_args.pretrained ({self.pretrained}): its transformer takes CLIP "
                "image states (image_dim set) but the pipeline has no image_encoder / image_processor"
            )
        if encoder is not None:
            encoder.requires_grad_(False)
            encoder.eval()
            self.image_encoder = encoder  # a submodule: Lightning moves it with the rest

    @property
    def expand_timesteps(self) -> bool:
        """Wan 2.2 TI2V-5B's form: the first frame replaces the first latent frame, at timestep 0."""
        return bool(self.pipe.config.get("expand_timesteps", False))

    @property
    def _uses_image_encoder(self) -> bool:
        """Wan 2.1 I2V: the transformer has CLIP image cross-attention (the pipeline's own test)."""
        return self.transformer.config.get("image_dim") is not None

    # -- conditioning -------------------------------------------------------------------------------

    def _encode_one(self, prompt: str) -> Embeds:
        # WanPipeline's own UMT5 encoding, on this pipeline's tokenizer and encoder: the image-to-video
        # pipeline's copy of it (diffusers 0.42) calls ftfy without checking that it is installed (the
        # text-to-video one checks), so without ftfy it raises a NameError. The two are otherwise the same.
        from diffusers import WanPipeline

        embeds = WanPipeline._get_t5_prompt_embeds(
            self.pipe,
            prompt=[prompt],
            max_sequence_length=self.max_sequence_length,
            device=self.text_encoder.device,
        )
        return {"prompt_embeds": embeds}

    @torch.no_grad()
    def encode_conditioned(
        self,
        prompts: Sequence[str],
        conditions: Sequence[Condition],
        height: int,
        width: int,
        frames: int = 1,
    ) -> Embeds:
        # Before any encoding: encode's default of one frame would give a conditioning of the wrong length.
        problems = self.frame_problems(frames)
        if problems:
            raise ValueError("; ".join(problems))
        check_one_image_each(self, conditions)
        text = self.encode_prompts(prompts)
        size = f"|{height}x{width}x{frames}"
        by_key = {c.key + size: c for c in conditions}
        rows = cat_embeds(
            self._conditions.rows(
                [c.key + size for c in conditions],
                lambda key: self._encode_condition(by_key[key].images[0], height, width, frames),
            )
        )
        return {**text, **{k: v.to(text["prompt_embeds"].device) for k, v in rows.items()}}

    def _encode_condition(self, image: Tensor, height: int, width: int, frames: int) -> Embeds:
        """One first frame's conditioning (batch 1), through the pipeline's own functions, as its ``__call__``
        prepares an image it is given."""
        pipe = self.pipe
        device = self.device
        pil = _to_pil(image)
        pixels = pipe.video_processor.preprocess(pil, height=height, width=width).to(
            device, dtype=torch.float32
        )
        spatial, temporal = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
        z = pipe.vae.config.z_dim
        # prepare_latents draws the noise unless given some: zeros, so that no generator is advanced.
        shape = (1, z, (frames - 1) // temporal + 1, height // spatial, width // spatial)
        out = pipe.prepare_latents(
            pixels,
            1,
            z,
            height,
            width,
            frames,
            torch.float32,
            device,
            None,
            torch.zeros(shape, device=device),
        )
        if self.expand_timesteps:
            _, first_frame, _ = out  # (1, C, 1, h, w), normalised; the mask is 0 on that frame alone
            return {"first_frame": first_frame}
        _, condition = out  # (1, 4 + C, F', h, w): mask channels, then the frame's latent and zeros
        embeds = {"condition": condition}
        if self._uses_image_encoder:
            embeds["image_embeds"] = pipe.encode_image(pil, device)  # (1, 257, 1280) for ViT-H/14
        return embeds

    # -- the networks -------------------------------------------------------------------------------

    def _network_inputs(
        self, network: nn.Module, latents: Tensor, timestep: Tensor, embeds: Embeds
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """As the pipeline's loop: the conditioning joined to the latent, and the CLIP states (Wan 2.1) beside
        the prompt's; CFG gives the unconditional half the same."""
        if "first_frame" in embeds:
            # TI2V-5B: the first frame in front of the generated ones; its tokens at timestep 0.
            x = torch.cat([embeds["first_frame"].to(latents.device), latents], dim=2)
            _, ph, pw = network.config.patch_size
            per_frame = (x.shape[3] // ph) * (x.shape[4] // pw)
            t = torch.cat(
                [
                    torch.zeros(latents.shape[0], per_frame, device=x.device),
                    timestep[:, None].expand(-1, latents.shape[2] * per_frame),
                ],
                dim=1,
            )  # (B, tokens) fp32, as first_frame_mask · t
            return x, t, None
        x = torch.cat([latents, embeds["condition"].to(latents.device)], dim=1)  # (B, 36, F', h, w) for 14B
        return x, timestep, embeds.get("image_embeds")

    def _generated(self, out: Tensor, embeds: Embeds) -> Tensor:
        if "first_frame" in embeds:
            return out[:, :, 1:]  # the given frame's output is never used (the pipeline replaces that frame)
        return out

    @torch.no_grad()
    def decode_conditioned(self, latents: Tensor, embeds: Embeds) -> Tensor:
        """Videos (B, F, 3, H, W) in [0, 1]. TI2V-5B: each sample's given first frame's latent in front of its
        generated ones first, as the pipeline's last step writes it."""
        if "first_frame" in embeds:
            first = embeds["first_frame"]
            latents = torch.cat([first.to(latents.device, latents.dtype), latents], dim=2)
        return self.decode(latents)

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> Tensor:
        """Clips (B, F, 3, H, W) to the latents :meth:`velocity` takes: TI2V-5B drops the first latent frame
        (the given one)."""
        latents = super().encode_images(images)
        return latents[:, :, 1:] if self.expand_timesteps else latents

    def latent_shape(self, height: int, width: int, frames: int = 1) -> tuple[int, ...]:
        """(C, F', H/s, W/s) of the generated latent (C: the transformer's output channels, 16 for Wan 2.1,
        48 for TI2V-5B; its input has the conditioning's channels too); TI2V-5B: F' − 1 frames (the first is
        given, see the module's notes)."""
        spatial, temporal = self.pipe.vae_scale_factor_spatial, self.pipe.vae_scale_factor_temporal
        _, ph, pw = self.transformer.config.patch_size
        channels = int(self.transformer.config.out_channels)
        shape = video_latent_shape(self, channels, (height, width, frames), (spatial, temporal), (ph, pw))
        if self.expand_timesteps:
            return (shape[0], shape[1] - 1, *shape[2:])
        return shape

    def flops_forward(self, height: int, width: int, frames: int = 1) -> Callable[[], Tensor]:
        shape = self.latent_shape(height, width, frames)
        device = self.device
        pipe = self.pipe
        z = pipe.vae.config.z_dim
        latent_frames = (frames - 1) // pipe.vae_scale_factor_temporal + 1
        h, w = shape[2], shape[3]
        if self.expand_timesteps:
            conditioning = {"first_frame": torch.zeros(1, z, 1, h, w, device=device)}
        else:
            conditioning = {
                "condition": torch.zeros(
                    1, pipe.vae_scale_factor_temporal + z, latent_frames, h, w, device=device
                )
            }
            if self._uses_image_encoder:
                vision = self.image_encoder.config
                tokens = (vision.image_size // vision.patch_size) ** 2 + 1  # patches and the class token
                conditioning["image_embeds"] = torch.zeros(1, tokens, vision.hidden_size, device=device)

        def forward() -> Tensor:
            embeds = {**self.encode_prompts([""]), **conditioning}
            latents = torch.zeros((1, *shape), device=device)
            return self.velocity(latents, torch.ones(1, device=device), embeds, 1.0)

        return forward


def _to_pil(image: Tensor) -> Any:
    """A (3, H, W) [0, 1] image as the PIL image it was read from (the data's images are 8-bit: k/255 back
    to k exactly), which the pipeline's image processors take."""
    from PIL import Image

    pixels = (image.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)
    return Image.fromarray(pixels.permute(1, 2, 0).numpy())
