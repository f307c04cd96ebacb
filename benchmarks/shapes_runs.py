"""Side-by-side learning runs on the shapes world, and the table and picture they make.

Runs many ``lit-flowgrpo fit`` jobs of the shapes world at once (a plan: labels x seeds), each in its
own folder with the CSV logger, then reads back held-out strict accuracy against rollouts:

    # the four objectives, 3 seeds each, side by side on one GPU
    python benchmarks/shapes_runs.py run --plan objectives --seeds 0 1 2 --accelerator cuda \
        --parallel 12 --out runs/objectives
    # what one rollout of each costs on this machine (CPU, one run at a time, no validation)
    python benchmarks/shapes_runs.py run --plan objectives --seeds 0 --rollouts 4 --val_every 0 \
        --parallel 1 --out runs/objectives_timing
    python benchmarks/shapes_runs.py report runs/objectives --timing runs/objectives_timing \
        --json benchmarks/results/shapes_objectives.json --plot docs/objective_comparison.png

``report`` prints one table row per label: held-out strict accuracy at each evaluation (mean over
seeds, with the seeds' spread), the gain reached within ``--minutes`` of the timing machine (base and
final evaluations included, from the timing runs' seconds per rollout and per evaluated sample), and
the paired standard error of each run's gain (the same held-out prompts and seeds before and after).

The runs' wall times are not a speed measurement when they share a machine: only ``--timing`` runs,
made one at a time on the machine to be described, are.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

LR = "--model.init_args.optimizer.init_args.lr="
NFT = "--model.init_args.objective.init_args."

# label -> (config, overrides). Every plan evaluates the same held-out metric: 250 held-out prompts x
# --val_seeds seeds (4: 1000 samples) at 10 ODE steps. The plans up to "hacking" ran before 2026-11-28
# on the base shipped then (git history: the 500-step toy_base.safetensors) at guidance 3, when
# configs/quickstart.yaml was Flow-GRPO (now quickstart_flowgrpo.yaml) and DiffusionNFT's quickstart
# was quickstart_nft.yaml (now quickstart.yaml, with lr 3e-5 and a CFG-free evaluation): they name
# today's files, so they run on today's base and settings. "room" is the round that chose today's.
PLANS: dict[str, dict[str, tuple[str, list[str]]]] = {
    "objectives": {
        "flow_grpo": ("configs/quickstart_flowgrpo.yaml", []),
        "grpo_guard": ("configs/quickstart_guard.yaml", []),
        "flow_dppo": ("configs/quickstart_dppo.yaml", []),
        "diffusion_nft": ("configs/quickstart.yaml", []),
    },
    # Levers for learning within 15 minutes of a 2-core CPU: a larger step, fewer update visits, smaller
    # rollouts. Each changes one or two settings of the quickstart's objective configs.
    "levers": {
        "flow_grpo_lr3e-5": ("configs/quickstart_flowgrpo.yaml", [LR + "3e-5"]),
        "flow_grpo_lr3e-5_p4": (
            "configs/quickstart_flowgrpo.yaml",
            [LR + "3e-5", "--data.init_args.prompts_per_step=4"],
        ),
        "grpo_guard_lr3e-5": ("configs/quickstart_guard.yaml", [LR + "3e-5"]),
        "flow_dppo_lr3e-5": ("configs/quickstart_dppo.yaml", [LR + "3e-5"]),
        "nft_lr5e-6": ("configs/quickstart.yaml", [LR + "5e-6"]),
        "nft_lr3e-5": ("configs/quickstart.yaml", [LR + "3e-5"]),
        "nft_tf0.3": ("configs/quickstart.yaml", [NFT + "visit_fraction=0.3"]),
        "nft_lr3e-5_tf0.3": ("configs/quickstart.yaml", [LR + "3e-5", NFT + "visit_fraction=0.3"]),
        # DiffusionNFT's claim is a better CFG-free model: the held-out metric at guidance 1 (its base is lower)
        "nft_eval_cfg1": (
            "configs/quickstart.yaml",
            ["--model.init_args.sampler.eval_guidance_scale=1.0"],
        ),
    },
}

SAMPLER = "--model.init_args.sampler."
# Second round of levers, around the first round's best (the quickstart's lr; larger ones overshoot).
PLANS["levers2"] = {
    "flow_grpo_lr2e-5": ("configs/quickstart_flowgrpo.yaml", [LR + "2e-5"]),
    "flow_grpo_noise1.0": ("configs/quickstart_flowgrpo.yaml", [SAMPLER + "noise_level=1.0"]),
    "flow_grpo_strict_only": (
        "configs/quickstart_flowgrpo.yaml",
        ['--model.init_args.reward.init_args.weights={"shapes/strict": 1.0}'],
    ),
    "flow_grpo_g16p4": (
        "configs/quickstart_flowgrpo.yaml",
        ["--data.init_args.group_size=16", "--data.init_args.prompts_per_step=4"],
    ),
    "flow_grpo_window10": (
        "configs/quickstart_flowgrpo.yaml",
        [SAMPLER + "sde_window_size=10", SAMPLER + "sde_window_range=[0,10]"],
    ),
    "flow_grpo_window2": ("configs/quickstart_flowgrpo.yaml", [SAMPLER + "sde_window_size=2"]),
    "grpo_guard_noise1.0": ("configs/quickstart_guard.yaml", [SAMPLER + "noise_level=1.0"]),
    "nft_lr5e-6_tf0.3": ("configs/quickstart.yaml", [LR + "5e-6", NFT + "visit_fraction=0.3"]),
    "nft_lr1e-5": ("configs/quickstart.yaml", [LR + "1e-5"]),
    "nft_lr5e-6_beta0.1": ("configs/quickstart.yaml", [LR + "5e-6", NFT + "beta=0.1"]),
}

# Room to learn (2026-11-28): on the 1000-step base, DiffusionNFT's levers for learning per CPU-minute,
# each from configs/quickstart.yaml's objective with the former lr 1.5e-5 unless it names its own; the
# main job's settings are "nft_lr3e-5". Run side by side on one H200, 3 seeds of the chosen ones:
# benchmarks/results/shapes_room_to_learn_H200.json.
_NFT_KL0 = ["--model.init_args.kl.coef=0.0", "--model.init_args.kl.reference.copy=false"]
_NFT_CHEAP = [NFT + "visit_fraction=0.3", *_NFT_KL0, "--model.init_args.advantage.filter_zero=true"]
PLANS["room"] = {
    "nft_lr1.5e-5": ("configs/quickstart.yaml", [LR + "1.5e-5"]),
    "nft_lr3e-5": ("configs/quickstart.yaml", [LR + "3e-5"]),
    "nft_vf0.3": ("configs/quickstart.yaml", [LR + "1.5e-5", NFT + "visit_fraction=0.3"]),
    "nft_vf0.5": ("configs/quickstart.yaml", [LR + "1.5e-5", NFT + "visit_fraction=0.5"]),
    "nft_lr3e-5_vf0.5": ("configs/quickstart.yaml", [LR + "3e-5", NFT + "visit_fraction=0.5"]),
    "nft_kl0": ("configs/quickstart.yaml", [LR + "1.5e-5", *_NFT_KL0]),
    "nft_filter_zero": (
        "configs/quickstart.yaml",
        [LR + "1.5e-5", "--model.init_args.advantage.filter_zero=true"],
    ),
    "nft_cheap": ("configs/quickstart.yaml", [LR + "1.5e-5", *_NFT_CHEAP]),
    "nft_cheap_lr5e-5": ("configs/quickstart.yaml", [LR + "5e-5", *_NFT_CHEAP]),
    "flow_grpo": ("configs/quickstart_flowgrpo.yaml", []),
    "grpo_guard": ("configs/quickstart_guard.yaml", []),
    "flow_dppo": ("configs/quickstart_dppo.yaml", []),
}

# Reward hacking: trained on the gameable colour proxy, judged by the strict verifier (gold).
TWO = '--model.init_args.reward.init_args.weights={"shapes_color": 1.0, "shapes/partial": 1.0, "shapes/strict": 0.0}'
PLANS["hacking"] = {
    "flow_grpo_proxy": ("configs/hacking_proxy.yaml", []),
    "grpo_guard_proxy": (
        "configs/hacking_proxy.yaml",
        [
            "--model.init_args.objective=lit_flowgrpo.objective.GRPOGuard",
            "--model.init_args.objective.init_args.clip_range=1e-5",
        ],
    ),
    "sum_proxy_partial": ("configs/hacking_proxy.yaml", [TWO]),
    "gdpo_proxy_partial": (
        "configs/hacking_proxy.yaml",
        [TWO, "--model.init_args.advantage.aggregation=gdpo", "--model.init_args.advantage.std=group"],
    ),
}
# GARDO's controls (configs/hacking_gardo.yaml) beside Flow-GRPO with a plain KL to the initial model, and
# Flow-GRPO with the KL only measured (its curve); a sweep of β first (one seed), then the chosen β on 3.
OBJ = "--model.init_args.objective.init_args."
KL_GROUP = "--model.init_args.kl."
MEASURE_KL = [KL_GROUP + "measure=true", KL_GROUP + "reference.copy=true"]
PLAIN_KL = [KL_GROUP + "reference.copy=true"]
JUDGED = '--model.init_args.reward.init_args.weights={"shapes_color": 1.0, "shapes/partial": 0.0, "shapes/strict": 0.0}'
GATE = KL_GROUP + 'gate={"proxy": "shapes_color", "auxiliary": ["shapes/partial"]}'
BONUS = '--model.init_args.advantage.diversity_bonus={"pool": 8, "distance": "cosine"}'
PLANS["gardo_sweep"] = {
    "flow_grpo_proxy_klmeasured": ("configs/hacking_proxy.yaml", MEASURE_KL),
    **{
        f"kl{b}_proxy": ("configs/hacking_proxy.yaml", [*PLAIN_KL, KL_GROUP + f"coef={b}"])
        for b in ("0.04", "0.4", "4", "40")
    },
    **{f"gardo_b{b}": ("configs/hacking_gardo.yaml", [KL_GROUP + f"coef={b}"]) for b in ("0.4", "4", "40")},
    "gardo_b4_initial_ref": (
        "configs/hacking_proxy.yaml",
        [*PLAIN_KL, KL_GROUP + "coef=4", JUDGED, GATE, BONUS],
    ),
    "diversity_bonus_only": ("configs/hacking_proxy.yaml", [BONUS]),
}
# The sweep's picks on 3 seeds: the plain KL and GARDO at the β that kept gold, GARDO without its refresh,
# and GARDO at a weaker β (Flow-GRPO itself: the sweep's flow_grpo_proxy_klmeasured, 3 seeds).
# The video world (configs/quickstart_video.yaml): its base checkpoint comes from `fit --config
# configs/toy_video_pretrain.yaml` and is passed after `--` as
# --model.init_args.policy.init_args.pretrained=PATH; 128 held-out clips (16 prompts x --val_seeds 8).
PLANS["video"] = {
    "video_flow_grpo": ("configs/quickstart_video.yaml", []),
    "video_flow_grpo_lr1e-4": ("configs/quickstart_video.yaml", [LR + "1e-4"]),
}
# Why the video world does not learn at the config's settings: step size, trust region, exploration,
# the reward's shape and the group size, each changed alone from lr 2e-4.
_V = "configs/quickstart_video.yaml"
PLANS["video_sweep"] = {
    "v_base": (_V, []),
    "v_lr2e-4": (_V, [LR + "2e-4"]),
    "v_lr5e-4": (_V, [LR + "5e-4"]),
    "v_lr1e-3": (_V, [LR + "1e-3"]),
    "v_lr2e-4_clip1e-2": (_V, [LR + "2e-4", OBJ + "clip_range=1e-2"]),
    "v_lr2e-4_steps2": (_V, [LR + "2e-4", "--model.init_args.update.optimizer_steps_per_rollout=2"]),
    "v_lr2e-4_noise1": (_V, [LR + "2e-4", SAMPLER + "noise_level=1.0"]),
    "v_lr2e-4_strict": (
        _V,
        [LR + "2e-4", "--model.init_args.reward.init_args.weights={shapes_video/strict: 1.0}"],
    ),
    "v_lr2e-4_g16": (
        _V,
        [LR + "2e-4", "--data.init_args.group_size=16", "--data.init_args.prompts_per_step=4"],
    ),
}
# The second round, after the first showed the reward falling once lr >= 2e-4 (while a brightness
# reward rose under the same update): more samples per step, training only the early steps (where
# the motion's direction is drawn), and a KL anchor.
_EARLY = [SAMPLER + "sde_window_size=2", SAMPLER + "sde_window_range=[0,4]"]
_ALL32 = ["--data.init_args.prompts_per_step=32"]
PLANS["video_sweep2"] = {
    "w_lr1e-4_early": (_V, [LR + "1e-4", *_EARLY]),
    "w_lr5e-5_early": (_V, [LR + "5e-5", *_EARLY]),
    "w_lr1e-4_all32": (_V, [LR + "1e-4", *_ALL32]),
    "w_lr3e-5_all32": (_V, [LR + "3e-5", *_ALL32]),
    "w_lr1e-4_all32_early": (_V, [LR + "1e-4", *_ALL32, *_EARLY]),
    "w_lr1e-4_kl": (_V, [LR + "1e-4", KL_GROUP + "coef=0.04", KL_GROUP + "reference.copy=true"]),
    "w_lr2e-4_all32_early": (_V, [LR + "2e-4", *_ALL32, *_EARLY]),
    "w_lr1e-4_early_steps2": (
        _V,
        [LR + "1e-4", *_EARLY, "--model.init_args.update.optimizer_steps_per_rollout=2"],
    ),
    "w_lr2e-5": (_V, [LR + "2e-5"]),
}
# The third round: with a group's initial noise shared, the config's SDE noise (0.7) leaves 38-63% of
# the groups with one outcome (std of the reward 0.07-0.12, against 0.35-0.5 across initial noises): the
# trained steps barely decide the motion. More SDE noise, with and without shared starts.
_SAME = ["--data.init_args.same_initial_noise=true"]
PLANS["video_sweep3"] = {
    "n1.5_lr5e-5": (_V, [SAMPLER + "noise_level=1.5", LR + "5e-5"]),
    "n1.5_lr1e-4": (_V, [SAMPLER + "noise_level=1.5", LR + "1e-4"]),
    "n1.5_lr2e-4": (_V, [SAMPLER + "noise_level=1.5", LR + "2e-4"]),
    "n1.5_same_lr5e-5": (_V, [SAMPLER + "noise_level=1.5", LR + "5e-5", *_SAME]),
    "n1.5_same_lr1e-4": (_V, [SAMPLER + "noise_level=1.5", LR + "1e-4", *_SAME]),
    "n1.5_early_lr1e-4": (_V, [SAMPLER + "noise_level=1.5", LR + "1e-4", *_EARLY]),
    "n1.2_lr1e-4": (_V, [SAMPLER + "noise_level=1.2", LR + "1e-4"]),
    "n2_lr5e-5": (_V, [SAMPLER + "noise_level=2.0", LR + "5e-5"]),
    "n1_same_lr1e-4": (_V, [SAMPLER + "noise_level=1.0", LR + "1e-4", *_SAME]),
}

# From the second base (uniform σ in pretraining, 2000 steps: it follows the named direction in about
# half of its clips): the config, step size, more SDE noise, a strict-only reward, more prompts.
PLANS["video_base2"] = {
    "b2_config": (_V, []),
    "b2_lr3e-5": (_V, [LR + "3e-5"]),
    "b2_lr1e-4": (_V, [LR + "1e-4"]),
    "b2_lr2e-4": (_V, [LR + "2e-4"]),
    "b2_lr1e-4_n1": (_V, [LR + "1e-4", SAMPLER + "noise_level=1.0"]),
    "b2_lr5e-5_strict": (_V, ["--model.init_args.reward.init_args.weights={shapes_video/strict: 1.0}"]),
    "b2_lr1e-4_all32": (_V, [LR + "1e-4", *_ALL32]),
    "b2_lr5e-5_steps2": (_V, ["--model.init_args.update.optimizer_steps_per_rollout=2"]),
    "b2_lr1e-4_early": (_V, [LR + "1e-4", *_EARLY]),
}

# DiffusionNFT on video, from the second base: it trains on the finished clips, so its credit does not
# hinge on the few stochastic steps where the direction is drawn. Beside it, Flow-GRPO with the
# exploration put where the direction is decided (early steps, more noise, shared starts).
_VN = "configs/quickstart_video_nft.yaml"
PLANS["video_nft"] = {
    "nft_config": (_VN, []),
    "nft_lr1.5e-5": (_VN, [LR + "1.5e-5"]),
    "nft_lr1e-4": (_VN, [LR + "1e-4"]),
    "nft_lr2e-4": (_VN, [LR + "2e-4"]),
    "nft_lr5e-5_strict": (_VN, ["--model.init_args.reward.init_args.weights={shapes_video/strict: 1.0}"]),
    "nft_lr1e-4_all32": (_VN, [LR + "1e-4", *_ALL32]),
    "nft_lr5e-5_beta0.1": (_VN, [NFT + "beta=0.1"]),
    "grpo_n1.5_same_early_lr1e-4": (_V, [SAMPLER + "noise_level=1.5", LR + "1e-4", *_SAME, *_EARLY]),
    "grpo_n1.5_early_lr1e-4": (_V, [SAMPLER + "noise_level=1.5", LR + "1e-4", *_EARLY]),
}

# The video plans above ran when configs/quickstart_video.yaml sampled and evaluated at guidance 3 and
# configs/quickstart_video_nft.yaml evaluated at 3 with lr 5e-5: pinned first (an entry's own flags
# come after and win), so that they rerun as recorded.
_AT_G3 = [SAMPLER + "guidance_scale=3.0", SAMPLER + "eval_guidance_scale=3.0"]
_NFT_AS_RUN = [SAMPLER + "eval_guidance_scale=3.0", LR + "5e-5"]
for _plan in ("video", "video_sweep", "video_sweep2", "video_sweep3", "video_base2", "video_nft"):
    PLANS[_plan] = {
        label: (config, [*(_NFT_AS_RUN if config == _VN else _AT_G3), *overrides])
        for label, (config, overrides) in PLANS[_plan].items()
    }

# Guidance: on the video world the on-policy gradient raises the reward of the policy it is taken
# under at guidance 1-2 and not at 3 (measured by stepping along it, README "The shapes world in
# video"), so these sample, train and evaluate at a lower guidance; nft_eval1 judges DiffusionNFT
# (whose rollouts are guidance-free) at 1.
_G = [SAMPLER + "guidance_scale={0}", SAMPLER + "eval_guidance_scale={0}"]


def _guided(scale: float, *more: str) -> list[str]:
    return [o.format(scale) for o in _G] + list(more)


PLANS["video_guidance"] = {
    "g1_lr5e-5": (_V, _guided(1.0)),
    "g1_lr1e-4": (_V, _guided(1.0, LR + "1e-4")),
    "g1_lr2e-4": (_V, _guided(1.0, LR + "2e-4")),
    "g1_lr1e-4_all32": (_V, _guided(1.0, LR + "1e-4", *_ALL32)),
    "g1.5_lr1e-4": (_V, _guided(1.5, LR + "1e-4")),
    "g2_lr1e-4": (_V, _guided(2.0, LR + "1e-4")),
    "nft_eval1": (_VN, [SAMPLER + "eval_guidance_scale=1.0", LR + "5e-5"]),
    "nft_eval1_lr1e-4": (_VN, [SAMPLER + "eval_guidance_scale=1.0", LR + "1e-4"]),
}

PLANS["gardo"] = {
    label: PLANS["gardo_sweep"][label] for label in ("kl0.4_proxy", "gardo_b4", "gardo_b4_initial_ref")
}
PLANS["gardo"]["gardo_b1"] = ("configs/hacking_gardo.yaml", [KL_GROUP + "coef=1"])

# The main job in bfloat16 (2026-12-02, second session): the toy policy loaded in bf16 computes under
# autocast while its float32 master weights train (the recipes' mixed precision). "nft_fp32" is the
# main job before that day, "nft_bf16" the same in bf16; both pinned to the update of then (9 of 10
# noise levels, micro-batches of 32), since configs/quickstart.yaml now visits 5 in micro-batches of 64
# (benchmarks/shapes_bf16.sh passed 64 to every run).
BF16 = "--model.init_args.policy.init_args.dtype=bfloat16"
_FULL = [
    NFT + "visit_fraction=0.99",
    "--model.init_args.update.micro_batch_size=32",
    LR + "3e-5",
]  # as run then
PLANS["bf16"] = {
    "nft_fp32": ("configs/quickstart.yaml", [*_FULL, "--model.init_args.policy.init_args.dtype=float32"]),
    "nft_bf16": ("configs/quickstart.yaml", [*_FULL, BF16]),
    "nft_bf16_mb64": (
        "configs/quickstart.yaml",
        [*_FULL, BF16, "--model.init_args.update.micro_batch_size=64"],
    ),
    # a larger step, and half the update's noise levels, for fewer rollouts in the same minutes
    "nft_bf16_lr5e-5": ("configs/quickstart.yaml", [*_FULL, BF16, LR + "5e-5"]),
    "nft_bf16_vf0.5": ("configs/quickstart.yaml", [*_FULL, BF16, NFT + "visit_fraction=0.5"]),
}
# The main job as shipped since (bf16, 5 of 10 noise levels) run long: its curve to 200 rollouts fell
# from 0.71 at 70-100 back to 0.49-0.60 in the full update's runs, the training reward with it, while
# the velocity's distance to the base (actor/kl_loss) grew from 0.02 to 0.5. A stronger pull to the
# reference for the long form: kl.coef 1e-4 (the config) against 0.1, 0.3 and 1.
PLANS["kl_long"] = {  # run at the main job's lr of then, 3e-5, in bf16
    f"nft_kl{c}": ("configs/quickstart.yaml", [KL_GROUP + f"coef={c}", LR + "3e-5", BF16])
    for c in ("1e-4", "0.1", "0.3", "1.0")
}
# Gain per CPU-minute of the whole job (2026-12-02, third session): the main job as shipped (dtype auto:
# bf16 on a GPU or a CPU with bf16 instructions, float32 on an AVX2 CPU, where bf16 products are emulated
# and over a hundred times slower), beside settings that make a rollout cheaper or a step larger. The
# learning is measured on a GPU, the cost of each on the CPU to be described (--timing).
_Q = "configs/quickstart.yaml"
PLANS["minute"] = {
    "nft": (_Q, [LR + "3e-5"]),  # the main job as it was when this plan ran (its lr since: 5e-5)
    "nft_vf0.3": (_Q, [NFT + "visit_fraction=0.3"]),
    "nft_vf0.2": (_Q, [NFT + "visit_fraction=0.2"]),
    "nft_lr5e-5": (_Q, [LR + "5e-5"]),
    "nft_lr5e-5_vf0.3": (_Q, [LR + "5e-5", NFT + "visit_fraction=0.3"]),
    "nft_p6": (_Q, ["--data.init_args.prompts_per_step=6", "--model.init_args.update.micro_batch_size=48"]),
    "nft_steps8": (_Q, [SAMPLER + "num_steps=8"]),
    "nft_lr5e-5_steps8": (_Q, [LR + "5e-5", SAMPLER + "num_steps=8"]),
    # the larger steps, after the first call of this plan showed lr 5e-5 ahead at every evaluation
    "nft_lr7e-5": (_Q, [LR + "7e-5"]),
    "nft_lr7e-5_vf0.3": (_Q, [LR + "7e-5", NFT + "visit_fraction=0.3"]),
    "nft_lr1e-4_vf0.3": (_Q, [LR + "1e-4", NFT + "visit_fraction=0.3"]),
}
#: validation and rollout keys besides the held-out one, kept per rollout when a run logs them
EXTRA_KEYS = (
    "val-aux/shapes_color/mean@1",
    "val-aux/shapes_color_gap/mean@1",
    "val-aux/drift",
    "val-aux/diversity",
    "rollout/diversity",
    "actor/kl_loss",
    "actor/kl_gated_fraction",
)

HELD_OUT = "val-core/shapes/strict/mean@1"
#: the video world's held-out key, read where a run logs it instead of the image world's
HELD_OUT_VIDEO = "val-core/shapes_video/strict/mean@1"
KL = "actor/kl_loss"
PROXY = "critic/rewards/shapes/strict/mean"
PROXY_VIDEO = "critic/rewards/shapes_video/strict/mean"
STEP_TIME = "perf/time_per_step"


def _steps_per_rollout(config: str, overrides: list[str]) -> int:
    for o in overrides:
        if o.startswith("--model.init_args.update.optimizer_steps_per_rollout="):
            return int(o.split("=", 1)[1])
    with open(config) as f:
        return int(yaml.safe_load(f)["model"]["init_args"]["update"].get("optimizer_steps_per_rollout", 1))


def command(
    config: str, overrides: list[str], seed: int, folder: Path, opts: argparse.Namespace
) -> list[str]:
    per = _steps_per_rollout(config, overrides)
    cmd = [
        sys.executable, "-m", "lit_flowgrpo.cli", "fit", "--config", config,
        f"--seed_everything={seed}", f"--data.init_args.seed={seed}", f"--model.init_args.seed={seed}",
        f"--trainer.max_steps={opts.rollouts * per}",
        f"--trainer.default_root_dir={folder}",
        f"--trainer.logger.init_args.save_dir={folder}", "--trainer.logger.init_args.name=log",
        "--trainer.logger.init_args.flush_logs_every_n_steps=1",  # partial runs still leave their curve
        f"--trainer.accelerator={opts.accelerator}",
        f"--data.init_args.val_seeds={opts.val_seeds}",
    ]  # fmt: skip
    if opts.val_every > 0:
        cmd.append(f"--trainer.val_check_interval={opts.val_every}")
    else:
        cmd += ["--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0"]
    if opts.max_val_prompts:
        cmd.append(f"--data.init_args.max_val_prompts={opts.max_val_prompts}")
    return cmd + overrides + opts.extra


def run(opts: argparse.Namespace) -> None:
    jobs = []
    for plan in opts.plan:
        for label, (config, overrides) in PLANS[plan].items():
            if opts.only and label not in opts.only:
                continue
            for seed in opts.seeds:
                folder = opts.out / f"{label}__s{seed}"
                jobs.append((folder, command(config, overrides, seed, folder, opts), config, overrides))
    env = dict(os.environ, OMP_NUM_THREADS=str(opts.threads))
    running: list[tuple[subprocess.Popen, Path, float]] = []
    start = time.monotonic()
    while jobs or running:
        while jobs and len(running) < opts.parallel:
            folder, cmd, config, overrides = jobs.pop(0)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "run.json").write_text(
                json.dumps({"command": cmd, "config": config, "overrides": overrides})
            )
            with open(folder / "stdout.log", "w") as log:  # the child keeps its own handle
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            running.append((proc, folder, time.monotonic()))
        for item in list(running):
            proc, folder, began = item
            if proc.poll() is not None:
                running.remove(item)
                print(f"{folder.name}: rc={proc.returncode} {time.monotonic() - began:.0f}s "
                      f"(at {time.monotonic() - start:.0f}s)", flush=True)  # fmt: skip
        time.sleep(1.0)


def read_run(folder: Path) -> dict:
    files = sorted(folder.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    held, proxy, step_s = {}, {}, {}
    extra: dict[str, dict[int, float]] = {}
    for row in csv.DictReader(files[-1].read_text().splitlines()) if files else []:
        step = int(float(row["step"]))
        value = row.get(HELD_OUT) or row.get(HELD_OUT_VIDEO)
        if value:
            # Lightning's logging step counts training batches (rollouts), not optimizer steps, and a
            # validation after rollout k logs at k − 1; the base model's (written by HeldOutReport,
            # outside any epoch) at 0
            held[step + 1 if row.get("epoch") else 0] = float(value)
        rollout = step + 1  # 1-based, as the progress bar counts
        for key in EXTRA_KEYS:
            if row.get(key):
                at = (step + 1 if row.get("epoch") else 0) if key.startswith("val") else rollout
                extra.setdefault(key, {})[at] = float(row[key])
        if row.get(PROXY) or row.get(PROXY_VIDEO):
            proxy[rollout] = float(row.get(PROXY) or row[PROXY_VIDEO])
        if row.get(STEP_TIME):
            step_s[rollout] = step_s.get(rollout, 0.0) + float(row[STEP_TIME])
    label, seed = folder.name.rsplit("__s", 1)
    paired = _paired(folder)
    return {
        "label": label, "seed": int(seed), "held_out": held, "proxy": proxy,
        "s_per_rollout": step_s, "paired": paired, "extra": extra,
    }  # fmt: skip


def _paired(folder: Path) -> dict | None:
    """The last line's paired gain (``+0.105 ± 0.020, 1000 paired samples``), when the run printed one."""
    log = folder / "stdout.log"
    if not log.exists():
        return None
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if "paired samples" in line and "±" in line:
            inner = line.split("(", 1)[1]
            gain, rest = inner.split("±", 1)
            se, n = rest.split(",", 1)
            return {"gain": float(gain), "se": float(se), "samples": int(n.split()[0])}
    return None


