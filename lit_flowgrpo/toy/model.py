"""The toy base model: a tiny text encoder over the toy world's vocabulary and a small U-Net.

The denoiser is diffusers' ``UNet2DConditionModel`` with a tiny config working directly in pixel
space (3 × 32 × 32, values in [-1, 1]). Two coordinate channels (x and y in [-1, 1]) are appended
to its input so that positions ("to the left of") are easy to express for a network whose
convolutions are translation invariant. The text reaches it in two ways: cross-attention to the
encoder's per-word states at the lower resolutions, and the pooled prompt state added to the
time embedding (diffusers' ``class_embed_type="projection"``), as SDXL/SD3 add a pooled text vector.

Both networks travel in ONE safetensors file: the tensors under the prefixes ``unet.`` and
``text_encoder.``, the two configs as JSON in the file's metadata.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
from diffusers import UNet2DConditionModel
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from lit_flowgrpo.toy import world

CHECKPOINT_FORMAT = "lit_flowgrpo.toy_base/1"
"""The ``format`` metadata value of a toy checkpoint (bumped when the layout changes)."""

PRETRAIN_COMMAND = "lit-flowgrpo fit --config configs/toy_pretrain.yaml"
"""The command that (re)creates the shipped checkpoint."""

REGENERATE_HINT = (
    f"regenerate it with `{PRETRAIN_COMMAND}` (it writes lit_flowgrpo/toy/assets/toy_base.safetensors; "
    "minutes on a GPU), or restore the shipped file with "
    "`git checkout -- lit_flowgrpo/toy/assets/toy_base.safetensors`"
)

PAD_ID = 0
BOS_ID = 1
_NUM_SPECIAL = 2  # ids 0 (padding) and 1 (begin of prompt) precede the vocabulary


def default_checkpoint() -> str:
    """Path of the base checkpoint shipped inside the package."""
    return str(resources.files("lit_flowgrpo.toy") / "assets" / "toy_base.safetensors")


@dataclass(frozen=True)
class ToyModelConfig:
    """Architecture of a freshly initialised toy model (pretraining).

    Args:
        block_out_channels: U-Net channels per resolution level, 32×32 first. Every level but the
            first cross-attends to the text (the first too with ``text_at_full_resolution``).
        layers_per_block: ResNet (+ attention) layers per down level; up levels have one more.
        attention_heads: heads of every U-Net attention layer.
        norm_num_groups: GroupNorm groups; must divide every entry of ``block_out_channels``.
        mid_block: add diffusers' cross-attention mid block at the lowest resolution.
        text_dim: width of the text encoder, also the U-Net's cross-attention width.
        text_layers: transformer layers of the text encoder.
        text_heads: attention heads of the text encoder.
        max_length: longest prompt in tokens, the begin-of-prompt token included.
        text_at_full_resolution: the first (32×32) level cross-attends to the text too, so every
            pixel reads the prompt directly, not only through the 16×16 and 8×8 features. That
            level's transformer is cross-attention only (diffusers' ``only_cross_attention``): its
            first attention also reads the text, where the others attend over the pixels, because
            self-attention over 1024 pixels would about double the model's cost on a CPU. That
            first attention gets no text mask (diffusers passes ``encoder_attention_mask`` only
            to the second); padding states are zero, so padding adds zero-valued keys, the same
            for a prompt in every run.
    """

    block_out_channels: tuple[int, ...] = (32, 64, 128)
    layers_per_block: int = 1
    attention_heads: int = 4
    norm_num_groups: int = 8
    mid_block: bool = False
    text_dim: int = 64
    text_layers: int = 2
    text_heads: int = 4
    max_length: int = 16
    text_at_full_resolution: bool = False

    def problems(self, flag: str = "--model.init_args.architecture") -> list[str]:
        out = level_problems(flag, self.block_out_channels, self.norm_num_groups)
        return out + text_encoder_problems(flag, self.text_dim, self.text_heads, self.max_length)


def level_problems(flag: str, block_out_channels: Sequence[int], norm_num_groups: int) -> list[str]:
    """Problems with a toy denoiser's resolution levels (the image and the video model's alike)."""
    out = []
    if len(block_out_channels) < 2:
        out.append(f"{flag}.block_out_channels needs at least 2 levels, got {list(block_out_channels)}")
    bad = [c for c in block_out_channels if c % norm_num_groups]
    if bad:
        out.append(
            f"{flag}.norm_num_groups ({norm_num_groups}) must divide every entry of "
            f"block_out_channels; it does not divide {bad}"
        )
    return out


def text_encoder_problems(flag: str, text_dim: int, text_heads: int, max_length: int) -> list[str]:
    """Problems with the sizes of a :class:`ToyTextEncoder` (the image and the video model's alike)."""
    out = []
    if text_dim % text_heads:
        out.append(f"{flag}.text_heads ({text_heads}) must divide text_dim ({text_dim})")
    if max_length < 2:
        out.append(f"{flag}.max_length ({max_length}) must be at least 2 (begin token + one word)")
    return out


class ToyTextEncoder(nn.Module):
    """Word embeddings + learned positions + a small pre-norm transformer encoder.

    Token ids: 0 pads, 1 begins every prompt, ``2 + i`` is ``vocab[i]``. The begin token makes the
    empty prompt a valid one-token sequence: it is the unconditional input of classifier-free
    guidance, and its final state is the pooled prompt vector.

    Args:
        vocab: the words this encoder knows (the toy world's ``VOCAB`` when it was trained).
        dim: model width.
        num_layers: transformer layers.
        num_heads: attention heads.
        max_length: longest sequence, begin token included.
    """

    def __init__(
        self,
        vocab: Sequence[str],
        dim: int = 64,
        num_layers: int = 2,
        num_heads: int = 4,
        max_length: int = 16,
    ) -> None:
        super().__init__()
        self.vocab = tuple(vocab)
        self.dim, self.num_layers, self.num_heads, self.max_length = dim, num_layers, num_heads, max_length
        self._ids = {word: i + _NUM_SPECIAL for i, word in enumerate(self.vocab)}
        self._token_cache: dict[str, list[int]] = {}
        self.token_embedding = nn.Embedding(len(self.vocab) + _NUM_SPECIAL, dim, padding_idx=PAD_ID)
        self.position_embedding = nn.Embedding(max_length, dim)
        layer = nn.TransformerEncoderLayer(
            dim,
            num_heads,
            dim_feedforward=4 * dim,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        # enable_nested_tensor=False: the padded rows stay dense, so train and eval run the same path.
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.final_norm = nn.LayerNorm(dim)
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.position_embedding.weight, std=0.02)

    @property
    def config(self) -> dict[str, Any]:
        return {
            "vocab": list(self.vocab),
            "dim": self.dim,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "max_length": self.max_length,
        }

    def tokenize(self, prompts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """Token ids (B, max_length) long and the attention mask (B, max_length) bool (True = token).

        Raises:
            ValueError: a prompt has words outside the toy world's vocabulary (all of them are
                listed), words this encoder was not trained on, or too many words.
        """
        rows = [self._token_ids(p) for p in prompts]
        ids = torch.full((len(rows), self.max_length), PAD_ID, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return ids, ids != PAD_ID

    #: What the errors tell a user whose checkpoint no longer matches the world (a subclass's own).
    regenerate_hint = REGENERATE_HINT

    def words(self, prompt: str) -> list[str]:
        """The words of ``prompt`` (raises ``ValueError`` listing every word outside the world)."""
        return world.tokenize(prompt)

    def _token_ids(self, prompt: str) -> list[int]:
        cached = self._token_cache.get(prompt)
        if cached is not None:
            return cached
        words = self.words(prompt)  # raises ValueError listing every unknown word
        unknown = sorted({w for w in words if w not in self._ids})
        if unknown:
            raise ValueError(
                f"prompt {prompt!r} has words {unknown} that the toy text encoder was not trained on (the "
                f"toy world's vocabulary changed since the checkpoint was made): {self.regenerate_hint}"
            )
        if len(words) + 1 > self.max_length:
            raise ValueError(
                f"prompt {prompt!r} has {len(words)} words; the toy text encoder takes at most "
                f"{self.max_length - 1}: shorten the prompt"
            )
        ids = [BOS_ID] + [self._ids[w] for w in words]
        self._token_cache[prompt] = ids
        return ids

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
        """Per-token states (B, L, D), zero at padding, and the pooled state (B, D) of the begin token."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.token_embedding(input_ids) + self.position_embedding(positions)[None]
        h = self.encoder(h, src_key_padding_mask=~attention_mask.bool())
        h = self.final_norm(h) * attention_mask[..., None].to(h.dtype)
        return h, h[:, 0]


def unet_config(config: ToyModelConfig) -> dict[str, Any]:
    """The ``UNet2DConditionModel`` keyword arguments for ``config``."""
    levels = len(config.block_out_channels)
    first = 1 if config.text_at_full_resolution else 0  # levels from the first that cross-attend
    extra: dict[str, Any] = {}
    if config.text_at_full_resolution:
        # per down level, 32x32 first (diffusers reverses it for the up levels); the mid block keeps
        # its self-attention
        extra = {
            "only_cross_attention": (True,) + (False,) * (levels - 1),
            "mid_block_only_cross_attention": False,
        }
    return extra | {
        "sample_size": world.IMAGE_SIZE,
        "in_channels": 3 + 2,  # RGB + the x, y coordinate channels
        "out_channels": 3,
        "down_block_types": ("DownBlock2D",) * (1 - first) + ("CrossAttnDownBlock2D",) * (levels - 1 + first),
        "up_block_types": ("CrossAttnUpBlock2D",) * (levels - 1 + first) + ("UpBlock2D",) * (1 - first),
        "block_out_channels": tuple(config.block_out_channels),
        "layers_per_block": config.layers_per_block,
        "mid_block_type": "UNetMidBlock2DCrossAttn" if config.mid_block else None,
        "cross_attention_dim": config.text_dim,
        # diffusers' UNet2DConditionModel reads `attention_head_dim` as the number of heads (a
        # historical misnomer documented in its source); `num_attention_heads` is refused.
        "attention_head_dim": config.attention_heads,
        "norm_num_groups": config.norm_num_groups,
        "class_embed_type": "projection",
        "projection_class_embeddings_input_dim": config.text_dim,
    }


def build_models(config: ToyModelConfig) -> tuple[UNet2DConditionModel, ToyTextEncoder]:
    """A freshly initialised U-Net and text encoder over the toy world's current vocabulary."""
    problems = config.problems()
    if problems:
        raise ValueError("; ".join(problems))
    unet = UNet2DConditionModel(**unet_config(config))
    text_encoder = ToyTextEncoder(
        world.VOCAB, config.text_dim, config.text_layers, config.text_heads, config.max_length
    )
    return unet, text_encoder


def coordinate_channels(height: int, width: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """(1, 2, H, W): x then y, each in [-1, 1] at pixel centres."""
    ys = (torch.arange(height, device=device, dtype=torch.float32) + 0.5) / height * 2 - 1
    xs = (torch.arange(width, device=device, dtype=torch.float32) + 0.5) / width * 2 - 1
    grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
    return torch.stack([grid_x, grid_y])[None].to(dtype)


def input_dtype(unet: nn.Module, default: torch.dtype) -> torch.dtype:
    """The dtype the U-Net's inputs are cast to: that of its norm parameters.

    diffusers adds the class embedding to the time embedding in the sample's dtype, outside autocast's
    casts. Float32 master weights and their frozen copies (the old policy, the reference: matrices in
    bf16, norms in float32, :func:`lit_flowgrpo.copies.cast_elementwise`) must add them in the same
    dtype to compute the same velocity before any update; a model loaded in bf16 throughout, or a
    LoRA on a bf16 base, keeps bf16 inputs.
    """
    for module in unet.modules():
        if isinstance(module, (nn.GroupNorm, nn.LayerNorm)) and module.weight is not None:
            return module.weight.dtype
    return unet.dtype if hasattr(unet, "dtype") else default


def predict_velocity(unet: nn.Module, latents: Tensor, sigma: Tensor, embeds: Mapping[str, Tensor]) -> Tensor:
    """The U-Net's velocity prediction v = ε − x0 (B, 3, H, W), in the U-Net's dtype.

    Args:
        unet: the toy ``UNet2DConditionModel`` (possibly wrapped by peft).
        latents: (B, 3, H, W) noisy pixels x_σ.
        sigma: (B,) noise levels in [0, 1]; the U-Net sees σ·1000 as its timestep (SD3's convention).
        embeds: ``text_hidden`` (B, L, D), ``text_mask`` (B, L), ``text_pooled`` (B, D).
    """
    dtype = input_dtype(unet, latents.dtype)
    b, _, h, w = latents.shape
    coords = coordinate_channels(h, w, latents.device, dtype).expand(b, -1, -1, -1)
    sample = torch.cat([latents.to(dtype), coords], dim=1)
    return unet(
        sample,
        sigma.to(latents.device, torch.float32) * 1000.0,
        encoder_hidden_states=embeds["text_hidden"].to(dtype),
        encoder_attention_mask=embeds["text_mask"],
        class_labels=embeds["text_pooled"].to(dtype),
    ).sample


def save_checkpoint(
    path: str,
    unet: UNet2DConditionModel,
    text_encoder: ToyTextEncoder,
    *,
    dtype: torch.dtype = torch.float16,
    info: Mapping[str, str] | None = None,
    checkpoint_format: str = CHECKPOINT_FORMAT,
) -> None:
    """Write both networks to one safetensors file at ``path`` (folders are created).

    Args:
        path: target ``.safetensors`` file.
        unet: the toy U-Net (unwrapped: no peft adapters).
        text_encoder: the toy text encoder.
        dtype: storage dtype of floating tensors (fp16 halves the file; loading casts back).
        info: extra string metadata (how the file was made), stored beside the configs.
        checkpoint_format: the ``format`` metadata value (the video model's checkpoints have their own).
    """
    tensors = {}
    for prefix, module in (("unet.", unet), ("text_encoder.", text_encoder)):
        for name, tensor in module.state_dict().items():
            tensor = tensor.detach().to("cpu")
            tensors[prefix + name] = (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous()
    metadata = {
        "format": checkpoint_format,
        "unet_config": json.dumps(dict(unet.config)),
        "text_encoder_config": json.dumps(text_encoder.config),
        **{k: str(v) for k, v in (info or {}).items()},
    }
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, path, metadata=metadata)


def read_checkpoint_metadata(
    path: str, *, checkpoint_format: str = CHECKPOINT_FORMAT, hint: str = REGENERATE_HINT
) -> dict[str, str]:
    """The metadata of a toy checkpoint of ``checkpoint_format``, validated (``hint``: how to regenerate one).

    Raises:
        ValueError: the file is missing, not safetensors, or not a toy checkpoint; the message says
            how to regenerate it.
    """
    if not os.path.isfile(path):
        raise ValueError(f"toy checkpoint {path} does not exist: {hint}")
    try:
        with safe_open(path, framework="pt") as f:
            metadata = dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"toy checkpoint {path} is not a readable safetensors file ({err}): {hint}") from err
    if metadata.get("format") != checkpoint_format:
        raise ValueError(
            f"{path} is not a toy checkpoint (format {metadata.get('format')!r}, expected "
            f"{checkpoint_format!r}): {hint}"
        )
    return metadata


def load_checkpoint(
    path: str,
    *,
    dtype: torch.dtype = torch.float32,
    checkpoint_format: str = CHECKPOINT_FORMAT,
    unet_class: Any = UNet2DConditionModel,
    text_encoder_class: type[ToyTextEncoder] = ToyTextEncoder,
    hint: str = REGENERATE_HINT,
) -> tuple[Any, ToyTextEncoder, dict[str, str]]:
    """Both networks from a file written by :func:`save_checkpoint`, plus its metadata.

    ``checkpoint_format``, ``unet_class``, ``text_encoder_class`` and ``hint`` describe another toy model that
    travels the same way (the video model: :mod:`lit_flowgrpo.toy.video_model`).

    Raises:
        ValueError: the file is missing or corrupt, or its tensors do not match its configs; the
            message says how to regenerate it.
    """
    metadata = read_checkpoint_metadata(path, checkpoint_format=checkpoint_format, hint=hint)
    try:
        unet = unet_class.from_config(json.loads(metadata["unet_config"]))
        text_encoder = text_encoder_class(**json.loads(metadata["text_encoder_config"]))
        parts: dict[str, dict[str, Tensor]] = {"unet.": {}, "text_encoder.": {}}
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                prefix = next((p for p in parts if key.startswith(p)), None)
                if prefix is None:
                    raise ValueError(f"unexpected tensor {key!r}")
                parts[prefix][key[len(prefix) :]] = f.get_tensor(key)
        unet.load_state_dict(parts["unet."], strict=True)
        text_encoder.load_state_dict(parts["text_encoder."], strict=True)
    except (KeyError, TypeError, ValueError, RuntimeError, SafetensorError, OSError) as err:
        raise ValueError(f"toy checkpoint {path} is corrupt ({err}): {hint}") from err
    if dtype != torch.float32:  # the networks are built in fp32; cast only when asked
        unet, text_encoder = unet.to(dtype), text_encoder.to(dtype)
    return unet, text_encoder, metadata
