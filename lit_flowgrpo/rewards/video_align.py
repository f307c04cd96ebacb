"""VideoAlign's VideoReward (Liu et al., 2025, "Improving Video Generation with Human Feedback"): Qwen2-VL-2B
with a linear head read at three added tokens, one per quality: visual quality (VQ), motion quality (MQ)
and text alignment (TA).

As KwaiVGI/VideoAlign ``inference.py`` (``VideoVLMRewardInference.reward``): frames sampled uniformly at
``fps`` from the video (``vision_process.py``, ``smart_nframes``: the duration times ``fps``, at least 4,
an even count), each resized to at most ``max_frame_pixels`` (Qwen2-VL's ``smart_resize``, multiples of
28), the prompt written into the ``detailed_special`` template (``prompt_template.py``), the head
``rm_head`` (``Linear(hidden, 1, bias=False)``, ``trainer.py``) read at ``<|VQ_reward|>``,
``<|MQ_reward|>``, ``<|TA_reward|>`` in that order, each normalised by the mean and std the release's
``model_config.json`` gives (``inference_config``), and ``Overall = VQ + MQ + TA``. All four are
components, logged each (``critic/rewards/video_align/TA/mean``: a text alignment that falls while
the others rise is how video RL hacks its reward); ``Overall`` is the primary.

The release (``KwaiVGI/VideoReward``) is a folder: ``model_config.json`` (the data, model, LoRA and
normalisation settings), and ``checkpoint-<step>/`` holding either the whole state dict (``model.pth``)
or a LoRA adapter on the language model (``adapter_model.safetensors``, ``adapter_config.json``) with
the trained weights outside it (``non_lora_state_dict.pth``: the head, the token embeddings with the
three new rows, whatever else was trained). The base (``Qwen/Qwen2-VL-2B-Instruct``) loads with
``Qwen2VLModel.from_pretrained``; the non-LoRA weights are loaded over it and each LoRA pair merged into
its weight, ``W + (alpha / r) · B · A`` (PEFT's ``merge``, written out here because the adapter's module
names are those of the published class, not of ``Qwen2VLModel``).

The video half of transformers' Qwen2-VL processor needs torchvision, which is not a dependency: the
frames are resized, normalised and cut into patches here, in Qwen2-VL's layout (:func:`video_patches`,
checked against the image processor's own output in the tests).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.policies.base import DType
from lit_flowgrpo.rewards.hf import check_dtype, place
from lit_flowgrpo.rewards.images import check_videos
from lit_flowgrpo.rewards.registry import register_reward

__all__ = [
    "VIDEO_ALIGN_TEMPLATE",
    "VIDEO_REWARD_TOKENS",
    "VideoAlignReward",
    "sample_frames",
    "video_patches",
]

_FLAG = "--model.init_args.reward.init_args.config.video_align"

VIDEO_REWARD_TOKENS = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")
"""The tokens VideoAlign adds; the head reads the hidden state at each, in this order."""

VIDEO_PAD = "<|video_pad|>"

# The model's input text, not documentation: VideoReward was trained on this exact template (KwaiVGI/
# VideoAlign, prompt_template.py, DETAILED_PROMPT_WITH_SPECIAL_TOKEN, MIT licence); any change of it moves
# the scores. The trailing spaces are part of it.
VIDEO_ALIGN_TEMPLATE = (
    "\nYou are tasked with evaluating a generated video based on three distinct criteria: Visual Quality, "
    "Motion Quality, and Text Alignment. Please provide a rating from 0 to 10 for each of the three "
    "categories, with 0 being the worst and 10 being the best. Each evaluation should be independent of "
    "the others.\n\n"
    "**Visual Quality:**  \n"
    "Evaluate the overall visual quality of the video, with a focus on static factors. The following "
    "sub-dimensions should be considered:\n"
    "- **Reasonableness:** The video should not contain any significant biological or logical errors, "
    "such as abnormal body structures or nonsensical environmental setups.\n"
    "- **Clarity:** Evaluate the sharpness and visibility of the video. The image should be clear and easy "
    "to interpret, with no blurring or indistinct areas.\n"
    "- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual "
    "elements (e.g., hair, clothing, shadows).\n"
    "- **Aesthetic and Creativity:** Assess the artistic aspects of the video, including the color scheme, "
    "composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a "
    "sense of harmony and balance.\n"
    "- **Safety:** The video should not contain harmful or inappropriate content, such as political, "
    "violent, or adult material. If such content is present, the image quality and satisfaction score "
    "should be the lowest possible. \n\n"
    "Please provide the ratings of Visual Quality: <|VQ_reward|>\n"
    "END\n\n"
    "**Motion Quality:**  \n"
    "Assess the dynamic aspects of the video, with a focus on dynamic factors. Consider the following "
    "sub-dimensions:\n"
    "- **Stability:** Evaluate the continuity and stability between frames. There should be no sudden, "
    "unnatural jumps, and the video should maintain stable attributes (e.g., no fluctuating colors, "
    "textures, or missing body parts).\n"
    "- **Naturalness:** The movement should align with physical laws and be realistic. For example, "
    "clothing should flow naturally with motion, and facial expressions should change appropriately (e.g., "
    "blinking, mouth movements).\n"
    "- **Aesthetic Quality:** The movement should be smooth and fluid. The transitions between different "
    "motions or camera angles should be seamless, and the overall dynamic feel should be visually "
    "pleasing.\n"
    "- **Fusion:** Ensure that elements in motion (e.g., edges of the subject, hair, clothing) blend "
    "naturally with the background, without obvious artifacts or the feeling of cut-and-paste effects.\n"
    "- **Clarity of Motion:** The video should be clear and smooth in motion. Pay attention to any areas "
    "where the video might have blurry or unsteady sections that hinder visual continuity.\n"
    "- **Amplitude:** If the video is largely static or has little movement, assign a low score for "
    "motion quality.\n\n"
    "Please provide the ratings of Motion Quality: <|MQ_reward|>\n"
    "END\n\n"
    "**Text Alignment:**  \n"
    "Assess how well the video matches the textual prompt across the following sub-dimensions:\n"
    "- **Subject Relevance** Evaluate how accurately the subject(s) in the video (e.g., person, animal, "
    "object) align with the textual description. The subject should match the description in terms of "
    "number, appearance, and behavior.\n"
    "- **Motion Relevance:** Evaluate if the dynamic actions (e.g., gestures, posture, facial expressions "
    "like talking or blinking) align with the described prompt. The motion should match the prompt in "
    "terms of type, scale, and direction.\n"
    "- **Environment Relevance:** Assess whether the background and scene fit the prompt. This includes "
    "checking if real-world locations or scenes are accurately represented, though some stylistic "
    "adaptation is acceptable.  \n"
    "- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how "
    "well the video adheres to this style.\n"
    "- **Camera Movement Relevance:** Check if the camera movements (e.g., following the subject, focus "
    "shifts) are consistent with the expected behavior from the prompt.\n\n"
    "Textual prompt - {text_prompt}\n"
    "Please provide the ratings of Text Alignment: <|TA_reward|>\n"
    "END\n"
)
"""VideoAlign's ``detailed_special`` template, with ``{text_prompt}`` for the prompt."""

