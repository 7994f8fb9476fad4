#!/usr/bin/env bash
# Session 26 call B, one H100, carry .whl: issue 25's 7B rows -- e4m3 with the final code of session 25 (a second
# lease for the 21k bar), then bf16 with every optimizer state on the GPU at B=6 x 21 (session 23 tried B=4:
# 13,636; the offloaded B=8 row is 14,158) for the 15.2k bf16 bar.
source benchmarks/device_lib.sh s26b.log smi_s26b.csv
run 7b_e4m3 200 benchmarks/bench_train.py --model Qwen2.5-7B --gpus 1 --backend triton --seq-len 1024 --warmup-steps 2 \
 --lmhead-chunks 4 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --matmul-dtype e4m3 \
 --lmhead-dtype e4m3 --transient-quants --memory-table --steps 8 --batch-size 6 --grad-accumulation 21 \
 --fp8-delayed-swiglu-scale --kept-quants-gib 1.8 --json "$OUT/7b_e4m3.json"
run 7b_bf16 230 benchmarks/bench_train.py --model Qwen2.5-7B --gpus 1 --backend triton --seq-len 1024 --warmup-steps 2 \
 --lmhead-chunks 4 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --memory-table \
 --steps 7 --batch-size 6 --grad-accumulation 21 --json "$OUT/7b_bf16.json"
stop_smi 10
grep -hE "^== |set-up|^step|tokens/s|peak|free on|Error|error|memory" "$L" | cut -c1-220 | tail -40
