#!/usr/bin/env bash
# Session 8, call 2 (nvidia-h100-x1; carry .whl), on main at 8e88d09 (same tree as call 1): the four bars of
# issue 6 through Ray on one lease, with a plain / --overlap-wgrad-sms 100 A/B at 1.5B bf16.
# Call 1 measured 1.5B bf16 + side100 60,409; 0.5B bf16 side100 154,519 against plain 156,237 (-1.1%).
source benchmarks/device_lib.sh session8b.log smi8b.csv
R="benchmarks/bench_train.py --gpus 1 --backend triton --seq-len 1024 --use-cuda-graphs --opt-m-dtype bf16 --opt-v-dtype bf16"
R15="$R --model Qwen2.5-1.5B --batch-size 16 --grad-accumulation 16 --steps 6 --warmup-steps 2"
R05="$R --model Qwen2.5-0.5B --batch-size 32 --steps 25 --warmup-steps 5"
run ray15_plain 100 $R15
run ray15_side100 100 $R15 --overlap-wgrad-sms 100
run ray15_e4m3 100 $R15 --matmul-dtype e4m3
run ray05_e4m3 70 $R05 --matmul-dtype e4m3
run ray05_plain 70 $R05
stop_smi 10
grep -E "^== |^tokens/s" "$L" | cut -c1-220
