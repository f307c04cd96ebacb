#!/usr/bin/env bash
# The main job in bfloat16, side by side on one GPU within SECONDS (issue 40): its curve to 200
# rollouts on 3 seeds (the world's ceiling at the main job's settings), beside a larger step (lr 5e-5,
# 3 seeds) and half the update's noise levels (visit_fraction 0.5, 2 seeds), each to 80 rollouts.
#
#   bash benchmarks/shapes_bf16.sh WORK SECONDS
#
# Every run is benchmarks/shapes_runs.py's plan "bf16" (configs/quickstart.yaml with the policy loaded
# in bfloat16, float32 master weights), held out on 250 prompts x 2 seeds = 500 paired samples every
# 10 rollouts, with micro-batches of 64 (as the CPU main job since 2026-12-02). Each run stops at its
# rollouts or at --trainer.max_time, whichever comes first, and is evaluated once more. At the end:
# shapes_runs.py's report of each folder (WORK/<name>.json) and WORK/metrics.tar.gz with every run's
# metrics.csv (per-family curves: val-aux/shapes/strict/<family>/mean@1).
# A CPU smoke: ACCEL=cpu EVERY=1 CEIL_ROLLOUTS=1 LEVER_ROLLOUTS=1 VAL_PROMPTS=4 VAL_SEEDS=1 bash ... WORK 300
set -uo pipefail
work=$1
budget=$2
py=${PYTHON:-python3}
start=$(date +%s)
# shellcheck source=benchmarks/deadline.sh
. "$(dirname "$0")/deadline.sh"
common=(--plan bf16 --val_seeds "${VAL_SEEDS:-2}" --max_val_prompts "${VAL_PROMPTS:-0}" --accelerator "${ACCEL:-cuda}" --val_every "${EVERY:-10}" --threads 1)
mb=--model.init_args.update.micro_batch_size=64
stop=$((budget - 40))  # leaves the last evaluation and the reports their time
run() {  # NAME LABEL ROLLOUTS SEEDS...
  local name=$1 label=$2 rollouts=$3
  shift 3
  $py benchmarks/shapes_runs.py run "${common[@]}" --only "$label" --seeds "$@" --rollouts "$rollouts" \
    --parallel $# --out "$work/$name" -- "$mb" --trainer.max_time="$(until_s "$stop")" > "$work/$name.log" 2>&1 &
}
mkdir -p "$work"
run ceiling nft_bf16 "${CEIL_ROLLOUTS:-200}" 0 1 2
run lr5e-5 nft_bf16_lr5e-5 "${LEVER_ROLLOUTS:-80}" 0 1 2
run vf0.5 nft_bf16_vf0.5 "${LEVER_ROLLOUTS:-80}" 0 1
wait
echo "all runs ended at $(($(date +%s) - start)) s"
for name in ceiling lr5e-5 vf0.5; do
  $py benchmarks/shapes_runs.py report "$work/$name" --json "$work/$name.json"
done
tar -czf "$work/metrics.tar.gz" -C "$work" $(cd "$work" && find . -name metrics.csv -o -name run.json -o -name stdout.log | sort)
