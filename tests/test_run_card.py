"""The run card: every checkpoint holds it as plain data, `lit-flowgrpo export` writes it as the export
folder's README.md (Hub model-card metadata and a page), and each of its fields is what the run logged.

The two whole-CLI runs (slow) read the card back and check each field against the run's own records:
its saved config, metrics.csv, the validation sample tables, the held-out line it printed and the
checkpoint. A shortened quickstart (DiffusionNFT, full fine-tune, the base model validated, a proxy
tracked, diversity and drift measured) carries every measured field; the tiny SD3 run (Flow-GRPO, LoRA,
EMA, resumed once, no base validation) carries the on-policy ratio error, the resume, and the fields it
cannot measure, each saying why.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from cli_helpers import load_shipped, tiny_fit_args

from lit_flowgrpo.cli import FlowGRPOCLI, main
from lit_flowgrpo.run_card import (
    CHECKPOINT_KEY,
    HeldOutGain,
    HeldOutSource,
    ProxyGap,
    checkpoint_card,
    is_measured,
    model_card,
    not_measured,
    read_card,
)
from lit_flowgrpo.toy.report import HeldOutReport

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------------
# The card's own rules (quick)
# --------------------------------------------------------------------------------------------------


def _saved_checkpoint(path: Path, **extra: Any) -> str:
    """A checkpoint as Lightning writes one, without a run card (written from Python without the recorder)."""
    ckpt = {"global_step": 6, "state_dict": {"w": torch.zeros(2)}, "callbacks": {}, **extra}
    torch.save(ckpt, path)
    return str(path)


def test_a_checkpoint_without_a_card_says_so_and_invents_nothing(tmp_path: Path) -> None:
    card = checkpoint_card(_saved_checkpoint(tmp_path / "a.ckpt"))
    why = "not measured: the checkpoint holds no run card (it was written without RunCardRecorder)"
    assert card["trust"] == card["sessions"] == card["trained"]["rollouts"] == why
    assert card["export"]["optimizer_steps"] == 6
    assert card["export"]["weights"] == "the trained weights"
    folder = tmp_path / "export"
    folder.mkdir()
    model_card(card).save(folder / "README.md")
    back = read_card(str(folder))
    metadata = back.pop("metadata")
    assert back == card
    assert "license" not in metadata and "base_model" not in metadata
    assert metadata["library_name"] == "diffusers"
    assert "## How far to trust it\n\n" + why in (folder / "README.md").read_text()


def test_the_ema_weights_are_named_only_when_exported(tmp_path: Path) -> None:
    ema = {"TrainableEMA{'decay': 0.9}": {"ema_state_dict": {"w": torch.ones(2)}}}
    path = _saved_checkpoint(tmp_path / "ema.ckpt", callbacks=ema)
    assert checkpoint_card(path)["export"]["weights"] == "the EMA of the trained weights"
    assert checkpoint_card(path, use_ema=False)["export"]["weights"] == "the trained weights"


def test_base_model_is_in_the_metadata_only_for_a_hub_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def metadata(pretrained: str | None, license: str | None = None) -> dict[str, Any]:
        base = {"policy": "lit_flowgrpo.policies.SD3Policy", "pretrained": pretrained, "modality": "image"}
        return model_card({"trained": {"base_model": base}}, license=license).data.to_dict()

    hub = "stabilityai/stable-diffusion-3.5-medium"
    assert metadata(hub)["base_model"] == hub
    assert metadata(hub)["pipeline_tag"] == "text-to-image"  # from the policy's modality
    assert metadata(hub, "other")["license"] == "other"
    # A local folder is not a Hub repository, even when its path reads like one.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    for local in ("org/name", str(tmp_path / "org" / "name"), None):
        assert "base_model" not in metadata(local)


def test_a_folder_without_a_card_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"has no README\.md"):
        read_card(str(tmp_path))
    (tmp_path / "README.md").write_text("# an adapter\n")
    with pytest.raises(ValueError, match="holds no run card"):
        read_card(str(tmp_path))


def test_held_out_report_hands_over_its_paired_gain() -> None:
    """HeldOutReport as a HeldOutSource: nothing before an evaluation after training; then the base and
    the last evaluation with their paired difference (s/√n), and the proxy's gap from the base model on."""
    report = HeldOutReport(proxy="shapes_color")
    assert isinstance(report, HeldOutSource) and report.held_out_gain() is None
    report.base, report.history, report.counts = (0.25, 4), [(0, 0.25)], [4]
    report.base_values = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    assert report.held_out_gain() is None  # the base model only
    report.history.append((3, 0.75))
    report.counts.append(4)
    report.last_values = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    report.proxy_history = [(0, 0.5, 0.25), (3, 0.9, 0.15)]
    gain = report.held_out_gain()
    # d = (1, 0, 1, 0): mean 1/2, sample standard deviation √(1/3), over √4.
    assert gain == HeldOutGain(
        "shapes/strict",
        0.25,
        4,
        0.75,
        4,
        3,
        0.5,
        math.sqrt(1 / 3) / 2,
        4,
        ProxyGap("shapes_color", 0.5, 0.9, 0.25, 0.15),
    )
    # Resumed: the last evaluation is known, its per-sample verdicts are not (they are not saved).
    report.last_values = None
    assert report.held_out_gain() == HeldOutGain(
        "shapes/strict", 0.25, 4, 0.75, 4, 3, proxy=ProxyGap("shapes_color", 0.5, 0.9, 0.25, 0.15)
    )