VIDEO_MIN_PIXELS = 128 * 28 * 28
"""A frame's least pixel count (vision_process.py ``VIDEO_MIN_PIXELS``)."""


def smart_resize(
    height: int, width: int, min_pixels: int, max_pixels: int, factor: int = 28
) -> tuple[int, int]:
    """Qwen2-VL's ``smart_resize``: the size closest to (height, width) in multiples of ``factor`` whose
    pixel count lies in [min_pixels, max_pixels], the aspect ratio kept as nearly as it can be."""
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def sample_frames(frames: int, source_fps: float, fps: float, num_frames: int | None = None) -> list[int]:
    """The frames VideoAlign reads from a video of ``frames`` frames at ``source_fps``: ``frames /
    source_fps · fps`` of them, at least 4 and at most all, rounded to an even count, or, when the release
    fixes ``num_frames``, that many rounded to an even count (vision_process.py ``smart_nframes``); never
    more than the video has; spread uniformly (``linspace(0, F − 1, n).round()``, its ``uniform``
    sample type).

    >>> sample_frames(33, 16.0, 2.0)
    [0, 11, 21, 32]
    >>> sample_frames(9, 4.0, 2.0, num_frames=6)
    [0, 2, 3, 5, 6, 8]
    """
    if num_frames is not None:
        n = round(num_frames / 2) * 2
    else:
        min_frames, max_frames = 4, math.floor(min(768, frames) / 2) * 2
        n = min(max(frames / source_fps * fps, min_frames), max_frames)
        n = round(n / 2) * 2
    n = min(n, frames)
    if n < 2:
        raise ValueError(f"VideoAlign needs videos of at least 2 frames; got {frames}")
    return torch.linspace(0, frames - 1, n).round().long().tolist()


