"""ImageReward on a tiny checkpoint built here in the released layout (``blip.visual_encoder.*`` of BLIP's
timm-style ViT, ``blip.text_encoder.*`` of its BERT with cross-attention, ``mlp.layers.*``), loaded through
the reward's real path (key conversion + transformers' BLIP ``from_pretrained``). The reference: the ViT's
forward re-derived here with BLIP's parameter names, the text encoder run as loaded by transformers
directly, and the score head re-derived by hand (first token → MLP → (raw − mean) / std)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from lit_flowgrpo.rewards import build_reward
from lit_flowgrpo.rewards.image_reward import ImageRewardReward, pil_resize_center_crop

WIDTH, HEADS, LAYERS, IMAGE, PATCH = 32, 2, 2, 32, 8
TEXT_WIDTH = 24
PROMPTS = ["a red cube", "two cats on a bench", "a blue sky at dusk", "hello"]
# The published normalisation, written here from ImageReward.py rather than imported.
MEAN, STD = 0.16717362830052426, 1.0333394966054072


class _Block(nn.Module):
    """BLIP vit.py's Block: pre-norm, fused qkv laid out (3, heads, head_dim), exact GELU MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH, eps=1e-6)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.attn.proj = nn.Linear(WIDTH, WIDTH)
        self.norm2 = nn.LayerNorm(WIDTH, eps=1e-6)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.mlp.fc2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.attn.qkv(self.norm1(x)).reshape(b, n, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        weights = ((q @ k.transpose(-2, -1)) * (c // HEADS) ** -0.5).softmax(dim=-1)
        x = x + self.attn.proj((weights @ v).transpose(1, 2).reshape(b, n, c))
        return x + self.mlp.fc2(nn.functional.gelu(self.mlp.fc1(self.norm2(x))))


class _ViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, WIDTH, PATCH, PATCH)
        self.cls_token = nn.Parameter(torch.randn(1, 1, WIDTH))
        self.pos_embed = nn.Parameter(torch.randn(1, (IMAGE // PATCH) ** 2 + 1, WIDTH))
        self.blocks = nn.ModuleList(_Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH, eps=1e-6)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed.proj(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.norm(x)  # every token, normalised: the cross-attention memory


def _tokenizer(path: Path):
    from transformers import BertTokenizer

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz", "##s", "cat"]
    (path / "vocab.txt").write_text("\n".join(words) + "\n")
    tokenizer = BertTokenizer(str(path / "vocab.txt"))
    tokenizer.save_pretrained(path)
    return tokenizer


@pytest.fixture(scope="module")
def tiny_image_reward(tmp_path_factory: pytest.TempPathFactory):
    from transformers import BlipTextConfig, BlipTextModel

    root = tmp_path_factory.mktemp("tiny_image_reward")
    tokenizer = _tokenizer(root)
    med = {  # the fields of ImageReward's med_config.json the reward reads, at a tiny size
        "vocab_size": len(tokenizer) + 2,  # + [DEC] and [ENC], as BLIP's tokenizer adds
        "hidden_size": TEXT_WIDTH,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "max_position_embeddings": 40,
        "layer_norm_eps": 1e-12,
        "hidden_act": "gelu",
        "pad_token_id": 0,
        "encoder_width": WIDTH,
        "add_cross_attention": True,
    }
    (root / "med_config.json").write_text(json.dumps(med))
    torch.manual_seed(0)
    vit = _ViT()
    text = BlipTextModel(
        BlipTextConfig(
            vocab_size=med["vocab_size"],
            hidden_size=TEXT_WIDTH,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=40,
            encoder_hidden_size=WIDTH,
            is_decoder=True,
        ),
        add_pooling_layer=False,
    )
    mlp = nn.Sequential(  # the released head's indices: layers.{0,2,4,6,7}
        nn.Linear(TEXT_WIDTH, 1024), nn.Dropout(), nn.Linear(1024, 128), nn.Dropout(), nn.Linear(128, 64),
        nn.Dropout(), nn.Linear(64, 16), nn.Linear(16, 1),
    )  # fmt: skip
    with torch.no_grad():
        for module in (vit, text):
            for name, param in module.named_parameters():
                is_norm_weight = "norm" in name.lower() and name.endswith("weight")
                param.copy_(torch.randn_like(param) * (0.3 if param.ndim > 1 else 0.1) + is_norm_weight)
        for layer in mlp:  # unit gain per layer (std 1/√fan_in): the score stays of order 1
            if isinstance(layer, nn.Linear):
                layer.weight.copy_(torch.randn_like(layer.weight) / layer.in_features**0.5)
                layer.bias.copy_(torch.randn_like(layer.bias) * 0.1)
    state = {
        **{f"blip.visual_encoder.{k}": v for k, v in vit.state_dict().items()},
        **{f"blip.text_encoder.{k}": v for k, v in text.state_dict().items()},
        "blip.text_encoder.embeddings.position_ids": torch.arange(40).view(1, -1),  # old BERT keeps it
        "blip.vision_proj.weight": torch.zeros(8, WIDTH),  # BLIP's contrastive heads, unused by the score
        "blip.text_proj.weight": torch.zeros(8, TEXT_WIDTH),
        **{f"mlp.layers.{k}": v for k, v in mlp.state_dict().items()},
    }
    torch.save(state, root / "ImageReward.pt")
    return root, vit.eval(), text.eval(), mlp.eval()


def _reward(root: Path) -> ImageRewardReward:
    vision = {
        "image_size": IMAGE,
        "patch_size": PATCH,
        "hidden_size": WIDTH,
        "intermediate_size": 4 * WIDTH,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "layer_norm_eps": 1e-6,
        "hidden_act": "gelu",
    }
    return build_reward(
        "image_reward",
        checkpoint=str(root / "ImageReward.pt"),
        med_config=str(root / "med_config.json"),
        tokenizer=str(root),
        vision_config=vision,
    )


# fp32 on both sides; the ViT's kernels differ (the reference's explicit softmax against transformers'
# attention): a dot product of k terms is within γ_k = k·eps/2 of exact (Higham §3.1); the widest is the
# MLP's 4·W = 128, met 3 times per block in L blocks, then the text encoder's cross-attention reads
# that memory through 2 more layers of widths up to 48, each error carried through layer norms whose
# 1/σ is below 10 here; the head's five maps have unit gain (std 1/√fan_in), with a margin of 10 for
# the spread of that gain. Measured: 7e-7, against scores 0.3 apart.
TOLERANCE = (LAYERS * 3 * 4 * WIDTH + 2 * 3 * 48) / 2 * torch.finfo(torch.float32).eps * 10 * 10


def test_image_reward_head(tiny_image_reward) -> None:
    root, vit, text, mlp = tiny_image_reward
    images = torch.rand(4, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(0))
    out = _reward(root)(images, PROMPTS, [{}] * 4)

    from transformers import AutoTokenizer

    # The reference preprocessing: 8-bit PIL images at the model's side, ToTensor, CLIP's Normalize.
    pixels = torch.stack(
        [
            torch.from_numpy(np.asarray(Image.fromarray(a), dtype=np.float32) / 255).permute(2, 0, 1)
            for a in (images * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
        ]
    )
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)
    tokens = AutoTokenizer.from_pretrained(root)(
        PROMPTS, padding="max_length", truncation=True, max_length=35, return_tensors="pt"
    )
    with torch.no_grad():
        memory = vit((pixels - mean) / std)
        first = text(
            input_ids=tokens["input_ids"],
            attention_mask=tokens["attention_mask"],
            encoder_hidden_states=memory,
            encoder_attention_mask=torch.ones(memory.shape[:2], dtype=torch.long),
        ).last_hidden_state[:, 0]
        x = first.double()
        for i in (0, 2, 4, 6, 7):  # five linear maps, no activation
            x = x @ mlp[i].weight.double().T + mlp[i].bias.double()
    want = ((x.squeeze(1) - MEAN) / STD).float()
    assert out.shape == (4,) and out.dtype == torch.float32
    assert want.std() > 10 * TOLERANCE  # the random model tells the pairs apart
    torch.testing.assert_close(out, want, atol=TOLERANCE, rtol=0)


def test_pil_resize_center_crop_is_imagerewards_transform() -> None:
    images = torch.rand(2, 3, 40, 56, generator=torch.Generator().manual_seed(2))
    out = pil_resize_center_crop(images, 32)
    # torchvision's Resize(32) on a 56 x 40 (w x h) PIL image: 44 x 32, then the central 32 columns.
    for got, image in zip(out, images, strict=True):
        pil = Image.fromarray((image * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy())
        want = np.asarray(pil.resize((44, 32), Image.BICUBIC).crop((6, 0, 38, 32)), dtype=np.float32) / 255
        assert torch.equal(got, torch.from_numpy(want).permute(2, 0, 1))


def test_a_foreign_checkpoint_is_refused(tiny_image_reward, tmp_path: Path) -> None:
    root = tiny_image_reward[0]
    state = torch.load(root / "ImageReward.pt", weights_only=True)
    torch.save({**state, "blip.text_decoder.cls.weight": torch.zeros(1)}, tmp_path / "other.pt")
    reward = _reward(root)
    reward.checkpoint = str(tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"no place .*blip\.text_decoder"):
        reward.load()
    with pytest.raises(ValueError, match=r"image_reward\.checkpoint .* neither an existing file"):
        build_reward("image_reward", checkpoint=str(tmp_path / "missing.pt"))
