#!/usr/bin/env bash
# The main job's long form and the objectives' comparison on the shipped base, side by side on one GPU
# within SECONDS (issue 40):
#   WORK/kl_long     configs/quickstart.yaml as shipped (bf16, 5 of 10 noise levels visited) to
#                    KL_ROLLOUTS rollouts at kl.coef 1e-4 (the config), 0.1, 0.3 and 1 (shapes_runs.py's
#                    plan kl_long), seeds KL_SEEDS, an evaluation every KL_EVERY rollouts;
#   WORK/objectives  Flow-GRPO, GRPO-Guard, Flow-DPPO and DiffusionNFT (the main job) as their configs ship them (plan objectives),
#                    3 seeds, OBJ_ROLLOUTS rollouts, an evaluation every 10;
#   WORK/hacking     configs/hacking_proxy.yaml with its KL measured and configs/hacking_gardo.yaml at
#                    beta 4 (shapes_runs.py's flow_grpo_proxy_klmeasured and gardo_b4), 3 seeds,
#                    HACK_ROLLOUTS rollouts, an evaluation every 10.
#
#   PARTS="kl_long objectives hacking" bash benchmarks/shapes_long_and_objectives.sh WORK SECONDS
#
# Held out on 250 prompts x 2 seeds = 500 paired samples. Each run stops at its rollouts or at
# --trainer.max_time. At the end: shapes_runs.py's report of each folder (WORK/<name>.json) and
# WORK/metrics.tar.gz with every run's metrics.csv.
# A CPU smoke: ACCEL=cpu KL_ROLLOUTS=1 KL_EVERY=1 OBJ_ROLLOUTS=1 VAL_PROMPTS=4 VAL_SEEDS=1 bash ... WORK 300
set -uo pipefail
work=$1
budget=$2
py=${PYTHON:-python3}
start=$(date +%s)
# shellcheck source=benchmarks/deadline.sh
. "$(dirname "$0")/deadline.sh"
common=(--val_seeds "${VAL_SEEDS:-2}" --max_val_prompts "${VAL_PROMPTS:-0}" --accelerator "${ACCEL:-cuda}" --threads 1)
stop=$((budget - 40))
read -r -a kl_seeds <<< "${KL_SEEDS:-0 1}"
mkdir -p "$work"
parts=${PARTS:-kl_long objectives hacking}
for part in $parts; do
  case $part in
    kl_long) args=(--plan kl_long --seeds "${kl_seeds[@]}" --rollouts "${KL_ROLLOUTS:-200}" --val_every "${KL_EVERY:-20}" --parallel 8) ;;
    objectives) args=(--plan objectives --only flow_grpo grpo_guard flow_dppo diffusion_nft --seeds 0 1 2 --rollouts "${OBJ_ROLLOUTS:-40}" --val_every 10 --parallel 12) ;;
    hacking) args=(--plan hacking gardo_sweep --only flow_grpo_proxy_klmeasured gardo_b4 --seeds 0 1 2 --rollouts "${HACK_ROLLOUTS:-60}" --val_every 10 --parallel 6) ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
  $py benchmarks/shapes_runs.py run "${args[@]}" "${common[@]}" --out "$work/$part" \
    -- --trainer.max_time="$(until_s "$stop")" > "$work/$part.log" 2>&1 &
done
wait
echo "all runs ended at $(($(date +%s) - start)) s"
for name in $parts; do
  $py benchmarks/shapes_runs.py report "$work/$name" --json "$work/$name.json"
done
tar -czf "$work/metrics.tar.gz" -C "$work" $(cd "$work" && find . -name metrics.csv -o -name run.json | sort)
