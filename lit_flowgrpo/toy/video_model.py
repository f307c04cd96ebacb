"""The toy video model: a small factorised space-time U-Net in pixel space, and its text encoder.

The smallest network that can draw the video world's clips ("a red circle moving up") from noise:

- per-frame 2D convolutions (ResNet blocks, a U-Net over ``len(block_out_channels)`` resolutions);
- after every ResNet block a temporal convolution along the frames at each pixel, and at the lowest
  resolution temporal self-attention over all frames, so the frames agree on one object and one path;
- three coordinate channels appended to the input, x, y and the frame's place in the clip t, each
  in [-1, 1] (the image toy's x, y channels plus t): positions and the order of frames are then
  something a translation-invariant network can read;
- conditioning as one vector per clip, added to every ResNet block (FiLM-style scale and shift, as
  diffusers' ``ResnetBlock2D`` with ``time_embedding_norm="scale_shift"``): the sinusoidal embedding
  of σ·1000 plus the pooled prompt state. A video prompt names one object, one colour, one
  direction, so a pooled vector carries all of it; no cross-attention is needed.

Written by hand (diffusers' ``UNet3DConditionModel`` does the same factorisation, but runs on a CPU
an order of magnitude slower at these sizes, and its temporal attention has no positions), as a
diffusers ``ModelMixin``/``ConfigMixin`` so a full fine-tune exports with ``save_pretrained``.

Both networks travel in one safetensors file as the image toy's do (:func:`save_video_checkpoint`),
with their own ``format``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import Tensor, nn

from lit_flowgrpo.toy import model as image_model
from lit_flowgrpo.toy.video_world import VIDEO_VOCAB, unknown_video_words

VIDEO_CHECKPOINT_FORMAT = "lit_flowgrpo.toy_video_base/1"
"""The ``format`` metadata value of a toy video checkpoint."""

VIDEO_PRETRAIN_COMMAND = "lit-flowgrpo fit --config configs/toy_video_pretrain.yaml"
"""The command that (re)creates the shipped video checkpoint."""

VIDEO_REGENERATE_HINT = (
    f"regenerate it with `{VIDEO_PRETRAIN_COMMAND}` (it writes "
    "lit_flowgrpo/toy/assets/toy_video_base.safetensors; minutes on a CPU), or restore the shipped file "
    "with `git checkout -- lit_flowgrpo/toy/assets/toy_video_base.safetensors`"
)


def default_video_checkpoint() -> str:
    """Path of the video base checkpoint shipped inside the package."""
    return str(resources.files("lit_flowgrpo.toy") / "assets" / "toy_video_base.safetensors")


@dataclass(frozen=True)
class ToyVideoModelConfig:
    """Architecture of a freshly initialised toy video model (pretraining).

    Args:
        block_out_channels: channels per resolution level, full resolution first; every level but
            the last halves the resolution.
        norm_num_groups: GroupNorm groups; must divide every entry of ``block_out_channels``.
        temporal_kernel: frames each temporal convolution sees (odd).
        attention_heads: heads of the temporal self-attention at the lowest resolution.
        text_dim: width of the text encoder (its pooled state conditions the network).
        text_layers: transformer layers of the text encoder.
        text_heads: attention heads of the text encoder.
        max_length: longest prompt in tokens, the begin-of-prompt token included.
        frames: frames of the clips it is trained on (the rollouts must draw as many).
        size: side of the square frames it is trained on, in pixels.
    """

    block_out_channels: tuple[int, ...] = (32, 48, 64)
    norm_num_groups: int = 8
    temporal_kernel: int = 3
    attention_heads: int = 4
    text_dim: int = 48
    text_layers: int = 2
    text_heads: int = 4
    max_length: int = 12
    frames: int = 6
    size: int = 16

    def problems(self, flag: str = "--model.init_args.architecture") -> list[str]:
        out = image_model.level_problems(flag, self.block_out_channels, self.norm_num_groups)
        if self.temporal_kernel < 1 or self.temporal_kernel % 2 == 0:
            out.append(f"{flag}.temporal_kernel ({self.temporal_kernel}) must be odd and positive")
        if self.block_out_channels and self.block_out_channels[-1] % self.attention_heads:
            out.append(
                f"{flag}.attention_heads ({self.attention_heads}) must divide the last block_out_channels "
                f"({self.block_out_channels[-1]})"
            )
        out += image_model.text_encoder_problems(flag, self.text_dim, self.text_heads, self.max_length)
        if self.frames < 2:
            out.append(
                f"{flag}.frames ({self.frames}) must be at least 2: motion needs a first and a last frame"
            )
        factor = 2 ** (len(self.block_out_channels) - 1)
        if self.size < 8 or self.size % factor:
            out.append(
                f"{flag}.size ({self.size}) must be at least 8 and a multiple of {factor} (each level but "
                "the last halves the frame)"
            )
        return out


class ToyVideoTextEncoder(image_model.ToyTextEncoder):
    """The image toy's text encoder over the video world's vocabulary (:data:`VIDEO_VOCAB`)."""

    regenerate_hint = VIDEO_REGENERATE_HINT

    def words(self, prompt: str) -> list[str]:
        unknown = unknown_video_words(prompt)
        if unknown:
            raise ValueError(
                f"prompt {prompt!r} has words outside the toy world's video vocabulary: {unknown}; "
                f"known words: {list(VIDEO_VOCAB)}"
            )
        return image_model.world._WORD.findall(prompt.lower())


class _ResBlock(nn.Module):
    """GroupNorm → SiLU → 3×3 conv, the clip's condition as scale and shift, again, plus a skip."""

    def __init__(self, cin: int, cout: int, emb_dim: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.emb = nn.Linear(emb_dim, 2 * cout)
        self.norm2 = nn.GroupNorm(groups, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: Tensor, emb: Tensor) -> Tensor:  # x (N, C, H, W), emb (N, E); N = B·F
        h = self.conv1(F.silu(self.norm1(x)))
        scale, shift = self.emb(emb)[:, :, None, None].chunk(2, dim=1)
        h = self.norm2(h) * (1 + scale) + shift  # diffusers' "scale_shift" time-embedding norm
        return self.skip(x) + self.conv2(F.silu(h))


class _TemporalConv(nn.Module):
    """A residual convolution along the frames at every pixel (zero-initialised: identity at first)."""

    def __init__(self, channels: int, kernel: int, groups: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels)
        self.conv = nn.Conv1d(channels, channels, kernel, padding=kernel // 2)
        nn.init.zeros_(self.conv.weight)
        nn.init.zeros_(self.conv.bias)

    def forward(self, x: Tensor, frames: int) -> Tensor:  # (B·F, C, H, W)
        n, c, h, w = x.shape
        y = F.silu(self.norm(x)).view(n // frames, frames, c, h, w).permute(0, 3, 4, 2, 1)  # (B, H, W, C, F)
        y = self.conv(y.reshape(-1, c, frames)).view(n // frames, h, w, c, frames)
        return x + y.permute(0, 4, 3, 1, 2).reshape(n, c, h, w)


class _TemporalAttention(nn.Module):
    """Residual self-attention over all frames at every pixel (the t channel gives the order)."""

    def __init__(self, channels: int, heads: int, groups: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels)
        self.attn = nn.MultiheadAttention(channels, heads, batch_first=True)

    def forward(self, x: Tensor, frames: int) -> Tensor:
        n, c, h, w = x.shape
        y = self.norm(x).view(n // frames, frames, c, h, w).permute(0, 3, 4, 1, 2).reshape(-1, frames, c)
        y = self.attn(y, y, y, need_weights=False)[0]  # (B·H·W, F, C)
        return x + y.view(n // frames, h, w, frames, c).permute(0, 3, 4, 1, 2).reshape(n, c, h, w)


def timestep_embedding(timestep: Tensor, dim: int) -> Tensor:
    """Sinusoidal embedding (B, dim) of timesteps (B,) (diffusers' ``Timesteps`` with
    ``flip_sin_to_cos=True, downscale_freq_shift=0``, as its U-Nets use)."""
    half = dim // 2
    freqs = torch.exp(
        -math.log(10000.0) * torch.arange(half, device=timestep.device, dtype=torch.float32) / half
    )
    args = timestep.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class ToyVideoNet(ModelMixin, ConfigMixin):
    """The factorised space-time U-Net (see the module docstring).

    Args:
        block_out_channels: channels per resolution level, full resolution first.
        norm_num_groups: GroupNorm groups.
        temporal_kernel: frames each temporal convolution sees.
        attention_heads: heads of the temporal self-attention at the lowest resolution.
        text_dim: width of the pooled prompt state it is conditioned on.
        frames: the frame count it was trained at (recorded; the network itself takes any count).
        sample_size: the frame side it was trained at (recorded).
    """

    @register_to_config
    def __init__(
        self,
        block_out_channels: tuple[int, ...] = (32, 48, 64),
        norm_num_groups: int = 8,
        temporal_kernel: int = 3,
        attention_heads: int = 4,
        text_dim: int = 48,
        frames: int = 6,
        sample_size: int = 16,
    ) -> None:
        super().__init__()
        chans = list(block_out_channels)
        emb_dim = 4 * chans[0]
        g = norm_num_groups
        self.time_mlp = nn.Sequential(nn.Linear(chans[0], emb_dim), nn.SiLU(), nn.Linear(emb_dim, emb_dim))
        self.text_proj = nn.Linear(text_dim, emb_dim)
        self.conv_in = nn.Conv2d(3 + 3, chans[0], 3, padding=1)  # RGB + x, y, t coordinate channels
        self.down = nn.ModuleList()
        self.down_temporal = nn.ModuleList()
        self.downsample = nn.ModuleList()
        cin = chans[0]
        for i, c in enumerate(chans):
            self.down.append(_ResBlock(cin, c, emb_dim, g))
            self.down_temporal.append(_TemporalConv(c, temporal_kernel, g))
            last = i == len(chans) - 1
            self.downsample.append(nn.Identity() if last else nn.Conv2d(c, c, 3, stride=2, padding=1))
            cin = c
        self.mid = _ResBlock(cin, cin, emb_dim, g)
        self.mid_attention = _TemporalAttention(cin, attention_heads, g)
        self.up = nn.ModuleList()
        self.up_temporal = nn.ModuleList()
        self.upsample = nn.ModuleList()
        for i, c in reversed(list(enumerate(chans))):
            self.up.append(_ResBlock(cin + c, c, emb_dim, g))
            self.up_temporal.append(_TemporalConv(c, temporal_kernel, g))
            self.upsample.append(nn.Identity() if i == 0 else nn.Conv2d(c, chans[i - 1], 3, padding=1))
            cin = c if i == 0 else chans[i - 1]
        self.norm_out = nn.GroupNorm(g, chans[0])
        self.conv_out = nn.Conv2d(chans[0], 3, 3, padding=1)

    def forward(self, sample: Tensor, timestep: Tensor, text_pooled: Tensor) -> Tensor:
        """Velocity (B, F, 3, H, W) for noisy clips ``sample`` (B, F, 3, H, W), timesteps (B,) = σ·1000
        and the pooled prompt states (B, text_dim)."""
        b, frames, _, h, w = sample.shape
        emb = self.time_mlp(timestep_embedding(timestep, self.config.block_out_channels[0]).to(sample.dtype))
        emb = (emb + self.text_proj(text_pooled.to(sample.dtype))).repeat_interleave(
            frames, dim=0
        )  # (B·F, E)
        coords = video_coordinates(frames, h, w, sample.device, sample.dtype).expand(b, -1, -1, -1, -1)
        x = self.conv_in(torch.cat([sample, coords], dim=2).flatten(0, 1))  # (B·F, C0, H, W)
        skips = []
        for block, temporal, down in zip(self.down, self.down_temporal, self.downsample, strict=True):
            x = temporal(block(x, emb), frames)
            skips.append(x)
            x = down(x)
        x = self.mid_attention(self.mid(x, emb), frames)
        for block, temporal, up in zip(self.up, self.up_temporal, self.upsample, strict=True):
            x = temporal(block(torch.cat([x, skips.pop()], dim=1), emb), frames)
            if not isinstance(up, nn.Identity):
                x = up(F.interpolate(x, scale_factor=2.0, mode="nearest"))
        out = self.conv_out(F.silu(self.norm_out(x)))
        return out.view(b, frames, 3, h, w)


def video_coordinates(
    frames: int, height: int, width: int, device: torch.device, dtype: torch.dtype
) -> Tensor:
    """(1, F, 3, H, W): x, y at pixel centres and t at the frame's place in the clip, each in [-1, 1]."""
    xy = image_model.coordinate_channels(height, width, device, torch.float32)  # (1, 2, H, W)
    t = torch.linspace(-1.0, 1.0, frames, device=device) if frames > 1 else torch.zeros(1, device=device)
    t = t.view(frames, 1, 1, 1).expand(frames, 1, height, width)
    return torch.cat([xy.expand(frames, -1, -1, -1), t], dim=1)[None].to(dtype)


def build_video_models(config: ToyVideoModelConfig) -> tuple[ToyVideoNet, ToyVideoTextEncoder]:
    """A freshly initialised video network and text encoder over the video world's vocabulary."""
    problems = config.problems()
    if problems:
        raise ValueError("; ".join(problems))
    net = ToyVideoNet(
        block_out_channels=tuple(config.block_out_channels),
        norm_num_groups=config.norm_num_groups,
        temporal_kernel=config.temporal_kernel,
        attention_heads=config.attention_heads,
        text_dim=config.text_dim,
        frames=config.frames,
        sample_size=config.size,
    )
    text_encoder = ToyVideoTextEncoder(
        VIDEO_VOCAB, config.text_dim, config.text_layers, config.text_heads, config.max_length
    )
    return net, text_encoder


def predict_video_velocity(
    net: nn.Module, latents: Tensor, sigma: Tensor, embeds: Mapping[str, Tensor]
) -> Tensor:
    """The network's velocity v = ε − x0 (B, F, 3, H, W) for noisy clips (B, F, 3, H, W) at σ (B,)."""
    dtype = image_model.input_dtype(net, latents.dtype)  # the norms' dtype, as the image toy
    timestep = sigma.to(latents.device, torch.float32) * 1000.0  # SD3's convention, as the image toy
    return net(latents.to(dtype), timestep, embeds["text_pooled"].to(dtype))


def save_video_checkpoint(
    path: str,
    net: ToyVideoNet,
    text_encoder: ToyVideoTextEncoder,
    *,
    dtype: torch.dtype = torch.float16,
    info: Mapping[str, str] | None = None,
) -> None:
    """Write both networks to one safetensors file (:func:`lit_flowgrpo.toy.model.save_checkpoint`)."""
    image_model.save_checkpoint(
        path, net, text_encoder, dtype=dtype, info=info, checkpoint_format=VIDEO_CHECKPOINT_FORMAT
    )


def read_video_checkpoint_metadata(path: str) -> dict[str, str]:
    """The metadata of a toy video checkpoint, validated (raises ``ValueError`` naming the fix)."""
    return image_model.read_checkpoint_metadata(
        path, checkpoint_format=VIDEO_CHECKPOINT_FORMAT, hint=VIDEO_REGENERATE_HINT
    )


def load_video_checkpoint(
    path: str, *, dtype: torch.dtype = torch.float32
) -> tuple[ToyVideoNet, ToyVideoTextEncoder, dict[str, str]]:
    """Both networks from a file written by :func:`save_video_checkpoint`, plus its metadata."""
    net, text_encoder, metadata = image_model.load_checkpoint(
        os.path.expanduser(path),
        dtype=dtype,
        checkpoint_format=VIDEO_CHECKPOINT_FORMAT,
        unet_class=ToyVideoNet,
        text_encoder_class=ToyVideoTextEncoder,
        hint=VIDEO_REGENERATE_HINT,
    )
    return net, text_encoder, metadata  # type: ignore[return-value]


def trained_size(metadata: Mapping[str, str]) -> tuple[int, int]:
    """(frames, frame side) a video checkpoint was trained at, from its metadata."""
    import json

    config: dict[str, Any] = json.loads(metadata["unet_config"])
    return int(config["frames"]), int(config["sample_size"])
