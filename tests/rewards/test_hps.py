"""HPS v2.1 on a tiny OpenCLIP-layout model built here: its state dict saved as the release is (``{"state_dict":
...}`` in a ``.pt``), loaded through the reward's real path (key conversion + ``CLIPModel.from_pretrained``),
against OpenCLIP's forward re-derived in this file with torch's own modules (``nn.MultiheadAttention`` holds the
fused ``in_proj`` exactly as OpenCLIP does)."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lit_flowgrpo.rewards import build_reward
from lit_flowgrpo.rewards.hps import HPSv2Reward, resize_center_crop
from lit_flowgrpo.rewards.image_reward import pil_resize_center_crop

WIDTH, HEADS, LAYERS, EMBED, IMAGE, PATCH, CONTEXT = 32, 2, 2, 16, 32, 8, 77
PROMPTS = ["a red cube", "two cats on a bench", "a blue sky at dusk", "hello"]
OPENAI_MEAN = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
OPENAI_STD = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)


class _Block(nn.Module):
    """OpenCLIP's ResidualAttentionBlock: pre-norm attention and a GELU MLP, its parameter names."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(
            OrderedDict(c_fc=nn.Linear(WIDTH, 4 * WIDTH), gelu=nn.GELU(), c_proj=nn.Linear(4 * WIDTH, WIDTH))
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, need_weights=False, attn_mask=mask)[0]
        return x + self.mlp(self.ln_2(x))


class _Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.resblocks = nn.ModuleList(_Block() for _ in range(LAYERS))


class _Visual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        grid = IMAGE // PATCH
        self.conv1 = nn.Conv2d(3, WIDTH, PATCH, PATCH, bias=False)
        self.class_embedding = nn.Parameter(torch.randn(WIDTH))
        self.positional_embedding = nn.Parameter(torch.randn(grid * grid + 1, WIDTH))
        self.ln_pre = nn.LayerNorm(WIDTH)
        self.transformer = _Tower()
        self.ln_post = nn.LayerNorm(WIDTH)
        self.proj = nn.Parameter(torch.randn(WIDTH, EMBED))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.conv1(pixels).flatten(2).transpose(1, 2)  # (B, grid², W)
        x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1) + self.positional_embedding
        x = self.ln_pre(x)
        for block in self.transformer.resblocks:
            x = block(x)
        return self.ln_post(x[:, 0]) @ self.proj  # the class token, projected