def test_the_rollout_reward_is_a_window_mean_at_each_end_with_its_spread() -> None:
    """One rollout scores one batch of other prompts: the card keeps the first and the last
    REWARD_WINDOW rollouts, their mean and standard error (sample std / √n), and shows both ends."""
    from lit_flowgrpo.callbacks.run_card import REWARD_WINDOW, RunCardRecorder

    rec = RunCardRecorder()
    values = [1.0, 3.0, 2.0, 4.0, 5.0, 0.5, 7.0, 6.0, 2.5, 8.0, 9.0, 10.0]
    for i, v in enumerate(values):
        # A component logged from the third rollout on: its window counts only the rollouts that had it.
        rec._rewards.add(
            i + 1, {"critic/rewards/mean": v, **({"critic/rewards/c/mean": -v} if i >= 2 else {})}
        )
    facts = rec._rewards.facts()
    first, last = facts["first"], facts["last"]
    assert facts["window"] == REWARD_WINDOW == 5
    assert first["at_rollouts"] == [1, 2, 3, 4, 5] and last["at_rollouts"] == [8, 9, 10, 11, 12]
    # First window 1, 3, 2, 4, 5: mean 3, sample variance 10/4, standard error √(2.5/5).
    assert first["mean"]["critic/rewards/mean"] == 3.0
    assert first["standard_error"]["critic/rewards/mean"] == math.sqrt(2.5 / 5)
    assert first["mean"]["critic/rewards/c/mean"] == -11 / 3  # rollouts 3 to 5 only
    # Last window 6, 2.5, 8, 9, 10: mean 7.1, Σ(x − m)² = 35.2 (a few float64 roundings: 2^-50 relative).
    assert last["mean"]["critic/rewards/mean"] == pytest.approx(7.1, rel=2**-52)  # fsum, one division
    assert last["standard_error"]["critic/rewards/mean"] == pytest.approx(math.sqrt(35.2 / 4 / 5), rel=2**-50)
    # A resume carries both windows on: the same facts after the card's round trip.
    again = RunCardRecorder()
    again._rewards = type(rec._rewards).restore(facts)
    assert again._rewards.facts() == facts
    page = model_card({"trust": {"rewards": facts}}).text
    assert "3 ± 0.707 over rollouts 1–5 (5) -> 7.1 ± 1.33 over rollouts 8–12 (5)" in page
    assert "not a held-out gain" in page and "share rollouts" not in page
    # Fewer rollouts than two windows: the page says that the ends share rollouts; one rollout has no spread.
    short = RunCardRecorder()
    short._rewards.add(1, {"critic/rewards/mean": 2.0})
    page = model_card({"trust": {"rewards": short._rewards.facts()}}).text
    assert "2 (one rollout: no spread) over rollouts 1–1 (1)" in page and "share rollouts" in page
    # A card of the earlier format (one rollout at each end) still renders, and shows no trend.
    earlier = {"first": {"at_rollout": 1, "values": {}}, "last": {"at_rollout": 9, "values": {}}}
    assert "not a trend, not shown" in model_card({"trust": {"rewards": earlier}}).text