def _timing(folder: Path | None) -> dict[str, dict[str, float]]:
    """Per label: median seconds per rollout (the first one left out: it warms caches up)."""
    out: dict[str, dict[str, float]] = {}
    for run_dir in sorted(folder.iterdir()) if folder else []:
        if not (run_dir / "run.json").exists():
            continue
        r = read_run(run_dir)
        times = [t for k, t in sorted(r["s_per_rollout"].items()) if k > 1]
        if times:
            out[r["label"]] = {"s_per_rollout": statistics.median(times), "rollouts_timed": len(times)}
    return out


def report(opts: argparse.Namespace) -> None:
    runs = [read_run(d) for d in sorted(opts.runs.iterdir()) if (d / "run.json").exists()]
    timing = _timing(opts.timing)
    labels = list(dict.fromkeys(r["label"] for r in runs))
    table = {}
    print(f"{'label':28s} {'seeds':>5s}  base -> final (rollouts)  gain mean [min, max]  ", end="")
    print(f"gain within {opts.minutes:g} min" if timing else "")
    for label in labels:
        group = [r for r in runs if r["label"] == label]
        common = sorted(set.intersection(*(set(r["held_out"]) for r in group)))
        curve = {k: [r["held_out"][k] for r in group] for k in common}
        entry: dict = {
            "seeds": [r["seed"] for r in group],
            "held_out": {k: v for k, v in curve.items()},
            "proxy": {r["seed"]: r["proxy"] for r in group},
            "extra": {r["seed"]: r["extra"] for r in group},
            "paired": {r["seed"]: r["paired"] for r in group},
        }
        if len(common) >= 2:
            first, last = common[0], common[-1]
            gains = [b - a for a, b in zip(curve[first], curve[last], strict=True)]
            entry.update(final_rollouts=last, gain_mean=statistics.mean(gains), gains=gains)
            row = (
                f"{label:28s} {len(group):5d}  {statistics.mean(curve[first]):.3f} -> "
                f"{statistics.mean(curve[last]):.3f} ({last:3d})      {statistics.mean(gains):+.3f} "
                f"[{min(gains):+.3f}, {max(gains):+.3f}]"
            )
        else:
            row = f"{label:28s} {len(group):5d}  (fewer than two evaluations)"
        t = timing.get(label)
        if t and len(common) >= 2:
            entry["cpu"] = budget = _within(curve, t["s_per_rollout"], opts)
            row += f"   {budget['gain_mean']:+.3f} at {budget['rollouts']} rollouts ({budget['minutes']:.1f} min)"
        table[label] = entry
        print(row)
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps({"timing": timing, "labels": table, "argv": sys.argv[1:]}, indent=1))
        print(f"wrote {opts.json}")
    if opts.plot:
        _plot(runs, labels, timing, opts)
    if opts.plot_panels:
        _plot_panels(runs, labels, opts.plot_panels)


