#!/usr/bin/env bash
# Gain per CPU-minute of the main job's settings (issue 40), side by side on one GPU within SECONDS:
# benchmarks/shapes_runs.py's plan "minute", the main job as shipped on 3 seeds and each cheaper or
# larger-stepped variant on 2, every run held out on 250 prompts x 2 seeds = 500 paired samples every
# 10 rollouts, to ROLLOUTS (60) or --trainer.max_time, whichever comes first, and evaluated once more.
# The cost of each on a CPU comes from `shapes_runs.py run --plan minute --val_every 0 --parallel 1`
# there; `shapes_runs.py report WORK/minute --timing THAT` turns the two into gain within 15 minutes.
# At the end: WORK/minute.json and WORK/metrics.tar.gz (every run's metrics.csv, per-family curves).
#
#   bash benchmarks/shapes_minute.sh WORK SECONDS
#
# ONLY (labels) and SEEDS (for every label; unset: 0 1, and 0 1 2 for the shipped "nft") pick the runs.
# A CPU smoke: ACCEL=cpu EVERY=1 ROLLOUTS=1 VAL_PROMPTS=4 VAL_SEEDS=1 ONLY="nft nft_p6" bash ... WORK 300
set -uo pipefail
work=$1
budget=$2
py=${PYTHON:-python3}
start=$(date +%s)
# shellcheck source=benchmarks/deadline.sh
. "$(dirname "$0")/deadline.sh"
stop=$((budget - 40))  # leaves the last evaluation and the report their time
read -r -a labels <<< "${ONLY:-nft nft_vf0.3 nft_vf0.2 nft_lr5e-5 nft_lr5e-5_vf0.3 nft_p6 nft_steps8 nft_lr5e-5_steps8}"
mkdir -p "$work"
for label in "${labels[@]}"; do
  read -r -a seeds <<< "${SEEDS:-0 1}"
  [ -z "${SEEDS:-}" ] && [ "$label" = nft ] && seeds=(0 1 2)
  $py benchmarks/shapes_runs.py run --plan minute --only "$label" --seeds "${seeds[@]}" \
    --rollouts "${ROLLOUTS:-60}" --val_every "${EVERY:-10}" --val_seeds "${VAL_SEEDS:-2}" \
    --max_val_prompts "${VAL_PROMPTS:-0}" --accelerator "${ACCEL:-cuda}" --threads 1 \
    --parallel "${#seeds[@]}" --out "$work/minute" -- --trainer.max_time="$(until_s "$stop")" \
    > "$work/$label.log" 2>&1 &
done
wait
echo "all runs ended at $(($(date +%s) - start)) s"
$py benchmarks/shapes_runs.py report "$work/minute" --json "$work/minute.json"
tar -czf "$work/metrics.tar.gz" -C "$work" $(cd "$work" && find . -name metrics.csv -o -name run.json -o -name stdout.log | sort)
