#!/usr/bin/env bash
# Issue 28, call C on nvidia-h200-x2 (carry .whl): Qwen2.5-14B ZeRO-3 vs --tensor-parallel 2 at 1k tokens per
# sequence in bf16, the recipe of device_s19_tp.sh (8-bit optimizer state, --recompute-ffn, B=4 x 4).
source benchmarks/device_lib.sh tp3.log smi_tp3.csv
S14="benchmarks/bench_train.py --model Qwen2.5-14B --gpus 2 --backend triton --warmup-steps 2 --steps 6
 --lmhead-chunks 8 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --recompute-ffn
 --grad-accumulation 4 --seq-len 1024 --batch-size 4"
run 14b_zero3_t1024 230 $S14 --zero-level 3 --json "$OUT/14b_zero3_t1024.json"
run 14b_tp2_t1024 230 $S14 --tensor-parallel 2 --json "$OUT/14b_tp2_t1024.json"
stop_smi 10
grep -E "^== |tokens/s|Error|error:|passed|failed|memory" "$L" | cut -c1-260
