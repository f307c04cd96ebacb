#!/usr/bin/env bash
# The shapes world's ceiling, the reward-hacking re-runs and one candidate base, side by side on one GPU
# within SECONDS (issue 40; docs/shapes_world.md, "Where the ceiling is").
#
#   bash benchmarks/shapes_ceiling.sh WORK SECONDS
#
# Runs at once, every run a `lit-flowgrpo fit` of a shipped config through benchmarks/shapes_runs.py,
# held out on 250 prompts x 2 seeds = 500 paired samples:
#   WORK/ceiling    the main job (configs/quickstart.yaml) for CEIL_ROLLOUTS rollouts, 3 seeds, an
#                   evaluation every CEIL_EVERY rollouts, split by family;
#   WORK/hacking    configs/hacking_proxy.yaml with its KL measured and configs/hacking_gardo.yaml at
#                   beta 4 (shapes_runs.py's flow_grpo_proxy_klmeasured and gardo_b4), HACK_ROLLOUTS
#                   rollouts, 3 seeds, an evaluation every HACK_EVERY (at nice 10: they yield the CPU);
#   WORK/bases      configs/toy_pretrain.yaml with the text cross-attended at 32x32 too
#                   (--model.init_args.architecture.text_at_full_resolution=true), PRE_STEPS steps or
#                   PRE_SECONDS, scored by family with lit_flowgrpo.toy.evaluate (the shipped base too);
#   WORK/xattn32_rl then the main job from that base, RL_ROLLOUTS rollouts, 3 seeds;
#   WORK/mix_rl     with MIX=1 only: the main job from the shipped base with the training list's position
#                   prompts listed 3 times and its colour-binding prompts twice (on the mix before 2026-12-02: 22% each of the RL
#                   prompts instead of 10% and 15%; the held-out list unchanged), RL_ROLLOUTS rollouts.
# Every fit gets --trainer.max_time so that it stops before the deadline and is evaluated once more
# (HeldOutReport's evaluate_after_training). The DiffusionNFT runs use micro-batches of 64 instead of
# the config's 32: each sample's visited noise levels and noise are drawn from its own seeds, so the
# split changes only the rounding, and the update takes half the forwards. At the end the script runs
# `python benchmarks/shapes_ceiling.py summarize WORK --json WORK/summary.json`.
# A CPU smoke of the whole script: ACCEL=cpu CEIL_ROLLOUTS=1 CEIL_EVERY=1 HACK_ROLLOUTS=1 HACK_EVERY=1
# RL_ROLLOUTS=1 RL_EVERY=1 PRE_STEPS=2 VAL_PROMPTS=4 EVAL_SPLIT_SEEDS=1 SEEDS=0 bash ... WORK 900
set -uo pipefail
work=$1
budget=$2
py=${PYTHON:-python3}
acc=${ACCEL:-cuda}
ceil_rollouts=${CEIL_ROLLOUTS:-200}
ceil_every=${CEIL_EVERY:-20}
hack_rollouts=${HACK_ROLLOUTS:-60}
hack_every=${HACK_EVERY:-10}
rl_rollouts=${RL_ROLLOUTS:-40}
rl_every=${RL_EVERY:-20}
pre_steps=${PRE_STEPS:-1000}
pre_seconds=${PRE_SECONDS:-180}
val_prompts=${VAL_PROMPTS:-0}
eval_seeds=${EVAL_SPLIT_SEEDS:-2}
read -r -a seeds <<< "${SEEDS:-0 1 2}"
start=$(date +%s)
left() { echo $((budget - ($(date +%s) - start))); }
# Lightning's max_time, DD:HH:MM:SS, for a run that must stop S seconds from now
until_s() { local s=$(($1 > 30 ? $1 : 30)); printf '00:%02d:%02d:%02d' $((s / 3600)) $((s % 3600 / 60)) $((s % 60)); }
mkdir -p "$work/bases/xattn32"
common=(--val_seeds 2 --accelerator "$acc" --max_val_prompts "$val_prompts")
nft64=--model.init_args.update.micro_batch_size=64

