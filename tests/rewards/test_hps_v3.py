"""HPSv3 on a tiny Qwen2-VL reward model built here: a ``Qwen2VLForConditionalGeneration`` with HPSv3's
``rm_head``, its state dict saved as the release is (one ``.safetensors``), the base's configuration,
tokenizer (with a Qwen2-VL-style chat template) and image processor in a folder, all loaded through the
reward's real path. The reference runs transformers' own ``Qwen2VLModel`` forward on each sample alone
(unpadded) with positions 0..L−1 on the three rotary axes, as HPSv3's forward has them, and re-derives
the head: hidden state at ``<|Reward|>`` → MLP → (μ, exp(second output))."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lit_flowgrpo.rewards import build_reward
from lit_flowgrpo.rewards.hps import HPSV3_INSTRUCTION, HPSv3Reward

PIXELS = 56 * 56  # 4 x 4 patches of 14 px, 2 x 2 merged tokens per image
PROMPTS = ["a red cube", "two cats on a bench under a tree", "sky", "hello"]
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL's chat template, reduced to what one user turn of an image or a video and a text renders.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_qwen2vl_base(path: Path, extra_tokens: int):
    """A folder with a tiny Qwen2-VL's configuration, tokenizer and image processor; returns (config,
    tokenizer); the configuration's vocabulary leaves room for ``extra_tokens`` added reward tokens."""
    from transformers import Qwen2VLConfig, Qwen2VLImageProcessorPil

    from lit_flowgrpo.tiny.qwenimage import qwen_tokenizer

    tokenizer = qwen_tokenizer()
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VISION_TOKENS]}
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=PIXELS, max_pixels=PIXELS).save_pretrained(path)
    ids = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 4096,
            "rope_scaling": {"type": "mrope", "mrope_section": [4, 2, 2]},  # head_dim 16: 8 pairs
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "embed_dim": 16,
            "hidden_size": 32,
            "mlp_ratio": 2,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        vision_start_token_id=ids[0],
        vision_end_token_id=ids[1],
        image_token_id=ids[2],
        video_token_id=ids[3],
    )
    config.save_pretrained(path)
    config.text_config.vocab_size = len(tokenizer) + extra_tokens
    return config, tokenizer


