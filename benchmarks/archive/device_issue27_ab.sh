#!/usr/bin/env bash
# (Ran at 0c45ac7, when both overlaps were on by default and --no-overlap-grad-reduce existed; since then they are
# one opt-in flag, --overlap-comm.)
# Issue 27, session 14 (nvidia-h100-x2; carry .whl): which of the two ZeRO-1 overlaps costs time at 0.5B on 2 GPUs:
# each switched off alone, and both on without CUDA graphs (bf16, B=32, 1 micro-step, 25 steps, through Ray).
source benchmarks/device_lib.sh ab27.log smi27ab.csv
A="benchmarks/bench_train.py --model Qwen2.5-0.5B --backend triton --batch-size 32 --grad-accumulation 1 --steps 20 --warmup-steps 5 --opt-m-dtype bf16 --opt-v-dtype bf16 --gpus 2"
run no-grad-reduce 150 $A --use-cuda-graphs --no-overlap-grad-reduce
run no-overlap-update 150 $A --use-cuda-graphs --no-overlap-update
run both-eager 150 $A
stop_smi 10
grep -E "^== |tokens/s" "$L"
