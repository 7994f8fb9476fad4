#!/usr/bin/env bash
# Session 24, one H100 (nvidia-h100-x1), carry .whl: issue 25's 7B e4m3 bar (21k, every optimizer state on the
# GPU). The 2026-11-26 row (19,068 tokens/s, h100-2026-11-26.md call 5) plus --fp8-delayed-swiglu-scale, at
# B=4 x 32 and at B=6 x 21 (the 11 GiB the first left free, for larger GEMMs). Each run is cut at its timeout.
source benchmarks/device_lib.sh s24_7b.log smi_s24_7b.csv
C="benchmarks/bench_train.py --model Qwen2.5-7B --gpus 1 --backend triton --seq-len 1024 --warmup-steps 2
 --lmhead-chunks 4 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --matmul-dtype
 e4m3 --lmhead-dtype e4m3 --transient-quants --memory-table --steps 6 --fp8-delayed-swiglu-scale"
run 7b_delayed_b4 150 $C --batch-size 4 --grad-accumulation 32 --json "$OUT/7b_delayed_b4.json"
run 7b_delayed_b6 150 $C --batch-size 6 --grad-accumulation 21 --json "$OUT/7b_delayed_b6.json"
stop_smi 10
grep -hE "^== |tokens/s|peak|Error|error" "$L" | cut -c1-240