def test_the_module_adds_the_recorder_to_a_trainer_built_by_hand(
    tiny_sd3_path: str, prompt_file: str, tmp_path: Path
) -> None:
    """FlowGRPOModule.configure_callbacks: a hand-built Trainer without a recorder gets one (its
    checkpoint holds the card); one with a recorder of its own (a subclass here) keeps that one only."""
    from lit_flowgrpo.callbacks import RunCardRecorder

    plain = _fit_card(tiny_sd3_path, prompt_file, tmp_path / "plain", devices=1, max_steps=1)
    assert plain["trained"]["rollouts"] == 1 and plain["trust"]["on_policy_ratio_error"]["rollouts"] == 1

    class Mine(RunCardRecorder):
        pass

    mine = Mine()
    trainer = _fit_card(tiny_sd3_path, prompt_file, tmp_path / "mine", 1, max_steps=1, recorder=mine)
    assert [c for c in trainer.callbacks if isinstance(c, RunCardRecorder)] == [mine]


def test_not_measured_is_a_sentence_not_a_number() -> None:
    assert not is_measured(not_measured("validation did not run"))
    assert is_measured(0.0) and is_measured({"last": 1.0}) and is_measured("a policy name")


# --------------------------------------------------------------------------------------------------
# Helpers: the run's own records
# --------------------------------------------------------------------------------------------------


def _rows(*folders: Path) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = []
    for folder in folders:
        with open(folder / "metrics.csv") as f:
            rows += list(csv.DictReader(f))
    return rows


def _column(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key)]


def _is_reward_mean(key: str) -> bool:
    return key.startswith("critic/rewards/") and key.endswith("/mean")


def _last_row_with(rows: list[dict[str, str]], key: str) -> dict[str, str]:
    return [r for r in rows if r.get(key)][-1]


def _check_series(facts: dict[str, Any], values: list[float]) -> None:
    """The card's last / max / mean of a per-rollout key against the logged values (the card holds
    each value as logged; only the mean is summed, in float64 on both sides, in the same order)."""
    assert facts["rollouts"] == len(values) and facts["nonfinite_rollouts"] == 0
    assert facts["last"] == values[-1] and facts["max"] == max(values)
    assert facts["mean"] == pytest.approx(sum(values) / len(values), rel=1e-15)


def _export(config: Path, out: Path, *extra: str) -> dict[str, Any]:
    main(["export", "--config", str(config), "--ckpt_path", "last", "--out", str(out), *extra])
    return read_card(str(out))


def _checkpoint_card(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)[CHECKPOINT_KEY]


