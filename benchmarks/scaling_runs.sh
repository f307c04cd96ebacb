#!/usr/bin/env bash
# The scaling runs behind benchmarks/results/scaling_*.json, in parts (each fits a 10-minute slot):
#   bash benchmarks/scaling_runs.sh lora RUNS_DIR [extra args]   # 1 GPU, ddp and fsdp2 with LoRA, resume
#   bash benchmarks/scaling_runs.sh full RUNS_DIR [extra args]   # ddp and fsdp2 full fine-tunes, resume
#   GPUS="1 2 4 8" bash benchmarks/scaling_runs.sh curve RUNS_DIR [extra args]
#       # the scaling curve: LoRA, ddp and fsdp2 at each GPU count with the same per-GPU batch
#       # (GPUS defaults to "1 2 4"; each count must not exceed the host's GPUs)
# then: python benchmarks/scaling.py report RUNS_DIR --out benchmarks/results/scaling_<machine>.json
set -u
part=$1; R=$2; shift 2
here=$(dirname "$0")
run1() { python3 "$here/scaling.py" run "$@"; }
run2() { python3 -m torch.distributed.run --standalone --nproc_per_node=2 "$here/scaling.py" run "$@"; }
mkdir -p "$R"
step() { local name=$1; shift; local t=$SECONDS; "$@" > "$R/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - t))s"; }
runN() { local n=$1; shift; python3 -m torch.distributed.run --standalone --nproc_per_node="$n" "$here/scaling.py" run "$@"; }
if [ "$part" = curve ]; then
  for n in ${GPUS:-1 2 4}; do
    if [ "$n" = 1 ]; then
      step single_lora_1gpu run1 --strategy single --global_ranks 1 --no_flop_count --out "$R/single_lora_1gpu" "$@"
      continue
    fi
    for s in ddp fsdp2; do
      step "${s}_lora_${n}gpu" runN "$n" --strategy "$s" --global_ranks "$n" --no_flop_count \
        --out "$R/${s}_lora_${n}gpu" "$@"
    done
  done
elif [ "$part" = lora ]; then
  step single_lora run1 --strategy single --rollouts 1 --out "$R/single_lora" "$@"
  step ddp_lora run2 --strategy ddp --out "$R/ddp_lora" "$@"
  step fsdp2_lora run2 --strategy fsdp2 --save_at 2 --save_trained --export --out "$R/fsdp2_lora" "$@"
  step fsdp2_lora_resumed run2 --strategy fsdp2 --resume "$R/fsdp2_lora/ckpt/step=2.ckpt" \
    --compare_to "$R/fsdp2_lora" --out "$R/fsdp2_lora_resumed" "$@"
else
  step fsdp2_full run2 --strategy fsdp2 --full --save_at 2 --save_trained --export --out "$R/fsdp2_full" "$@"
  step fsdp2_full_resumed run2 --strategy fsdp2 --full --resume "$R/fsdp2_full/ckpt/step=2.ckpt" \
    --compare_to "$R/fsdp2_full" --out "$R/fsdp2_full_resumed" "$@"
  step ddp_full run2 --strategy ddp --full --out "$R/ddp_full" "$@"
fi
