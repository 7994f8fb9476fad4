#!/usr/bin/env bash
# Session 31, one H200 (no H100 is a lent kind), carry .whl and .anchors: issue 25's whole table beside llm.q in
# one lease, at the code of the H100 figures (no kernel or engine change since session 26), as the record of where
# the bars stand on the hardware there is. PART=A: 0.5B (bf16, e4m3 + FP8 head + delayed SwiGLU scale, llm.q, HF
# baseline) at B=32 x 4, then 7B e4m3 with every optimizer state on the GPU (session 25's 21k row). PART=B: 1.5B
# the same way at B=16 x 16, then 7B bf16 with the Adam moments offloaded to the host (the README's row).
source benchmarks/device_lib.sh s31${PART,,}.log smi_s31${PART,,}.csv
table() {  # MODEL TIMEOUT ROW_TIMEOUT EXTRA...
  m=$1; t=$2; r=$3; shift 3
  PYTHONPATH=/tmp/site:$PWD timeout $t python3 benchmarks/speed_table.py --models $m --backends triton \
    --matmul-dtypes bf16 e4m3 --fp8-head --fp8-delayed-swiglu-scale --llmq-bin .anchors/llmq-bin --row-timeout-s $r \
    --log $OUT/speed_table_$m.log --json-out $OUT/table_$m.json --markdown-out $OUT/table_$m.md "$@" 2>&1 | tail -3 | tee -a "$L"
  echo "== table $m $(( $(date +%s) - T0 ))s" | tee -a "$L"; }
if [ "$PART" = A ]; then
  table Qwen2.5-0.5B 330 100 --triton-shape 32 4 12 3
  run 7b_e4m3 200 benchmarks/bench_train.py --model Qwen2.5-7B --gpus 1 --backend triton --seq-len 1024 \
   --warmup-steps 2 --lmhead-chunks 4 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 \
   --matmul-dtype e4m3 --lmhead-dtype e4m3 --transient-quants --memory-table --steps 8 --batch-size 6 \
   --grad-accumulation 21 --fp8-delayed-swiglu-scale --kept-quants-gib 1.8 --json "$OUT/7b_e4m3.json"
else
  table Qwen2.5-1.5B 360 110
  run 7b_bf16_offload 225 benchmarks/bench_train.py --model Qwen2.5-7B --gpus 1 --backend triton --batch-size 8 \
   --seq-len 1024 --warmup-steps 2 --lmhead-chunks 4 --master-dtype bf16 --opt-m-dtype bf16 --opt-v-dtype bf16 \
   --offload-opt-m --offload-opt-v --model-dtype bf16 --memory-table --grad-accumulation 32 --steps 7 \
   --opt-resident-gib 12 --json "$OUT/7b_bf16.json"
fi
stop_smi 10
cat $OUT/table_*.md
grep -hE "^== |tokens/s|peak|Error|error" "$L" | cut -c1-220 | tail -30