# --------------------------------------------------------------------------------------------------
# The shortened quickstart: every measured field
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_quickstart_export_carries_its_paired_gain_and_every_field_matches_the_logs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = load_shipped("quickstart")
    callbacks = config["trainer"]["callbacks"]
    (report,) = [c for c in callbacks if c["class_path"].endswith("HeldOutReport")]
    report["init_args"] = {"proxy": "shapes/partial"}  # a tracked "proxy": its gap to strict is measured
    callbacks.insert(0, {"class_path": "lit_flowgrpo.callbacks.OverOptimizationMonitor"})
    recipe = tmp_path / "quickstart.yaml"
    recipe.write_text(yaml.safe_dump(config))
    # Two rollouts, one validation after them (and the base model's before), 8 held-out prompts x 2
    # seeds: 16 paired samples, and two seeds per prompt for the diversity.
    cli = FlowGRPOCLI(
        args=[
            "fit",
            "--config",
            str(recipe),
            "--trainer.max_steps=2",
            "--trainer.val_check_interval=2",
            f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--data.init_args.prompts_per_step=2",
            "--data.init_args.group_size=4",
            "--data.init_args.max_val_prompts=8",
            "--data.init_args.val_seeds=2",
            "--data.init_args.val_batch_size=16",
            "--model.init_args.update.micro_batch_size=8",
        ]
    )
    printed = capsys.readouterr().out
    (run,) = tmp_path.glob("quickstart/version_0")
    card = _export(run / "config.yaml", tmp_path / "exported", "--license=apache-2.0")
    metadata = card.pop("metadata")
    export = card.pop("export")
    saved = yaml.safe_load((run / "config.yaml").read_text())
    rows = _rows(run)
    trained, trust = card["trained"], card["trust"]

    # The Hub's metadata: no base_model (the toy's shipped weights are on no Hub), the license given.
    assert metadata["library_name"] == "diffusers" and metadata["license"] == "apache-2.0"
    assert metadata["pipeline_tag"] == "text-to-image"
    assert "base_model" not in metadata
    assert {"lit-flowgrpo", "diffusionnft", "full-fine-tune", "text-to-image"} <= set(metadata["tags"])

    # What was trained: the run's saved config.
    model = saved["model"]["init_args"]
    assert trained["module"] == "lit_flowgrpo.module.FlowGRPOModule"
    assert trained["base_model"] == {
        "policy": "lit_flowgrpo.toy.policy.ToyPolicy",
        "pretrained": None,
        "modality": "image",
    }
    assert trained["objective"]["class_path"] == model["objective"]["class_path"]
    assert trained["objective"]["init_args"] == model["objective"]["init_args"]
    assert trained["reward"]["weights"] == model["reward"]["init_args"]["weights"]
    assert trained["weights"] == model["weights"]
    assert trained["kl"]["coef"] == model["kl"]["coef"] and trained["kl"]["reference"]["copy"] is True
    assert trained["settings"]["update"] == model["update"]
    optimizer = model["optimizer"]["init_args"]
    assert trained["optimizer"]["class"] == "torch.optim.adamw.AdamW"
    assert (trained["optimizer"]["lr"], trained["optimizer"]["weight_decay"]) == (
        optimizer["lr"],
        optimizer["weight_decay"],
    )
    seeds = {
        "seed_everything": saved["seed_everything"],
        "module": model["seed"],
        "data": saved["data"]["init_args"]["seed"],
    }
    assert trained["seeds"] == seeds
    # Progress: the rollouts and images the logs count, the steps the checkpoint holds.
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    assert trained["rollouts"] == len(_column(rows, "critic/rewards/mean")) == 2
    assert trained["optimizer_steps"] == export["optimizer_steps"] == torch.load(ckpt)["global_step"] == 2
    assert trained["samples_generated"] == sum(_column(rows, "perf/total_num_images")) == 16
    assert trained["measured_from_rollout"] == 0
    (session,) = card["sessions"]
    assert session["resumed_from"] is None and session["at_rollout"] == session["at_optimizer_step"] == 0
    assert session["versions"]["torch"] == torch.__version__
    assert (session["hardware"]["accelerator"], session["hardware"]["world_size"]) == ("cpu", 1)
    assert export["checkpoint"] == str(ckpt) and export["weights"] == "the trained weights"

    # The paired held-out gain, re-derived from the per-sample verdicts HeldOutReport kept of the two
    # evaluations; the tuned ones are also the table the sample logger wrote (it skips the sanity
    # check, so the base model's verdicts have no table), and both average to the logged means.
    (report,) = [c for c in cli.trainer.callbacks if isinstance(c, HeldOutReport)]
    base, tuned = report.base_values, report.last_values
    table = json.loads((run / "images" / "val_samples_table_step0000001.json").read_text())
    column = table["columns"].index("shapes/strict")
    assert [r[column] for r in table["data"]] == tuned.tolist()
    diff = tuned - base  # (16,) float64 verdicts of 0 or 1
    (held,) = trust["held_out"]
    assert (held["component"], held["after_rollouts"], held["paired_samples"]) == ("shapes/strict", 2, 16)
    assert (held["base_samples"], held["tuned_samples"]) == (16, 16)
    # Means of 16 verdicts of 0 or 1: exact in float64 whatever the order of the sums.
    assert (held["base"], held["tuned"], held["gain"]) == (
        float(base.mean()),
        float(tuned.mean()),
        float(diff.mean()),
    )
    assert held["standard_error"] == pytest.approx(float(diff.std() / 4), rel=1e-12)  # s/√16
    strict = _column(rows, "val-core/shapes/strict/mean@1")  # HeldOutReport's base at 0, then the tuned
    assert (strict[0], strict[-1]) == (held["base"], held["tuned"])
    line = (
        f"held-out strict accuracy: {held['base']:.3f} -> {held['tuned']:.3f} "
        f"({held['gain']:+.3f} ± {held['standard_error']:.3f}, 16 paired samples; the base model -> after 2 rollouts)"
    )
    assert line in printed
    readme = (tmp_path / "exported" / "README.md").read_text()
    shown = f"{held['gain']:+.3f} ± {held['standard_error']:.3f}, 16 paired samples"
    assert (
        f"| held-out shapes/strict (paired gain) | {held['base']:.3f} -> {held['tuned']:.3f} ({shown}"
        in readme
    )

    # The proxy's gap to gold, as logged for the base model (by HeldOutReport, at step 0) and after.
    (gap,) = trust["proxy_gap"]
    assert (gap["proxy"], gap["gold"], gap["at_rollout"]) == ("shapes/partial", "shapes/strict", 2)
    logged_gap = _column(rows, "val-aux/shapes/partial_gap/mean@1")
    # The card holds HeldOutReport's float64 means; the logger got the base one as float64 too, and the
    # last one through Lightning's logging, as fp32 (one rounding: 2^-24 relative).
    assert (len(logged_gap), gap["base"]) == (2, logged_gap[0])
    assert gap["last"] == pytest.approx(logged_gap[-1], rel=2**-23)

    # Diversity and drift, as the last validation logged them.
    last = _last_row_with(rows, "val-aux/drift")
    assert trust["diversity"] == {"value": float(last["val-aux/diversity"]), "at_rollout": 2}
    assert trust["drift"] == {"value": float(last["val-aux/drift"]), "at_rollout": 2}
    assert trust["drift"]["value"] > 0  # two rollouts moved the samples from the base model's

    # The KL term to the (frozen, initial) reference; DiffusionNFT has no ratio to check on-policy.
    assert trust["kl_to_reference"]["reference"] == "the base model (the initial weights)"
    _check_series(trust["kl_to_reference"], _column(rows, "actor/kl_loss"))
    assert trust["on_policy_ratio_error"].startswith("not measured: the objective logs no importance ratio")
    # Nothing logged for it either: a 0 would read as a check that passed.
    assert not _column(rows, "actor/on_policy_ratio_err") and not _column(rows, "actor/ratio_mean")

    # Validation: the base model's (Lightning's sanity check; HeldOutReport logs its tally at step 0,
    # an fp32 mean here, float64 there) and the last evaluation's, key for key as logged.
    validation = trust["validation"]
    assert validation["base"]["at_rollout"] == 0 and validation["base"]["samples"] == 16
    first = next(r for r in rows if r.get("val-core/shapes/strict/mean@1"))
    for key in ("val-core/shapes/strict/mean@1", "val-aux/shapes/partial/mean@1"):
        assert validation["base"]["values"][key] == pytest.approx(float(first[key]), rel=1e-6)
    # The base model's accuracy per prompt family, as HeldOutReport logged it at step 0.
    families = {
        k: float(v) for k, v in first.items() if k.count("/") == 4 and k.startswith("val-aux/shapes/strict/")
    }
    assert families, sorted(first)
    for key, value in families.items():
        assert validation["base"]["values"][key] == pytest.approx(value, rel=1e-6), key
    tuned_row = _last_row_with(rows, "val-aux/shapes/strict/unscored_count")
    logged = {k: float(v) for k, v in tuned_row.items() if k.startswith(("val-core/", "val-aux/")) and v}
    assert validation["last"] == {"at_rollout": 2, "samples": 16, "values": logged}

    # The rollouts' rewards (2 rollouts: both windows hold both), and the counters as last logged.
    reward_rows = [r for r in rows if r.get("critic/rewards/mean")]
    logged = [
        {
            "at_rollout": i + 1,
            "values": {k: float(v) for k, v in r.items() if _is_reward_mean(k) and v},
        }
        for i, r in enumerate(reward_rows)
    ]
    for which in ("first", "last"):
        window = trust["rewards"][which]
        assert window["rollouts"] == logged and window["at_rollouts"] == [1, 2]
        xs = [e["values"]["critic/rewards/mean"] for e in logged]
        assert window["mean"]["critic/rewards/mean"] == math.fsum(xs) / 2  # the same sum, the same order
    counters = ("actor/dropped_samples", "actor/nonfinite_losses", "actor/skipped_optimizer_steps")
    assert trust["counters"] == {k: int(float(reward_rows[-1][k])) for k in counters}

    # The checkpoint holds the same card as plain data (a weights-only load).
    assert _checkpoint_card(ckpt) == card


