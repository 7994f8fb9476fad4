#!/usr/bin/env bash
# Issue 27, session 15, the last call of the lease (nvidia-h100-x2; carry .whl, runs/shake): Qwen2.5-7B on 2 GPUs
# with the FP8 weight copies kept (no --transient-quants: ZeRO-1 halves the optimizer state, so they fit) in e4m3,
# and bf16 (device_issue27_big.sh's bf16 row asked for --transient-quants, which bf16 refuses); then the noise
# reference of the loss curves: one GPU, B=16 x 1 (the same global batch as B=8 x 2, summed in another order).
source benchmarks/device_lib.sh big27b.log smi27d.csv
S7="benchmarks/bench_train.py --model Qwen2.5-7B --gpus 2 --backend triton --seq-len 1024 --warmup-steps 2 --steps 4
 --lmhead-chunks 4 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --memory-table
 --batch-size 4 --grad-accumulation 32"
run 7b_e4m3_keep 115 $S7 --matmul-dtype e4m3 --lmhead-dtype e4m3
run 7b_bf16 125 $S7
C=$(sed -n 's/^C="\(.*\)"$/\1/p' benchmarks/archive/device_issue27_curves.sh)
run g1b 100 $C --gpus 1 --batch-size 16 --grad-accumulation 1 --out-dir $OUT/g1b --log-file $OUT/curve_g1b.json
stop_smi 10
grep -E "^== |tokens/s|Error|error:" "$L" | cut -c1-240
