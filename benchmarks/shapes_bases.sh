#!/usr/bin/env bash
# Pretrain toy bases of the shapes world side by side on one GPU and score every export by family.
#
#   bash benchmarks/shapes_bases.sh OUT STEPS SECONDS LABEL=OVERRIDES ...
#
# Each LABEL trains `configs/toy_pretrain.yaml` with its overrides (space-separated, no spaces inside
# one) for STEPS steps (at most SECONDS), exporting every EVERY steps (500) to OUT/LABEL/; every export
# is then evaluated on the held-out list (250 prompts x SEEDS seeds (2), 10 Euler steps, at each guidance of
# GUIDANCE, "1 3" by default) into OUT/LABEL/eval_step<N>.json. The shipped base is scored the same way
# into OUT/shipped.json. With FAILURES=1 each label's last export (and the shipped base) is also split
# by the first condition its colour-binding and position samples miss (benchmarks/shapes_failures.py,
# 8 seeds) into OUT/LABEL/failures.json. WORKERS (3) sets each run's rendering processes.
set -uo pipefail
out=$1; steps=$2; seconds=$3; shift 3
every=${EVERY:-500}
workers=${WORKERS:-3}
read -r -a guidance <<< "${GUIDANCE:-1 3}"
mkdir -p "$out"
pids=()
for spec in "$@"; do
  label=${spec%%=*}; overrides=${spec#*=}
  mkdir -p "$out/$label"
  # shellcheck disable=SC2086
  timeout "$seconds" lit-flowgrpo fit --config configs/toy_pretrain.yaml --trainer.max_steps="$steps" \
    --trainer.logger.init_args.save_dir="$out/$label" --data.init_args.num_workers="$workers" \
    --model.init_args.export_path="$out/$label/base.safetensors" --model.init_args.export_every_n_steps="$every" \
    $overrides > "$out/$label/pretrain.log" 2>&1 &
  pids+=($!)
done
python -m lit_flowgrpo.toy.evaluate --num-seeds "${SEEDS:-2}" --num-steps 10 --guidance "${guidance[@]}" \
  --json "$out/shipped.json" > "$out/shipped.log" 2>&1
wait "${pids[@]}"
for ckpt in "$out"/*/base_step*.safetensors; do
  dir=$(dirname "$ckpt"); step=${ckpt##*_step}; step=${step%.safetensors}
  python -m lit_flowgrpo.toy.evaluate --checkpoint "$ckpt" --num-seeds "${SEEDS:-2}" --num-steps 10 --guidance "${guidance[@]}" \
    --json "$dir/eval_step$step.json" > "$dir/eval_step$step.log" 2>&1 &
  while [ "$(jobs -r | wc -l)" -ge 8 ]; do sleep 1; done
done
if [ "${FAILURES:-0}" = 1 ]; then
  python benchmarks/shapes_failures.py --seeds 8 --json "$out/shipped_failures.json" > "$out/shipped_failures.log" 2>&1 &
  for spec in "$@"; do
    label=${spec%%=*}
    last=$(ls "$out/$label"/base_step*.safetensors 2>/dev/null | sort -V | tail -1)
    [ -n "$last" ] || continue
    python benchmarks/shapes_failures.py --checkpoint "$last" --seeds 8 --json "$out/$label/failures.json" \
      > "$out/$label/failures.log" 2>&1 &
    while [ "$(jobs -r | wc -l)" -ge 8 ]; do sleep 1; done
  done
fi
wait
