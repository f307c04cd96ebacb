"""HunyuanVideo 1.5 text-to-video behind the :class:`~lit_flowgrpo.policies.base.FlowPolicy` interface.

Through diffusers' ``HunyuanVideo15Pipeline`` and its own components: the Qwen2.5-VL text model and the
ByT5 glyph encoder (both through the pipeline's ``encode_prompt``), ``HunyuanVideo15Transformer3DModel``
and the causal video VAE ``AutoencoderKLHunyuanVideo15``. The pieces, each as the pipeline's
``__call__`` does it (diffusers 0.42):

- latents are (C, F', H/16, W/16) per sample, F' = (F − 1)/4 + 1 (the VAE keeps the first frame alone
  and folds every 4 after it; 32 channels in the released model), so ``frames`` must be 4k + 1 and
  height and width multiples of 16 (the transformer's patches are 1×1);
- the transformer reads ``[latents, condition latents, mask]`` along the channels (65 = 32 + 32 + 1);
  for text-to-video the condition latents and the mask are zeros, and the image embedding (729 SigLIP
  rows) is zeros too, which the transformer masks out;
- it takes ``timestep = σ·1000`` in the model's dtype and predicts the flow velocity ε − x0 (the
  pipeline steps ``FlowMatchEulerDiscreteScheduler`` with it);
- the noise levels: the pipeline hands its scheduler ``linspace(1, 0, T + 1)[:-1]``, which the
  scheduler shifts (``shift`` 5 for 480p, 9 for 720p) and ends with 0;
- classifier-free guidance with a negative prompt (default "", the pipeline's), ``uncond + s·(cond −
  uncond)`` as its ``ClassifierFreeGuidance`` guider computes it, here as one batched forward (the
  pipeline runs two);
- decoding: latents / ``scaling_factor``, the VAE, then the video processor.

Sequence parallelism: not offered. ``HunyuanVideo15Transformer3DModel`` has no context-parallel plan
(``_cp_plan``) in diffusers 0.42, and its joint attention builds a (tokens × tokens) mask from the
tokens it holds, which Ulysses attention would have to receive for the gathered sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lit_flowgrpo.policies.base import (
    FRAMES_FLAG,
    HEIGHT_FLAG,
    MMDIT_ATTENTION_PROJECTIONS,
    WIDTH_FLAG,
    DType,
    Embeds,
    FlowPolicy,
    PromptCache,
    cat_embeds,
    check_family,
    check_pretrained,
    pretrained_dtype_kwargs,
    resolve_dtype,
)
from lit_flowgrpo.policies.packed import PRETRAINED_FLAG

_FLAG = "--model.init_args.policy.init_args"
#: The VAE's temporal factor (AutoencoderKLHunyuanVideo15's ``temporal_compression_ratio``).
TEMPORAL_FACTOR = 4
#: ``HunyuanVideo15Pipeline.tokenizer_max_length``: the Qwen2.5-VL states kept after the template.
MAX_PROMPT_TOKENS = 1000


class HunyuanVideo15Policy(FlowPolicy):
    """HunyuanVideo 1.5 text-to-video (``hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v``, 720p alike).

    Embeds, each batch-first, as ``HunyuanVideo15Pipeline.encode_prompt`` returns them:
    ``prompt_embeds`` (B, max_sequence_length, 3584) Qwen2.5-VL states and their mask
    ``prompt_embeds_mask``; ``prompt_embeds_2`` (B, 256, 1472) ByT5 states of the prompt's quoted text
    (zeros when it quotes none) and ``prompt_embeds_mask_2``.

    Args:
        pretrained: Hub id or local folder of a ``HunyuanVideo15Pipeline``.
        dtype: the transformer's and the text encoders' dtype; the step math stays fp32.
        vae_dtype: the VAE's dtype (the model card loads the whole pipeline in one dtype).
        max_sequence_length: Qwen2.5-VL states per prompt after the chat template (the pipeline's 1000);
            fewer keep a shorter padded text, which the transformer masks.
        negative_prompt: the unconditional prompt of classifier-free guidance.
        prompt_cache_size: encoded prompts kept (least recently used dropped).
    """

    modality = "video"
    pipeline_name = "HunyuanVideo15Pipeline"
    #: The joint attention's image and text projections in every block (and the text refiner's, whose
    #: names they share), as LoRA on MMDiT families (SD3, FLUX) targets them.
    default_lora_targets: tuple[str, ...] = MMDIT_ATTENTION_PROJECTIONS
    default_lora_rank: int = 32
    default_lora_alpha: int = 64
    #: The text is padded and the padding masked in the joint attention (the kernel is chosen for it).
    masked_prompts: bool = True
    #: The VAE's 16× and the transformer's 1×1 patches of every release.
    image_size_multiple: int = 16
    image_size_reason: str = "the VAE downsamples by 16 and the transformer cuts 1×1 patches"

    def __init__(
        self,
        pretrained: str,
        dtype: DType = "bfloat16",
        vae_dtype: DType = "bfloat16",
        max_sequence_length: int = MAX_PROMPT_TOKENS,
        negative_prompt: str = "",
        prompt_cache_size: int = 1024,
    ) -> None:
        super().__init__()
        self.pretrained = pretrained
        self.dtype_name = dtype
        self.vae_dtype_name = vae_dtype
        self.max_sequence_length = max_sequence_length
        self.negative_prompt = negative_prompt
        self.prompt_cache_size = prompt_cache_size
        self.pipe: Any = None  # a HunyuanVideo15Pipeline once loaded
        self._cache = PromptCache(prompt_cache_size)

    # -- settings -----------------------------------------------------------------------------------

    def problems(self) -> list[str]:
        out = check_pretrained(self.pretrained, PRETRAINED_FLAG) or check_family(
            self.pretrained, (self.pipeline_name,), PRETRAINED_FLAG, type(self).__name__
        )
        for name, value in (("dtype", self.dtype_name), ("vae_dtype", self.vae_dtype_name)):
            if value not in ("float32", "bfloat16", "float16"):
                out.append(f"{_FLAG}.{name} ({value}) must be float32, bfloat16 or float16")
        if not 1 <= self.max_sequence_length <= MAX_PROMPT_TOKENS:
            out.append(
                f"{_FLAG}.max_sequence_length ({self.max_sequence_length}) must be in [1, {MAX_PROMPT_TOKENS}]: "
                f"HunyuanVideo 1.5 was trained with {MAX_PROMPT_TOKENS} Qwen2.5-VL states"
            )
        if self.prompt_cache_size < 0:
            out.append(f"{_FLAG}.prompt_cache_size ({self.prompt_cache_size}) must be >= 0")
        return out

    def frame_problems(self, frames: int, flag: str = FRAMES_FLAG) -> list[str]:
        if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
            return [f"{flag} ({frames!r}) must be a positive whole number of frames"]
        if frames % TEMPORAL_FACTOR != 1:
            nearest = (frames // TEMPORAL_FACTOR) * TEMPORAL_FACTOR + 1
            return [
                f"{flag} ({frames}) must be 4k + 1 for {type(self).__name__} (its VAE encodes the first frame "
                f"alone and then every {TEMPORAL_FACTOR}): use {nearest}, for example"
            ]
        return []

    def sequence_parallel_problems(
        self, sp: int, height: int, width: int, frames: int, flag: str
    ) -> list[str]:
        import diffusers

        plan = getattr(diffusers.HunyuanVideo15Transformer3DModel, "_cp_plan", None)
        why = (
            f"has no context-parallel plan (_cp_plan) in diffusers {diffusers.__version__}"
            if plan is None
            else "has a context-parallel plan that this package has not checked against one process"
        )
        return [
            f"{flag} ({sp}): HunyuanVideo15Transformer3DModel {why}, so {type(self).__name__} cannot split its "
            f"tokens over ranks: set {flag}=1 (data parallelism still applies)"
        ]

    # -- loading ------------------------------------------------------------------------------------

    def load(self) -> None:
        if self.pipe is not None:
            return
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))
        try:
            (key,) = pretrained_dtype_kwargs(torch.float32)
            dtypes = {"default": resolve_dtype(self.dtype_name), "vae": resolve_dtype(self.vae_dtype_name)}
            pipe = self.pipeline_class.from_pretrained(self.pretrained, **{key: dtypes})
        except (OSError, ValueError) as err:
            raise ValueError(
                f"{PRETRAINED_FLAG} ({self.pretrained}): loading the {self.pipeline_name} failed: {err}"
            ) from err
        pipe.set_progress_bar_config(disable=True)
        pipe.tokenizer_max_length = self.max_sequence_length  # read by the pipeline's encode_prompt
        for part in (pipe.text_encoder, pipe.text_encoder_2, pipe.vae, pipe.transformer):
            part.requires_grad_(False)
            part.eval()
        # Registered as submodules so that Lightning moves them and the strategies see them.
        self._transformer = pipe.transformer
        self.vae = pipe.vae
        self.text_encoder = pipe.text_encoder
        self.text_encoder_2 = pipe.text_encoder_2
        self.pipe = pipe

    @property
    def transformer(self) -> nn.Module:
        if self.pipe is None:
            raise RuntimeError("HunyuanVideo15Policy.load() has not run: the weights are not loaded yet")
        return self._transformer

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    def save_lora(self, path: str, lora_state_dict: dict[str, Tensor], adapter_metadata: dict | None) -> None:
        """The adapter as ``transformer.load_lora_adapter(path)`` reads it (``transformer.``-prefixed
        keys and metadata in ``pytorch_lora_weights.safetensors``): diffusers 0.42 gives
        ``HunyuanVideo15Pipeline`` no LoRA loader of its own, so the file is written with the writer
        the pipelines' loaders share."""
        from diffusers.loaders.lora_base import LoraBaseMixin

        LoraBaseMixin.write_lora_layers(
            state_dict={f"transformer.{k}": v for k, v in lora_state_dict.items()},
            save_directory=path,
            is_main_process=True,
            weight_name=None,
            save_function=None,
            safe_serialization=True,
            lora_adapter_metadata=(
                {f"transformer.{k}": v for k, v in adapter_metadata.items()} if adapter_metadata else None
            ),
        )

    # -- prompts ------------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> Embeds:
        return cat_embeds(self._cache.rows(prompts, self._encode_one))

    def _encode_one(self, prompt: str) -> Embeds:
        # In the transformer's dtype, as the pipeline's __call__ asks encode_prompt for it (masks too).
        embeds, mask, embeds_2, mask_2 = self.pipe.encode_prompt(
            prompt=[prompt], device=self.text_encoder.device, dtype=self.transformer.dtype, batch_size=1
        )
        return {
            "prompt_embeds": embeds,
            "prompt_embeds_mask": mask,
            "prompt_embeds_2": embeds_2,
            "prompt_embeds_mask_2": mask_2,
        }

    # -- the network --------------------------------------------------------------------------------

    def velocity(self, latents: Tensor, sigma: Tensor, embeds: Embeds, guidance_scale: float) -> Tensor:
        """v = ε − x0, (B, C, F', h, w) fp32."""
        network = self.transformer
        dtype = self.input_dtype(network)
        batch = latents.shape[0]
        timestep = sigma.to(device=latents.device, dtype=torch.float32).expand(batch)
        timestep = timestep * self.pipe.scheduler.config.num_train_timesteps  # the pipeline's t
        cfg = guidance_scale > 1.0
        x = latents.to(dtype)
        cond = {k: v.to(latents.device) for k, v in embeds.items()}
        if cfg:  # one batched forward: [cond; uncond]
            neg = self.encode_prompts([self.negative_prompt])
            cond = {
                k: torch.cat([v, neg[k].to(v.device).expand(batch, *v.shape[1:])]) for k, v in cond.items()
            }
            x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
        rows = x.shape[0]
        # Text-to-video: zero condition latents and mask beside the latents, zero image rows (the
        # pipeline's prepare_cond_latents_and_mask and image_embeds).
        hidden = torch.cat([x, torch.zeros_like(x), torch.zeros_like(x[:, :1])], dim=1)
        config = network.config
        image_embeds = torch.zeros(
            rows, self.pipe.vision_num_semantic_tokens, config.image_embed_dim, dtype=dtype, device=x.device
        )
        out = network(
            hidden_states=hidden,
            image_embeds=image_embeds,
            timestep=timestep.to(dtype),  # the pipeline feeds t in the latents' dtype
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            encoder_attention_mask=cond["prompt_embeds_mask"].to(dtype),
            encoder_hidden_states_2=cond["prompt_embeds_2"].to(dtype),
            encoder_attention_mask_2=cond["prompt_embeds_mask_2"].to(dtype),
            return_dict=False,
        )[0].float()
        if not cfg:
            return out
        cond_out, uncond = out.chunk(2)
        return uncond + guidance_scale * (cond_out - uncond)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Videos (B, F, 3, H, W) in [0, 1], as the pipeline decodes: latents / scaling_factor, the VAE,
        the video processor. One video at a time: the VAE's causal attention in its middle block builds a
        (B, tokens, tokens) mask that broadcasts against (B, 1, tokens, C) queries as (B, B, ...), so a
        batch of more than one fails there (diffusers 0.42)."""
        vae = self.vae
        videos = []
        for row in latents:
            x = row[None].to(vae.dtype) / vae.config.scaling_factor
            video = vae.decode(x, return_dict=False)[0]  # (1, 3, F, H, W) in [-1, 1]
            videos.append(self.pipe.video_processor.postprocess_video(video, output_type="pt").float())
        return torch.cat(videos)

    def sigmas(self, num_steps: int, height: int, width: int) -> Tensor:
        """The checkpoint scheduler's shifted noise levels for ``num_steps``, from the pipeline's
        ``linspace(1, 0, num_steps + 1)[:-1]`` (size-independent: no dynamic shift)."""
        import numpy as np

        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1], device="cpu")
        sigmas = torch.as_tensor(scheduler.sigmas, dtype=torch.float32)
        if sigmas.numel() != num_steps + 1 or float(sigmas[-1]) != 0.0:
            raise ValueError(
                f"{PRETRAINED_FLAG}: its {type(scheduler).__name__} gives {sigmas.numel()} noise levels ending at "
                f"{float(sigmas[-1])} for {num_steps} steps; {type(self).__name__} needs num_steps + 1 ending at 0"
            )
        return sigmas

    def latent_shape(self, height: int, width: int, frames: int = 1) -> tuple[int, ...]:
        spatial, temporal = self.pipe.vae_scale_factor_spatial, self.pipe.vae_scale_factor_temporal
        patch = int(self.transformer.config.patch_size)
        problems = [] if (frames - 1) % temporal == 0 else self.frame_problems(frames)
        for flag, value in ((HEIGHT_FLAG, height), (WIDTH_FLAG, width)):
            if value % (spatial * patch):
                problems.append(
                    f"{flag} ({value}) must be a multiple of {spatial * patch} for this checkpoint (its VAE "
                    f"downsamples by {spatial}, its transformer cuts patches of {patch})"
                )
        if problems:
            raise ValueError("; ".join(problems))
        channels = int(self.pipe.num_channels_latents)
        return (channels, (frames - 1) // temporal + 1, height // spatial, width // spatial)
