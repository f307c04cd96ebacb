"""Rewards that see the source: the edit judge against a real chat server on 127.0.0.1, and the
preservation term on hand-made images whose values the test works out on its own.

The server decodes every image of a request (the sources, then the result) and answers with numbers it
computes from their pixels, printed with 6 decimals; the test prints the same numbers from the same
uint8 pixels (a float64 mean of integers, one rounding) and so knows each reply's value exactly.
"""

from __future__ import annotations

import base64
import io
import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from PIL import Image
from tolerances import EPS32, depth, network_atol

from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.rewards.base import MultiReward, needs_sources, uses_sources
from lit_flowgrpo.rewards.edit import EditJudgeReward, fit_within
from lit_flowgrpo.rewards.images import to_numpy_hwc
from lit_flowgrpo.rewards.preservation import PreservationReward, resized_source

PROMPTS = ["make the sky red", "put the cat on the sofa", "FAIL remove the tree"]


def _pixels(url: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))


def _scores(result: np.ndarray, sources: list[np.ndarray]) -> tuple[str, str, str]:
    """What the server prints for one request: instruction = 10·mean(result)/255, preservation =
    10·(1 − mean|result − first source|/255), quality = 5 + the number of sources."""
    instruction = 10 * result.astype(np.float64).mean() / 255
    first = sources[0].astype(np.float64)
    preservation = 10 * (1 - np.abs(result.astype(np.float64) - first).mean() / 255)
    return f"{instruction:.6f}", f"{preservation:.6f}", f"{5 + len(sources):.6f}"


class EditChatHandler(BaseHTTPRequestHandler):
    """Route prefix picks a behaviour: /ok, /error (500), /missing (no quality line), /range (a score of
    11), /partial (500 when the question holds 'FAIL')."""

    lock = threading.Lock()
    seen: ClassVar[list[dict]] = []

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._reply(200 if self.path.endswith("/v1/models") else 404, b'{"data": [{"id": "judge"}]}')

    def do_POST(self) -> None:
        route = self.path.split("/")[1]
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with EditChatHandler.lock:
            EditChatHandler.seen.append(request)
        content = request["messages"][0]["content"]
        images = [_pixels(c["image_url"]["url"]) for c in content if c["type"] == "image_url"]
        text = next(c["text"] for c in content if c["type"] == "text")
        if route == "error" or (route == "partial" and "FAIL" in text):
            return self._reply(500, b'{"error": "boom"}')
        instruction, preservation, quality = _scores(images[-1], images[:-1])
        lines = [
            "The sky is mostly red. Instruction score: 1 would be too harsh.",  # an early match: the last counts
            f"Instruction score: {'11' if route == 'range' else instruction}",
            f"Preservation score: **{preservation}**",
        ]
        if route != "missing":
            lines.append(f"Quality score: {quality}")
        reply = {"choices": [{"message": {"role": "assistant", "content": "\n".join(lines)}}]}
        self._reply(200, json.dumps(reply).encode())


@pytest.fixture
def server(http_server) -> Iterator[str]:
    EditChatHandler.seen = []
    yield http_server(EditChatHandler)


def _judge(server: str, route: str, **kwargs: object) -> EditJudgeReward:
    settings = {
        "max_side": None,
        "timeout_s": 5.0,
        "max_retries": 0,
        "backoff_s": 0.0,
        "model": "judge",
        **kwargs,
    }
    return EditJudgeReward(base_url=f"{server}/{route}/v1", **settings)


@pytest.fixture
def batch() -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """Three results (12 x 16) and their sources: one, two (the second of another size), one."""
    g = torch.Generator().manual_seed(0)
    results = torch.rand(3, 3, 12, 16, generator=g)
    first = [torch.rand(3, 12, 16, generator=g) for _ in range(3)]
    second = torch.rand(3, 10, 10, generator=g)
    return results, [[first[0]], [first[1], second], [first[2]]]


