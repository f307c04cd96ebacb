"""Human Preference Score v2.1 (Wu et al., 2023, "Human Preference Score v2"): an OpenCLIP ViT-H/14
fine-tuned on human preference pairs (HPD v2).

The score is the cosine of the L2-normalised image and text embeddings, unscaled (tgxs002/HPSv2,
``hpsv2/img_score.py``: ``image_features @ text_features.T`` on the ``output_dict`` features, which
OpenCLIP normalises; the diagonal is the paired score, about 0.2 to 0.35 on real images).

The released weights are an OpenCLIP state dict (``HPS_v2.1_compressed.pt`` in ``xswu/HPSv2``). OpenCLIP
is not a dependency here: ``open_clip_torch`` requires torchvision, whose wheels pin one torch build
each, so installing it beside a CPU or custom torch can replace that torch. The network is the same as
transformers' ``CLIPModel`` with the ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` configuration (HPSv2 is
that very model fine-tuned), so :func:`open_clip_to_transformers` renames the state dict's keys (and
splits the fused attention projection) and ``CLIPModel.from_pretrained(None, config=..., state_dict=...)``
loads it; a folder written by ``save_pretrained`` of the converted model loads directly.

Preprocessing follows OpenCLIP's evaluation transform (``open_clip/transform.py``, ``image_transform``
with ``is_train=False``): the image as a float tensor, resized so its shorter side is 224 (bicubic), the
central 224 x 224 crop, normalised with the OpenAI CLIP mean and std. It runs on the scorer's device,
on the float images: the sampler's images need no round trip through PIL.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_flowgrpo.policies.base import DType
from lit_flowgrpo.rewards.hf import as_features, check_dtype, place
from lit_flowgrpo.rewards.images import check_images
from lit_flowgrpo.rewards.registry import register_reward

__all__ = ["HPSv2Reward", "open_clip_to_transformers", "resize_center_crop"]

_FLAG = "--model.init_args.reward.init_args.config.hpsv2"
_HUB_FILE = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+/.+$")


def resize_center_crop(
    images: Tensor, size: int, crop: tuple[int, int], mean: list[float], std: list[float]
) -> Tensor:
    """(B, 3, H, W) in [0, 1] -> (B, 3, crop_h, crop_w) fp32, normalised: CLIP's evaluation transform.

    Shorter side to ``size`` (bicubic, antialiased, the longer side ``int(size · long / short)`` as
    torchvision's ``Resize(int)``), the central crop (torchvision's ``CenterCrop`` rounding), then
    ``(x − mean) / std`` per channel.
    """
    check_images(images)
    x = images.float()
    h, w = x.shape[-2:]
    new_h, new_w = (size, int(size * w / h)) if h <= w else (int(size * h / w), size)
    if (new_h, new_w) != (h, w):
        x = F.interpolate(x, size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True)
    top, left = round((new_h - crop[0]) / 2.0), round((new_w - crop[1]) / 2.0)
    x = x[..., top : top + crop[0], left : left + crop[1]]
    mean_t = torch.tensor(mean, device=x.device).view(1, 3, 1, 1)
    std_t = torch.tensor(std, device=x.device).view(1, 3, 1, 1)
    return (x - mean_t) / std_t  # (B, 3, crop_h, crop_w) fp32


# OpenCLIP name -> transformers CLIPModel name, for one residual block (after the tower's prefix).
_BLOCK = {
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "attn.out_proj": "self_attn.out_proj",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
}
_TOWER = {
    "visual.transformer.resblocks.": "vision_model.encoder.layers.",
    "transformer.resblocks.": "text_model.encoder.layers.",
}
_PLAIN = {
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",  # transformers' spelling
    "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
    "visual.ln_post.weight": "vision_model.post_layernorm.weight",
    "visual.ln_post.bias": "vision_model.post_layernorm.bias",
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "ln_final.weight": "text_model.final_layer_norm.weight",
    "ln_final.bias": "text_model.final_layer_norm.bias",
    "logit_scale": "logit_scale",
}
# OpenCLIP keeps the projections as (width, embed) matrices applied as x @ P; nn.Linear holds P^T.
_PROJECTIONS = {"visual.proj": "visual_projection.weight", "text_projection": "text_projection.weight"}


def open_clip_to_transformers(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """An OpenCLIP ``CLIP`` state dict (ViT towers, no custom text model) as ``CLIPModel``'s.

    Each key is renamed; the fused attention input projection ``attn.in_proj_{weight,bias}`` (rows
    q, k, v, as ``nn.MultiheadAttention``) is split into ``q_proj``, ``k_proj``, ``v_proj``; the two
    output projections are transposed. The causal mask buffer ``attn_mask`` is dropped (transformers
    builds its own). A key of no known place raises, so a checkpoint of another architecture fails
    here rather than loading half its weights.
    """
    out: dict[str, Tensor] = {}
    unknown = []
    for key, value in state.items():
        key = key.removeprefix("module.")  # saved from a DistributedDataParallel wrapper
        if key == "attn_mask":
            continue
        if key in _PLAIN:
            out[_PLAIN[key]] = value
            continue
        if key in _PROJECTIONS:
            out[_PROJECTIONS[key]] = value.t().contiguous()
            continue
        tower = next((t for t in _TOWER if key.startswith(t)), None)
        if tower is None:
            unknown.append(key)
            continue
        index, rest = key[len(tower) :].split(".", 1)
        prefix = f"{_TOWER[tower]}{index}."
        if rest.startswith("attn.in_proj_"):
            kind = rest.rsplit("_", 1)[1]  # weight or bias
            for name, part in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3, dim=0), strict=True):
                out[f"{prefix}self_attn.{name}.{kind}"] = part.contiguous()
            continue
        module, kind = rest.rsplit(".", 1)
        if module not in _BLOCK:
            unknown.append(key)
            continue
        out[f"{prefix}{_BLOCK[module]}.{kind}"] = value
    if unknown:
        raise ValueError(
            f"{len(unknown)} keys of the OpenCLIP state dict have no place in CLIPModel (e.g. {unknown[:3]}): "
            "HPSv2 is a ViT-H/14 OpenCLIP model; is this another architecture?"
        )
    return out


def _checkpoint_problem(source: str) -> str | None:
    if os.path.isdir(source) or os.path.isfile(source) or _HUB_FILE.match(source):
        return None
    return (
        f"{_FLAG}.checkpoint ({source!r}) is neither an existing file or folder nor a hub file "
        "'org/repo/filename' (the release is xswu/HPSv2/HPS_v2.1_compressed.pt)"
    )


def _load_state(source: str) -> dict[str, Tensor]:
    """A checkpoint's tensors: a local ``.pt``/``.safetensors`` file or a hub file ``org/repo/file``."""
    if not os.path.isfile(source):
        from huggingface_hub import hf_hub_download

        org, repo, filename = source.split("/", 2)
        source = hf_hub_download(f"{org}/{repo}", filename)
    if source.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(source)
    state = torch.load(source, map_location="cpu", weights_only=True)
    return state.get("state_dict", state)  # HPSv2's files hold {"state_dict": ...}


