"""VideoAlign's VideoReward on a tiny release built here as the published one is laid out: a base Qwen2-VL
folder (``save_pretrained``), and a release folder with ``model_config.json`` and ``checkpoint-<step>/``
holding a LoRA adapter made by PEFT on the language model (``adapter_model.safetensors``,
``adapter_config.json``) and the trained non-LoRA weights (``non_lora_state_dict.pth``: the head and the
grown token embeddings). The reward merges the adapter into the base; the reference runs PEFT's own
unmerged LoRA forward, reads the three reward tokens, applies the head and the release's normalisation
by hand. The patch layout is checked against transformers' Qwen2-VL image processor."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lit_flowgrpo.rewards import build_reward
from lit_flowgrpo.rewards.video_align import VIDEO_REWARD_TOKENS, sample_frames, video_patches

PROMPTS = ["a dog runs on the beach", "a red car"]
NORM = {"VQ_mean": 0.5, "VQ_std": 2.0, "MQ_mean": -1.0, "MQ_std": 0.5, "TA_mean": 0.25, "TA_std": 4.0}
VIDEO_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% for content in message['content'] %}"
    "{% if content['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_release(tmp_path_factory: pytest.TempPathFactory):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file
    from test_hps_v3 import randomize, tiny_qwen2vl_base
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    root = tmp_path_factory.mktemp("tiny_video_align")
    config, _ = tiny_qwen2vl_base(root / "base", extra_tokens=0)
    tokenizer = AutoTokenizer.from_pretrained(root / "base")
    tokenizer.chat_template = VIDEO_CHAT_TEMPLATE
    tokenizer.save_pretrained(root / "base")
    torch.manual_seed(0)
    base = Qwen2VLForConditionalGeneration(config).eval()
    randomize(base)
    base.save_pretrained(root / "base")
    # The published class: the base with the three tokens' rows and a head, LoRA on the language model.
    tokenizer.add_special_tokens({"additional_special_tokens": list(VIDEO_REWARD_TOKENS)})
    base.resize_token_embeddings(len(tokenizer))
    base.rm_head = nn.Linear(config.text_config.hidden_size, 1, bias=False)
    with torch.no_grad():  # the new rows and the head random too; the saved base stays as it is
        rows = base.get_input_embeddings().weight
        rows[-len(VIDEO_REWARD_TOKENS) :] = (
            torch.randn(len(VIDEO_REWARD_TOKENS), rows.shape[1]) / rows.shape[1] ** 0.5
        )
        base.rm_head.weight.copy_(torch.randn_like(base.rm_head.weight) / rows.shape[1] ** 0.5)
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj|o_proj|down_proj)"
    )
    model = get_peft_model(base, lora).eval()
    with torch.no_grad():  # PEFT starts B at zero: a merge of zeros would prove nothing
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param) * 0.2)
    step = root / "release" / "checkpoint-12"
    step.mkdir(parents=True)
    save_file(
        {k: v.contiguous() for k, v in get_peft_model_state_dict(model).items()},
        step / "adapter_model.safetensors",
    )
    (step / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "use_rslora": False}))
    trained = {k: v for k, v in model.named_parameters() if "rm_head" in k or "embed_tokens" in k}
    torch.save({k: v.detach().clone() for k, v in trained.items()}, step / "non_lora_state_dict.pth")
    tokenizer.save_pretrained(step / "tokenizer")
    (root / "release" / "model_config.json").write_text(
        json.dumps(
            {
                "data_config": {
                    "fps": 2.0,
                    "max_frame_pixels": 128 * 28 * 28,
                    "eval_dim": ["VQ", "MQ", "TA"],
                    "prompt_template_type": "detailed_special",
                    "sample_type": "uniform",
                },
                "model_config": {"output_dim": 1, "use_special_tokens": True, "reward_token": "special"},
                "inference_config": NORM,
            }
        )
    )
    return root, model, tokenizer


def test_video_align_heads_and_normalisation(tiny_release) -> None:
    root, model, tokenizer = tiny_release
    reward = build_reward(
        "video_align",
        checkpoint=str(root / "release"),
        base=str(root / "base"),
        source_fps=4.0,
        dtype="float32",
    )
    videos = torch.rand(2, 9, 3, 40, 48, generator=torch.Generator().manual_seed(0))
    out = reward(videos, PROMPTS, [{}] * 2)
    assert set(out) == {"VQ", "MQ", "TA", "Overall"} and reward.primary == "Overall"

    batch = reward._encode(videos, PROMPTS)
    # 4 of 9 frames (2 fps of 4); 40 x 48 px grown to the least 128·28·28 pixels: 308 x 364, 22 x 26 patches
    assert batch["video_grid_thw"].tolist() == [[2, 22, 26]] * 2
    # The resized frames are 8-bit again, as torchvision's resize of VideoAlign's uint8 frames returns
    # them: undoing the normalisation gives integers in [0, 255] (fp32 (x − m)/s and back: a few ulps of 255).
    mean = torch.tensor(reward.vision["mean"]).view(1, 3, 1)
    std = torch.tensor(reward.vision["std"]).view(1, 3, 1)
    pixels = (batch["pixel_values_videos"].view(-1, 3, 2 * 14 * 14) * std + mean) * 255
    assert pixels.min() > -1e-3 and pixels.max() < 255 + 1e-3
    assert (pixels - pixels.round()).abs().max() < 255 * 8 * torch.finfo(torch.float32).eps
    ids = tokenizer.convert_tokens_to_ids(list(VIDEO_REWARD_TOKENS))
    want = {q: [] for q in ("VQ", "MQ", "TA")}
    length = batch["attention_mask"].sum(-1)
    for i in range(2):  # each sample alone, unpadded, through PEFT's live (unmerged) LoRA
        n = int(length[i])
        input_ids = batch["input_ids"][i : i + 1, :n]
        patches = batch["pixel_values_videos"].view(2, -1, batch["pixel_values_videos"].shape[-1])[i]
        with torch.no_grad():
            hidden = model.base_model.model.model(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                pixel_values_videos=patches,
                video_grid_thw=batch["video_grid_thw"][i : i + 1],
                position_ids=torch.arange(n).view(1, 1, -1).expand(3, 1, -1),  # 0..L-1, as published
            ).last_hidden_state[0]
        for quality, token in zip(("VQ", "MQ", "TA"), ids, strict=True):
            raw = model.base_model.model.rm_head(hidden[input_ids[0].tolist().index(token)])[0]
            want[quality].append((raw - NORM[f"{quality}_mean"]) / NORM[f"{quality}_std"])
    # fp32; the merged weight W + s·B·A against PEFT's W·x + s·B·(A·x): one more rounding per product of
    # k ≤ 64 terms, γ_k = k·eps/2 (Higham §3.1), in each of 2 layers, on values of order 1 (unit-gain
    # weights), amplified at most 4x by the normalisation (std 0.5 → ×2, and a margin of 2).
    tolerance = 64 / 2 * torch.finfo(torch.float32).eps * 2 * 4 * 10
    for quality in ("VQ", "MQ", "TA"):
        torch.testing.assert_close(out[quality], torch.stack(want[quality]), atol=tolerance, rtol=0)
    assert torch.stack(want["TA"]).sub(torch.stack(want["VQ"])).abs().min() > 10 * tolerance  # distinct heads
    torch.testing.assert_close(out["Overall"], out["VQ"] + out["MQ"] + out["TA"], atol=0, rtol=0)


def test_video_patches_are_qwen2vls_layout() -> None:
    """An image is a video of two equal frames to Qwen2-VL's processor: the same patches come out."""
    from transformers import Qwen2VLImageProcessorPil

    from lit_flowgrpo.rewards.images import to_pil

    image = torch.rand(1, 3, 56, 84, generator=torch.Generator().manual_seed(3))
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 84, max_pixels=56 * 84)
    want = processor(images=to_pil(image), return_tensors="pt")
    quantised = (image * 255).round() / 255  # the processor reads 8-bit images
    mean = torch.tensor(processor.image_mean).view(1, 3, 1, 1)
    std = torch.tensor(processor.image_std).view(1, 3, 1, 1)
    frames = ((quantised - mean) / std).expand(2, -1, -1, -1)
    patches, grid = video_patches(frames, 14, 2, 2)
    assert grid.tolist() == want["image_grid_thw"].tolist() == [[1, 4, 6]]
    torch.testing.assert_close(patches, want["pixel_values"], atol=8 * torch.finfo(torch.float32).eps, rtol=0)


