#!/usr/bin/env bash
# The scaling runs behind benchmarks/results/scaling_*.json, in two parts (each fits a 10-minute slot):
#   bash benchmarks/scaling_runs.sh lora RUNS_DIR [extra args]   # 1 GPU, ddp and fsdp2 with LoRA, resume
#   bash benchmarks/scaling_runs.sh full RUNS_DIR [extra args]   # ddp and fsdp2 full fine-tunes, resume
# then: python benchmarks/scaling.py report RUNS_DIR --out benchmarks/results/scaling_<machine>.json
set -u
part=$1; R=$2; shift 2
here=$(dirname "$0")
run1() { python3 "$here/scaling.py" run "$@"; }
run2() { python3 -m torch.distributed.run --standalone --nproc_per_node=2 "$here/scaling.py" run "$@"; }
mkdir -p "$R"
step() { local name=$1; shift; local t=$SECONDS; "$@" > "$R/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - t))s"; }
if [ "$part" = lora ]; then
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
