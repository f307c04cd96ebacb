"""The shipped SFT and Diffusion-DPO recipes run on the shapes world through ``lit-flowgrpo fit --config``,
shortened to one step, on data written by ``lit_flowgrpo.toy.make_image_data``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from lit_flowgrpo.cli import FlowGRPOCLI
from lit_flowgrpo.toy.make_image_data import write_image_data

CONFIGS = Path(__file__).resolve().parents[1] / "lit_flowgrpo" / "configs"


@pytest.fixture(scope="module")
def shapes_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return write_image_data(str(tmp_path_factory.mktemp("shapes_data")), count=24, seed=0)


def test_the_written_pairs_are_verifier_labelled(shapes_data):
    import json

    import numpy as np
    from PIL import Image

    from lit_flowgrpo.toy.verifier import ShapeVerifier

    root = Path(shapes_data["pairs"]).parent
    lines = [json.loads(line) for line in Path(shapes_data["pairs"]).read_text().splitlines()]
    assert lines
    for line in lines[:4]:
        images = np.stack([np.asarray(Image.open(root / line[k])) for k in ("chosen", "rejected")])
        strict, _ = ShapeVerifier().score_batch(images, [line, line])
        assert strict.tolist() == [1.0, 0.0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["quickstart_sft", "quickstart_dpo", "quickstart_dpo_online"])
def test_recipe_runs_one_step(name, shapes_data, tmp_path):
    cfg = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    trainer, data = cfg["trainer"], cfg["data"]["init_args"]
    trainer.update(
        max_steps=1,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
        callbacks=[],
        logger={
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(tmp_path)},
        },
    )
    data.update(val=None, prompts_per_step=4, val_batch_size=4)
    if name != "quickstart_dpo_online":
        data["train"] = shapes_data["pairs" if data.get("pairs") else "sft"]
    else:
        data.update(train=str(CONFIGS / ".." / "toy" / "assets" / "train.jsonl"), group_size=4)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli = FlowGRPOCLI(args=["fit", "--config", str(path)])
    assert cli.trainer.global_step == 1
    logged = {k: float(v) for k, v in cli.trainer.logged_metrics.items()}
    assert math.isfinite(logged["actor/loss"]) and math.isfinite(logged["actor/grad_norm"])
    key = "actor/sft_loss" if name == "quickstart_sft" else "actor/dpo_reward_accuracy"
    assert key in logged
