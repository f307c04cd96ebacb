"""The shipped reward-server recipe end to end: ``lit-flowgrpo serve-reward --config reward_server/shapes``
in a process of its own on 127.0.0.1, the quickstart recipe that trains against it, and the server killed
in the middle of the run."""

from __future__ import annotations

import json
import re
import select
import subprocess
import sys
import urllib.request
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from lit_flowgrpo.cli import FlowGRPOCLI
from lit_flowgrpo.rewards.images import to_uint8
from lit_flowgrpo.rewards.remote import RemoteRewardError
from lit_flowgrpo.toy.reward import ShapesReward

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "lit_flowgrpo" / "configs" / "reward_server_quickstart.yaml"


class KillAfter(L.Callback):
    """Records each rollout's rewards, the in-process reward of its images, and its logged failure rate;
    kills the server after rollout ``after``."""

    def __init__(self, server: subprocess.Popen, url: str, after: int) -> None:
        self.server, self.url, self.after = server, url, after
        self.rows: list[dict] = []
        self.health: dict = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        images = to_uint8(outputs["images"]).float() / 255  # what the server decoded from the PNGs
        local = ShapesReward()(images, list(batch.prompts), list(batch.metadata))
        self.rows.append(
            {
                "rewards": outputs["rewards"].cpu(),
                "local": local["strict"] + 0.5 * local["partial"],
                "advantages": outputs["advantages"].cpu(),
                "keep": outputs["keep"].cpu(),
                "failure_rate": float(trainer.callback_metrics["reward/failure_rate"]),
                "dropped": pl_module.counters.values["dropped_samples"],
            }
        )
        if batch_idx == self.after:
            with urllib.request.urlopen(f"{self.url}/health", timeout=30) as response:
                self.health = json.loads(response.read())
            self.server.kill()  # SIGKILL: no goodbye to the clients
            self.server.wait()


@pytest.mark.slow
def test_the_recipe_trains_against_a_served_reward_and_counts_the_loss_when_it_dies(tmp_path: Path) -> None:
    # stderr to a file: a pipe nobody reads would block the server once 64 KiB of warnings filled it
    errors = (tmp_path / "server.err").open("w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lit_flowgrpo.cli",
            "serve-reward",
            "--config",
            "reward_server/shapes",
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=errors,
        text=True,
    )
    try:
        # The address is printed once it listens; a server that hangs on start fails the test, not CI.
        # 300 s: it imports torch and the package, 10-20 s on a loaded 2-core machine.
        assert select.select([server.stdout], [], [], 300)[0], "serve-reward printed nothing in 300 s"
        line = server.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert found, (line, (tmp_path / "server.err").read_text())
        url = found[0]
        cfg = yaml.safe_load(RECIPE.read_text())
        trainer, model, data = cfg["trainer"], cfg["model"]["init_args"], cfg["data"]["init_args"]
        trainer.update(
            max_steps=6,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            enable_progress_bar=False,
            enable_checkpointing=False,
            callbacks=[],
            default_root_dir=str(tmp_path),
            logger={
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(tmp_path)},
            },
        )
        served = model["reward"]["init_args"]["config"]["served"]
        served.update(url=url, max_retries=1, backoff_s=0.0, timeout_s=30.0, max_consecutive_failures=2)
        model["update"]["micro_batch_size"] = 4
        for key in ("train", "val"):
            data[key] = str((RECIPE.parent / data[key]).resolve())
        data.update(val=None, prompts_per_step=2, group_size=4)
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(cfg))

        cli = FlowGRPOCLI(args=["--config", str(path)], run=False)
        recorder = KillAfter(server, url, after=1)
        cli.trainer.callbacks.append(recorder)
        with pytest.raises(RemoteRewardError, match=re.escape(url)) as stopped:
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        server.stdout.close()
        errors.close()
    assert "failed 2 consecutive batches" in str(stopped.value)
    # Two rollouts scored by the server, in one batch each (8 samples), its values those of the
    # in-process verifier on the images it decoded.
    assert (recorder.health["samples"], recorder.health["batches"]) == (16, 2)
    for row in recorder.rows[:2]:
        torch.testing.assert_close(row["rewards"], row["local"], rtol=0, atol=0)
        assert row["failure_rate"] == 0.0
    # Killed: the third rollout's rewards are NaN, counted as failures and dropped, never a number; the
    # fourth is the second failed batch in a row, which stops the run.
    assert len(recorder.rows) == 3
    lost = recorder.rows[2]
    assert torch.isnan(lost["rewards"]).all() and lost["failure_rate"] == 1.0
    assert not lost["keep"].any() and (lost["advantages"] == 0).all()
    assert lost["dropped"] == recorder.rows[1]["dropped"] + 8
