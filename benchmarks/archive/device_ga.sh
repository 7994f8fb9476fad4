#!/usr/bin/env bash
# Session 4 (2026-11-23), calls 3 and 4 (nvidia-h100-x1; carry .whl). After the Triton bias gradient (e845cca):
#   bash benchmarks/archive/device_ga.sh 1   does amortizing the update over 4 micro-steps help at 0.5B and 1.5B (the GPU is
#        at its 700 W cap, so the update's ~34 GB of traffic per 1.5B step slows the GEMMs even when overlapped)?
#        And the 0.5B B=32 CUDA-graph figures through the Ray worker (bench_train), bf16 Adam moments.
#   bash benchmarks/archive/device_ga.sh 2   Qwen2.5-7B bf16 through Ray, 32 micro-steps, 12 GiB of Adam state kept (the
#        configuration of session 3's 13,910)
source benchmarks/device_lib.sh "ga_$1.log" "smi_ga_$1.csv"
if [ "$1" = 1 ]; then
  E="benchmarks/engine_step.py --backend triton --cuda-graphs --steps 8"
  run 05b_bf16_b32_ga1 45 $E --model Qwen2.5-0.5B --batch-size 32
  run 05b_bf16_b32_ga4 60 $E --model Qwen2.5-0.5B --batch-size 32 --grad-accumulation 4
  run 05b_e4m3_b32_ga4 60 $E --model Qwen2.5-0.5B --batch-size 32 --grad-accumulation 4 --matmul-dtype e4m3
  run 15b_bf16_b16_ga1 60 $E --model Qwen2.5-1.5B --batch-size 16
  run 15b_bf16_b16_ga4 75 $E --model Qwen2.5-1.5B --batch-size 16 --grad-accumulation 4
  run 15b_e4m3_b16_ga4 75 $E --model Qwen2.5-1.5B --batch-size 16 --grad-accumulation 4 --matmul-dtype e4m3
  R="benchmarks/bench_train.py --model Qwen2.5-0.5B --gpus 1 --backend triton --batch-size 32 --seq-len 1024 --steps 25
     --warmup-steps 5 --use-cuda-graphs --opt-m-dtype bf16 --opt-v-dtype bf16"
  run ray_05b_e4m3_b32 100 $R --matmul-dtype e4m3
  run ray_05b_bf16_b32 100 $R
else
  B7="benchmarks/bench_train.py --model Qwen2.5-7B --gpus 1 --backend triton --batch-size 8 --seq-len 1024
   --warmup-steps 2 --lmhead-chunks 4 --master-dtype bf16 --opt-m-dtype bf16 --opt-v-dtype bf16 --offload-opt-m
   --offload-opt-v --model-dtype bf16 --memory-table"
  run 7b_bf16_ga32_kept12 330 $B7 --grad-accumulation 32 --steps 6 --opt-resident-gib 12
fi
stop_smi 10
grep -E "^== |^RESULT|tokens/s|step [0-9]+ .*ms|Traceback|Error" "$L" | cut -c1-220 | tail -50
