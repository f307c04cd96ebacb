"""Wan 2.1 / 2.2 text-to-video behind the :class:`~lit_flowgrpo.policies.base.FlowPolicy` interface.

Through diffusers' ``WanPipeline`` and its own components: the UMT5 text encoder,
``WanTransformer3DModel`` (one, or two experts for Wan 2.2 A14B) and the causal video VAE
``AutoencoderKLWan``. The pieces, each as the pipeline's ``__call__`` does it:

- latents are (C, F', H/8, W/8) per sample, F' = (F − 1)/4 + 1 (the VAE keeps the first frame alone
  and folds every 4 after it), so ``frames`` must be 4k + 1 and height and width multiples of the
  VAE factor × the transformer's 2×2 patch (16 for Wan 2.1 and A14B, 32 for TI2V-5B);
- the transformer takes ``timestep = σ·1000`` and predicts the flow velocity ε − x0 (the pipeline
  steps its scheduler with it as ``model_output`` of a ``flow_prediction`` schedule);
- classifier-free guidance with a negative prompt (default "", as flow_grpo's ``train_wan2_1.py``),
  ``uncond + s·(cond − uncond)``, here as one batched forward;
- Wan 2.2 A14B: ``transformer`` (high-noise expert) serves σ·1000 ≥ ``boundary_ratio``·1000 and
  ``transformer_2`` (low-noise expert) the rest, the pipeline's own comparison; each has its own
  LoRA adapter (:attr:`trainable_networks`). ``guidance_scale_2`` sets the low-noise expert's CFG
  scale (Wan 2.2's default is the same as the high-noise one);
- Wan 2.2 TI2V-5B (text-to-video use): the pipeline's ``expand_timesteps`` (one timestep per latent
  token) is honoured; the rest of that model differs in config only.
- the noise levels are those of the checkpoint's scheduler (``UniPCMultistepScheduler`` with flow
  sigmas and ``flow_shift`` for the released folders), stepped by this package's Euler / SDE step,
  as flow_grpo's ``wan_pipeline_with_logprob`` steps them; with diffusers'
  ``FlowMatchEulerDiscreteScheduler`` in its place the ODE (noise level 0) is the pipeline's own
  sampler exactly (``tests/policies/test_wan.py``). UniPC's own multistep update is not used: its
  transitions have no Gaussian log-prob.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lit_flowgrpo.policies.base import (
    FRAMES_FLAG,
    HEIGHT_FLAG,
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
    index_embeds,
    load_pipeline,
    resolve_dtype,
    vae_pixels,
    video_latent_shape,
)
from lit_flowgrpo.policies.packed import PRETRAINED_FLAG

_FLAG = "--model.init_args.policy.init_args"
#: The VAE's temporal factor of every Wan release (Wan 2.1's and Wan 2.2's VAEs alike).
WAN_TEMPORAL_FACTOR = 4


class WanPolicy(FlowPolicy):
    """Wan text-to-video: Wan 2.1 T2V 1.3B / 14B, Wan 2.2 T2V A14B (two experts), Wan 2.2 TI2V-5B.

    Embeds: ``prompt_embeds`` (B, max_sequence_length, D), each prompt's UMT5 states followed by
    zeros, as ``WanPipeline.encode_prompt`` pads them.

    Args:
        pretrained: Hub id or local folder of a ``WanPipeline`` (``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``).
        dtype: the transformers' and the text encoder's dtype; the step math stays fp32.
        vae_dtype: the VAE's dtype (float32 by default, as diffusers' Wan examples and flow_grpo load it).
        max_sequence_length: UMT5 tokens per prompt (the pipeline's default, 512).
        negative_prompt: the unconditional prompt of classifier-free guidance.
        guidance_scale_2: Wan 2.2 A14B: the CFG scale of the low-noise expert; ``None`` takes the scale
            the loop gives (``--model.init_args.sampler.guidance_scale``). Unused with one transformer.
        prompt_cache_size: encoded prompts kept (least recently used dropped).
    """

    modality = "video"
    pipeline_name = "WanPipeline"
    #: flow_grpo ``scripts/train_wan2_1.py``: LoRA r32 α64 on ``to_q/to_k/to_v/to_out.0`` (its
    #: ``add_*`` names exist only in the image-to-video models), which match both the self-attention
    #: (``attn1``) and the cross-attention (``attn2``) of every block.
    default_lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    default_lora_rank: int = 32
    default_lora_alpha: int = 64
    #: Where :meth:`~lit_flowgrpo.weights.TrainableWeights.export` writes the low-noise expert's adapter.
    lora_subfolders: tuple[str, ...] = ("transformer_2",)

    def __init__(
        self,
        pretrained: str,
        dtype: DType = "bfloat16",
        vae_dtype: DType = "float32",
        max_sequence_length: int = 512,
        negative_prompt: str = "",
        guidance_scale_2: float | None = None,
        prompt_cache_size: int = 1024,
    ) -> None:
        super().__init__()
        self.pretrained = pretrained
        self.dtype_name = dtype
        self.vae_dtype_name = vae_dtype
        self.max_sequence_length = max_sequence_length
        self.negative_prompt = negative_prompt
        self.guidance_scale_2 = guidance_scale_2
        self.prompt_cache_size = prompt_cache_size
        self.pipe: Any = None  # a WanPipeline once loaded
        self._transformer_2: nn.Module | None = None
        self._cache = PromptCache(prompt_cache_size)

    # -- settings -----------------------------------------------------------------------------------

    def problems(self) -> list[str]:
        out = check_pretrained(self.pretrained, PRETRAINED_FLAG) or check_family(
            self.pretrained, (self.pipeline_name,), PRETRAINED_FLAG, type(self).__name__
        )
        for name, value in (("dtype", self.dtype_name), ("vae_dtype", self.vae_dtype_name)):
            if value not in ("float32", "bfloat16", "float16"):
                out.append(f"{_FLAG}.{name} ({value}) must be float32, bfloat16 or float16")
        if not 1 <= self.max_sequence_length <= 512:
            out.append(
                f"{_FLAG}.max_sequence_length ({self.max_sequence_length}) must be in [1, 512]: Wan's UMT5 "
                "conditioning was trained with 512 tokens"
            )
        if self.guidance_scale_2 is not None and not self.guidance_scale_2 > 0:
            out.append(f"{_FLAG}.guidance_scale_2 ({self.guidance_scale_2}) must be > 0, or null")
        if self.prompt_cache_size < 0:
            out.append(f"{_FLAG}.prompt_cache_size ({self.prompt_cache_size}) must be >= 0")
        return out

    def frame_problems(self, frames: int, flag: str = FRAMES_FLAG) -> list[str]:
        return causal_video_frame_problems(
            frames, flag, type(self).__name__, "Wan's VAE", WAN_TEMPORAL_FACTOR
        )

    def sequence_parallel_problems(
        self, sp: int, height: int, width: int, frames: int, flag: str
    ) -> list[str]:
        """Wan's transformer has diffusers' context-parallel plan; what Ulysses attention asks: sp divides
        the attention heads (each rank attends with heads/sp) and the video tokens per sample (split in
        equal parts). Read from the checkpoint's configs before loading (a local folder), or from the
        loaded networks; a hub id is checked once loaded."""
        import diffusers

        nets = self._network_configs()
        if nets is None:
            return []
        spatial, temporal = self._vae_factors()
        latent_frames = (frames - 1) // temporal + 1
        out: list[str] = []
        for name, config in nets:
            cls = getattr(diffusers, str(config.get("_class_name")), None)
            if getattr(cls, "_cp_plan", None) is None:
                out.append(
                    f"{flag} ({sp}): {name} ({config.get('_class_name')}) has no context-parallel plan "
                    f"(diffusers' _cp_plan; diffusers {diffusers.__version__}): set {flag}=1"
                )
                continue
            heads = int(config["num_attention_heads"])
            if heads % sp:
                out.append(
                    f"{flag} ({sp}) must divide the {heads} attention heads of {name} (Ulysses attention gives each "
                    f"rank heads/sp of them): use a divisor of {heads}"
                )
            pt, ph, pw = (int(p) for p in config.get("patch_size", (1, 2, 2)))
            grid = (latent_frames // pt, height // spatial // ph, width // spatial // pw)
            tokens = grid[0] * grid[1] * grid[2]
            if tokens % sp:
                out.append(
                    f"{flag} ({sp}) must divide the {tokens} video tokens per sample ({' × '.join(map(str, grid))} "
                    f"patches at {FRAMES_FLAG}={frames}, {HEIGHT_FLAG}={height}, {WIDTH_FLAG}={width}), which "
                    "diffusers splits in equal parts: change the size or the setting"
                )
        return list(dict.fromkeys(out))  # both experts of Wan 2.2 A14B share one config

    def _network_configs(self) -> list[tuple[str, dict[str, Any]]] | None:
        """(component, config) of each transformer: the loaded ones, else a local folder's
        ``<component>/config.json``; ``None`` when neither is at hand (a hub id before loading)."""
        import json
        import os

        if self.pipe is not None:
            names = ("transformer", "transformer_2")
            return [
                (name, {**net.config, "_class_name": type(net).__name__})
                for name, net in zip(names, self.trainable_networks, strict=False)
            ]
        out = []
        for name in ("transformer", "transformer_2"):
            try:
                with open(os.path.join(self.pretrained, name, "config.json"), encoding="utf-8") as f:
                    out.append((name, json.load(f)))
            except (OSError, ValueError):
                continue
        return out or None

    @property
    def image_size_multiple(self) -> int:  # type: ignore[override]
        """The VAE's spatial factor × the transformer's patch: 16 for Wan 2.1 and A14B, 32 for
        TI2V-5B (read from a local folder's configs before loading; Wan 2.1's for a hub id)."""
        return self._vae_factors()[0] * self._patch()

    @property
    def image_size_reason(self) -> str:  # type: ignore[override]
        patch = self._patch()
        return f"the VAE downsamples by {self._vae_factors()[0]} and the transformer cuts {patch}×{patch} patches"

    def _patch(self) -> int:
        """The transformer's spatial patch side (2 in every Wan checkpoint)."""
        nets = self._network_configs()
        return int(nets[0][1].get("patch_size", (1, 2, 2))[1]) if nets else 2

    def _vae_factors(self) -> tuple[int, int]:
        """(spatial, temporal) downsampling of the VAE, as ``WanPipeline`` reads them (8 and 4 unless
        the VAE's config says otherwise, as Wan 2.2 TI2V-5B's does)."""
        import json
        import os

        if self.pipe is not None:
            return self.pipe.vae_scale_factor_spatial, self.pipe.vae_scale_factor_temporal
        try:
            with open(os.path.join(self.pretrained, "vae", "config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            config = {}
        return int(config.get("scale_factor_spatial", 8)), int(
            config.get("scale_factor_temporal", WAN_TEMPORAL_FACTOR)
        )

    @property
    def declared_networks(self) -> int:
        """Trainable networks the checkpoint holds, read from a local folder's ``model_index.json``
        before any weight (2 for Wan 2.2 A14B); 1 when unknown (a hub id: known once loaded)."""
        import json
        import os

        index = os.path.join(self.pretrained, "model_index.json")
        try:
            with open(index, encoding="utf-8") as f:
                entry = json.load(f).get("transformer_2")
        except (OSError, ValueError):
            return 1
        return 2 if isinstance(entry, list) and entry[0] is not None else 1

    # -- loading ------------------------------------------------------------------------------------

    def load(self) -> None:
        if self.pipe is not None:
            return
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))
        pipe = load_pipeline(self, self._component_dtypes(), PRETRAINED_FLAG)
        if pipe.transformer is None:
            raise ValueError(
                f"{PRETRAINED_FLAG} ({self.pretrained}): this WanPipeline has no `transformer` (a low-noise "
                "expert alone); WanPolicy needs the high-noise one too"
            )
        pipe.set_progress_bar_config(disable=True)
        for part in (pipe.text_encoder, pipe.vae, pipe.transformer, pipe.transformer_2):
            if part is not None:
                part.requires_grad_(False)
                part.eval()
        # Registered as submodules so that Lightning moves them and the strategies see them.
        self._transformer = pipe.transformer
        self._transformer_2 = pipe.transformer_2  # None unless Wan 2.2 A14B
        self.vae = pipe.vae
        self.text_encoder = pipe.text_encoder
        self.pipe = pipe

    def _component_dtypes(self) -> dict[str, torch.dtype]:
        """One dtype for every component but the VAE (diffusers reads a {component: dtype} mapping)."""
        return {"default": resolve_dtype(self.dtype_name), "vae": resolve_dtype(self.vae_dtype_name)}

    @property
    def transformer(self) -> nn.Module:
        """The (high-noise) transformer; Wan 2.2 A14B's low-noise expert is ``trainable_networks[1]``."""
        if self.pipe is None:
            raise RuntimeError("WanPolicy.load() has not run: the weights are not loaded yet")
        return self._transformer

    @property
    def trainable_networks(self) -> tuple[nn.Module, ...]:
        second = () if self._transformer_2 is None else (self._transformer_2,)
        return (self.transformer, *second)

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def boundary_timestep(self) -> float | None:
        """``boundary_ratio`` × num_train_timesteps (Wan 2.2 A14B), the timestep where the pipeline
        hands over to the low-noise expert; ``None`` with one transformer."""
        ratio = self.pipe.config.get("boundary_ratio")
        if ratio is None or self._transformer_2 is None:
            return None
        return ratio * self.pipe.scheduler.config.num_train_timesteps

    # -- prompts ------------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> Embeds:
        return cat_embeds(self._cache.rows(prompts, self._encode_one))

    def _encode_one(self, prompt: str) -> Embeds:
        embeds, _ = self.pipe.encode_prompt(
            prompt=[prompt],
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
            device=self.text_encoder.device,
        )
        return {"prompt_embeds": embeds}

    # -- the networks -------------------------------------------------------------------------------

    def velocity(self, latents: Tensor, sigma: Tensor, embeds: Embeds, guidance_scale: float) -> Tensor:
        """v = ε − x0, (B, C, F', h, w) fp32; Wan 2.2 A14B sends each sample to the expert of its σ."""
        batch = latents.shape[0]
        timestep = sigma.to(device=latents.device, dtype=torch.float32).expand(batch)
        timestep = timestep * self.pipe.scheduler.config.num_train_timesteps  # the pipeline's t
        boundary = self.boundary_timestep
        if boundary is None:
            return self._guided(self.transformer, latents, timestep, embeds, guidance_scale)
        high = timestep >= boundary  # (B,) as the pipeline compares its t
        low_scale = (
            guidance_scale if self.guidance_scale_2 is None or guidance_scale <= 1 else self.guidance_scale_2
        )
        parts = [(high, self.transformer, guidance_scale), (~high, self._transformer_2, low_scale)]
        if bool(high.all()) or not bool(high.any()):
            mask, network, scale = parts[0] if bool(high.all()) else parts[1]
            return self._guided(network, latents, timestep, embeds, scale)
        # A batch that straddles the boundary (DiffusionNFT's random noise levels): each expert its rows.
        out = torch.empty(latents.shape, dtype=torch.float32, device=latents.device)
        for mask, network, scale in parts:
            out[mask] = self._guided(
                network, latents[mask], timestep[mask], index_embeds(embeds, mask), scale
            )
        return out

    def _guided(
        self,
        network: nn.Module,
        latents: Tensor,
        timestep: Tensor,
        embeds: Embeds,
        guidance_scale: float,
    ) -> Tensor:
        """One expert's guided velocity for these rows (``embeds``: their conditioning): with CFG one batched
        forward over [cond; uncond], both halves given the same inputs (:meth:`_network_inputs`) but the
        prompt's states."""
        dtype = self.input_dtype(network)
        batch = latents.shape[0]
        cfg = guidance_scale > 1.0
        x, t, image = self._network_inputs(network, latents, timestep, embeds)
        cond = embeds["prompt_embeds"]
        if cfg:
            neg = self.encode_prompts([self.negative_prompt])["prompt_embeds"].to(cond.device)
            x, t = torch.cat([x, x]), torch.cat([t, t])
            cond = torch.cat([cond, neg.expand(batch, -1, -1)])
            image = None if image is None else torch.cat([image, image])
        out = network(
            hidden_states=x.to(dtype),
            timestep=t,
            encoder_hidden_states=cond.to(dtype),
            encoder_hidden_states_image=None if image is None else image.to(dtype),
            return_dict=False,
        )[0].float()
        out = self._generated(out, embeds)
        if not cfg:
            return out
        cond_out, uncond = out.chunk(2)
        return uncond + guidance_scale * (cond_out - uncond)

    def _network_inputs(
        self, network: nn.Module, latents: Tensor, timestep: Tensor, embeds: Embeds
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """The transformer's hidden states, timestep(s) and image-encoder states for these rows, before CFG
        doubles them: here the latents, their t, and no image states."""
        if not self.pipe.config.get("expand_timesteps", False):
            return latents, timestep, None
        # Wan 2.2 TI2V: one timestep per latent token (all equal for text-to-video).
        _, ph, pw = network.config.patch_size
        tokens = latents.shape[2] * (latents.shape[3] // ph) * (latents.shape[4] // pw)
        return latents, timestep[:, None].expand(-1, tokens), None

    def _generated(self, out: Tensor, embeds: Embeds) -> Tensor:
        """The transformer's output (fp32) for the latent frames the trajectory holds: all of them here."""
        return out

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Videos (B, F, 3, H, W) in [0, 1]: undo the per-channel normalisation, decode, as the pipeline."""
        vae = self.vae
        x = latents.to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(x.device, x.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(
            x.device, x.dtype
        )
        x = x / inv_std + mean  # written as the pipeline writes it, so the rounding agrees too
        video = vae.decode(x, return_dict=False)[0]  # (B, 3, F, H, W) in [-1, 1]
        return self.pipe.video_processor.postprocess_video(video, output_type="pt").float()

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> Tensor:
        """The inverse of :meth:`decode`: videos (B, F, 3, H, W) through the VAE's mean latent
        (B, C, (F − 1)/4 + 1, H/8, W/8), normalised per channel as ``(z − mean)·(1/std)``, as
        ``WanImageToVideoPipeline.prepare_latents`` encodes its conditioning video (``sample_mode="argmax"``)."""
        vae = self.vae
        z = vae.encode(vae_pixels(vae, images).transpose(1, 2)).latent_dist.mode().float()  # (B, C, f, h, w)
        mean = torch.tensor(vae.config.latents_mean, device=z.device).view(1, vae.config.z_dim, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std, device=z.device).view(
            1, vae.config.z_dim, 1, 1, 1
        )
        return (z - mean) * inv_std

    def sigmas(self, num_steps: int, height: int, width: int) -> Tensor:
        """The checkpoint scheduler's own noise levels for ``num_steps`` (size-independent for Wan)."""
        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        scheduler.set_timesteps(num_steps, device="cpu")
        hint = " (a flow schedule with final_sigmas_type='zero')"
        return checked_sigmas(scheduler, num_steps, PRETRAINED_FLAG, "WanPolicy", hint)

    def latent_shape(self, height: int, width: int, frames: int = 1) -> tuple[int, ...]:
        spatial, temporal = self.pipe.vae_scale_factor_spatial, self.pipe.vae_scale_factor_temporal
        _, ph, pw = self.transformer.config.patch_size
        channels = int(self.transformer.config.in_channels)
        return video_latent_shape(self, channels, (height, width, frames), (spatial, temporal), (ph, pw))

    def flops_forward(self, height: int, width: int, frames: int = 1) -> Callable[[], Tensor]:
        # σ = 1 is the first (high-noise) network's, whose gradients the FLOP count saves and restores.
        shape = self.latent_shape(height, width, frames)
        device = self.device

        def forward() -> Tensor:
            embeds = self.encode_prompts([""])
            latents = torch.zeros((1, *shape), device=device)
            return self.velocity(latents, torch.ones(1, device=device), embeds, 1.0)

        return forward