def _within(curve: dict[int, list[float]], s_per_rollout: float, opts: argparse.Namespace) -> dict:
    """The last evaluation reachable within the budget: two evaluations of ``--eval_samples`` at
    ``--s_per_sample`` plus the rollouts before it."""
    evals = 2 * opts.eval_samples * opts.s_per_sample
    reach = [k for k in curve if k * s_per_rollout + evals + opts.startup_s <= opts.minutes * 60]
    k = max(reach) if reach else 0
    base = curve[min(curve)]
    gains = [b - a for a, b in zip(base, curve[k], strict=True)]
    minutes = (k * s_per_rollout + evals + opts.startup_s) / 60
    return {"rollouts": k, "gain_mean": statistics.mean(gains), "gains": gains, "minutes": minutes}


def _plot(runs: list[dict], labels: list[str], timing: dict, opts: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_n = 2 if timing else 1
    fig, axes = plt.subplots(1, axes_n, figsize=(5.5 * axes_n, 4), sharey=True, squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, label in enumerate(labels):
        group = [r for r in runs if r["label"] == label]
        c = colours[i % len(colours)]
        common = sorted(set.intersection(*(set(r["held_out"]) for r in group)))
        mean = [statistics.mean(r["held_out"][k] for r in group) for k in common]
        lo = [min(r["held_out"][k] for r in group) for k in common]
        hi = [max(r["held_out"][k] for r in group) for k in common]
        xs = [common]
        if timing and label in timing:
            s = timing[label]["s_per_rollout"]
            # when the evaluation after k rollouts has printed its number: the base's, k rollouts, its own
            e = opts.eval_samples * opts.s_per_sample
            xs.append([(opts.startup_s + e + k * s + (e if k else 0)) / 60 for k in common])
        for ax, x in zip(axes[0], xs, strict=False):
            ax.fill_between(x, lo, hi, color=c, alpha=0.15, linewidth=0)
            ax.plot(x, mean, "o-", color=c, markersize=3, label=f"{label} ({len(group)} seeds)")
    axes[0][0].set_xlabel("rollouts (64 images each)")
    axes[0][0].set_ylabel("held-out strict accuracy (mean; band: seeds' range)")
    if timing:
        axes[0][1].set_xlabel("minutes of a 2-core CPU until the number is printed (from timing runs)")
        axes[0][1].axvline(opts.minutes, color="grey", linestyle=":", linewidth=1)
    for ax in axes[0]:
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    opts.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(opts.plot, dpi=120)
    print(f"wrote {opts.plot}")


def _plot_panels(runs: list[dict], labels: list[str], path: Path) -> None:
    """Held-out accuracy and each extra validation key a run logged, one panel each, against rollouts:
    mean over seeds, the band their range (the reward-hacking picture: gold, proxy, diversity, drift)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logged = [k for k in EXTRA_KEYS if any(k in r["extra"] for r in runs)]
    keys = [HELD_OUT] + [k for k in logged if k.startswith("val") or k == KL]
    cols = 2
    rows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for n, key in enumerate(keys):
        ax = axes[n // cols][n % cols]
        for i, label in enumerate(labels):
            series = [r["held_out"] if key == HELD_OUT else r["extra"].get(key, {}) for r in runs]
            series = [x for r, x in zip(runs, series, strict=True) if r["label"] == label and x]
            if not series:
                continue
            common = sorted(set.intersection(*(set(x) for x in series)))
            if key == KL:
                common = [k for k in common if all(x[k] > 0 for x in series)]
            mean = [statistics.mean(x[k] for x in series) for k in common]
            c = colours[i % len(colours)]
            lo = [min(x[k] for x in series) for k in common]
            hi = [max(x[k] for x in series) for k in common]
            ax.fill_between(common, lo, hi, color=c, alpha=0.15, linewidth=0)
            ax.plot(common, mean, "o-", color=c, markersize=3, label=f"{label} ({len(series)} seeds)")
        if key == KL:  # per rollout, over orders of magnitude (0 before the first step: left out)
            ax.set_yscale("log")
        ax.set_title(key if key != HELD_OUT else f"{key} (gold)", fontsize=9)
        ax.set_xlabel("rollouts")
        ax.grid(alpha=0.3)
    for n in range(len(keys), rows * cols):
        axes[n // cols][n % cols].axis("off")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="launch a plan's runs side by side")
    r.add_argument("--plan", nargs="+", choices=sorted(PLANS), required=True)
    r.add_argument("--only", nargs="*", help="labels of the plans to run (default: all)")
    r.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    r.add_argument("--rollouts", type=int, default=60)
    r.add_argument("--val_every", type=int, default=5, help="rollouts between evaluations (0: none)")
    r.add_argument("--max_val_prompts", type=int, default=0, help="0: all 250")
    r.add_argument("--val_seeds", type=int, default=4, help="seeds per held-out prompt (4: 1000 samples)")
    r.add_argument("--accelerator", default="cpu")
    r.add_argument("--parallel", type=int, default=1)
    r.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("extra", nargs="*", help="more `fit` flags for every run (after --)")
    p = sub.add_parser("report", help="the table (and picture) of finished or partial runs")
    p.add_argument("runs", type=Path)
    p.add_argument("--timing", type=Path, help="folder of `run --val_every 0 --parallel 1` runs")
    p.add_argument("--minutes", type=float, default=15.0)
    p.add_argument("--eval_samples", type=int, default=1000, help="samples per held-out evaluation")
    p.add_argument("--s_per_sample", type=float, default=0.28, help="seconds per evaluated sample")
    p.add_argument("--startup_s", type=float, default=15.0)
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path, help="held-out accuracy against rollouts (and CPU minutes)")
    p.add_argument("--plot_panels", type=Path, help="a panel per logged validation key (reward hacking)")
    opts = parser.parse_args()
    run(opts) if opts.cmd == "run" else report(opts)


if __name__ == "__main__":
    main()
