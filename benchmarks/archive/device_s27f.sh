#!/usr/bin/env bash
# Session 27 call F, 2x H200, carry .whl and build/s27_base (a worktree of 11c0503, before ZeRO-3 skipped the
# gathers of kept layers): call E's ZeRO-3 e4m3 1.5B row with --kept-quants-gib auto, alternated between that tree
# (kept copies, every layer still gathered every pass) and this one (kept layers not gathered again in the step).
source benchmarks/device_lib.sh s27f.log smi_s27f.csv
A="--model Qwen2.5-1.5B --gpus 2 --backend triton --seq-len 1024 --batch-size 16 --grad-accumulation 4 --steps 9 --warmup-steps 3 --zero-level 3 --model-dtype bf16 --matmul-dtype e4m3 --opt-m-dtype bf16 --opt-v-dtype bf16 --kept-quants-gib auto"
run_in build/s27_base base1 130 build/s27_base/benchmarks/bench_train.py $A
run new1 130 benchmarks/bench_train.py $A
run_in build/s27_base base2 130 build/s27_base/benchmarks/bench_train.py $A
run new2 130 benchmarks/bench_train.py $A
stop_smi 10
grep -hE "^== |^tokens/s|Error" "$L" | cut -c1-200 | tail -16
