"""The multi-node launches of the scaling docs, on one machine: two "nodes" of one CPU rank each,
started by torchrun and (as srun would) with SLURM's variables. Each rank reports what Lightning read."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = str(Path(__file__).with_name("launch_probe.py"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(commands: list[list[str]], envs: list[dict[str, str]]) -> None:
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cmd, env in zip(commands, envs, strict=True)
    ]
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-4000:]


def reports(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def clean_env() -> dict[str, str]:
    drop = (
        "SLURM_",
        "TORCHELASTIC_",
        "LOCAL_RANK",
        "RANK",
        "WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_",
        "NODE_RANK",
    )
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


@pytest.mark.slow
def test_torchrun_two_nodes(tmp_path):
    port = str(free_port())
    commands = [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", f"--node_rank={n}",
         "--master_addr=127.0.0.1", f"--master_port={port}", PROBE, str(tmp_path), "2", "1"]
        for n in range(2)
    ]  # fmt: skip
    launch(commands, [clean_env(), clean_env()])
    for rank, report in enumerate(reports(tmp_path)):
        assert report["environment"] == "TorchElasticEnvironment"
        assert (report["global_rank"], report["node_rank"], report["local_rank"]) == (rank, rank, 0)
        assert report["world_size"] == 2 and report["num_nodes"] == 2 and report["mesh"] == [2, 1]
        assert report["rank_sum"] == 1.0  # the all-reduce spans both "nodes"


@pytest.mark.slow
def test_slurm_two_nodes(tmp_path):
    job_id = "4" + str(free_port() % 10000).zfill(4)  # Lightning's port is 15000 + the last 4 digits
    envs = []
    for n in range(2):
        env = clean_env()
        env.update(
            SLURM_JOB_ID=job_id, SLURM_JOB_NAME="probe", SLURM_NNODES="2", SLURM_NTASKS="2",
            SLURM_NTASKS_PER_NODE="1", SLURM_NODELIST="127.0.0.1", SLURM_PROCID=str(n), SLURM_LOCALID="0",
            SLURM_NODEID=str(n),
        )  # fmt: skip
        envs.append(env)
    launch([[sys.executable, PROBE, str(tmp_path), "2", "1"]] * 2, envs)
    for rank, report in enumerate(reports(tmp_path)):
        assert report["environment"] == "SLURMEnvironment"
        assert (report["global_rank"], report["node_rank"], report["local_rank"]) == (rank, rank, 0)
        assert report["world_size"] == 2 and report["mesh"] == [2, 1]
        assert report["main_address"] == "127.0.0.1"
        assert report["main_port"] == 15000 + int(job_id[-4:])
        assert report["rank_sum"] == 1.0
