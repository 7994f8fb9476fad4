#!/usr/bin/env bash
# The README's one-GPU speed rows, with llm.q's prebuilt binary and the PyTorch baseline beside ours on the same
# machine; one part per device call (each under ten minutes), from the repository root, carry .whl and .anchors
# (.anchors/llmq-bin: llm.q's prebuilt train binary):
#   bash benchmarks/speed_table_1gpu.sh 0.5B   # Qwen2.5-0.5B bf16 and e4m3 (+ FP8 LM head + delayed SwiGLU scale),
#                                              # llm.q, HF baseline at B=32 x 4 (12 steps: 3 warm-up + 9 timed);
#                                              # then 7B e4m3 with every optimizer state on the GPU
#   bash benchmarks/speed_table_1gpu.sh 1.5B   # Qwen2.5-1.5B the same way at B=16 x 16 (7 steps: 2 warm-up + 5
#                                              # timed); then 7B bf16 with the Adam moments offloaded to the host
# Tables (markdown and JSON) and logs go to $OUT. Every row: T=1024, from scratch on random tokens, through Ray,
# CUDA graphs; tokens/s is the median of the timed steps (--steps minus --warmup-steps). The recipe of
# benchmarks/results/h200-2026-11-29.md (session 31, calls A and B).
PART=${1:?"usage: speed_table_1gpu.sh 0.5B|1.5B"}
source benchmarks/device_lib.sh speed_$PART.log smi_speed_$PART.csv
table() {  # MODEL TIMEOUT ROW_TIMEOUT EXTRA...
  m=$1; t=$2; r=$3; shift 3
  PYTHONPATH=/tmp/site:$PWD timeout $t python3 benchmarks/speed_table.py --models $m --backends triton \
    --matmul-dtypes bf16 e4m3 --fp8-head --fp8-delayed-swiglu-scale --llmq-bin .anchors/llmq-bin --row-timeout-s $r \
    --log $OUT/speed_table_$m.log --json-out $OUT/table_$m.json --markdown-out $OUT/table_$m.md "$@" 2>&1 | tail -3 | tee -a "$L"
  echo "== table $m $(( $(date +%s) - T0 ))s" | tee -a "$L"; }
case $PART in
0.5B)
  table Qwen2.5-0.5B 330 100 --triton-shape 32 4 12 3
  run 7b_e4m3 200 benchmarks/bench_train.py --model Qwen2.5-7B --gpus 1 --backend triton --seq-len 1024 \
   --warmup-steps 2 --lmhead-chunks 4 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 \
   --matmul-dtype e4m3 --lmhead-dtype e4m3 --transient-quants --memory-table --steps 8 --batch-size 6 \
   --grad-accumulation 21 --fp8-delayed-swiglu-scale --kept-quants-gib 1.8 --json "$OUT/7b_e4m3.json" ;;
1.5B)
  table Qwen2.5-1.5B 360 110
  run 7b_bf16_offload 225 benchmarks/bench_train.py --model Qwen2.5-7B --gpus 1 --backend triton --batch-size 8 \
   --seq-len 1024 --warmup-steps 2 --lmhead-chunks 4 --master-dtype bf16 --opt-m-dtype bf16 --opt-v-dtype bf16 \
   --offload-opt-m --offload-opt-v --model-dtype bf16 --memory-table --grad-accumulation 32 --steps 7 \
   --opt-resident-gib 12 --json "$OUT/7b_bf16.json" ;;
*) echo "usage: speed_table_1gpu.sh 0.5B|1.5B"; exit 2 ;;
esac
stop_smi 10
cat $OUT/table_*.md
grep -hE "^== |tokens/s|peak|Error|error" "$L" | cut -c1-220 | tail -30
