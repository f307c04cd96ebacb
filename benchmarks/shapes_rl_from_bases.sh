#!/usr/bin/env bash
# The main job (configs/quickstart.yaml as shipped) from each of several toy bases, side by side on one GPU:
#
#   bash benchmarks/shapes_rl_from_bases.sh WORK OUT SECONDS BASE.safetensors:"SEEDS"[:LABEL:"OVERRIDES"] ...
#
# A spec with LABEL and OVERRIDES (the CLI's flags, e.g. --model.init_args.kl.coef=0.03) runs its base with
# those settings changed, reported under LABEL (default: the base's file name).
# Each base runs benchmarks/shapes_runs.py's plan "minute", label nft_lr5e-5 (the shipped settings), on its
# seeds, three at a time, held out on 250 prompts x VAL_SEEDS (2) = 500 paired samples every EVERY (20)
# rollouts, to ROLLOUTS (200) or SECONDS, whichever comes first. OUT gets one report (.json and .txt) a
# base and metrics.tar.gz (every run's metrics.csv: the per-family curves).
# A CPU smoke: ACCEL=cpu EVERY=1 ROLLOUTS=1 VAL_PROMPTS=4 VAL_SEEDS=1 bash ... WORK OUT 240 BASE:0
set -uo pipefail
work=$1; out=$2; budget=$3; shift 3
start=$(date +%s); mkdir -p "$work" "$out"
# shellcheck source=benchmarks/deadline.sh
. "$(dirname "$0")/deadline.sh"
stop=$((budget - 30))
labels=()
for spec in "$@"; do
  IFS=: read -r base seeds label overrides <<< "$spec"
  label=${label:-$(basename "$base" .safetensors)}; labels+=("$label")
  # shellcheck disable=SC2086
  python3 benchmarks/shapes_runs.py run --plan minute --only nft_lr5e-5 --seeds $seeds \
    --rollouts "${ROLLOUTS:-200}" --val_every "${EVERY:-20}" --val_seeds "${VAL_SEEDS:-2}" \
    --max_val_prompts "${VAL_PROMPTS:-0}" --accelerator "${ACCEL:-cuda}" --threads 1 \
    --parallel 3 --out "$work/$label" -- --trainer.max_time="$(until_s "$stop")" \
    --model.init_args.policy.init_args.pretrained="$base" ${overrides:-} > "$work/$label.log" 2>&1 &
done
wait
echo "all runs ended at $(($(date +%s) - start)) s"
for label in "${labels[@]}"; do
  python3 benchmarks/shapes_runs.py report "$work/$label" --json "$out/$label.json" > "$out/$label.report.txt" 2>&1
done
tar -czf "$out/metrics.tar.gz" -C "$work" $(cd "$work" && find . -name metrics.csv -o -name run.json | sort)
tail -n 5 "$work"/*.log
cat "$out"/*.report.txt
