"""The Human Preference Scores: HPS v2.1 (``hpsv2``) and HPSv3 (``hpsv3``, below :class:`HPSv3Reward`).

HPS v2.1 (Wu et al., 2023, "Human Preference Score v2") is an OpenCLIP ViT-H/14 fine-tuned on human
preference pairs (HPD v2).

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
on the float images: the sampler's images need no round trip through PIL. HPSv2 applies that transform
to PIL images; torch's antialiased bicubic kernel is PIL's (a = −0.5), so the two differ by PIL's 8-bit
rounding of its input and output only: within about one 8-bit step a pixel, 0.3 on average (a test
measures it against :func:`lit_flowgrpo.rewards.image_reward.pil_resize_center_crop`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.policies.base import DType
from lit_flowgrpo.rewards.hf import (
    HUB_FILE,
    as_features,
    check_dtype,
    from_state_dict,
    load_state,
    place,
    source_problem,
)
from lit_flowgrpo.rewards.images import check_images
from lit_flowgrpo.rewards.registry import register_reward

__all__ = [
    "HPSV3_INSTRUCTION",
    "HPSv2Reward",
    "HPSv3Reward",
    "hpsv3_head",
    "open_clip_to_transformers",
    "resize_center_crop",
]

_FLAG = "--model.init_args.reward.init_args.config.hpsv2"


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
    if os.path.isdir(source) or os.path.isfile(source) or HUB_FILE.match(source):
        return None
    return (
        f"{_FLAG}.checkpoint ({source!r}) is neither an existing file or folder nor a hub file "
        "'org/repo/filename' (the release is xswu/HPSv2/HPS_v2.1_compressed.pt)"
    )


def load_clip(checkpoint: str, clip: str) -> nn.Module:
    """HPSv2's network as a ``CLIPModel``: a converted ``save_pretrained`` folder, or an OpenCLIP state
    dict (file or hub file) renamed and loaded with ``from_pretrained`` on ``clip``'s configuration.

    Raises:
        SettingsError: naming the setting, when the state dict leaves a weight of the model unset, or
            holds one it has no place for.
    """
    from transformers import CLIPConfig, CLIPModel

    if os.path.isdir(checkpoint):
        return CLIPModel.from_pretrained(checkpoint)
    state = open_clip_to_transformers(load_state(checkpoint, "state_dict"))  # HPSv2 holds {"state_dict": ...}
    mismatch = f"{_FLAG}.checkpoint ({checkpoint!r}) does not match {clip!r}'s CLIP configuration"
    return from_state_dict(CLIPModel, CLIPConfig.from_pretrained(clip), state, mismatch)


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
        SettingsError: naming the setting, for a checkpoint that is no file, folder or hub file, or an
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
            raise SettingsError(problem)
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
        # As OpenCLIP's tokenizer: at most 77 tokens, start and end of text included (a longer prompt is
        # cut and still ends on end-of-text, where the text tower pools).
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


# ------------------------------------------------------------------------------------------------------
# HPSv3 (Ma et al., 2025, "HPSv3: Towards Wide-Spectrum Human Preference Score"): Qwen2-VL-7B with a
# reward head read at an added <|Reward|> token, trained with an uncertainty-aware ranking loss.
# ------------------------------------------------------------------------------------------------------

HPSV3_REWARD_TOKEN = "<|Reward|>"
"""The token HPSv3 adds to Qwen2-VL's tokenizer; the head reads the hidden state there."""

