#!/usr/bin/env bash
# The runs of "Big models on Hopper", in one call of at most 10 minutes on one host of 4 GPUs (H100
# 80 GB or H200 141 GB), in order of priority:
#   a  SD3.5-M LoRA, ddp then fsdp2, 4 GPUs, 3 rollouts, the last one profiled (NCCL time and overlap)
#   b  Qwen-Image-20B LoRA with the recipe's CFG (configs/qwenimage_ocr_grpoguard.yaml): fsdp2 on GPUs
#      0-1 (save, export), beside its one-GPU reference (first rollout) on GPU 2
#   c  FLUX.1-dev-sized (12B) full fine-tune, fsdp2, 4 GPUs, frozen reference copy, β 0.04, no
#      activation checkpointing, the micro-batch the GPU's memory allows
#   d  Qwen-Image-20B full fine-tune, fsdp2, 4 GPUs, without CFG and without KL (verl-omni's
#      published full fine-tune setting)
#   then, while the budget lasts: b resumed from its checkpoint, a under fsdp2 with
#   reshard_after_forward=false (profiled), c with compiled blocks.
#
#   bash benchmarks/big_runs.sh RUNS_DIR [OUT_DIR]
#
# Each step has its own timeout, capped by what is left of BUDGET seconds (default 500) for all of
# them, and is skipped when less is left than it needs; a failed step does not stop the next. Each
# prints one line (rc, seconds, images/GPU/s, peak memory, resumed / exported, Δ vs one GPU, NCCL
# overlap). OUT_DIR gets summary.txt (those lines), failures.txt (the tail of each failed log),
# runs.jsonl (each run's raw records, as it ends), profiles.txt (the profile summaries) and
# big_runs.json (scaling.py report).
#
# SMOKE=1 runs the same steps on the tiny sizes, 2 CPU processes where the plan has 4 GPUs: the CPU
# check of this plan (tests/test_scaling_smoke.py, opt-in: LIT_FLOWGRPO_PLAN_SMOKE=1 pytest -m slow).
set -u
R=$1
OUT=${2:-$1}
here=$(dirname "$0")
PY=${PYTHON:-python3}
# NVLink multicast stays off on shared hosts (NCCL, PyTorch's symmetric memory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
mkdir -p "$R" "$OUT"
: > "$OUT/summary.txt"
: > "$OUT/failures.txt"
: > "$OUT/runs.jsonl"

if [ "${SMOKE:-0}" = 1 ]; then
  SD=tiny FLUX=flux_tiny QWEN=qwen_tiny N4=2 MEM_MIB=0 BUDGET=${BUDGET:-100000} SCALE=20 CB=eager
  A_PER=4 A_MB=2 B_PER=4 C_PER=4 D_PER=4
else
  SD=sd35m FLUX=flux12b QWEN=qwenimage20b N4=4 BUDGET=${BUDGET:-500} SCALE=1 CB=inductor
  MEM_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | sort -n | head -1)
  A_PER=16 A_MB=8 B_PER=8 C_PER=4 D_PER=8
fi
# Micro-batches by the GPU's memory (docs/scaling.md, "Big models": the arithmetic). 80 GB: the
# activations of 2 samples (4 with CFG) beside the shards; 141 GB: of 4 (8).
if [ "$MEM_MIB" -gt 100000 ]; then B_MB=4 C_MB=4 D_MB=4; else B_MB=2 C_MB=2 D_MB=2; fi
if [ "${SMOKE:-0}" = 1 ]; then B_MB=2 C_MB=2 D_MB=2; fi
echo "GPU memory ${MEM_MIB} MiB: micro-batches b ${B_MB}, c ${C_MB}, d ${D_MB}; budget ${BUDGET}s" | tee -a "$OUT/summary.txt"

start=$SECONDS
SCALING="$here/scaling.py"
RUN1="$PY $SCALING run"
RUNN="$PY -m torch.distributed.run --standalone --nproc_per_node"

# limit NEED MAX: the timeout of a step that needs about NEED seconds and may take MAX (times SCALE
# on CPUs); fails, so that the step is skipped, when less than NEED is left of the budget.
limit() {
  local left=$((BUDGET - (SECONDS - start))) max=$(($2 * SCALE))
  [ "$left" -ge "$1" ] || return 1
  echo $((max < left ? max : left))
}
report_line() {  # NAME RC SECONDS LIMIT
  local result
  result=$(grep -h "^RESULT:" "$R/$1.log" 2>/dev/null | tail -1 | cut -c9-)
  echo "$1 rc=$2 $3s (limit $4s) ${result:-no result}" | tee -a "$OUT/summary.txt"
  if [ "$2" != 0 ]; then { echo "== $1 rc=$2"; tail -n 40 "$R/$1.log"; } >> "$OUT/failures.txt"; fi
  # The run's raw records as it ends, in case the call is cut before the report.
  "$PY" -c 'import json, pathlib, sys
d = pathlib.Path(sys.argv[1])
read = lambda f: json.loads(f.read_text()) if f.exists() else None
print(json.dumps({"name": d.name, "info": read(d / "info_rank0.json"), "metrics": read(d / "metrics.json")}))' \
    "$R/$1" >> "$OUT/runs.jsonl" 2>/dev/null
}
skipped() { echo "$1 skipped: $((BUDGET - (SECONDS - start)))s left, needs about $2s" | tee -a "$OUT/summary.txt"; }
# step NAME NEED MAX CMD...: CMD under its timeout, logged to RUNS_DIR/NAME.log, then its line.
step() {
  local name=$1 need=$2 max=$3 lim t rc
  shift 3
  lim=$(limit "$need" "$max") || { skipped "$name" "$need"; return; }
  t=$SECONDS
  timeout -k 20 "$lim" "$@" > "$R/$name.log" 2>&1
  rc=$?
  report_line "$name" "$rc" $((SECONDS - t)) "$lim"
}
# together "NAME NEED MAX GPUS CMD" ...: steps on disjoint GPUs at the same time (no spaces in paths).
together() {
  local pids=() names=() lims=() t=$SECONDS spec name need max gpus cmd lim i
  for spec in "$@"; do
    read -r name need max gpus cmd <<< "$spec"
    lim=$(limit "$need" "$max") || { skipped "$name" "$need"; continue; }
    # shellcheck disable=SC2086  # cmd is split into words on purpose
    CUDA_VISIBLE_DEVICES=$gpus timeout -k 20 "$lim" $cmd > "$R/$name.log" 2>&1 &
    pids+=($!) names+=("$name") lims+=("$lim")
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"
    report_line "${names[$i]}" $? $((SECONDS - t)) "${lims[$i]}"
  done
}

