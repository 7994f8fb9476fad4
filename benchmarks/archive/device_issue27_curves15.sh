#!/usr/bin/env bash
# Issue 27, session 15 (nvidia-h100-x2; carry .whl, runs/shake): the 1-vs-2-GPU loss curves (the first half of
# device_issue27_curves.sh, run with the same commands), then Qwen2.5-1.5B e4m3 (+ FP8 head) on 1 and 2 GPUs again
# (B=16 x 16, ZeRO-1, CUDA graphs: session 14 measured 98.82%), then 0.5B bf16 on 2 GPUs with ZeRO-2 and ZeRO-3.
source benchmarks/device_lib.sh curves27.log smi27c.csv
sed -n '/^C="examples/,/^PY$/p' benchmarks/archive/device_issue27_curves.sh > /tmp/curves_part.sh
source /tmp/curves_part.sh
PYTHONPATH=/tmp/site:$PWD timeout $(( 560 - ($(date +%s) - T0) )) python3 benchmarks/speed_table.py \
  --models Qwen2.5-1.5B --backends triton --matmul-dtypes e4m3 --fp8-head --gpus 1 2 --no-hf-baseline \
  --row-timeout-s 110 --log $OUT/speed_table.log --json-out $OUT/table-1.5B-e4m3.json \
  --markdown-out $OUT/table-1.5B-e4m3.md 2>&1 | tail -3 | tee -a "$L"
cat $OUT/table-1.5B-e4m3.md | tee -a "$L"
A="benchmarks/bench_train.py --model Qwen2.5-0.5B --backend triton --batch-size 32 --grad-accumulation 1 --steps 12 --warmup-steps 3 --opt-m-dtype bf16 --opt-v-dtype bf16 --gpus 2 --memory-table"
[ $(( $(date +%s) - T0 )) -lt 480 ] && run z2_g2 $(( 585 - ($(date +%s) - T0) )) $A --zero-level 2
[ $(( $(date +%s) - T0 )) -lt 510 ] && run z3_g2 $(( 585 - ($(date +%s) - T0) )) $A --zero-level 3
stop_smi 10
grep -E "^== |tokens/s|largest" "$L"
