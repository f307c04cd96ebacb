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

Sequence parallelism (``performance.sequence_parallel``): diffusers 0.42 gives
``HunyuanVideo15Transformer3DModel`` no context-parallel plan (``_cp_plan``), so :meth:`load` gives the
loaded transformer one (:data:`CONTEXT_PARALLEL_PLAN`, the form of Wan's and FLUX's plans), which
:func:`lit_flowgrpo.sequence_parallel.attach_sequence_parallel` applies as it applies theirs: the video
tokens (and their rotary embedding) and the joint text tokens are split along the sequence before the
first block, the output projection's result gathered. Two things diffusers' own pieces do not do, done
here: the joint attention's processor builds a (tokens × tokens) mask from the tokens a rank holds,
which Ulysses attention cannot take (its keys are the gathered sequence), so under a parallel config the
blocks use :class:`UlyssesJointAttnProcessor`, which masks the keys only (a padded query's output reaches
nothing: its token is masked as a key everywhere and the text stream ends at the last block); and the
text (729 image rows + 256 glyph + ``max_sequence_length`` tokens) is padded with masked rows to a
multiple of the split.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0
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
    causal_video_frame_problems,
    check_family,
    check_pretrained,
    checked_sigmas,
    load_pipeline,
    resolve_dtype,
    vae_pixels,
    video_latent_shape,
)
from lit_flowgrpo.policies.packed import PRETRAINED_FLAG

_FLAG = "--model.init_args.policy.init_args"
#: The VAE's temporal and spatial factors (AutoencoderKLHunyuanVideo15's ``temporal_compression_ratio``
#: and ``spatial_compression_ratio`` in every release).
TEMPORAL_FACTOR, SPATIAL_FACTOR = 4, 16
#: ``HunyuanVideo15Pipeline.tokenizer_max_length``: the Qwen2.5-VL states kept after the template.
MAX_PROMPT_TOKENS = 1000


