#!/usr/bin/env bash
# Session 8, call 3 (nvidia-h100-x1; carry .whl), on main at 8e88d09 (same tree as calls 1-2):
# 1. Where a 1.5B bf16 step goes with the wgrads beside the backward (--overlap-wgrad 100) and without, same lease
#    (engine_step --profile: top kernels, GEMM / non-GEMM split, compute-stream idle time).
# 2. 0.5B bf16: does the side stream help at any SM count there (call 1: -1.1% at 100 SMs through Ray)?
source benchmarks/device_lib.sh session8c.log smi8c.csv
E15="benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-1.5B --batch-size 16 --grad-accumulation 4 --steps 3 --profile"
run prof15_side100 90 $E15 --overlap-wgrad 100
run prof15_plain 90 $E15
E05="benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-0.5B --batch-size 32 --grad-accumulation 1 --steps 20"
run e05_plain 45 $E05
run e05_side116 45 $E05 --overlap-wgrad 116
run e05_side124 45 $E05 --overlap-wgrad 124
run e05_plain_2 45 $E05
stop_smi 10
grep -E "^== |^RESULT" "$L" | cut -c1-220
