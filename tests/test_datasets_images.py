"""ImageDataModule: the JSONL image index, its checks before any weight loads, dealing over ranks and
an exact resume, and the images as the batch carries them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.image_data import ImageBatch, ImageDataModule, load_image


def write_images(root: Path, count: int, size: int = 8, pairs: bool = False) -> str:
    """``count`` records of random RGB PNGs (and a rejected image each, with ``pairs``) under ``root``."""
    rng = np.random.default_rng(0)
    (root / "img").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(root / "img" / f"{i}.png")
        record = {"prompt": f"prompt {i}", "tag": "t"}
        if pairs:
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(
                root / "img" / f"{i}_l.png"
            )
            record |= {"chosen": f"img/{i}.png", "rejected": f"img/{i}_l.png"}
        else:
            record["image"] = f"img/{i}.png"
        lines.append(json.dumps(record))
    index = root / "index.jsonl"
    index.write_text("\n".join(lines) + "\n")
    return str(index)


def batches(dm: ImageDataModule, rank: int, world: int, count: int) -> list[ImageBatch]:
    dm._world = lambda: (world, rank)  # the trainer's data-parallel view, without a trainer
    it = iter(dm.train_dataloader())
    return [next(it) for _ in range(count)]


def test_records_are_read_relative_to_the_index_and_carry_their_images(tmp_path):
    index = write_images(tmp_path / "data", 6, size=8)
    dm = ImageDataModule(train=index, prompts_per_step=4, height=8, width=8, seed=3)
    (batch,) = batches(dm, 0, 1, 1)
    assert isinstance(batch, ImageBatch) and batch.images.shape == (4, 3, 8, 8) and batch.rejected is None
    for prompt, image, rid in zip(batch.prompts, batch.images, batch.record_ids.tolist(), strict=True):
        assert prompt == f"prompt {rid}"
        want = np.asarray(Image.open(tmp_path / "data" / "img" / f"{rid}.png"), dtype=np.float32) / 255
        torch.testing.assert_close(image, torch.from_numpy(want).permute(2, 0, 1), rtol=0, atol=0)
    assert batch.metadata[0] == {"tag": "t"}


def test_load_image_resizes_the_shorter_side_and_crops_the_centre(tmp_path):
    pixels = np.zeros((8, 16, 3), dtype=np.uint8)
    pixels[:, 4:12] = 255  # a white band in the middle 8 columns: what the centre crop keeps
    Image.fromarray(pixels).save(tmp_path / "wide.png")
    image = load_image(str(tmp_path / "wide.png"), 8, 8)
    assert image.shape == (3, 8, 8) and float(image.min()) == 1.0


def test_two_ranks_deal_what_one_process_does_and_resume_exactly(tmp_path):
    index = write_images(tmp_path, 10, pairs=True)

    def module() -> ImageDataModule:
        return ImageDataModule(train=index, prompts_per_step=4, height=8, width=8, pairs=True, seed=1)

    one = batches(module(), 0, 1, 3)
    two = [batches(module(), r, 2, 3) for r in range(2)]
    for step in range(3):
        ids = torch.cat([two[0][step].sample_ids, two[1][step].sample_ids])
        assert torch.equal(ids, one[step].sample_ids)  # rank-major: rank 0's rows, then rank 1's
        rejected = torch.cat([two[0][step].rejected, two[1][step].rejected])
        assert torch.equal(rejected, one[step].rejected)
    dm = module()
    dm.load_state_dict({"next_step": 2, "seed": 1})
    (resumed,) = batches(dm, 0, 1, 1)
    assert resumed.step == 2 and torch.equal(resumed.images, one[2].images)
    assert resumed.prompts == one[2].prompts
    # The rest of the batch too: the rejected images, the ids and the noise seeds drawn from them.
    for field in ("rejected", "sample_ids", "group_ids", "seeds"):
        assert torch.equal(getattr(resumed, field), getattr(one[2], field)), field


@pytest.mark.parametrize(
    ("line", "pairs", "fragment"),
    [
        ({"prompt": "p", "image": "nope.png"}, False, "nope.png does not exist"),
        ({"prompt": "p", "image": "bad.png"}, False, "bad.png cannot be read"),
        ({"prompt": "p", "images": ["ok.png", "ok.png"]}, True, "unlabelled pair"),
        ({"prompt": "p", "images": ["ok.png", "ok.png"], "preferred": 0.5}, True, "unlabelled pair"),
        ({"prompt": "p", "chosen": "ok.png"}, True, "unlabelled pair"),
        ({"prompt": "p", "image": "ok.png"}, True, "--data.init_args.pairs=true needs"),
        ({"image": "ok.png"}, False, 'no string "prompt"'),
    ],
    ids=["missing", "unreadable", "no_label", "tie", "no_rejected", "not_a_pair", "no_prompt"],
)
def test_bad_records_are_refused_naming_the_file_and_line(tmp_path, line, pairs, fragment):
    Image.new("RGB", (4, 4)).save(tmp_path / "ok.png")
    (tmp_path / "bad.png").write_bytes(b"not an image")
    good = (
        {"prompt": "q", "chosen": "ok.png", "rejected": "ok.png"}
        if pairs
        else {"prompt": "q", "image": "ok.png"}
    )
    index = tmp_path / "index.jsonl"
    index.write_text(json.dumps(good) + "\n\n" + json.dumps(line) + "\n")
    with pytest.raises(SettingsError) as err:
        ImageDataModule(train=str(index), prompts_per_step=1, height=4, width=4, pairs=pairs)
    message = str(err.value)
    assert "--data.init_args.train" in message and f"{index} line 3" in message and fragment in message


def test_an_empty_index_and_a_missing_one_are_refused(tmp_path):
    index = tmp_path / "index.jsonl"
    index.write_text("\n")
    with pytest.raises(SettingsError, match="holds no records"):
        ImageDataModule(train=str(index), prompts_per_step=1)
    with pytest.raises(SettingsError, match=r"must be an existing \.jsonl index"):
        ImageDataModule(train=str(tmp_path / "absent.jsonl"), prompts_per_step=1)
