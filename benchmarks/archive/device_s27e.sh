#!/usr/bin/env bash
# Session 27 call E, 2x H200 (nvidia-h200-x2), carry .whl: ZeRO-3 e4m3 on two GPUs through Ray, Qwen2.5-1.5B B=16 x 4,
# alternated without and with --kept-quants-gib auto (every layer's FP8 copies kept for the step, so from each
# step's second micro-step on no layer is gathered and no weight is re-quantized).
source benchmarks/device_lib.sh s27e.log smi_s27e.csv
B="benchmarks/bench_train.py --model Qwen2.5-1.5B --gpus 2 --backend triton --seq-len 1024 --batch-size 16 --grad-accumulation 4 --steps 9 --warmup-steps 3 --zero-level 3 --model-dtype bf16 --matmul-dtype e4m3 --opt-m-dtype bf16 --opt-v-dtype bf16"
run none1 130 $B
run kept1 130 $B --kept-quants-gib auto
run none2 130 $B
run kept2 130 $B --kept-quants-gib auto
stop_smi 10
grep -hE "^== |tokens_per_s|RESULT|Error|error" "$L" | cut -c1-240 | tail -24