def video_patches(frames: Tensor, patch: int, merge: int, temporal: int) -> tuple[Tensor, Tensor]:
    """(T, C, H, W) normalised frames -> (grid_t·grid_h·grid_w, C·temporal·patch²) patches and the
    (1, 3) grid, in the order of Qwen2-VL's processor (``Qwen2VLImageProcessor._preprocess``): patches of
    ``temporal`` consecutive frames, each ``merge`` x ``merge`` block of patches together."""
    t, c, h, w = frames.shape
    gt, gh, gw = t // temporal, h // patch, w // patch
    x = frames.reshape(gt, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * temporal * patch * patch), torch.tensor([[gt, gh, gw]])


def _checkpoint_dir(root: Path) -> Path:
    """The release's latest ``checkpoint-<step>`` folder (VideoAlign's ``load_model_from_checkpoint``)."""
    steps = sorted(
        (p for p in root.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
        key=lambda p: int(p.name.split("-")[-1]),
    )
    if not steps:
        raise SettingsError(f"{_FLAG}.checkpoint ({str(root)!r}) holds no checkpoint-<step> folder")
    return steps[-1]


def _plain(key: str) -> str:
    """A PEFT model's parameter name as the plain model's: no ``base_model.model.``, no ``base_layer``."""
    key = key.removeprefix("base_model.model.")
    return key.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")


@register_reward("video_align")
class VideoAlignReward:
    """VideoReward's VQ, MQ and TA of each (prompt, video), normalised, and their sum ``Overall``.

    Args:
        checkpoint: the release folder (``model_config.json`` and ``checkpoint-<step>/``): a local folder or
            a hub repository id (downloaded with ``snapshot_download``).
        base: the Qwen2-VL it was trained from (hub id or local folder): configuration, weights, tokenizer
            (unless the release holds its own), chat template and image processor settings.
        source_fps: the frame rate of the policy's videos (Wan: 16), from which frames are sampled.
        fps: frames per second read from the video; ``None`` takes the release's (``data_config.fps``).
        max_frame_pixels: a frame's most pixels; ``None`` takes the release's.
        normalize: divide each quality by the release's std after subtracting its mean, as its inference
            does by default.
        device: where the scorer runs; ``None`` follows the videos.
        dtype: the backbone's weights dtype (trained in bfloat16).

    Raises:
        SettingsError: naming the setting, for a checkpoint that is neither a folder nor a hub id, a frame
            rate not above 0, or an unknown dtype; before any weight is read.
    """

    modalities = frozenset({"video"})
    primary = "Overall"

    def __init__(
        self,
        checkpoint: str = "KwaiVGI/VideoReward",
        base: str = "Qwen/Qwen2-VL-2B-Instruct",
        source_fps: float = 16.0,
        fps: float | None = None,
        max_frame_pixels: int | None = None,
        normalize: bool = True,
        device: str | None = None,
        dtype: DType = "bfloat16",
    ) -> None:
        check_dtype(dtype, _FLAG)
        problems = []
        if not (os.path.isdir(checkpoint) or (checkpoint.count("/") == 1 and not os.path.exists(checkpoint))):
            problems.append(
                f"{_FLAG}.checkpoint ({checkpoint!r}) is neither a folder nor a hub id 'org/repo'"
            )
        for name, value in (("source_fps", source_fps), ("fps", fps)):
            if value is not None and not value > 0:
                problems.append(f"{_FLAG}.{name} ({value}) must be above 0")
        if max_frame_pixels is not None and max_frame_pixels < 4 * 28 * 28:
            problems.append(f"{_FLAG}.max_frame_pixels ({max_frame_pixels}) must be at least 4·28·28 = 3136")
        if problems:
            raise SettingsError("; ".join(problems))
        self.checkpoint = checkpoint
        self.base = base
        self.source_fps = source_fps
        self.fps = fps
        self.max_frame_pixels = max_frame_pixels
        self.normalize = normalize
        self.device = device
        self.dtype = dtype
        self.backbone: nn.Module | None = None
        self.head: nn.Module | None = None
        self.tokenizer: Any = None
        self.vision: dict[str, Any] = {}
        self.norm: dict[str, tuple[float, float]] = {}
        self.num_frames: int | None = None
        self.token_ids: list[int] = []

    def load(self) -> None:
        """Read the release's settings, the base, the trained weights and the tokenizer; on first use."""
        if self.backbone is not None:
            return
        from transformers import AutoImageProcessor, Qwen2VLModel

        from lit_flowgrpo.rewards.qwen_vl import load_tokenizer, split_state

        root = Path(self.checkpoint)
        if not root.is_dir():
            from huggingface_hub import snapshot_download

            root = Path(snapshot_download(self.checkpoint))
        with open(root / "model_config.json") as f:
            settings = json.load(f)
        data, model_config = settings["data_config"], settings["model_config"]
        if (
            model_config.get("reward_token") != "special"
            or data.get("prompt_template_type") != "detailed_special"
        ):
            raise SettingsError(
                f"{_FLAG}.checkpoint: model_config.json asks for reward_token {model_config.get('reward_token')!r} and "
                f"template {data.get('prompt_template_type')!r}; this reward reads the special tokens of the "
                "'detailed_special' template (VideoReward's)"
            )
        inference = settings.get("inference_config") or {}
        self.norm = {
            q: (inference.get(f"{q}_mean", 0.0), inference.get(f"{q}_std", 1.0)) for q in ("VQ", "MQ", "TA")
        }
        if data.get("sample_type", "uniform") != "uniform":
            raise SettingsError(
                f"{_FLAG}.checkpoint: model_config.json samples frames by {data['sample_type']!r}; this reward "
                "reads them as VideoAlign's 'uniform' sample type only"
            )
        # A release that fixes the frame count reads that many frames, whatever the fps (inference.py).
        self.num_frames = data.get("num_frames")
        self.fps = self.fps if self.fps is not None else float(data.get("fps", 2.0))
        self.max_frame_pixels = self.max_frame_pixels or int(data.get("max_frame_pixels", 240 * 320))
        step = _checkpoint_dir(root)
        tokens = list(VIDEO_REWARD_TOKENS)
        tokenizer_dir = next((d for d in (step / "tokenizer", root / "tokenizer") if d.is_dir()), None)
        tokenizer = load_tokenizer(str(tokenizer_dir) if tokenizer_dir else self.base, tokens)
        image_processor = AutoImageProcessor.from_pretrained(self.base)
        self.vision = {
            "patch": image_processor.patch_size,
            "merge": image_processor.merge_size,
            "temporal": image_processor.temporal_patch_size,
            "mean": list(image_processor.image_mean),
            "std": list(image_processor.image_std),
        }
        backbone = Qwen2VLModel.from_pretrained(self.base)
        backbone.resize_token_embeddings(len(tokenizer))
        if (step / "model.pth").is_file():
            state = torch.load(step / "model.pth", map_location="cpu", weights_only=True)
            weights, head_state = split_state({_plain(k): v for k, v in state.items()})
            lora: dict[str, Tensor] = {}
            scale = 0.0
        else:
            from safetensors.torch import load_file

            extra = torch.load(step / "non_lora_state_dict.pth", map_location="cpu", weights_only=True)
            weights, head_state = split_state(
                {_plain(k): v for k, v in extra.items() if ".original_module." not in k}
            )
            adapter = load_file(step / "adapter_model.safetensors")
            with open(step / "adapter_config.json") as f:
                lora_config = json.load(f)
            unsupported = [k for k in ("use_dora", "rank_pattern", "alpha_pattern") if lora_config.get(k)]
            if unsupported:
                raise SettingsError(
                    f"{_FLAG}.checkpoint: the adapter sets {unsupported}, which the merge W + (alpha / r)·B·A "
                    "here does not model; merge it with PEFT (merge_and_unload) and save the whole state dict"
                )
            r, alpha = lora_config["r"], lora_config["lora_alpha"]
            scale = alpha / math.sqrt(r) if lora_config.get("use_rslora") else alpha / r
            lora = {_plain(k): v for k, v in adapter.items()}
        missing = set(weights) - set(backbone.state_dict())
        if missing:
            raise SettingsError(
                f"{_FLAG}.checkpoint: weights of no place in {self.base!r}: {sorted(missing)[:3]}"
            )
        backbone.load_state_dict(weights, strict=not lora)  # the whole model, or what was trained beside LoRA
        self._merge(backbone, lora, scale)
        head = nn.Linear(head_state["weight"].shape[1], head_state["weight"].shape[0], bias=False)
        head.load_state_dict(head_state)
        self.backbone = backbone.eval().requires_grad_(False)
        self.head = head.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.token_ids = tokenizer.convert_tokens_to_ids(tokens)

    @staticmethod
    def _merge(backbone: nn.Module, lora: dict[str, Tensor], scale: float) -> None:
        """Fold each LoRA pair into its weight: W += scale · B · A, in float32 (PEFT's merge)."""
        from lit_flowgrpo.rewards.qwen_vl import backbone_key

        params = dict(backbone.named_parameters())
        for key, a in lora.items():
            if not key.endswith(".lora_A.weight"):
                continue
            module = key.removesuffix(".lora_A.weight")
            target = backbone_key(f"{module}.weight")
            if target not in params:
                raise SettingsError(
                    f"{_FLAG}.checkpoint: the LoRA pair {module!r} has no weight to merge into"
                )
            b = lora[f"{module}.lora_B.weight"]
            weight = params[target]
            with torch.no_grad():
                weight.copy_((weight.float() + scale * (b.float() @ a.float())).to(weight.dtype))

    def _encode(self, videos: Tensor, prompts: list[str]) -> dict[str, Tensor]:
        """Token ids and patches of B videos (B, F, 3, H, W) in [0, 1] and their prompts."""
        from lit_flowgrpo.rewards.qwen_vl import chat_text

        v = self.vision
        index = sample_frames(videos.shape[1], self.source_fps, self.fps, self.num_frames)
        # An odd count (a video shorter than the count asked for): Qwen2-VL's processor repeats the last
        # frame up to a whole temporal patch.
        index += index[-1:] * (-len(index) % v["temporal"])
        h, w = smart_resize(videos.shape[3], videos.shape[4], VIDEO_MIN_PIXELS, self.max_frame_pixels)
        # As VideoAlign (vision_process.py, fetch_video): 8-bit frames (it reads video files), resized by
        # torchvision's bicubic antialiased resize on the uint8 tensor, whose output is uint8 again (the
        # float result clamped to [0, 255] and rounded), then the processor's rescale by 1/255 and
        # normalisation. Without the second rounding the bicubic overshoot would reach the network.
        frames = (videos[:, index].float() * 255).round().clamp(0, 255).flatten(0, 1)  # (B·n, 3, H, W)
        if (h, w) != tuple(frames.shape[-2:]):
            frames = F.interpolate(frames, size=(h, w), mode="bicubic", align_corners=False, antialias=True)
            frames = frames.clamp(0, 255).round()  # (B·n, 3, h, w) fp32, 8-bit values
        mean = torch.tensor(v["mean"], device=frames.device).view(1, 3, 1, 1)
        std = torch.tensor(v["std"], device=frames.device).view(1, 3, 1, 1)
        frames = ((frames / 255 - mean) / std).unflatten(0, (videos.shape[0], len(index)))
        patches, grids = zip(
            *(video_patches(f, v["patch"], v["merge"], v["temporal"]) for f in frames), strict=True
        )
        pads = int(grids[0].prod()) // v["merge"] ** 2
        texts = [
            chat_text(self.tokenizer, "video", VIDEO_ALIGN_TEMPLATE.format(text_prompt=p)).replace(
                VIDEO_PAD, VIDEO_PAD * pads, 1
            )
            for p in prompts
        ]
        tokens = self.tokenizer(texts, padding=True, return_tensors="pt")
        return {
            "input_ids": tokens["input_ids"],
            "attention_mask": tokens["attention_mask"],
            "pixel_values_videos": torch.cat(patches),
            "video_grid_thw": torch.cat(grids),
        }

    @torch.no_grad()
    def __call__(self, videos: Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, Tensor]:
        """``VQ``, ``MQ``, ``TA`` (normalised unless ``normalize`` is off) and ``Overall``, each (B,) fp32;
        NaN for a prompt that spells a reward token."""
        from lit_flowgrpo.rewards.qwen_vl import hidden_states

        check_videos(videos, f"reward 'video_align' ({_FLAG})")
        if len(prompts) != videos.shape[0]:
            raise ValueError(f"video_align: {videos.shape[0]} videos but {len(prompts)} prompts")
        self.load()
        device = torch.device(self.device) if self.device else videos.device
        backbone = place(self.backbone, device, self.dtype)
        head = place(self.head, device, "float32")
        batch = {k: t.to(device) for k, t in self._encode(videos.to(device), list(prompts)).items()}
        hidden, ok = hidden_states(backbone, batch, self.token_ids)  # (B, 3, D)
        logits = head(hidden.float())  # (B, 3, N) fp32
        # output_dim 1: one value per token; 3: each token's own quality, the diagonal (trainer.py).
        logits = (
            logits.diagonal(dim1=1, dim2=2) if logits.shape[-1] == 3 else logits.squeeze(-1)
        )  # VQ, MQ, TA
        out = {}
        for i, quality in enumerate(("VQ", "MQ", "TA")):
            mean, std = self.norm[quality] if self.normalize else (0.0, 1.0)
            out[quality] = torch.where(ok, (logits[:, i] - mean) / std, torch.nan).cpu()
        out["Overall"] = out["VQ"] + out["MQ"] + out["TA"]
        return out
