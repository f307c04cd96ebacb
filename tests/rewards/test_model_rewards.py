"""PickScore, CLIPScore and the aesthetic predictor on a tiny CLIP built in code and loaded back
through ``from_pretrained``; references come from the model's own forward (``logits_per_image``,
``image_embeds``) and a hand-run MLP, not from the reward code."""

from __future__ import annotations

import pytest
import torch
from transformers import CLIPModel, CLIPProcessor

from lit_flowgrpo.rewards import build_reward
from lit_flowgrpo.rewards.images import to_pil
from lit_flowgrpo.rewards.pickscore import PickScoreReward

PROMPTS = ["a red cube", "two cats on a bench", "a blue sky", "hello"]


@pytest.fixture(scope="module")
def reference(tiny_clip_dir):
    model = CLIPModel.from_pretrained(tiny_clip_dir).eval()
    return model, CLIPProcessor.from_pretrained(tiny_clip_dir)


EPS = torch.finfo(torch.float32).eps


def _cosine_bound(model: CLIPModel) -> float:
    """How far two fp32 computations of the same cosine may differ.

    The rewards and ``CLIPModel`` get identical embeddings (the same forward on the same inputs) but
    normalise and multiply them by different kernels. Each side's cosine <t, i> / (|t|·|i|) over D
    terms is within (D + 2)·eps of exact (a dot product's γ_D plus two norms' γ_(D/2+1); Higham,
    Accuracy and Stability of Numerical Algorithms, §3.1), so the two are within 2·(D + 2)·eps.
    """
    return 2 * (model.config.projection_dim + 2) * EPS


def _forward(reference, images: torch.Tensor):
    model, processor = reference
    inputs = processor(text=PROMPTS, images=to_pil(images), padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**inputs)


def test_pickscore(tiny_clip_dir, reference, images: torch.Tensor) -> None:
    reward = build_reward("pickscore", model=str(tiny_clip_dir), processor=str(tiny_clip_dir))
    out = reward(images, PROMPTS, [{}] * 4)
    logits = _forward(reference, images).logits_per_image.diagonal()  # exp(logit_scale)·cos, paired
    bound = reference[0].logit_scale.exp().item() * _cosine_bound(reference[0])  # + the product's rounding
    torch.testing.assert_close(out["logit"], logits, atol=bound, rtol=EPS)
    torch.testing.assert_close(out["score"], logits / 26, atol=bound / 26, rtol=2 * EPS)
    assert reward.primary == "score"
    # Built from the same modules instead of from_pretrained: the same computation.
    built = PickScoreReward.from_modules(*reference)
    again = built(images, PROMPTS, [{}] * 4)
    assert torch.equal(again["logit"], out["logit"]) and built.model is reference[0]


def test_clip_score_uses_torchmetrics_formula(
    tiny_clip_dir, reference, images: torch.Tensor, tmp_path
) -> None:
    model, processor = reference
    cos = _forward(reference, images).logits_per_image.diagonal() / model.logit_scale.exp()
    assert (cos < 0).all()  # this random tiny CLIP sees every pair as dissimilar: max(·, 0) clamps
    out = build_reward("clip_score", model=str(tiny_clip_dir))(images, PROMPTS, [{}] * 4)
    torch.testing.assert_close(out, torch.zeros(4))
    # The same model with the text projection negated has cos → −cos: the unclamped branch.
    flipped = CLIPModel.from_pretrained(tiny_clip_dir)
    with torch.no_grad():
        flipped.text_projection.weight.neg_()
    flipped.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    out = build_reward("clip_score", model=str(tmp_path))(images, PROMPTS, [{}] * 4)
    # Negating the projection negates the text embedding exactly; the cosines agree as above, the
    # reference's own cos = logit / exp(logit_scale) adding a rounding on each side (the rtol).
    torch.testing.assert_close(out, -100 * cos, atol=100 * _cosine_bound(model), rtol=2 * EPS)


def test_aesthetic(tiny_clip_dir, aesthetic_mlp_file, reference, images: torch.Tensor) -> None:
    reward = build_reward("aesthetic", clip=str(tiny_clip_dir), mlp_weights=str(aesthetic_mlp_file))
    out = reward(images, PROMPTS, [{}] * 4)
    embeds = _forward(reference, images).image_embeds  # projected and L2-normalised by CLIPModel
    state = torch.load(aesthetic_mlp_file, weights_only=True)
    # The reference runs the head in float64 on CLIPModel's unit embedding; the tolerance is the worst
    # case of the reward's fp32 arithmetic (forward error analysis, Higham §3.1): its unit embedding
    # is within (D/2 + 2)·eps of exact, as is CLIPModel's; each layer's dot products are within
    # γ_(k+1)·(|W|·|x| + |b|), γ_n = n·eps/2; and the head is linear, so an error made at one layer
    # reaches the score through the product of the layers after it. Measured: 7e-9; the bound is
    # about 3e-4, on scores that differ from each other by 2e-3.
    # The published head: five linear layers, no activation.
    layers = [
        (state[f"layers.{i}.weight"].double(), state[f"layers.{i}.bias"].double()) for i in (0, 2, 4, 6, 7)
    ]
    # after[l]: the linear map from layer l's output to the score.
    after = [torch.ones(1, 1, dtype=torch.float64)]
    for w, _ in reversed(layers[1:]):
        after.insert(0, after[0] @ w)
    x = embeds.double()
    bound = ((reference[0].config.projection_dim + 4) * EPS * x.abs()) @ (after[0] @ layers[0][0]).abs().T
    for (w, b), rest in zip(layers, after, strict=True):
        bound += ((w.shape[1] + 1) * EPS / 2 * (x.abs() @ w.abs().T + b.abs())) @ rest.abs().T
        x = x @ w.T + b
    assert ((out.double() - x.squeeze(1)).abs() <= bound.squeeze(1)).all()
    assert out.shape == (4,)


def test_bad_input(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"aesthetic\.mlp_weights .* neither an existing file"):
        build_reward("aesthetic", mlp_weights=str(tmp_path / "missing.pth"))
    with pytest.raises(ValueError, match=r"pickscore\.dtype"):
        build_reward("pickscore", dtype="float64")
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        build_reward("jpeg_compressibility")(torch.rand(3, 8, 8), ["p"], [{}])
