#!/usr/bin/env bash
# Pretrain toy bases of the shapes world side by side on one GPU and score every export by family.
#
#   bash benchmarks/shapes_bases.sh OUT STEPS SECONDS LABEL=OVERRIDES ...
#
# Each LABEL trains `configs/toy_pretrain.yaml` with its overrides (space-separated, no spaces inside
# one) for STEPS steps (at most SECONDS), exporting every 500 steps to OUT/LABEL/; every export is then
# evaluated on the held-out list (250 prompts x 2 seeds, 10 Euler steps, guidance 1 and 3) into
# OUT/LABEL/eval_step<N>.json. The shipped base is scored the same way into OUT/shipped.json.
set -uo pipefail
out=$1; steps=$2; seconds=$3; shift 3
mkdir -p "$out"
pids=()
for spec in "$@"; do
  label=${spec%%=*}; overrides=${spec#*=}
  mkdir -p "$out/$label"
  # shellcheck disable=SC2086
  timeout "$seconds" lit-flowgrpo fit --config configs/toy_pretrain.yaml --trainer.max_steps="$steps" \
    --trainer.logger.init_args.save_dir="$out/$label" --data.init_args.num_workers=3 \
    --model.init_args.export_path="$out/$label/base.safetensors" --model.init_args.export_every_n_steps=500 \
    $overrides > "$out/$label/pretrain.log" 2>&1 &
  pids+=($!)
done
python -m lit_flowgrpo.toy.evaluate --num-seeds 2 --num-steps 10 --guidance 1 3 --json "$out/shipped.json" \
  > "$out/shipped.log" 2>&1
wait "${pids[@]}"
for ckpt in "$out"/*/base_step*.safetensors; do
  dir=$(dirname "$ckpt"); step=${ckpt##*_step}; step=${step%.safetensors}
  python -m lit_flowgrpo.toy.evaluate --checkpoint "$ckpt" --num-seeds 2 --num-steps 10 --guidance 1 3 \
    --json "$dir/eval_step$step.json" > "$dir/eval_step$step.log" 2>&1 &
  while [ "$(jobs -r | wc -l)" -ge 6 ]; do sleep 1; done
done
wait