def load_clip(checkpoint: str, clip: str) -> nn.Module:
    """HPSv2's network as a ``CLIPModel``: a converted ``save_pretrained`` folder, or an OpenCLIP state
    dict (file or hub file) renamed and loaded with ``from_pretrained`` on ``clip``'s configuration.

    Raises:
        ValueError: the state dict leaves a weight of the model unset, or holds one it has no place for.
    """
    from transformers import CLIPConfig, CLIPModel

    if os.path.isdir(checkpoint):
        return CLIPModel.from_pretrained(checkpoint)
    state = open_clip_to_transformers(_load_state(checkpoint))
    model, info = CLIPModel.from_pretrained(
        None, config=CLIPConfig.from_pretrained(clip), state_dict=state, output_loading_info=True
    )
    missing = [k for k in info["missing_keys"] if not k.endswith("position_ids")]
    if missing or info["unexpected_keys"]:
        raise ValueError(
            f"{_FLAG}.checkpoint ({checkpoint!r}) does not match {clip!r}'s CLIP configuration: "
            f"missing {missing[:3]}, unexpected {list(info['unexpected_keys'])[:3]}"
        )
    return model


@register_reward("hpsv2")
class HPSv2Reward:
    """HPS v2.1 of each (prompt, image) pair: the cosine of the two CLIP embeddings.

    Args:
        checkpoint: the HPS weights: an OpenCLIP state dict as released (a local ``.pt`` file or a hub
            file ``org/repo/filename``; ``xswu/HPSv2/HPS_v2.0_compressed.pt`` is HPS v2.0), or a
            folder written by ``save_pretrained`` of the converted ``CLIPModel``.
        clip: the OpenCLIP ViT-H/14 it was fine-tuned from, in transformers' format (hub id or local
            folder): its configuration builds the network and its tokenizer reads the prompts.
        device: where the scorer runs; ``None`` follows the images.
        dtype: the scorer's weights dtype (released in float16 and evaluated under autocast; the
            cosine is taken in float32 whatever this is).

    Raises:
        ValueError: naming the setting, for a checkpoint that is no file, folder or hub file, or an
            unknown dtype; before any weight is read.
    """

    def __init__(
        self,
        checkpoint: str = "xswu/HPSv2/HPS_v2.1_compressed.pt",
        clip: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        device: str | None = None,
        dtype: DType = "float32",
    ) -> None:
        check_dtype(dtype, _FLAG)
        problem = _checkpoint_problem(checkpoint)
        if problem:
            raise ValueError(problem)
        self.checkpoint = checkpoint
        self.clip = clip
        self.device = device
        self.dtype = dtype
        self.model: nn.Module | None = None
        self.tokenizer: Any = None

    def load(self) -> None:
        """Read the weights and the tokenizer (``from_pretrained``); called on first use."""
        if self.model is not None:
            return
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.clip)
        self.model = load_clip(self.checkpoint, self.clip).eval().requires_grad_(False)

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        """(B,) fp32: cos(E_image, E_text) of each pair."""
        check_images(images)
        if len(prompts) != images.shape[0]:
            raise ValueError(f"hpsv2: {images.shape[0]} images but {len(prompts)} prompts")
        self.load()
        device = torch.device(self.device) if self.device else images.device
        model = place(self.model, device, self.dtype)
        dtype = next(model.parameters()).dtype
        # OpenAI CLIP's mean and std: OpenCLIP's defaults (open_clip/constants.py), which HPSv2 keeps.
        side = model.config.vision_config.image_size  # 224 for ViT-H/14
        pixels = resize_center_crop(
            images.to(device),
            side,
            (side, side),
            [0.48145466, 0.4578275, 0.40821073],
            [0.26862954, 0.26130258, 0.27577711],
        )
        # As OpenCLIP's tokenizer: 77 tokens with start and end of text, truncated keeping the end.
        text = self.tokenizer(
            list(prompts), padding=True, truncation=True, max_length=77, return_tensors="pt"
        )
        image_embs = as_features(model.get_image_features(pixel_values=pixels.to(dtype)))
        text_embs = as_features(
            model.get_text_features(
                input_ids=text["input_ids"].to(device), attention_mask=text["attention_mask"].to(device)
            )
        )
        image_embs = F.normalize(image_embs.float(), dim=-1)  # (B, D) fp32, unit norm
        text_embs = F.normalize(text_embs.float(), dim=-1)  # (B, D) fp32, unit norm
        return (image_embs * text_embs).sum(-1).cpu()  # (B,) the paired diagonal