class _OpenCLIP(nn.Module):
    """A tiny OpenCLIP ``CLIP`` (ViT towers), its state dict keyed as the released HPSv2 one."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.visual = _Visual()
        self.token_embedding = nn.Embedding(vocab, WIDTH)
        self.positional_embedding = nn.Parameter(torch.randn(CONTEXT, WIDTH))
        self.transformer = _Tower()
        self.ln_final = nn.LayerNorm(WIDTH)
        self.text_projection = nn.Parameter(torch.randn(WIDTH, EMBED))
        self.logit_scale = nn.Parameter(torch.tensor(4.6052))
        # OpenCLIP keeps its causal mask as a buffer; the conversion must drop it.
        self.register_buffer("attn_mask", torch.full((CONTEXT, CONTEXT), float("-inf")).triu(1))

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.token_embedding(tokens) + self.positional_embedding
        for block in self.transformer.resblocks:
            x = block(x, self.attn_mask)
        x = self.ln_final(x)
        return x[torch.arange(x.shape[0]), tokens.argmax(dim=-1)] @ self.text_projection  # at end of text


@pytest.fixture(scope="module")
def tiny_hps(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, _OpenCLIP]:
    """(checkpoint .pt, CLIP folder with config and tokenizer, the OpenCLIP model the checkpoint holds)."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPConfig, CLIPTokenizer

    root = tmp_path_factory.mktemp("tiny_hps")
    chars = sorted(ByteLevel.alphabet())  # every character a token: CLIP's BPE without merges
    tokens = [*chars, *(c + "</w>" for c in chars), "<|startoftext|>", "<|endoftext|>"]
    tokenizer = CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[])
    tokenizer.save_pretrained(root / "clip")
    common = {
        "hidden_size": WIDTH,
        "intermediate_size": 4 * WIDTH,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "hidden_act": "gelu",  # OpenCLIP's ViT-H/14 uses nn.GELU, not CLIP's quick GELU
        "layer_norm_eps": 1e-5,
    }
    CLIPConfig(
        text_config={
            **common,
            "vocab_size": len(tokenizer),
            "max_position_embeddings": CONTEXT,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={**common, "image_size": IMAGE, "patch_size": PATCH},
        projection_dim=EMBED,
    ).save_pretrained(root / "clip")
    torch.manual_seed(0)
    model = _OpenCLIP(len(tokenizer))
    with torch.no_grad():  # every weight random, the layer norms too, at a scale that keeps GELU non-linear
        for name, param in model.named_parameters():
            if name != "logit_scale":
                param.copy_(
                    torch.randn_like(param) * (0.3 if param.ndim > 1 else 0.1)
                    + (name.endswith("ln_1.weight") or name.endswith("ln_2.weight"))
                )
    torch.save({"state_dict": model.state_dict()}, root / "hps.pt")
    return root / "hps.pt", root / "clip", model.eval()


# fp32 on both sides, different kernels (nn.MultiheadAttention against transformers' attention): each dot
# product of length k is within γ_k = k·eps/2 of exact (Higham §3.1); the widest is the MLP's 4·W = 128
# terms, met 3 times per block (q/k/v, MLP in, MLP out), in 2 towers of L blocks, each error carried
# through the layer norms (whose 1/σ is below 10 for these weights). The cosine of two such embeddings
# differs by at most the sum: 2 towers · L · 3 · 128/2 · eps · 10.
TOLERANCE = 2 * LAYERS * 3 * (4 * WIDTH) / 2 * torch.finfo(torch.float32).eps * 10


def test_hpsv2_is_openclips_cosine(tiny_hps) -> None:
    checkpoint, clip, reference = tiny_hps
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(4, 3, IMAGE, IMAGE, generator=generator)  # at the model's side: no resize
    reward = build_reward("hpsv2", checkpoint=str(checkpoint), clip=str(clip))
    out = reward(images, PROMPTS, [{}] * 4)

    from transformers import AutoTokenizer

    # OpenCLIP's tokens: the full 77-long context, no attention mask (the causal mask alone).
    tokens = AutoTokenizer.from_pretrained(clip)(
        PROMPTS, padding="max_length", max_length=CONTEXT, return_tensors="pt"
    )["input_ids"]
    with torch.no_grad():
        image_features = F.normalize(reference.visual((images - OPENAI_MEAN) / OPENAI_STD), dim=-1)
        text_features = F.normalize(reference.encode_text(tokens), dim=-1)
    want = (image_features @ text_features.T).diagonal()  # HPSv2's img_score.py: the paired diagonal
    assert out.shape == (4,) and out.dtype == torch.float32
    assert want.abs().max() > 0.05 and want.std() > 0.01  # the random model tells the pairs apart
    torch.testing.assert_close(out, want, atol=TOLERANCE, rtol=0)

    # A prompt's score depends on its own pair only: the batch in another order gives the same values.
    order = [2, 0, 3, 1]
    again = reward(images[order], [PROMPTS[i] for i in order], [{}] * 4)
    torch.testing.assert_close(again, out[order], atol=TOLERANCE, rtol=0)


def test_converted_folder_loads_directly(tiny_hps, tmp_path: Path) -> None:
    checkpoint, clip, _ = tiny_hps
    images = torch.rand(2, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(1))
    reward = HPSv2Reward(checkpoint=str(checkpoint), clip=str(clip))
    reward.load()
    reward.model.save_pretrained(tmp_path)
    again = HPSv2Reward(checkpoint=str(tmp_path), clip=str(clip))
    assert torch.equal(again(images, PROMPTS[:2], [{}] * 2), reward(images, PROMPTS[:2], [{}] * 2))


def test_another_architecture_is_refused(tiny_hps, tmp_path: Path) -> None:
    _, clip, reference = tiny_hps
    state = {**reference.state_dict(), "visual.attnpool.weight": torch.zeros(1)}
    torch.save({"state_dict": state}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"no place in CLIPModel.*visual\.attnpool"):
        HPSv2Reward(checkpoint=str(tmp_path / "other.pt"), clip=str(clip)).load()
    with pytest.raises(ValueError, match=r"hpsv2\.checkpoint .* neither an existing file"):
        build_reward("hpsv2", checkpoint=str(tmp_path / "missing.pt"))


def test_resize_center_crop_geometry() -> None:
    # A 32 x 64 image at side 32: no resize, the central 32 columns (16 to 47) kept.
    columns = torch.arange(64.0).view(1, 1, 1, 64).expand(1, 3, 32, 64) / 64
    out = resize_center_crop(columns, 32, (32, 32), [0.0] * 3, [1.0] * 3)
    assert out.shape == (1, 3, 32, 32) and torch.equal(out[0, 0, 0], torch.arange(16.0, 48.0) / 64)
    # A constant image stays constant through the bicubic resize, then (c − mean) / std.
    flat = torch.full((2, 3, 40, 48), 0.25)
    out = resize_center_crop(flat, 16, (16, 16), [0.5, 0.5, 0.5], [0.25, 0.5, 1.0])
    want = torch.tensor([-1.0, -0.5, -0.25]).view(1, 3, 1, 1).expand(2, 3, 16, 16)
    torch.testing.assert_close(out, want, atol=4 * torch.finfo(torch.float32).eps, rtol=0)


def test_resize_center_crop_is_pils_up_to_its_8_bit_rounding() -> None:
    """HPSv2 resizes PIL images (OpenCLIP's transform); this resize runs on float tensors. Torch's
    antialiased bicubic is PIL's kernel, so on 8-bit inputs they differ by PIL's rounding of its output
    (half a step) and its fixed-point weights: within 1.5 steps a pixel and 0.5 on average. Torch's
    plain bicubic (a = −0.75) is more than 1.5 steps away on the same upscale: the check tells them apart."""
    generator = torch.Generator().manual_seed(0)
    for height, width in ((512, 512), (480, 832), (200, 300)):  # down, down and cropped, up
        smooth = F.avg_pool2d(torch.rand(2, 3, height, width, generator=generator), 9, 1, 4)  # as generated
        images = (smooth * 255).round() / 255  # 8-bit, as the PIL path reads them
        ours = resize_center_crop(images, 224, (224, 224), [0.0] * 3, [1.0] * 3)
        pil = pil_resize_center_crop(images, 224)
        assert (ours - pil).abs().max() * 255 < 1.5 and (ours - pil).abs().mean() * 255 < 0.5
    plain = F.interpolate(images[:, :, :, 50:250], size=(224, 224), mode="bicubic", align_corners=False)
    assert (plain - pil).abs().max() * 255 > 1.5  # the check above can tell kernels apart
