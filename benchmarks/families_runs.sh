#!/usr/bin/env bash
# The GPU figures of the new image families (FLUX.2 klein 4B / 9B and dev 32B, Z-Image-Turbo, SD3.5-Large)
# on random weights of their public configs (lit_flowgrpo/tiny/specs.py), in one call of at most 10
# minutes on one H200, in order of priority:
#   1-4  LoRA r32, one GPU (benchmarks/throughput.py, variant rollout_batch: bf16 compute, eager, rollout
#        batch = update micro-batch = 4): klein 4B, klein 9B (CFG 4.5 in rollout and update), Z-Image-Turbo
#        (with CFG, then Flow-GRPO-Fast without CFG, its own setting), SD3.5-Large (CFG 4.5)
#   5-7  full fine-tune, one GPU (benchmarks/scaling.py --strategy single --full): klein 4B, klein 9B,
#        SD3.5-Large, training the bf16 weights in place (--master_dtype model) with no KL term, so that
#        AdamW's two states fit beside the weights
#   8    FLUX.2-dev LoRA r32 on one GPU (the fsdp2 runs need two GPUs)
# 512 px, 6 denoising steps of which a window of 2 is stochastic and trained (as the klein and Z-Image
# recipes train a window), 8 images per rollout (1 prompt x 8), 2 rollouts per run: the first warms up,
# the second is measured (the budget allows no more; the on-policy ratio is checked in both).
#
#   bash benchmarks/families_runs.sh RUNS_DIR OUT_DIR
#
# Each step has its own timeout, capped by what is left of BUDGET seconds (default 430); a failed step
# does not stop the next. OUT_DIR gets families.json (each run's figures: images/GPU/s, MFU of rollout
# and update, peak memory, the on-policy ratio's deviation), summary.txt and failures.txt.
# SMOKE=1 runs the same steps on the tiny configs on the CPU (a check of this plan).
set -u
R=$1
OUT=$2
here=$(dirname "$0")
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$R/tp" "$R/sc" "$OUT"
: > "$OUT/summary.txt"
: > "$OUT/failures.txt"
BUDGET=${BUDGET:-430}
start=$SECONDS
if [ "${SMOKE:-0}" = 1 ]; then
  TINY=--tiny; K4=flux2_tiny; K9=flux2_tiny; SDL=tiny; SDLM=sd35m; DEV=flux2_dev_tiny; RES=32
else
  TINY=; K4=flux2_klein4b; K9=flux2_klein9b; SDL=sd35l; SDLM=sd35l; DEV=flux2_dev; RES=512
fi
TP="$PY $here/throughput.py $TINY --variants rollout_batch --warmup 1 --steps 1 --num-steps 6 --sde-window-size 2 --prompts 1 --group 8 --micro-batch 4 --resolution $RES --out $R/tp"
SC="$PY $here/scaling.py run --strategy single --per_gpu 8 --global_ranks 1 --rollouts 2 --num_steps 6 --sde_window_size 2 --resolution $RES"

step() {  # step NAME NEED_S MAX_S COMMAND...
  local name=$1 need=$2 max=$3 left
  shift 3
  left=$((BUDGET - (SECONDS - start)))
  if [ "$left" -lt "$need" ]; then
    echo "$name skipped: ${left}s left of the budget, needs ${need}s" | tee -a "$OUT/summary.txt"
    return
  fi
  [ "$left" -lt "$max" ] && max=$left
  local t0=$SECONDS
  timeout "$max" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
  if [ "$rc" != 0 ]; then
    { echo "== $name (rc $rc)"; tail -25 "$R/$name.log"; } >> "$OUT/failures.txt"
  fi
}

step klein4b_lora 40 110 $TP --model flux2_klein4b --no-fast
step klein9b_lora 40 120 $TP --model flux2_klein9b --no-fast
step zimage_turbo_lora 40 120 $TP --model zimage_turbo
step sd35l_lora 40 110 $TP --model "$SDLM" --no-fast
step klein4b_full 40 110 $SC --size "$K4" --full --master_dtype model --kl_coef 0 --micro_batch 2 --out "$R/sc/klein4b_full"
step klein9b_full 50 120 $SC --size "$K9" --full --master_dtype model --kl_coef 0 --micro_batch 2 --out "$R/sc/klein9b_full"
step sd35l_full 40 110 $SC --size "$SDL" --full --master_dtype model --kl_coef 0 --micro_batch 2 --out "$R/sc/sd35l_full"
step dev_lora 60 150 $SC --size "$DEV" --micro_batch 4 --out "$R/sc/dev_lora"

"$PY" - "$R" "$OUT" <<'EOF'
"""Each run's figures into one JSON: throughput.py's results files, and scaling.py's runs with the
callback's MFU, peak memory and on-policy ratio read from their metrics."""
import glob, json, os, statistics, sys

runs_dir, out = sys.argv[1], sys.argv[2]
rows = []
for path in sorted(glob.glob(os.path.join(runs_dir, "tp", "*.json"))):
    with open(path) as f:
        data = json.load(f)
    for v in data["variants"]:
        rows.append({"script": "throughput.py", "config": data["config"], "command": data.get("command"),
                     "device": data.get("device_name"), "training": "lora r32", **v})
for folder in sorted(glob.glob(os.path.join(runs_dir, "sc", "*"))):
    try:
        info = json.load(open(os.path.join(folder, "info_rank0.json")))
        metrics = json.load(open(os.path.join(folder, "metrics.json")))
    except (OSError, ValueError) as err:
        rows.append({"script": "scaling.py", "run": os.path.basename(folder), "error": str(err)})
        continue
    steps = [metrics[k] for k in sorted(metrics, key=int)]
    measured = steps[1:] or steps  # the first rollout warms up

    def med(key):
        vals = [s[key] for s in measured if key in s]
        return statistics.median(vals) if vals else None

    rows.append({"script": "scaling.py", "run": os.path.basename(folder), "info": info,
                 "images_per_gpu_s": med("perf/throughput"), "mfu_infer": med("perf/mfu/actor_infer"),
                 "mfu_actor": med("perf/mfu/actor"),
                 "peak_memory_gb": max((s.get("perf/max_memory_allocated_gb", 0) for s in steps), default=None),
                 "onpolicy_ratio_abs_dev": max((s.get("actor/on_policy_ratio_err", 0) for s in steps), default=None)})
with open(os.path.join(out, "families.json"), "w") as f:
    json.dump({"runs": rows, "summary": open(os.path.join(out, "summary.txt")).read()}, f, indent=1)
print(f"{len(rows)} rows")
EOF
