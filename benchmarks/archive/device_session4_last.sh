#!/usr/bin/env bash
# Session 4 (2026-11-23), call 6 (nvidia-h100-x1; carry .whl), after the FP8 SwiGLU backward (376af5c): where a
# 1.5B e4m3 step goes now (profile, 4 micro-steps per update), whether B=24 fits and helps at 1.5B, and 1.5B e4m3
# with 16 micro-steps through the Ray worker.
source benchmarks/device_lib.sh "last.log" "smi_last.csv"
E="benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-1.5B --grad-accumulation 4"
run prof_15b_e4m3_b16_ga4 55 $E --batch-size 16 --matmul-dtype e4m3 --steps 3 --profile
run 15b_e4m3_b24_ga4 55 $E --batch-size 24 --matmul-dtype e4m3 --steps 5
run 15b_bf16_b24_ga4 60 $E --batch-size 24 --steps 5
run ray_15b_e4m3_b16_ga16 100 benchmarks/bench_train.py --model Qwen2.5-1.5B --gpus 1 --backend triton --batch-size 16 \
  --seq-len 1024 --grad-accumulation 16 --steps 6 --warmup-steps 2 --use-cuda-graphs --opt-m-dtype bf16 \
  --opt-v-dtype bf16 --matmul-dtype e4m3
stop_smi 10
grep -E "^== |^RESULT|^KERNELS [a-z]|^KERNELS wall|^GAPS streams|^tokens/s|OutOfMemory|out of memory" "$L" | cut -c1-200 | tail -40
