#!/usr/bin/env bash
# Session 5, call 4 (nvidia-h100-x1; carry .whl), from main after the cuBLASLt changes (beta = 1 FP8
# accumulation, tuned GEMM algorithms): the issue-6 configurations through the Ray worker (bench_train.py), the
# closest-to-the-bar first.
source benchmarks/device_lib.sh session5_ray.log smi5_ray.csv
R="benchmarks/bench_train.py --gpus 1 --backend triton --seq-len 1024 --use-cuda-graphs --opt-m-dtype bf16 --opt-v-dtype bf16"
run ray_15b_e4m3_b24_ga8 100 $R --model Qwen2.5-1.5B --batch-size 24 --grad-accumulation 8 --steps 7 --warmup-steps 2 --matmul-dtype e4m3
run ray_05b_bf16 70 $R --model Qwen2.5-0.5B --batch-size 32 --steps 25 --warmup-steps 5
run ray_15b_e4m3_b16_ga16 100 $R --model Qwen2.5-1.5B --batch-size 16 --grad-accumulation 16 --steps 6 --warmup-steps 2 --matmul-dtype e4m3
run ray_15b_bf16_b16_ga16 100 $R --model Qwen2.5-1.5B --batch-size 16 --grad-accumulation 16 --steps 6 --warmup-steps 2
run ray_05b_e4m3 70 $R --model Qwen2.5-0.5B --batch-size 32 --steps 25 --warmup-steps 5 --matmul-dtype e4m3
stop_smi 10
grep -E "^== |^tokens/s|^Qwen|^step " "$L" | cut -c1-220 | tail -70
