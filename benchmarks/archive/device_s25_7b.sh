#!/usr/bin/env bash
# Session 25, one H100 (nvidia-h100-x1), carry .whl: issue 25's 7B e4m3 row (bar 21k, every optimizer state on
# the GPU). 1) a profile of the row's step (engine, no Ray; 3 micro-steps + update): where the ~297 ms per
# micro-step go; 2) the row's command (B=6 x 21, --fp8-delayed-swiglu-scale) and 3) the same without the flag,
# side by side in one lease. The bench runs print their set-up time (init_params now draws in a thread pool).
source benchmarks/device_lib.sh s25_7b.log smi_s25_7b.csv
run prof_7b 170 benchmarks/engine_step.py --model Qwen2.5-7B --backend triton --batch-size 6 --grad-accumulation 3 \
 --steps 3 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --matmul-dtype e4m3 --lmhead-dtype e4m3 \
 --lmhead-chunks 4 --transient-quants --fp8-delayed-swiglu-scale --profile
C="benchmarks/bench_train.py --model Qwen2.5-7B --gpus 1 --backend triton --seq-len 1024 --warmup-steps 2
 --lmhead-chunks 4 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --matmul-dtype
 e4m3 --lmhead-dtype e4m3 --transient-quants --memory-table --steps 7 --batch-size 6 --grad-accumulation 21"
run 7b_delayed 175 $C --fp8-delayed-swiglu-scale --json "$OUT/7b_delayed.json"
run 7b_plain 175 $C --json "$OUT/7b_plain.json"
stop_smi 10
grep -hE "^== |set-up|tokens/s|peak|RESULT|KERNELS|TOPKERNEL|GAPS streams|Error|error" "$L" | cut -c1-200
