"""Sequence parallelism (diffusers' context parallelism) for Wan image-to-video on CPU processes (gloo):
two ranks splitting each sample's tokens against one process, as tests/test_sequence_parallel.py checks
Wan text-to-video, with the tolerances it derives there (its docstring)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import wan_i2v_sp_worker
from test_sequence_parallel import check_equal, finish
from test_wan_i2v import first_frames
from tolerances import depth, network_atol, sum_rtol

from lit_flowgrpo.policies.wan_i2v import WanImageToVideoPolicy
from lit_flowgrpo.tiny.wan_i2v import build_tiny_wan_i2v

WORKER = str(Path(wan_i2v_sp_worker.__file__))


def _torchrun(config: dict, tmp: Path, name: str, procs: int) -> subprocess.Popen:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(dict(config, out=str(tmp / name), devices=procs)))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={procs}",
        WORKER,
        str(path),
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# slow: one run of two processes beside one in-process run, each two rollouts (about a minute on 2 cores)
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["2.1", "ti2v"])
def test_two_ranks_splitting_each_sample_equal_one_process(tmp_path: Path, variant: str) -> None:
    """sp = 2 under DDP: the same rollouts, rewards, advantages, metrics and LoRA weights after two SGD
    steps as one process. sp_worker's run draws 2 records x 4 at 32 x 32 px, 5 frames. Wan 2.1: the first
    frame's CLIP states and mask + latent channels in every forward, 2 x 2 x 2 = 8 tokens, 4 a rank.
    TI2V: 2 x 1 x 1 tokens (16x VAE), the given frame's on one rank and the generated frame's on the
    other, each with its own timestep (0 and σ·1000: diffusers splits the per-token timesteps too)."""
    pipeline = build_tiny_wan_i2v(tmp_path / "tiny", variant)
    prompts = first_frames(tmp_path / "data", n=2, size=(32, 32))
    config = dict(pipeline=pipeline, prompts=prompts)
    proc = _torchrun(dict(config, sp=2, strategy="ddp"), tmp_path, "ddp_sp2", 2)
    wan_i2v_sp_worker.run(dict(config, sp=1, out=str(tmp_path / "single")))
    finish(proc)
    policy = WanImageToVideoPolicy(pipeline, dtype="float32", max_sequence_length=16)
    policy.load()
    # tests/test_sequence_parallel.py's reward_atol: latents 4 ulps apart through the decoder, then the mean.
    atol = network_atol(4 + depth(policy.vae.decoder), 1.0) + sum_rtol(3 * 5 * 32 * 32)
    check_equal(tmp_path / "single", tmp_path / "ddp_sp2", ranks=2, reward_atol=atol)