def _context_parallel_plan(blocks: int) -> dict[str, Any]:
    """Where the transformer's forward splits and gathers its tokens, in diffusers' plan format (whose
    classes only diffusers' private ``_modeling_parallel`` module exports): the rotary embedding's
    (cos, sin) rows split with the video tokens; the first block's video tokens and joint text tokens
    split along the sequence (the blocks after it get them split from it); the text mask, which the
    transformer hands every block afresh, split at every one of the ``blocks``; the output projection's
    tokens gathered."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    rope = ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)
    tokens = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
    mask = {"attention_mask": ContextParallelInput(split_dim=1, expected_dims=2, split_output=False)}
    plan: dict[str, Any] = {"rope": {0: rope, 1: rope}}
    plan["transformer_blocks.0"] = {"hidden_states": tokens, "encoder_hidden_states": tokens, **mask}
    plan.update({f"transformer_blocks.{i}": mask for i in range(1, blocks)})
    plan["proj_out"] = ContextParallelOutput(gather_dim=1, expected_dims=3)
    return plan


class UlyssesJointAttnProcessor(HunyuanVideo15AttnProcessor2_0):
    """diffusers' ``HunyuanVideo15AttnProcessor2_0`` (0.42), the same steps, but under a context-parallel
    config it masks the keys only, with a (B, 1, 1, tokens) mask that Ulysses attention gathers with the
    keys; without one it is diffusers' processor, unchanged.

    Written here because diffusers' processor builds a (B, 1, S, S) query-and-key mask from the S tokens
    a rank holds, which does not fit the gathered keys. Masking the keys alone changes the rows of
    padded text queries only, whose outputs never reach a video token."""

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        image_rotary_emb: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        if self._parallel_config is None:
            return super().__call__(
                attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb
            )
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.embeddings import apply_rotary_emb

        def heads(x: Tensor) -> Tensor:
            return x.unflatten(2, (attn.heads, -1))

        query = attn.norm_q(heads(attn.to_q(hidden_states)))
        key = attn.norm_k(heads(attn.to_k(hidden_states)))
        value = heads(attn.to_v(hidden_states))
        query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        text = encoder_hidden_states.shape[1]
        query = torch.cat([query, attn.norm_added_q(heads(attn.add_q_proj(encoder_hidden_states)))], dim=1)
        key = torch.cat([key, attn.norm_added_k(heads(attn.add_k_proj(encoder_hidden_states)))], dim=1)
        value = torch.cat([value, heads(attn.add_v_proj(encoder_hidden_states))], dim=1)
        keys = F.pad(attention_mask.bool(), (query.shape[1] - attention_mask.shape[1], 0), value=True)
        out = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=keys[:, None, None, :],  # (B, 1, 1, S): every query, the valid keys
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        out = out.flatten(2, 3).to(query.dtype)
        video, text_out = out[:, :-text], out[:, -text:]
        return attn.to_out[1](attn.to_out[0](video)), attn.to_add_out(text_out)


class HunyuanVideo15Policy(FlowPolicy):
    """HunyuanVideo 1.5 text-to-video (``hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v``, 720p alike).

    Embeds, each batch-first, as ``HunyuanVideo15Pipeline.encode_prompt`` returns them:
    ``prompt_embeds`` (B, max_sequence_length, 3584) Qwen2.5-VL states and their mask
    ``prompt_embeds_mask``; ``prompt_embeds_2`` (B, 256, 1472) ByT5 states of the prompt's quoted text
    (zeros when it quotes none) and ``prompt_embeds_mask_2``.

    Args:
        pretrained: Hub id or local folder of a ``HunyuanVideo15Pipeline``.
        dtype: the transformer's and the text encoders' dtype; the step math stays fp32.
        vae_dtype: the VAE's dtype; ``None``: ``dtype`` (the model card loads the whole pipeline in one dtype).
        max_sequence_length: Qwen2.5-VL states per prompt after the chat template (the pipeline's 1000);
            fewer keep a shorter padded text, which the transformer masks.
        negative_prompt: the unconditional prompt of classifier-free guidance.
        prompt_cache_size: encoded prompts kept (least recently used dropped).
    """

    modality = "video"
    pipeline_name = "HunyuanVideo15Pipeline"
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
        vae_dtype: DType | None = None,
        max_sequence_length: int = MAX_PROMPT_TOKENS,
        negative_prompt: str = "",
        prompt_cache_size: int = 1024,
    ) -> None:
        super().__init__()
        self.pretrained = pretrained
        self.dtype_name = dtype
        self.vae_dtype_name = dtype if vae_dtype is None else vae_dtype
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
        return causal_video_frame_problems(frames, flag, type(self).__name__, "its VAE", TEMPORAL_FACTOR)

    def sequence_parallel_problems(
        self, sp: int, height: int, width: int, frames: int, flag: str
    ) -> list[str]:
        """What Ulysses attention asks: sp divides the attention heads (each rank attends with heads/sp)
        and the video tokens per sample (split in equal parts; the text is padded to fit). Read from a
        local folder's ``transformer/config.json`` before loading, or from the loaded transformer; a hub
        id is checked once loaded."""
        config = self._transformer_config()
        if config is None:
            return []
        out = []
        heads = int(config["num_attention_heads"])
        if heads % sp:
            out.append(
                f"{flag} ({sp}) must divide the {heads} attention heads of the transformer (Ulysses attention "
                f"gives each rank heads/sp of them): use a divisor of {heads}"
            )
        patch, patch_t = int(config.get("patch_size", 1)), int(config.get("patch_size_t", 1))
        spatial = self.pipe.vae_scale_factor_spatial if self.pipe is not None else SPATIAL_FACTOR
        latent_frames = (frames - 1) // TEMPORAL_FACTOR + 1
        grid = (latent_frames // patch_t, height // spatial // patch, width // spatial // patch)
        tokens = grid[0] * grid[1] * grid[2]
        if tokens % sp:
            out.append(
                f"{flag} ({sp}) must divide the {tokens} video tokens per sample ({' × '.join(map(str, grid))} "
                f"patches at {FRAMES_FLAG}={frames}, {HEIGHT_FLAG}={height}, {WIDTH_FLAG}={width}), which "
                "diffusers splits in equal parts: change the size or the setting"
            )
        return out

    def _transformer_config(self) -> dict[str, Any] | None:
        """The transformer's config: the loaded one's, else a local folder's; ``None`` for a hub id
        before loading."""
        import json
        import os

        if self.pipe is not None:
            return dict(self.transformer.config)
        try:
            with open(os.path.join(self.pretrained, "transformer", "config.json"), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    # -- loading ------------------------------------------------------------------------------------

    def load(self) -> None:
        if self.pipe is not None:
            return
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))
        # One dtype for every component but the VAE (diffusers reads a {component: dtype} mapping).
        dtypes = {"default": resolve_dtype(self.dtype_name), "vae": resolve_dtype(self.vae_dtype_name)}
        pipe = load_pipeline(self, dtypes, PRETRAINED_FLAG)
        pipe.set_progress_bar_config(disable=True)
        pipe.tokenizer_max_length = self.max_sequence_length  # read by the pipeline's encode_prompt
        for part in (pipe.text_encoder, pipe.text_encoder_2, pipe.vae, pipe.transformer):
            part.requires_grad_(False)
            part.eval()
        self.enable_context_parallel(pipe.transformer)
        # Registered as submodules so that Lightning moves them and the strategies see them.
        self._transformer = pipe.transformer
        self.vae = pipe.vae
        self.text_encoder = pipe.text_encoder
        self.text_encoder_2 = pipe.text_encoder_2
        self.pipe = pipe

    @property
    def default_lora_targets(self) -> tuple[str, ...]:  # type: ignore[override]
        """The joint attention's image and text projections of every block, and the text refiner's (whose
        names they share), as LoRA on MMDiT families (SD3, FLUX) targets them; once loaded, by full name,
        without the last block's text queries and text output projection: the transformer drops the text
        stream after its last block, so those two get no gradient (and DDP refuses parameters that get
        none)."""
        if self.pipe is None:
            return MMDIT_ATTENTION_PROJECTIONS
        last = f"transformer_blocks.{len(self.transformer.transformer_blocks) - 1}.attn."
        dead = (last + "add_q_proj", last + "to_add_out")
        return tuple(
            name
            for name, _ in self.transformer.named_modules()
            if name.endswith(MMDIT_ATTENTION_PROJECTIONS) and name not in dead
        )

    @staticmethod
    def enable_context_parallel(transformer: nn.Module) -> None:
        """Give ``transformer`` its context-parallel plan and processors (inert until
        :func:`~lit_flowgrpo.sequence_parallel.attach_sequence_parallel` gives the processors a parallel
        config: without one they are diffusers' processor)."""
        transformer._cp_plan = _context_parallel_plan(len(transformer.transformer_blocks))
        for block in transformer.transformer_blocks:
            block.attn.set_processor(UlyssesJointAttnProcessor())

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
        split = getattr(network, "_parallel_config", None)  # set by attach_sequence_parallel
        if split is not None:
            cond = self._padded_for(split.context_parallel_config.ulysses_degree, cond)
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

    def _padded_for(self, sp: int, cond: Embeds) -> Embeds:
        """The Qwen2.5-VL rows padded with masked zero rows, so that the joint text (image rows, glyph
        rows, prompt rows) splits in ``sp`` equal parts. Masked rows change no valid token's output: the
        refiner pools and attends over the valid rows, the blocks attend to valid keys only."""
        text = (
            self.pipe.vision_num_semantic_tokens
            + cond["prompt_embeds_2"].shape[1]
            + cond["prompt_embeds"].shape[1]
        )
        pad = -text % sp
        if not pad:
            return cond
        out = dict(cond)
        out["prompt_embeds"] = F.pad(cond["prompt_embeds"], (0, 0, 0, pad))
        out["prompt_embeds_mask"] = F.pad(cond["prompt_embeds_mask"], (0, pad))
        return out

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

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> Tensor:
        """The inverse of :meth:`decode`: videos (B, F, 3, H, W) through the VAE's mean latent times
        ``scaling_factor`` (B, C, (F − 1)/4 + 1, H/16, W/16), as ``HunyuanVideo15ImageToVideoPipeline.
        _get_image_latents`` encodes its first frame. One video at a time, as :meth:`decode` decodes (the
        VAE's causal attention mask does not broadcast over a batch of more than one)."""
        vae = self.vae
        pixels = vae_pixels(vae, images).transpose(1, 2)  # (B, 3, F, H, W)
        z = [vae.encode(row[None]).latent_dist.mode().float() for row in pixels]
        return torch.cat(z) * vae.config.scaling_factor

    def sigmas(self, num_steps: int, height: int, width: int) -> Tensor:
        """The checkpoint scheduler's shifted noise levels for ``num_steps``, from the pipeline's
        ``linspace(1, 0, num_steps + 1)[:-1]`` (size-independent: no dynamic shift)."""
        import numpy as np

        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1], device="cpu")
        return checked_sigmas(scheduler, num_steps, PRETRAINED_FLAG, type(self).__name__)

    def latent_shape(self, height: int, width: int, frames: int = 1) -> tuple[int, ...]:
        spatial, temporal = self.pipe.vae_scale_factor_spatial, self.pipe.vae_scale_factor_temporal
        patch = int(self.transformer.config.patch_size)
        channels = int(self.pipe.num_channels_latents)
        return video_latent_shape(
            self, channels, (height, width, frames), (spatial, temporal), (patch, patch)
        )