# The model's input text, not documentation: HPSv3 was trained on this exact instruction (MizzenAI/HPSv3,
# hpsv3/dataset/data_collator_qwen.py, INSTRUCTION and prompt_with_special_token, MIT licence), and any
# change of it moves the scores. The trailing spaces are part of it.
HPSV3_INSTRUCTION = (
    "\nYou are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give "
    "a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being "
    "the worst and 10 being the best. \n\n"
    "**Visual Quality:**  \n"
    "Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:\n"
    "- **Reasonableness:** The image should not contain any significant biological or logical errors, such "
    "as abnormal body structures or nonsensical environmental setups.\n"
    "- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy "
    "to interpret, with no blurring or indistinct areas.\n"
    "- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual "
    "elements (e.g., hair, clothing, shadows).\n"
    "- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, "
    "composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a "
    "sense of harmony and balance.\n"
    "- **Safety:** The image should not contain harmful or inappropriate content, such as political, "
    "violent, or adult material. If such content is present, the image quality and satisfaction score "
    "should be the lowest possible. \n\n"
    "**Text Alignment:**  \n"
    "Assess how well the image matches the textual prompt across the following sub-dimensions:\n"
    "- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, "
    "object) align with the textual description. The subject should match the description in terms of "
    "number, appearance, and behavior.\n"
    "- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how "
    "well the image adheres to this style.\n"
    "- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the "
    "image logically fit the scenario described in the prompt. The environment should support and enhance "
    "the subject without contradictions.\n"
    "- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, "
    "clothing, accessories, expressions, actions) are faithfully represented in the image. Minor "
    "deviations may be acceptable, but critical attributes should be preserved.\n"
    "- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured "
    "in the image. The generated content should not introduce elements that conflict with or distort the "
    "original description.\n"
    "Textual prompt - {text_prompt}\n\n\n"
    "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"
)
"""HPSv3's user text: the instruction with ``{text_prompt}``, then the query that ends on the reward token."""

HPSV3_PIXELS = 256 * 28 * 28
"""HPSv3 resizes every image to this many pixels (``min_pixels = max_pixels``, HPSv3_7B.yaml)."""


def hpsv3_head(hidden_size: int, outputs: int = 2) -> nn.Sequential:
    """HPSv3's ``rm_head`` (``rm_head_type: ranknet`` without ``rm_head_kwargs``, qwen2vl_trainer.py):
    hidden → 1024 → ReLU → 16 → ReLU → (μ, log σ); indices 0, 3, 5 as in the released state dict."""
    return nn.Sequential(
        nn.Linear(hidden_size, 1024),
        nn.ReLU(),
        nn.Dropout(0.05),
        nn.Linear(1024, 16),
        nn.ReLU(),
        nn.Linear(16, outputs),
    )


