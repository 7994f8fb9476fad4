#!/usr/bin/env bash
# Ran at commit e2a9f3e (its tools are there; main later removed what this call showed slower or inconclusive).
# Session 6, call 6 (nvidia-h100-x1; carry .whl), on what is left of the session's device time:
# 1. The RMSNorm backward's launch shapes alone at 1.5B (B=16) and 0.5B (B=32) sizes (data for the next session).
# 2. The 1.5B bf16 bar through Ray twice more on main as it stands (kernels as measured in call 3).
source benchmarks/device_lib.sh session6f.log smi6f.csv
run bench_15b 40 benchmarks/rmsnorm_bwd_bench.py --rows 16384 --channels 1536
run bench_05b 40 benchmarks/rmsnorm_bwd_bench.py --rows 32768 --channels 896
R="benchmarks/bench_train.py --gpus 1 --backend triton --seq-len 1024 --use-cuda-graphs --opt-m-dtype bf16 --opt-v-dtype bf16"
run ray_15b_bf16 95 $R --model Qwen2.5-1.5B --batch-size 16 --grad-accumulation 16 --steps 6 --warmup-steps 2
run ray_15b_bf16_2 95 $R --model Qwen2.5-1.5B --batch-size 16 --grad-accumulation 16 --steps 6 --warmup-steps 2
stop_smi 10
grep -E "^rmsnorm_bwd|^BEST" "$L" | cut -c1-200
grep -E "^== |^tokens/s" "$L" | cut -c1-220