def _expected(results: torch.Tensor, sources: list[list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each component as the judge should read it from the server's reply, from the test's own prints."""
    out: dict[str, list[float]] = {"instruction": [], "preservation": [], "quality": [], "overall": []}
    for result, srcs in zip(results, sources, strict=True):
        printed = _scores(to_numpy_hwc(result[None])[0], [to_numpy_hwc(s[None])[0] for s in srcs])
        i, p, q = (float(v) / 10 for v in printed)
        for key, value in zip(out, (i, p, q, math.sqrt(min(i, p) * q)), strict=True):
            out[key].append(value)
    return {k: torch.tensor(v, dtype=torch.float64).float() for k, v in out.items()}


def test_judge_sends_sources_then_result_and_parses_every_component(server: str, batch) -> None:
    results, sources = batch
    judge = _judge(server, "ok", max_concurrency=3)
    assert uses_sources(judge) and needs_sources(judge) and judge.primary == "overall"
    scores = judge(results, PROMPTS, [{}, {}, {}], sources=sources)
    expected = _expected(results, sources)
    assert sorted(scores) == sorted(expected)
    for key, value in expected.items():  # the printed numbers, parsed and divided: the same float32s
        assert torch.equal(scores[key], value), key
    # Each request: the record's sources in order, then the result, then the question naming the count.
    assert len(EditChatHandler.seen) == 3
    for request in EditChatHandler.seen:
        assert request["model"] == "judge" and request["temperature"] == 0.0
        content = request["messages"][0]["content"]
        assert [c["type"] for c in content[:-1]] == ["image_url"] * (len(content) - 1) and content[-1][
            "type"
        ] == "text"
        i = next(n for n, p in enumerate(PROMPTS) if f"[{p}]" in content[-1]["text"])
        wanted = [*sources[i], results[i]]
        assert len(content) == len(wanted) + 1
        for part, image in zip(content, wanted, strict=False):
            assert np.array_equal(_pixels(part["image_url"]["url"]), to_numpy_hwc(image[None])[0])


def test_judge_scales_each_image_down_to_max_side_keeping_its_shape(server: str, batch) -> None:
    results, sources = batch
    _judge(server, "ok", max_side=8)(results[:2], PROMPTS[:2], [], sources=sources[:2])
    sizes = sorted(
        [
            Image.open(io.BytesIO(base64.b64decode(c["image_url"]["url"].split(",", 1)[1]))).size
            for c in r["messages"][0]["content"]
            if c["type"] == "image_url"
        ]
        for r in EditChatHandler.seen
    )
    assert sizes == [
        [(8, 6), (8, 6)],
        [(8, 6), (8, 8), (8, 6)],
    ]  # (width, height): 16 x 12 -> 8 x 6, 10 x 10 -> 8 x 8
    assert fit_within(Image.new("RGB", (5, 3)), 8).size == (5, 3)  # never scaled up


@pytest.mark.parametrize(
    ("route", "error"),
    [("error", "HTTP 500"), ("missing", "no quality score"), ("range", "outside [0, 10]")],
)
def test_a_failed_reply_is_nan_in_every_component_after_its_retries(
    server: str, batch, route: str, error: str
) -> None:
    results, sources = batch
    judge = _judge(server, route, max_retries=1, max_concurrency=3)
    scores = judge(results, PROMPTS, [], sources=sources)
    assert all(torch.isnan(value).all() for value in scores.values()), route
    assert error in judge.endpoint.last_stats.last_error
    assert len(EditChatHandler.seen) == 3 * 2  # each request retried once


def test_one_failed_sample_leaves_the_others_scored(server: str, batch) -> None:
    results, sources = batch
    scores = _judge(server, "partial", max_consecutive_failures=1)(results, PROMPTS, [], sources=sources)
    expected = _expected(results, sources)
    for key, value in scores.items():
        assert torch.isnan(value[2]) and torch.equal(value[:2], expected[key][:2]), key


def test_a_judge_of_other_components_reads_those_and_weights_the_first(server: str, batch) -> None:
    results, sources = batch
    judge = _judge(
        server,
        "ok",
        components={"follows": r"Instruction score:\s*([0-9.]+)"},
        template="Edit {num_sources}: {prompt} ({metadata[kind]})",
    )
    assert judge.primary == "follows" and judge.required_metadata == ("kind",)
    scores = judge(results[:1], PROMPTS[:1], [{"kind": "colour"}], sources=sources[:1])
    assert set(scores) == {"follows"} and torch.equal(
        scores["follows"], _expected(results, sources)["instruction"][:1]
    )
    assert EditChatHandler.seen[0]["messages"][0]["content"][-1]["text"] == f"Edit 1: {PROMPTS[0]} (colour)"


def test_judge_settings_and_inputs_are_checked(server: str, batch, closed_port_url: str) -> None:
    results, sources = batch
    _judge(server, "ok").check()
    with pytest.raises(ValueError, match=r"edit_judge\.base_url .* unreachable"):
        EditJudgeReward(base_url=f"{closed_port_url}/v1", timeout_s=1.0).check()
    for kwargs, message in [
        ({"template": "Rate the edit"}, r"template must contain \{prompt\}"),
        ({"template": "{prompt} {unknown}"}, r"template names a field other than"),
        ({"components": {}}, r"components is empty"),
        ({"components": {"overall": r"(\d)"}}, r"not 'overall'"),
        ({"components": {"a": r"\d"}}, r"components\.a .* needs a group"),
        ({"score_max": 0}, r"score_max \(0\) must be positive"),
    ]:
        with pytest.raises(SettingsError, match=message):
            EditJudgeReward(**kwargs)
    judge = _judge(server, "ok")
    with pytest.raises(ValueError, match=r"needs each sample's source images"):
        judge(results, PROMPTS, [])
    with pytest.raises(ValueError, match=r"sample 1 has no source image"):
        judge(results, PROMPTS, [], sources=[sources[0], [], sources[2]])
    assert EditChatHandler.seen == []  # refused before any request


# --------------------------------------------------------------------------------------------------
# preservation
# --------------------------------------------------------------------------------------------------

# pixel and ssim are float64 sums over at most 3 x 32 x 32 terms, rounded once to float32: the float32
# rounding dominates (half an ulp of 1 is 2^-24; the float64 error is below 2^-40 for these sizes).
ROUNDING = EPS32


def _ssim_constant(a: float, b: float) -> float:
    """SSIM of two constant images (no variance): (2ab + C1) / (a² + b² + C1), C1 = (0.01·1)²."""
    c1 = 0.01**2
    return (2 * a * b + c1) / (a * a + b * b + c1)


def test_an_unchanged_result_keeps_everything(tiny_clip_dir: Path) -> None:
    g = torch.Generator().manual_seed(1)
    source = torch.rand(3, 32, 32, generator=g)
    reward = PreservationReward(model=str(tiny_clip_dir))
    assert uses_sources(reward) and needs_sources(reward) and reward.primary == "pixel"
    out = reward(source[None], ["x"], [{}], sources=[[source]])
    assert out["pixel"].item() == 1.0
    torch.testing.assert_close(out["ssim"], torch.ones(1), atol=ROUNDING, rtol=0)
    # cos(e, e) of one embedding: its norm's rounding, over the CLIP tower's depth
    model = reward.model
    torch.testing.assert_close(out["feature"], torch.ones(1), atol=network_atol(depth(model), 1.0), rtol=0)


def test_a_known_difference_gives_the_formulas_value() -> None:
    source = torch.full((3, 32, 32), 0.5)
    result = source.clone()
    result[:, :8, :8] = 0.75  # 64 of 1024 pixels off by 0.25 in every channel
    out = PreservationReward()(result[None], ["x"], [{}], sources=[[source]])
    assert out["pixel"].item() == 1 - 0.25 * 64 / 1024  # 0.984375, exact in float32
    flat = PreservationReward()(torch.full((1, 3, 32, 32), 0.75), ["x"], [{}], sources=[[source]])
    assert flat["pixel"].item() == 0.75
    torch.testing.assert_close(flat["ssim"], torch.tensor([_ssim_constant(0.75, 0.5)]), atol=ROUNDING, rtol=0)


def _changed_inside_and_outside() -> tuple[torch.Tensor, torch.Tensor]:
    """A 32 x 32 source and a result that differs by 0.25 inside [0, 8) x [0, 8) and by 0.5 in one
    pixel column outside it (x = 31, 32 pixels)."""
    source = torch.full((3, 32, 32), 0.25)
    result = source.clone()
    result[:, :8, :8] = 1.0
    result[:, :, 31] = 0.75
    return source, result


def test_the_edit_box_excludes_the_edited_region() -> None:
    source, result = _changed_inside_and_outside()
    reward = PreservationReward()
    out = reward(result[None], ["x"], [{"edit_box": [0, 0, 8, 8]}], sources=[[source]])
    kept = 1024 - 64
    assert out["pixel"].item() == pytest.approx(1 - 0.5 * 32 / kept, abs=ROUNDING)
    inside_only = result.clone()
    inside_only[:, :, 31] = 0.25
    both = reward(
        inside_only[None].repeat(2, 1, 1, 1),
        ["x", "x"],
        [{"edit_box": [[0, 0, 4, 8], [4, 0, 8, 8]]}, {}],
        sources=[[source]] * 2,
    )
    assert both["pixel"][0].item() == 1.0  # two boxes covering the change: nothing else changed
    torch.testing.assert_close(both["ssim"][:1], torch.ones(1), atol=ROUNDING, rtol=0)
    assert both["pixel"][1].item() == 1 - 0.75 * 64 / 1024  # no box: the whole image


def test_the_edit_mask_image_excludes_white_pixels_and_is_read_from_mask_root(tmp_path: Path) -> None:
    source, result = _changed_inside_and_outside()
    mask = np.zeros((16, 16), dtype=np.uint8)  # drawn at half the result's size: resized by nearest neighbour
    mask[:4, :4] = 255
    Image.fromarray(mask).save(tmp_path / "mask.png")
    reward = PreservationReward(mask_root=str(tmp_path))
    out = reward(result[None], ["x"], [{"edit_mask": "mask.png"}], sources=[[source]])
    assert out["pixel"].item() == pytest.approx(1 - 0.5 * 32 / (1024 - 64), abs=ROUNDING)
    assert reward.problems([{"edit_mask": "mask.png"}, {"edit_mask": "gone.png"}]) == [
        f"record 2: edit_mask {str(tmp_path / 'gone.png')!r} does not exist (a relative path is read from "
        f"--model.init_args.reward.init_args.config.preservation.mask_root ({tmp_path}))"
    ]


def test_a_box_is_scaled_with_a_source_of_another_size() -> None:
    # A 16 x 16 source, resized to the 32 x 32 result: its box [0, 0, 4, 4] covers [0, 8) x [0, 8) there.
    g = torch.Generator().manual_seed(2)
    source = (torch.rand(3, 16, 16, generator=g) * 255).round() / 255  # as read from a file: k / 255
    lanczos = Image.fromarray(to_numpy_hwc(source[None])[0]).resize((32, 32), Image.LANCZOS)
    resized = torch.from_numpy(np.asarray(lanczos).copy()).permute(2, 0, 1).float() / 255
    assert torch.equal(resized_source(source, 32, 32), resized)  # as FluxKontextPipeline resizes a PIL source
    result = resized.clone()
    result[:, :8, :8] = 1 - result[:, :8, :8]
    out = PreservationReward()(result[None], ["x"], [{"edit_box": [0, 0, 4, 4]}], sources=[[source]])
    assert out["pixel"].item() == 1.0


def test_a_sample_with_nothing_left_to_compare_is_nan_in_every_component(tiny_clip_dir: Path) -> None:
    source = torch.full((3, 16, 16), 0.5)
    reward = PreservationReward(model=str(tiny_clip_dir))
    out = reward(
        torch.rand(2, 3, 16, 16), ["x", "y"], [{"edit_box": [0, 0, 16, 16]}, {}], sources=[[source]] * 2
    )
    assert all(torch.isnan(v[0]) and torch.isfinite(v[1]) for v in out.values())


def test_the_feature_compares_the_embeddings_outside_the_edit(tiny_clip_dir: Path) -> None:
    from transformers import CLIPImageProcessor, CLIPModel

    source, result = _changed_inside_and_outside()
    reward = PreservationReward(model=str(tiny_clip_dir), primary="feature")
    out = reward(
        result[None].repeat(2, 1, 1, 1), ["x"] * 2, [{"edit_box": [0, 0, 8, 8]}, {}], sources=[[source]] * 2
    )
    # By hand: the result with its box filled from the source, and the source, through CLIP's own calls.
    model, processor = (
        CLIPModel.from_pretrained(tiny_clip_dir).eval(),
        CLIPImageProcessor.from_pretrained(tiny_clip_dir),
    )
    filled = result.clone()
    filled[:, :8, :8] = source[:, :8, :8]
    pil = [Image.fromarray(to_numpy_hwc(x[None])[0]) for x in (filled, result, source)]
    with torch.no_grad():
        output = model.get_image_features(
            pixel_values=processor(images=pil, return_tensors="pt")["pixel_values"]
        )
    embeds = getattr(output, "pooler_output", output).double()
    expected = torch.nn.functional.cosine_similarity(embeds[:2], embeds[2:].expand(2, -1), dim=-1).float()
    torch.testing.assert_close(out["feature"], expected, atol=network_atol(depth(model), 1.0), rtol=0)
    assert out["feature"][0] > out["feature"][1]  # the edit's own change no longer counts


def test_a_vision_tower_with_a_pooler_gives_the_feature(tmp_path: Path) -> None:
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    config = Dinov2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
    )
    torch.manual_seed(0)
    Dinov2Model(config).save_pretrained(tmp_path)
    BitImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(
        tmp_path
    )
    source = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(3))
    reward = PreservationReward(model=str(tmp_path))
    out = reward(torch.stack([source, 1 - source]), ["x", "y"], [{}, {}], sources=[[source]] * 2)
    torch.testing.assert_close(
        out["feature"][:1], torch.ones(1), atol=network_atol(depth(reward.model), 1.0), rtol=0
    )
    assert out["feature"][1] < out["feature"][0]


def test_preservation_settings_and_records_are_checked(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"primary is 'feature' but .*model is null"):
        PreservationReward(primary="feature")
    with pytest.raises(SettingsError, match=r"mask_root .* is not a folder"):
        PreservationReward(mask_root=str(tmp_path / "none"))
    (tmp_path / "bad.png").write_bytes(b"not a png")
    found = PreservationReward(source_index=1).problems(
        [
            {"edit_box": [4, 0, 2, 8]},
            {"edit_box": "left half"},
            {"edit_mask": str(tmp_path / "bad.png")},
            {"condition_images": ["/a.png"]},
            {"condition_images": ["/a.png", "/b.png"], "edit_box": [[0, 0, 1, 1], [2, 2, 3, 3]]},
        ]
    )
    assert [line.split(":")[0] for line in found] == [
        "record 1",
        "record 2",
        "record 3",
        "record 4 gives 1 condition_images, but --model.init_args.reward.init_args.config.preservation.source_index (1) compares with image 2",
    ]
    assert "0 <= x0 < x1" in found[0] and "cannot be read" in found[2]
    with pytest.raises(ValueError, match=r"needs each sample's source images"):
        PreservationReward()(torch.rand(1, 3, 8, 8), ["x"], [{}])


def test_a_multi_reward_of_judge_and_preservation_is_called_with_sources(server: str, batch) -> None:
    results, sources = batch
    seen: list[int] = []

    def blind(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        seen.append(images.shape[0])  # called without sources: it declares none
        return torch.zeros(images.shape[0])

    preservation = PreservationReward()
    reward = MultiReward(
        {"edit_judge": 1.0, "preservation": 0.5, "blind": 0.0},
        rewards={
            "edit_judge": _judge(server, "partial", max_concurrency=3),
            "preservation": preservation,
            "blind": blind,
        },
    )
    out = reward(results, PROMPTS, [{}, {}, {}], sources=sources)
    judged = _expected(results, sources)
    kept = preservation(results, PROMPTS, [{}, {}, {}], sources=sources)
    assert seen == [3]
    assert torch.equal(out.components["edit_judge/overall"][:2], judged["overall"][:2])
    assert torch.equal(out.components["preservation/pixel"], kept["pixel"])
    torch.testing.assert_close(out.total[:2], judged["overall"][:2] + 0.5 * kept["pixel"][:2], atol=0, rtol=0)
    assert torch.isnan(out.total[2]) and out.failures == {"edit_judge": 1, "preservation": 0, "blind": 0}


@pytest.mark.slow
def test_both_rewards_by_name_score_a_conditioned_fit_and_its_validation(server: str, tmp_path: Path) -> None:
    """One training step and one validation of the toy policy conditioned on a source: the registry builds
    both rewards from their settings, each request holds the record's own source file then the sample,
    and the record's edit_box reaches the preservation term through the metadata."""
    import lightning as L
    from test_conditioning import SourceToyPolicy

    from lit_flowgrpo import FlowGRPOModule, PromptDataModule, Sampler, UpdateSettings, WeightsSettings
    from lit_flowgrpo.conditioning import read_rgb

    prompts = ["a red circle", "a blue square", "two green triangles", "a yellow circle"]

    def records(name: str, n: int, shade: int) -> str:
        lines = []
        for i in range(n):
            colour = (50 * i + shade, 90, 200 - 40 * i)
            Image.fromarray(np.full((32, 32, 3), colour, dtype=np.uint8)).save(tmp_path / f"{name}_{i}.png")
            box = [0, 0, 32, 32] if (name, i) == ("val", 1) else [0, 0, 16, 32]  # val 1: all of it edited
            record = {"prompt": prompts[i], "condition_images": [f"{name}_{i}.png"], "edit_box": box}
            lines.append(json.dumps(record))
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        return str(tmp_path / f"{name}.jsonl")

    data = PromptDataModule(
        train=records("train", 4, 0),
        val=records("val", 2, 25),
        prompts_per_step=2,
        group_size=2,
        val_batch_size=2,
    )
    judge = {"base_url": f"{server}/ok/v1", "model": "judge", "max_side": None, "max_retries": 0}
    reward = MultiReward({"edit_judge": 1.0, "preservation": 0.5}, config={"edit_judge": judge})
    module = FlowGRPOModule(
        policy=SourceToyPolicy(),
        reward=reward,
        sampler=Sampler(num_steps=3, eval_num_steps=2, guidance_scale=1.0, height=32, width=32),
        update=UpdateSettings(micro_batch_size=4),
        weights=WeightsSettings(lora=None),
    )
    trainer = L.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        val_check_interval=1,
    )
    trainer.fit(module, datamodule=data)
    assert trainer.global_step > 0
    # Each request: its record's own source file (at the file's size), then the sample, then the question.
    given: dict[str, list[np.ndarray]] = {}
    for r in [*data.train_records, *data.val_records]:
        given.setdefault(r["prompt"], []).append(to_numpy_hwc(read_rgb(r["condition_images"][0])[None])[0])
    assert len(EditChatHandler.seen) == 2 * 2 + 2  # 2 records x 2 samples, then 2 held-out records
    for request in EditChatHandler.seen:
        content = request["messages"][0]["content"]
        prompt = next(p for p in prompts if f"[{p}]" in content[-1]["text"])
        assert [c["type"] for c in content] == ["image_url", "image_url", "text"]
        source = _pixels(content[0]["image_url"]["url"])
        assert any(np.array_equal(source, s) for s in given[prompt])
    metrics = trainer.callback_metrics
    for key in ("critic/rewards/edit_judge/overall/mean", "critic/rewards/preservation/pixel/mean"):
        assert math.isfinite(float(metrics[key])), key
    assert math.isfinite(float(metrics["val-aux/preservation/ssim/mean@1"]))
    # The held-out record whose box is the whole image has nothing to compare: its sample is unscored.
    assert float(metrics["val-aux/preservation/pixel/unscored_count"]) == 1
    assert float(metrics["val-aux/edit_judge/overall/unscored_count"]) == 0