def randomize(model: nn.Module) -> None:
    """Weights of unit gain (std 1/√fan_in) and norm scales near 1: the default 0.02 init leaves a tiny
    model's outputs nearly equal for every input, and a test that cannot tell inputs apart proves little."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                param.copy_(torch.randn_like(param) / param[0].numel() ** 0.5)
            elif "norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.1 * torch.randn_like(param))


@pytest.fixture(scope="module")
def tiny_hpsv3(tmp_path_factory: pytest.TempPathFactory):
    from safetensors.torch import save_file
    from transformers import Qwen2VLForConditionalGeneration

    root = tmp_path_factory.mktemp("tiny_hpsv3")
    config, _ = tiny_qwen2vl_base(root / "base", extra_tokens=1)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).eval()
    randomize(model)
    # HPSv3's head: Linear(h, 1024), ReLU, Dropout, Linear(1024, 16), ReLU, Linear(16, 2), written here.
    head = nn.Sequential(
        nn.Linear(32, 1024), nn.ReLU(), nn.Dropout(), nn.Linear(1024, 16), nn.ReLU(), nn.Linear(16, 2)
    )
    randomize(head)
    state = {**model.state_dict(), **{f"rm_head.{k}": v for k, v in head.state_dict().items()}}
    save_file({k: v.contiguous() for k, v in state.items()}, root / "HPSv3.safetensors")
    return root, model, head.eval()


def _reference(
    root: Path, model, head, images: torch.Tensor, prompts: list[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(μ, σ) of each sample alone, through transformers' Qwen2VLModel forward and the head by hand."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from lit_flowgrpo.rewards.images import to_pil

    tokenizer = AutoTokenizer.from_pretrained(root / "base")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|Reward|>"]})
    image_processor = AutoImageProcessor.from_pretrained(root / "base")
    reward_id = tokenizer.convert_tokens_to_ids("<|Reward|>")
    mu, sigma = [], []
    for image, prompt in zip(to_pil(images), prompts, strict=True):
        pixels = image_processor(images=[image], return_tensors="pt")
        n = int(pixels["image_grid_thw"].prod()) // 4  # merged 2 x 2
        text = (
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
            + "<|image_pad|>" * n
            + "<|vision_end|>"
            + HPSV3_INSTRUCTION.format(text_prompt=prompt)
            + "<|im_end|>\n<|im_start|>assistant\n"
        )
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        positions = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)  # 0..L-1 on each axis
        with torch.no_grad():
            hidden = model.model(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                pixel_values=pixels["pixel_values"],
                image_grid_thw=pixels["image_grid_thw"],
                position_ids=positions,
            ).last_hidden_state[0, ids[0].tolist().index(reward_id)]
            x = torch.relu(head[0](hidden))
            x = torch.relu(head[3](x))
            out = head[5](x)
        mu.append(out[0])
        sigma.append(out[1].exp())
    return torch.stack(mu), torch.stack(sigma)


# fp32 on both sides, the same weights; the two differ in padding (the batch is padded on the right,
# the reference is not: masked keys add exact zeros to softmax sums, but the kernels' summation order
# changes with the length) and in how the image features are scattered (the same values). Each dot
# product of k ≤ 1024 terms (the head's widest) is within γ_k = k·eps/2 of exact (Higham §3.1), on
# values of order 1 (unit-gain weights); the two decoder layers and the head's three layers add one
# such error each at most: a factor 5. Measured: 1.5e-8.
TOLERANCE = 1024 / 2 * torch.finfo(torch.float32).eps * 5


def _reward(root: Path, checkpoint: str | None = None) -> HPSv3Reward:
    return build_reward(
        "hpsv3",
        checkpoint=checkpoint or str(root / "HPSv3.safetensors"),
        base=str(root / "base"),
        dtype="float32",
        pixels=PIXELS,
    )


def test_hpsv3_is_mu_and_exp_of_the_second_output(tiny_hpsv3) -> None:
    root, model, head = tiny_hpsv3
    images = torch.rand(4, 3, 60, 52, generator=torch.Generator().manual_seed(0))
    out = _reward(root)(images, PROMPTS, [{}] * 4)
    mu, sigma = _reference(root, model, head, images, PROMPTS)
    assert set(out) == {"mu", "sigma"} and out["mu"].shape == (4,)
    assert mu.std() > 10 * TOLERANCE  # the random model tells the samples apart
    torch.testing.assert_close(out["mu"], mu, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(out["sigma"], sigma, atol=0, rtol=4 * TOLERANCE)  # exp: relative error
    assert HPSv3Reward.primary == "mu"


def test_hpsv3_reads_the_earlier_key_layout_and_refuses_a_spelled_reward_token(
    tiny_hpsv3, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    root = tiny_hpsv3[0]
    images = torch.rand(2, 3, 56, 56, generator=torch.Generator().manual_seed(1))
    state = load_file(root / "HPSv3.safetensors")
    # transformers < 4.52 saved the vision tower as visual.* and the language model as model.*.
    old = {
        (
            k.replace("model.visual.", "visual.", 1)
            if k.startswith("model.visual.")
            else k.replace("model.language_model.", "model.", 1)
        ): v
        for k, v in state.items()
    }
    save_file(old, tmp_path / "old.safetensors")
    new = _reward(root)(images, PROMPTS[:2], [{}] * 2)
    again = _reward(root, str(tmp_path / "old.safetensors"))(images, PROMPTS[:2], [{}] * 2)
    assert torch.equal(new["mu"], again["mu"])
    # A prompt that spells the reward token cannot be scored: NaN for that sample alone.
    spelled = _reward(root)(images, ["fine", "a <|Reward|> here"], [{}] * 2)
    assert (
        torch.isfinite(spelled["mu"][0])
        and torch.isnan(spelled["mu"][1])
        and torch.isnan(spelled["sigma"][1])
    )


def test_hpsv3_settings_are_checked_before_loading(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"hpsv3\.checkpoint .* neither an existing file"):
        build_reward("hpsv3", checkpoint=str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match=r"hpsv3\.instruction must hold"):
        build_reward("hpsv3", checkpoint="org/repo/file.safetensors", instruction="no placeholder <|Reward|>")
    with pytest.raises(ValueError, match=r"hpsv3\.pixels"):
        build_reward("hpsv3", checkpoint="org/repo/file.safetensors", pixels=100)


def test_chat_text_without_a_template_is_qwen2vls_rendering(tmp_path: Path) -> None:
    """A base whose tokenizer carries no chat template gets the same text as one whose template renders it."""
    from lit_flowgrpo.rewards.qwen_vl import chat_text

    _, tokenizer = tiny_qwen2vl_base(tmp_path, extra_tokens=0)
    for vision in ("image", "video"):
        templated = chat_text(tokenizer, vision, "rate this")
        tokenizer.chat_template = None
        assert chat_text(tokenizer, vision, "rate this") == templated.replace(
            "<|image_pad|>", f"<|{vision}_pad|>"
        )
        tokenizer.chat_template = CHAT_TEMPLATE
    assert templated.startswith(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    )


def test_hpsv3_in_bfloat16_as_released(tiny_hpsv3) -> None:
    root = tiny_hpsv3[0]
    images = torch.rand(2, 3, 56, 56, generator=torch.Generator().manual_seed(2))
    full = _reward(root)(images, PROMPTS[:2], [{}] * 2)
    reward = build_reward(
        "hpsv3", checkpoint=str(root / "HPSv3.safetensors"), base=str(root / "base"), pixels=PIXELS
    )
    assert reward.dtype == "bfloat16"  # the default: HPSv3 was trained and released in bf16
    half = reward(images, PROMPTS[:2], [{}] * 2)
    assert next(reward.backbone.parameters()).dtype == torch.bfloat16
    assert next(reward.head.parameters()).dtype == torch.float32 and half["mu"].dtype == torch.float32
    # bf16 keeps 8 bits (eps 2^-8); the hidden state carries a rounding from each of the embedding, the two
    # decoder layers' attention and MLP and the final norm, each relative to values of order 1: 8 eps.
    torch.testing.assert_close(half["mu"], full["mu"], atol=8 * 2**-8, rtol=0)