# a: SD3.5-M LoRA under ddp and fsdp2 (the 85-87% gap), rollout 3 profiled (left out of the figures).
a="--size $SD --per_gpu $A_PER --global_ranks $N4 --micro_batch $A_MB --rollouts 3 --no_flop_count"
for s in ddp fsdp2; do
  step "a_${s}_sd35m_lora" 90 160 $RUNN=$N4 "$SCALING" run --strategy $s $a \
    --profile "$R/a_${s}_sd35m_lora/profile" --out "$R/a_${s}_sd35m_lora"
done

# b: Qwen-Image-20B LoRA with CFG 4 (the recipe: GRPO-Guard, 2 trained steps of the first 5), fsdp2 on
# 2 GPUs, saved after rollout 1 and exported; beside it, one GPU samples the same global batch in the
# same chunks (the first rollout's reference).
b="--size $QWEN --micro_batch $B_MB --no_flop_count"
together \
  "b_fsdp2_qwen20b_lora 110 220 0,1 $RUNN=2 $SCALING run --strategy fsdp2 $b --per_gpu $B_PER --global_ranks 2 --rollouts 2 --save_at 1 --save_trained --export --out $R/b_fsdp2_qwen20b_lora" \
  "b_single_qwen20b_lora 100 220 2 $RUN1 --strategy single $b --per_gpu $B_PER --global_ranks 2 --rollouts 1 --activation_checkpointing --out $R/b_single_qwen20b_lora"

# c: FLUX.1-dev-sized full fine-tune, fsdp2 on 4 GPUs, frozen reference copy and β 0.04 (the measured
# 38.4 s rollout used activation checkpointing and micro-batch 1): no checkpointing, larger micro-batch.
c="--size $FLUX --full --kl_coef 0.04 --per_gpu $C_PER --global_ranks $N4 --micro_batch $C_MB --rollouts 2 --no_flop_count"
step c_fsdp2_flux12b_full 110 230 $RUNN=$N4 "$SCALING" run --strategy fsdp2 $c --out "$R/c_fsdp2_flux12b_full"

# d: Qwen-Image-20B full fine-tune, fsdp2 on 4 GPUs, no CFG, no KL (so no reference copy: see the memory
# arithmetic in docs/scaling.md).
d="--size $QWEN --full --no_cfg --kl_coef 0 --per_gpu $D_PER --global_ranks $N4 --micro_batch $D_MB --rollouts 2 --no_flop_count"
step d_fsdp2_qwen20b_full 90 200 $RUNN=$N4 "$SCALING" run --strategy fsdp2 $d --out "$R/d_fsdp2_qwen20b_full"

# Extras, while the budget lasts.
if [ -d "$R/b_fsdp2_qwen20b_lora/ckpt/step=1.ckpt" ]; then
  together "b_fsdp2_qwen20b_lora_resumed 70 150 0,1 $RUNN=2 $SCALING run --strategy fsdp2 $b --per_gpu $B_PER --global_ranks 2 --rollouts 2 --resume $R/b_fsdp2_qwen20b_lora/ckpt/step=1.ckpt --compare_to $R/b_fsdp2_qwen20b_lora --out $R/b_fsdp2_qwen20b_lora_resumed"
fi
step a_fsdp2_sd35m_lora_zero2 95 160 $RUNN=$N4 "$SCALING" run --strategy fsdp2 $a --reshard_after_forward false \
  --profile "$R/a_fsdp2_sd35m_lora_zero2/profile" --out "$R/a_fsdp2_sd35m_lora_zero2"
step c_fsdp2_flux12b_full_compiled 200 300 $RUNN=$N4 "$SCALING" run --strategy fsdp2 $c --compile_blocks \
  --compile_backend $CB --out "$R/c_fsdp2_flux12b_full_compiled"

echo "steps done in $((SECONDS - start))s" | tee -a "$OUT/summary.txt"
for f in "$R"/*/profile/rank0_summary.txt; do [ -f "$f" ] && { echo "### $f"; cat "$f"; }; done > "$OUT/profiles.txt"
"$PY" "$SCALING" report "$R" --out "$OUT/big_runs.json" 2>&1 | tail -n 20 | tee -a "$OUT/summary.txt"