# --------------------------------------------------------------------------------------------------
# The tiny SD3 run, resumed once: the on-policy ratio error, sessions, and what it cannot measure
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_resumed_lora_run_carries_its_sessions_and_says_what_it_did_not_measure(
    tiny_sd3_path: str, tmp_path: Path
) -> None:
    FlowGRPOCLI(args=tiny_fit_args(tiny_sd3_path, tmp_path))  # one rollout of 2 optimizer steps
    first = _checkpoint_card(tmp_path / "checkpoints" / "last.ckpt")
    FlowGRPOCLI(args=[*tiny_fit_args(tiny_sd3_path, tmp_path), "--trainer.max_steps=4", "--ckpt_path=last"])
    runs = sorted(tmp_path.glob("lightning_logs/version_*"))
    assert len(runs) == 2
    card = _export(runs[-1] / "config.yaml", tmp_path / "exported")
    metadata, export = card.pop("metadata"), card.pop("export")
    rows = _rows(*runs)
    trained, trust = card["trained"], card["trust"]

    assert {"lit-flowgrpo", "flowgrpo", "lora"} <= set(metadata["tags"])
    assert "base_model" not in metadata and "license" not in metadata  # a local folder; none given
    assert trained["weights"]["lora"]["rank"] == 4 and trained["weights"]["lora"]["alpha"] == 8
    # The adapter as peft applied it: the policy's default targets where the config left null.
    assert trained["weights"]["lora"]["target_modules"] is None
    adapter = trained["weights"]["adapter"]
    assert (adapter["r"], adapter["lora_alpha"]) == (4, 8) and "attn.to_q" in adapter["target_modules"]
    assert export["weights"] == "the EMA of the trained weights"  # tiny_sd3.yaml keeps an EMA
    assert (trained["rollouts"], trained["optimizer_steps"]) == (2, 4)
    assert trained["samples_generated"] == sum(_column(rows, "perf/total_num_images"))

    # Two sessions: the first from the base model, the second from the first's last checkpoint.
    assert first["sessions"] == card["sessions"][:1]
    resumed = card["sessions"][1]
    assert Path(resumed["resumed_from"]).parent == tmp_path / "checkpoints"
    assert (resumed["at_rollout"], resumed["at_optimizer_step"]) == (1, 2)
    assert trained["measured_from_rollout"] == 0  # the first checkpoint had a card: nothing was missed

    # Measured over both sessions, as both logged them.
    _check_series(trust["on_policy_ratio_error"], _column(rows, "actor/on_policy_ratio_err"))
    assert trust["on_policy_ratio_error"]["max"] < 1e-6  # fp32 throughout: the check's tolerance
    _check_series(trust["kl_to_reference"], _column(rows, "actor/kl_loss"))
    assert trust["kl_to_reference"]["reference"] == "the base model (the initial weights)"

    # What this run had no source for, each saying why.
    assert trust["validation"]["base"].startswith("not measured: the base model was not validated")
    assert "--trainer.num_sanity_val_steps=-1" in trust["validation"]["base"]
    assert "HeldOutSource" in trust["held_out"]
    for key in ("proxy_gap", "diversity", "drift"):
        assert not is_measured(trust[key])
    assert all(math.isfinite(v) for v in trust["validation"]["last"]["values"].values())