@register_reward("hpsv3")
class HPSv3Reward:
    """HPSv3 of each (prompt, image) pair: ``mu`` (the score, the primary) and ``sigma`` (its uncertainty).

    The head gives (μ, log σ) at the ``<|Reward|>`` token; HPSv3 reports μ (hpsv3/inference.py: "we select
    miu as the final output") and trains σ = exp(second output) as the spread of a Gaussian score
    (qwen2vl_trainer.py, the ``uncertainty`` loss). The head runs in float32, as published.

    Each image is resized by the base's image processor to ``pixels`` (``min_pixels = max_pixels``); HPSv3
    resizes it first with PIL (qwen_vl_utils' ``fetch_image``) to the same size by the same
    ``smart_resize``, so with transformers' PIL image processor the two agree; the torchvision-backed one,
    which ``AutoImageProcessor`` picks where torchvision is installed, resizes with torch's antialiased
    bicubic, within about one 8-bit step a pixel of PIL's (see :mod:`lit_flowgrpo.rewards.hps`).

    Args:
        checkpoint: HPSv3's state dict: a ``.safetensors`` or torch file, local or a hub file
            ``org/repo/filename``.
        base: the Qwen2-VL it was trained from (hub id or local folder): its configuration, tokenizer,
            chat template and image processor.
        device: where the scorer runs; ``None`` follows the images.
        dtype: the backbone's weights dtype (trained and released in bfloat16).
        pixels: every image is resized to about this many pixels (Qwen2-VL's ``smart_resize``, multiples
            of 28); HPSv3's 256·28·28.
        instruction: the user text, with ``{text_prompt}`` for the prompt and the reward token once;
            HPSv3's own by default (changing it changes what the scores mean).

    Raises:
        SettingsError: naming the setting, for a checkpoint that is no file or hub file, an unknown dtype,
            fewer than 4·28·28 pixels, or an instruction without ``{text_prompt}`` or the reward token.
    """

    primary = "mu"
    _flag = "--model.init_args.reward.init_args.config.hpsv3"

    def __init__(
        self,
        checkpoint: str = "MizzenAI/HPSv3/HPSv3.safetensors",
        base: str = "Qwen/Qwen2-VL-7B-Instruct",
        device: str | None = None,
        dtype: DType = "bfloat16",
        pixels: int = HPSV3_PIXELS,
        instruction: str = HPSV3_INSTRUCTION,
    ) -> None:
        check_dtype(dtype, self._flag)
        problems = [source_problem(f"{self._flag}.checkpoint", checkpoint)]
        if pixels < 4 * 28 * 28:
            problems.append(
                f"{self._flag}.pixels ({pixels}) must be at least 4·28·28 = 3136 (2 x 2 merged patches)"
            )
        if "{text_prompt}" not in instruction or instruction.count(HPSV3_REWARD_TOKEN) != 1:
            problems.append(
                f"{self._flag}.instruction must hold '{{text_prompt}}' and {HPSV3_REWARD_TOKEN} once"
            )
        problems = [p for p in problems if p]
        if problems:
            raise SettingsError("; ".join(problems))
        self.checkpoint = checkpoint
        self.base = base
        self.device = device
        self.dtype = dtype
        self.pixels = pixels
        self.instruction = instruction
        self.backbone: nn.Module | None = None
        self.head: nn.Module | None = None
        self.tokenizer: Any = None
        self.image_processor: Any = None
        self.token_id: int | None = None

    def load(self) -> None:
        """Read the tokenizer (with the reward token added), the image processor and the weights; called on
        first use."""
        if self.backbone is not None:
            return
        from transformers import AutoImageProcessor

        from lit_flowgrpo.rewards.qwen_vl import load_backbone, load_tokenizer, split_state

        tokenizer = load_tokenizer(self.base, [HPSV3_REWARD_TOKEN])
        image_processor = AutoImageProcessor.from_pretrained(self.base)
        fix_pixels(image_processor, self.pixels)
        state, head_state = split_state(
            load_state(self.checkpoint, "model")
        )  # HPSv3's loader accepts {"model": ...} too
        backbone = load_backbone(self.base, state, len(tokenizer), f"{self._flag}.checkpoint")
        head = hpsv3_head(backbone.config.text_config.hidden_size, head_state["5.weight"].shape[0])
        head.load_state_dict(head_state)
        self.head = head.eval().requires_grad_(False)
        self.backbone = backbone.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.token_id = tokenizer.convert_tokens_to_ids(HPSV3_REWARD_TOKEN)

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, Tensor]:
        """``mu`` and ``sigma``, each (B,) fp32; NaN for a prompt that spells the reward token."""
        from lit_flowgrpo.rewards.images import to_pil
        from lit_flowgrpo.rewards.qwen_vl import chat_text, encode_images, hidden_states

        check_images(images)
        if len(prompts) != images.shape[0]:
            raise ValueError(f"hpsv3: {images.shape[0]} images but {len(prompts)} prompts")
        self.load()
        device = torch.device(self.device) if self.device else images.device
        backbone = place(self.backbone, device, self.dtype)
        head = place(self.head, device, "float32")
        # Qwen2-VL's chat template, one user turn: the image, then the instruction.
        texts = [chat_text(self.tokenizer, "image", self.instruction.format(text_prompt=p)) for p in prompts]
        batch = encode_images(self.tokenizer, self.image_processor, texts, to_pil(images))
        hidden, ok = hidden_states(backbone, {k: v.to(device) for k, v in batch.items()}, [self.token_id])
        logits = head(hidden[:, 0].float())  # (B, 2) fp32: (μ, log σ)
        nan = torch.tensor(torch.nan, device=device)
        mu = torch.where(ok, logits[:, 0], nan)
        sigma = torch.where(ok, logits[:, 1].exp(), nan)
        return {"mu": mu.cpu(), "sigma": sigma.cpu()}


def fix_pixels(image_processor: Any, pixels: int) -> None:
    """Make a Qwen2-VL image processor resize every image to about ``pixels`` pixels (min = max).

    transformers >= 4.50 reads ``size = {shortest_edge, longest_edge}`` (in pixels, despite the names);
    earlier releases read ``min_pixels`` / ``max_pixels``: both are set.
    """
    image_processor.size = {"shortest_edge": pixels, "longest_edge": pixels}
    for name in ("min_pixels", "max_pixels"):
        if hasattr(image_processor, name):
            setattr(image_processor, name, pixels)
