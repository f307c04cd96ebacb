"""Cost per image (per video) of the preference reward models (``hpsv2``, ``image_reward``, ``hpsv3``,
``video_align``) at their real sizes.

Each reward is built with the released architecture (HPS v2.1: OpenCLIP ViT-H/14 as ``CLIPModel``;
ImageReward: BLIP ViT-L/16 + BERT-base with cross-attention + MLP; HPSv3: Qwen2-VL-7B + its head;
VideoAlign: Qwen2-VL-2B + its head, on 33-frame 480 x 832 videos, 4 frames read at 2 fps) and
random weights (no weights are downloaded), then scores a batch of 512 x 512 images through its own
``__call__``: preprocessing, tokenisation, the forward and the copy back, as a training step runs it.
Tokenizers are made here (no downloads): CLIP's and BERT's at character level (CLIP pads or truncates to
at most 77 tokens, BERT always to 35, as ImageReward), Qwen2-VL's at word level (about one token a word,
as its BPE is on English; the measured sequence length is recorded). The numbers are the median of
``--repeats`` timed calls after ``--warmup`` untimed ones, per image; peak memory is the GPU's.

    python benchmarks/reward_cost.py --out benchmarks/results/reward_cost_H200.json
    python benchmarks/reward_cost.py --tiny --device cpu   # the code path, at toy sizes, on a CPU
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import torch

PROMPTS = [
    "a photo of an astronaut riding a horse on the moon, highly detailed, dramatic lighting",
    "a cozy wooden cabin in a snowy forest at dusk, warm light in the windows",
    "a red fox sitting in a field of sunflowers, watercolor painting",
    "a futuristic city skyline at night with flying cars and neon signs",
]


def _clip_tokenizer():
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    chars = sorted(ByteLevel.alphabet())
    tokens = [*chars, *(c + "</w>" for c in chars), "<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[])


def _bert_tokenizer(tmp: str):
    import os

    from transformers import BertTokenizer

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz0123456789,."]
    path = os.path.join(tmp, "vocab.txt")
    with open(path, "w") as f:
        f.write("\n".join(words) + "\n")
    return BertTokenizer(path)


def _qwen_tokenizer(text: str):
    """A word-level tokenizer over the words of ``text``, with Qwen2-VL's special tokens and chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from lit_flowgrpo.rewards.hps import HPSV3_REWARD_TOKEN

    words = sorted(
        set(
            pre_tokenizers.Whitespace().pre_tokenize_str(text)[i][0]
            for i in range(len(pre_tokenizers.Whitespace().pre_tokenize_str(text)))
        )
    )
    special = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
        "[UNK]",
    ]
    vocab = {w: i for i, w in enumerate([*special, *words])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|endoftext|>", unk_token="[UNK]")
    tokenizer.add_special_tokens({"additional_special_tokens": special[1:7]})
    tokenizer.chat_template = (
        "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
        "<|im_start|>{{ message['role'] }}\n{% for content in message['content'] %}"
        "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
        "{% else %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer.padding_side = "right"
    tokenizer.add_special_tokens({"additional_special_tokens": [HPSV3_REWARD_TOKEN]})
    return tokenizer


def _build(
    cls: type, config: Any, device: torch.device, dtype: torch.dtype, **kwargs: Any
) -> torch.nn.Module:
    """``cls(config)`` with random weights made on ``device`` in ``dtype`` directly (a 7B model made on the
    CPU in float32 first would take minutes and 30 GB)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls(config, **kwargs).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(previous)


def hpsv2(device: torch.device, tiny: bool):
    from transformers import CLIPConfig, CLIPModel

    from lit_flowgrpo.rewards.hps import HPSv2Reward

    tokenizer = _clip_tokenizer()
    if tiny:
        text = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
        vision = {**text, "image_size": 32, "patch_size": 8}
        projection = 16
    else:  # laion/CLIP-ViT-H-14-laion2B-s32B-b79K (HPSv2's ViT-H-14.json)
        text = {
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
        }
        vision = {
            "hidden_size": 1280,
            "intermediate_size": 5120,
            "num_hidden_layers": 32,
            "num_attention_heads": 16,
            "image_size": 224,
            "patch_size": 14,
        }
        projection = 1024
    config = CLIPConfig(
        text_config={
            **text,
            "hidden_act": "gelu",
            "vocab_size": len(tokenizer),
            "max_position_embeddings": 77,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
        },
        vision_config={**vision, "hidden_act": "gelu"},
        projection_dim=projection,
    )
    reward = HPSv2Reward(device=str(device), dtype="float32")
    reward.model = _build(CLIPModel, config, device, torch.float32)
    reward.tokenizer = tokenizer
    return reward, {"dtype": "float32", "params": sum(p.numel() for p in reward.model.parameters())}


def image_reward(device: torch.device, tiny: bool, tmp: str):
    from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

    from lit_flowgrpo.rewards.aesthetic import AestheticMLP
    from lit_flowgrpo.rewards.image_reward import BLIP_VIT_LARGE, ImageRewardReward

    tokenizer = _bert_tokenizer(tmp)
    if tiny:
        vision = {
            **BLIP_VIT_LARGE,
            "image_size": 32,
            "patch_size": 8,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
        }
        text = {"hidden_size": 24, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2}
    else:  # ImageReward's med_config.json: BERT-base, cross-attention to the ViT-L's 1024 wide tokens
        vision = dict(BLIP_VIT_LARGE)
        text = {
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
        }
    reward = ImageRewardReward(vision_config=vision, device=str(device), dtype="float32")
    reward.vision = _build(BlipVisionModel, BlipVisionConfig(**vision), device, torch.float32)
    text_config = BlipTextConfig(
        vocab_size=30524,
        max_position_embeddings=512,
        layer_norm_eps=1e-12,
        encoder_hidden_size=vision["hidden_size"],
        is_decoder=True,
        bos_token_id=None,
        sep_token_id=None,
        **text,
    )
    reward.text = _build(BlipTextModel, text_config, device, torch.float32, add_pooling_layer=False)
    reward.mlp = AestheticMLP(text["hidden_size"]).to(device).eval().requires_grad_(False)
    reward.tokenizer = tokenizer
    params = sum(p.numel() for m in (reward.vision, reward.text, reward.mlp) for p in m.parameters())
    return reward, {"dtype": "float32", "params": params}


#: A Qwen2-VL of two text layers of width 32 and one vision block, for the tiny runs of HPSv3 and VideoAlign.
TINY_QWEN2VL_TEXT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "rope_scaling": {"type": "mrope", "mrope_section": [4, 2, 2]},
}
TINY_QWEN2VL_VISION = {"depth": 1, "embed_dim": 16, "hidden_size": 32, "mlp_ratio": 2, "num_heads": 2}


def _qwen2vl_config(tokenizer, text: dict, vision: dict):
    """A Qwen2-VL config of ``text`` and ``vision`` sizes for ``tokenizer`` (its vision token ids), with the
    14-pixel patches, 2×2 merge and 2-frame temporal patches of every Qwen2-VL release, on SDPA."""
    from transformers import Qwen2VLConfig

    ids = tokenizer.convert_tokens_to_ids(
        ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    )
    config = Qwen2VLConfig(
        text_config={
            **text,
            "vocab_size": len(tokenizer),
            "max_position_embeddings": 32768,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            **vision,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_chans": 3,
        },
        vision_start_token_id=ids[0],
        vision_end_token_id=ids[1],
        image_token_id=ids[2],
        video_token_id=ids[3],
    )
    config._attn_implementation = "sdpa"
    return config


def hpsv3(device: torch.device, tiny: bool):
    from transformers import Qwen2VLImageProcessor, Qwen2VLModel

    from lit_flowgrpo.rewards.hps import (
        HPSV3_INSTRUCTION,
        HPSV3_PIXELS,
        HPSV3_REWARD_TOKEN,
        HPSv3Reward,
        fix_pixels,
        hpsv3_head,
    )

    tokenizer = _qwen_tokenizer(
        HPSV3_INSTRUCTION + " ".join(PROMPTS) + " system You are a helpful assistant. user assistant"
    )
    if tiny:
        text, vision = TINY_QWEN2VL_TEXT, TINY_QWEN2VL_VISION
        pixels = 56 * 56
    else:  # Qwen/Qwen2-VL-7B-Instruct's config.json
        text = {
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
        }
        vision = {"depth": 32, "embed_dim": 1280, "hidden_size": 3584, "mlp_ratio": 4, "num_heads": 16}
        pixels = HPSV3_PIXELS
    config = _qwen2vl_config(tokenizer, text, vision)
    reward = HPSv3Reward(device=str(device), dtype="float32" if tiny else "bfloat16", pixels=pixels)
    reward.backbone = _build(Qwen2VLModel, config, device, torch.float32 if tiny else torch.bfloat16)
    reward.head = hpsv3_head(text["hidden_size"]).to(device).eval().requires_grad_(False)
    reward.tokenizer = tokenizer
    image_processor = Qwen2VLImageProcessor()
    fix_pixels(image_processor, pixels)
    reward.image_processor = image_processor
    reward.token_id = tokenizer.convert_tokens_to_ids(HPSV3_REWARD_TOKEN)
    params = sum(p.numel() for m in (reward.backbone, reward.head) for p in m.parameters())
    return reward, {
        "dtype": reward.dtype,
        "params": params,
        "image_processor": type(image_processor).__name__,
    }


def video_align(device: torch.device, tiny: bool):
    from transformers import Qwen2VLModel

    from lit_flowgrpo.rewards.video_align import VIDEO_ALIGN_TEMPLATE, VIDEO_REWARD_TOKENS, VideoAlignReward

    tokenizer = _qwen_tokenizer(
        VIDEO_ALIGN_TEMPLATE + " ".join(PROMPTS) + " system You are a helpful assistant. user assistant"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(VIDEO_REWARD_TOKENS)})
    tokenizer.chat_template = tokenizer.chat_template.replace("'image'", "'video'").replace(
        "<|image_pad|>", "<|video_pad|>"
    )
    if tiny:
        text, vision = TINY_QWEN2VL_TEXT, TINY_QWEN2VL_VISION
    else:  # Qwen/Qwen2-VL-2B-Instruct's config.json
        text = {
            "hidden_size": 1536,
            "intermediate_size": 8960,
            "num_hidden_layers": 28,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
        }
        vision = {"depth": 32, "embed_dim": 1280, "hidden_size": 1536, "mlp_ratio": 4, "num_heads": 16}
    config = _qwen2vl_config(tokenizer, text, vision)
    dtype = "float32" if tiny else "bfloat16"
    reward = VideoAlignReward(
        checkpoint="KwaiVGI/VideoReward",
        source_fps=16.0,
        fps=2.0,
        max_frame_pixels=448 * 448,
        device=str(device),
        dtype=dtype,
    )
    reward.backbone = _build(Qwen2VLModel, config, device, torch.float32 if tiny else torch.bfloat16)
    reward.head = torch.nn.Linear(text["hidden_size"], 1, bias=False).to(device).eval().requires_grad_(False)
    reward.tokenizer = tokenizer
    reward.vision = {
        "patch": 14,
        "merge": 2,
        "temporal": 2,
        "mean": [0.48145466, 0.4578275, 0.40821073],
        "std": [0.26862954, 0.26130258, 0.27577711],
    }
    reward.norm = {q: (0.0, 1.0) for q in ("VQ", "MQ", "TA")}
    reward.token_ids = tokenizer.convert_tokens_to_ids(list(VIDEO_REWARD_TOKENS))
    params = sum(p.numel() for m in (reward.backbone, reward.head) for p in m.parameters())
    return reward, {"dtype": dtype, "params": params, "fps": 2.0, "max_frame_pixels": 448 * 448}


def measure(
    reward: Any, images: torch.Tensor, prompts: list[str], warmup: int, repeats: int
) -> dict[str, Any]:
    device = images.device
    for _ in range(warmup):
        out = reward(images, prompts, [{}] * len(prompts))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = reward(images, prompts, [{}] * len(prompts))  # returns CPU tensors: the GPU work is done
        seconds.append(time.perf_counter() - start)
    values = out if isinstance(out, dict) else {"score": out}
    batch = images.shape[0]
    result = {
        "batch": batch,
        "seconds_per_call": [round(s, 5) for s in seconds],
        "ms_per_image_median": round(1000 * statistics.median(seconds) / batch, 3),
        "finite": all(bool(torch.isfinite(v).all()) for v in values.values()),
    }
    if device.type == "cuda":
        result["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="toy sizes: check the code path on a CPU")
    parser.add_argument("--video_batch", type=int, default=8)
    parser.add_argument("--video", default="33x480x832", help="frames x height x width (Wan 2.1 1.3B's 480p)")
    parser.add_argument("--rewards", default="hpsv2,image_reward,hpsv3,video_align")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import tempfile

    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(args.batch, 3, args.size, args.size, generator=generator).to(device)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]
    record: dict[str, Any] = {
        "command": "python benchmarks/reward_cost.py "
        + " ".join(f"--{k}={v}" for k, v in vars(args).items() if v not in (None, False)),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "images": f"{args.batch} x 3 x {args.size} x {args.size}, uniform noise in [0, 1]",
        "weights": "random (architecture and dtype as released; no weights downloaded)",
        "rewards": {},
    }
    import transformers

    record["transformers"] = transformers.__version__
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.rewards.split(","):
            if name == "hpsv2":
                reward, info = hpsv2(device, args.tiny)
            elif name == "image_reward":
                reward, info = image_reward(device, args.tiny, tmp)
            elif name == "hpsv3":
                reward, info = hpsv3(device, args.tiny)
            elif name == "video_align":
                reward, info = video_align(device, args.tiny)
            else:
                raise SystemExit(f"unknown reward {name!r}")
            if name == "video_align":  # per video, not per image
                frames, height, width = (int(x) for x in args.video.split("x"))
                videos = torch.rand(args.video_batch, frames, 3, height, width, generator=generator).to(
                    device
                )
                info["videos"] = f"{args.video_batch} x {frames} x 3 x {height} x {width} at 16 fps"
                video_prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.video_batch)]
                info.update(measure(reward, videos, video_prompts, args.warmup, args.repeats))
                info["ms_per_video_median"] = info.pop("ms_per_image_median")
                info["sequence_length"] = int(
                    reward._encode(videos[:1], video_prompts[:1])["input_ids"].shape[1]
                )
                del videos
            else:
                info.update(measure(reward, images, prompts, args.warmup, args.repeats))
            if name == "hpsv3":
                texts = [reward.instruction.format(text_prompt=p) for p in prompts[:1]]
                info["text_tokens_per_sample"] = len(reward.tokenizer(texts[0])["input_ids"])
            record["rewards"][name] = info
            print(name, json.dumps(info), flush=True)
            del reward
            if device.type == "cuda":
                torch.cuda.empty_cache()
    text = json.dumps(record, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