def test_frame_sampling_and_settings() -> None:
    assert sample_frames(9, 4.0, 2.0) == [0, 3, 5, 8]  # 4.5 frames -> 4 (even), spread uniformly
    assert len(sample_frames(81, 16.0, 2.0)) == 10  # 81 / 16 x 2 = 10.1 -> 10
    with pytest.raises(ValueError, match=r"video_align\.source_fps \(0\) must be above 0"):
        build_reward("video_align", checkpoint="org/repo", source_fps=0)
    with pytest.raises(ValueError, match=r"video_align\.checkpoint .* neither a folder nor a hub id"):
        build_reward("video_align", checkpoint="not/a/hub/id")


def _release_with(tiny_release, tmp_path, data: dict | None = None, adapter: dict | None = None):
    """A copy of the tiny release whose model_config.json's data_config / adapter_config.json differ."""
    import shutil

    root = tiny_release[0]
    settings = json.loads((root / "release" / "model_config.json").read_text())
    settings["data_config"].update(data or {})
    shutil.copytree(root / "release" / "checkpoint-12", tmp_path / "checkpoint-12")
    (tmp_path / "model_config.json").write_text(json.dumps(settings))
    if adapter:
        path = tmp_path / "checkpoint-12" / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **adapter}))
    return build_reward(
        "video_align", checkpoint=str(tmp_path), base=str(root / "base"), source_fps=4.0, dtype="float32"
    )


def test_a_release_that_fixes_the_frame_count_reads_that_many(tiny_release, tmp_path) -> None:
    reward = _release_with(tiny_release, tmp_path, data={"num_frames": 6})
    reward.load()
    videos = torch.rand(1, 9, 3, 40, 48, generator=torch.Generator().manual_seed(1))
    assert reward._encode(videos, PROMPTS[:1])["video_grid_thw"].tolist() == [[3, 22, 26]]  # 6 frames, not 4
    # A video shorter than that: its 3 frames, the last repeated to fill the temporal patch (Qwen2-VL's).
    assert sample_frames(3, 4.0, 2.0, num_frames=6) == [0, 1, 2]
    assert reward._encode(videos[:, :3], PROMPTS[:1])["video_grid_thw"].tolist() == [[2, 22, 26]]


def test_release_settings_the_reward_cannot_reproduce_are_refused(tiny_release, tmp_path) -> None:
    from lit_flowgrpo.errors import SettingsError

    with pytest.raises(SettingsError, match=r"samples frames by 'multi_pts'"):
        _release_with(tiny_release, tmp_path / "a", data={"sample_type": "multi_pts"}).load()
    with pytest.raises(SettingsError, match=r"adapter sets \['use_dora'\]"):
        _release_with(tiny_release, tmp_path / "b", adapter={"use_dora": True}).load()