# --------------------------------------------------------------------------------------------------
# Two ranks: the card counts every rank's samples once and agrees with one process
# --------------------------------------------------------------------------------------------------


def _fit_card(
    pretrained: str, prompts: str, folder: Path, devices: int, max_steps: int = 2, recorder: Any = None
) -> Any:
    """``max_steps`` rollouts of 8 samples (2 prompts x 4) on ``devices`` CPU ranks, the Trainer built by
    hand with no run-card recorder (the module adds one) or with ``recorder``: the card of the last
    checkpoint, or the Trainer when ``recorder`` is given."""
    import lightning as L
    from ddp_helpers import CloseProcessGroup
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_flowgrpo import FlowGRPOModule, KLSettings, PromptDataModule, Sampler, UpdateSettings
    from lit_flowgrpo.callbacks import FinalCheckpoint
    from lit_flowgrpo.policies import SD3Policy

    module = FlowGRPOModule(
        policy=SD3Policy(pretrained, dtype="float32", max_sequence_length=16),
        reward={"jpeg_compressibility": 1.0},  # a registered name: ddp_spawn pickles the module
        sampler=Sampler(num_steps=3, eval_num_steps=2, height=32, width=32),
        update=UpdateSettings(micro_batch_size=2, optimizer_steps_per_rollout=1),
        kl=KLSettings(coef=0.04),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp_spawn" if devices > 1 else "auto",
        callbacks=[
            *([recorder] if recorder is not None else []),
            FinalCheckpoint(),
            ModelCheckpoint(dirpath=folder, save_last=True),
            CloseProcessGroup(),
        ],
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, datamodule=PromptDataModule(train=prompts, prompts_per_step=2, group_size=4, seed=5))
    return trainer if recorder is not None else _checkpoint_card(folder / "last.ckpt")


@pytest.mark.slow
def test_two_ranks_count_every_sample_once(tiny_sd3_path: str, prompt_file: str, tmp_path: Path) -> None:
    import os

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    one = _fit_card(tiny_sd3_path, prompt_file, tmp_path / "one", devices=1)
    two = _fit_card(tiny_sd3_path, prompt_file, tmp_path / "two", devices=2)
    for card in (one, two):
        assert (card["trained"]["rollouts"], card["trained"]["samples_generated"]) == (2, 16)
    assert [s["hardware"]["world_size"] for s in one["sessions"] + two["sessions"]] == [1, 2]
    # The module logs the same values on every rank (the on-policy error and the KL reduced over
    # ranks), so the card of rank 0 holds what any rank saw: checked here against one process only for
    # presence and count; their values differ by the ranks' summation order (tests/test_ddp.py).
    for key in ("on_policy_ratio_error", "kl_to_reference"):
        assert one["trust"][key]["rollouts"] == two["trust"][key]["rollouts"] == 2