OMP_NUM_THREADS=2 $py -m lit_flowgrpo.cli fit --config configs/toy_pretrain.yaml --trainer.accelerator="$acc" \
  --trainer.max_steps="$pre_steps" --trainer.max_time="$(until_s "$pre_seconds")" \
  --trainer.logger.init_args.save_dir="$work/bases/xattn32" \
  --model.init_args.export_path="$work/bases/xattn32/base.safetensors" --model.init_args.export_every_n_steps=250 \
  --model.init_args.architecture.text_at_full_resolution=true > "$work/bases/xattn32/pretrain.log" 2>&1 &
pre=$!

$py benchmarks/shapes_runs.py run --plan objectives --only diffusion_nft --seeds "${seeds[@]}" \
  --rollouts "$ceil_rollouts" --val_every "$ceil_every" "${common[@]}" --parallel 3 --out "$work/ceiling" \
  -- "$nft64" --trainer.max_time="$(until_s $(($(left) - 25)))" > "$work/ceiling.log" 2>&1 &
ceiling=$!

nice -n 10 $py benchmarks/shapes_runs.py run --plan hacking gardo_sweep \
  --only flow_grpo_proxy_klmeasured gardo_b4 --seeds "${seeds[@]}" --rollouts "$hack_rollouts" \
  --val_every "$hack_every" "${common[@]}" --parallel 6 --out "$work/hacking" \
  -- --trainer.max_time="$(until_s $(($(left) - 25)))" > "$work/hacking.log" 2>&1 &
hacking=$!

if [ "${MIX:-0}" = 1 ]; then
  $py - "$work/train_mix.jsonl" <<'PY'
import json, sys
from lit_flowgrpo.toy import world
copies = {"position": 3, "color_attr": 2}  # of each training record of the family
with open(sys.argv[1], "w", encoding="utf-8") as f:
    for record in world.load_prompts("train"):
        f.writelines(json.dumps(record) + "\n" for _ in range(copies.get(record["tag"], 1)))
PY
  $py benchmarks/shapes_runs.py run --plan objectives --only diffusion_nft --seeds "${seeds[@]}" \
    --rollouts "$rl_rollouts" --val_every "$rl_every" "${common[@]}" --parallel 3 --out "$work/mix_rl" \
    -- "$nft64" --data.init_args.train="$work/train_mix.jsonl" \
    --trainer.max_time="$(until_s $(($(left) - 25)))" > "$work/mix_rl.log" 2>&1 &
  mix=$!
fi

evaluate() {  # CHECKPOINT NAME: the bases table's scoring (guidance 1), by family
  local ckpt=()
  [ "$1" = shipped ] || ckpt=(--checkpoint "$1")
  $py -m lit_flowgrpo.toy.evaluate "${ckpt[@]}" --num-seeds "$eval_seeds" --num-steps 10 --guidance 1 \
    --json "$work/bases/$2.eval.json" > "$work/bases/$2.eval.log" 2>&1
}
evaluate shipped shipped &
wait "$pre"
steps=$($py -c "import sys; from lit_flowgrpo.toy.model import read_checkpoint_metadata as m; print(m(sys.argv[1])['steps'])" \
  "$work/bases/xattn32/base.safetensors" 2>&1 | tail -1)
echo "pretraining ended at $(($(date +%s) - start)) s after $steps steps"
evaluate "$work/bases/xattn32/base.safetensors" xattn32
echo "base scored at $(($(date +%s) - start)) s"
if [ "$(left)" -gt 75 ]; then
  $py benchmarks/shapes_runs.py run --plan objectives --only diffusion_nft --seeds "${seeds[@]}" \
    --rollouts "$rl_rollouts" --val_every "$rl_every" "${common[@]}" --parallel 3 --out "$work/xattn32_rl" \
    -- "$nft64" --model.init_args.policy.init_args.pretrained="$work/bases/xattn32/base.safetensors" \
    --trainer.max_time="$(until_s $(($(left) - 25)))" > "$work/xattn32_rl.log" 2>&1
fi
wait "$ceiling" "$hacking" ${mix:+"$mix"}
echo "all runs ended at $(($(date +%s) - start)) s"
$py benchmarks/shapes_ceiling.py summarize "$work" --json "$work/summary.json"
