"""The editing quickstart through the real CLI, shortened: the base model's held-out evaluation, a
rollout (edit sources in the conditioning, ``shapes_edit`` reward, DiffusionNFT update), the evaluation
after it with its line, the per-kind split and the source | base | tuned picture; a run resumed from
its checkpoint equals the uninterrupted one bit for bit; the hacking config runs the same way.

Whether RL learns is measured by the full run (configs/quickstart_edit.yaml's header), not here.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
import torch
from PIL import Image

from lit_flowgrpo.cli import main

REPO = Path(__file__).resolve().parents[2]


def _args(config: str, root: Path, max_steps: int) -> list[str]:
    # Length only: one small group set a rollout, 8 held-out records, one batch each.
    return [
        "fit",
        "--config",
        str(REPO / "configs" / config),
        f"--trainer.max_steps={max_steps}",
        "--trainer.val_check_interval=1",
        f"--trainer.default_root_dir={root}",
        f"--trainer.logger.init_args.save_dir={root}",
        "--data.init_args.prompts_per_step=2",
        "--data.init_args.group_size=4",
        "--data.init_args.max_val_prompts=8",
        "--data.init_args.val_seeds=1",
        "--data.init_args.val_batch_size=8",
        "--model.init_args.update.micro_batch_size=8",  # the config's 32 would not divide 8 samples
    ]


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("policy.unet.")}


@pytest.mark.slow
def test_edit_quickstart_rollout_update_validation_picture_and_exact_resume(tmp_path: Path, capsys) -> None:
    straight = tmp_path / "straight"
    main(_args("quickstart_edit.yaml", straight, max_steps=2))
    out = capsys.readouterr().out
    line = re.search(
        r"held-out edit accuracy \(strict\): (\d\.\d{3}) -> (\d\.\d{3}) \(([+-]\d\.\d{3}) ± (\d\.\d{3}), 8 paired",
        out,
    )
    assert line, out[-2000:]
    assert re.search(r"by tag \(the base model -> after 2 rollouts\): (\w+ \d\.\d\d -> \d\.\d\d(, )?)+", out)
    (metrics,) = straight.glob("quickstart_edit/version_0/metrics.csv")
    with open(metrics) as f:
        rows = list(csv.DictReader(f))

    def values(key: str) -> list[float]:
        return [float(r[key]) for r in rows if r.get(key)]

    strict = values("val-core/shapes_edit/strict/mean@1")
    assert len(strict) == 3 and all(8 * v == round(8 * v) for v in strict)  # base, after 1, after 2
    assert float(line.group(1)) == pytest.approx(strict[0], abs=5e-4)
    for component in ("edit", "preserve", "partial"):
        assert len(values(f"val-aux/shapes_edit/{component}/mean@1")) == 3
        assert all(0 <= v <= 1 for v in values(f"critic/rewards/shapes_edit/{component}/mean"))
    # The picture: a source row above each base / tuned pair (three tile rows of 32 px x 4).
    picture = metrics.parent / "base_vs_tuned.png"
    with Image.open(picture) as image:
        assert image.height > 3 * 32 * 4
    assert "source, base (top) vs tuned (bottom) samples" in out

    # One rollout, then a resume from its checkpoint to the second: the weights equal the straight run's.
    half = tmp_path / "half"
    main(_args("quickstart_edit.yaml", half, max_steps=1))
    main(
        [
            *_args("quickstart_edit.yaml", half, max_steps=2),
            f"--ckpt_path={half / 'checkpoints' / 'last.ckpt'}",
        ]
    )
    a, b = _weights(straight / "checkpoints" / "last.ckpt"), _weights(half / "checkpoints" / "last.ckpt")
    assert a.keys() == b.keys() and a
    base = _weights_of_shipped()
    assert any(not torch.equal(a[k], base[k]) for k in a), "the update changed nothing"
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} of {len(a)} tensors differ after the resume, e.g. {differ[:3]}"


def _weights_of_shipped() -> dict[str, torch.Tensor]:
    from lit_flowgrpo.toy.edit_model import default_edit_checkpoint, load_edit_checkpoint

    unet, _, _ = load_edit_checkpoint(default_edit_checkpoint())
    return {f"policy.unet.{k}": v for k, v in unet.state_dict().items()}


@pytest.mark.slow
def test_edit_hacking_config_reports_the_proxy_beside_the_gold(tmp_path: Path, capsys) -> None:
    main(_args("quickstart_edit_hacking.yaml", tmp_path, max_steps=1))
    out = capsys.readouterr().out
    assert re.search(
        r"held-out edit accuracy \(strict\) after 1 rollout: \d\.\d{3}; shapes_edit/edit: \d\.\d{3} \(gap [+-]\d\.\d{3}\)",
        out,
    ), out[-2000:]
    assert re.search(r"shapes_edit/edit: \d\.\d{3} -> \d\.\d{3}, its gap to held-out edit accuracy", out)
