#!/usr/bin/env bash
# Issue 27, for the next two-GPU lease (nvidia-h100-x2 / nvidia-h200-x2; carry .whl): the big models on 2 GPUs.
#   bash benchmarks/archive/device_issue27_big.sh
# Rows (through Ray, from scratch, random tokens, T=1024, e4m3 with the FP8 LM head unless bf16 is named):
# - Qwen2.5-7B e4m3, ZeRO-1, the 8-bit-state recipe of the one-GPU 19.1k row (bf16 weights as the record, e4m3 m,
#   bf16 v, --transient-quants), B=4 x 32 as there, and B=8 x 16 (ZeRO-1 halves the optimizer state per GPU);
# - Qwen2.5-7B bf16, the same recipe, B=4 x 32;
# - Qwen2.5-14B e4m3 and bf16, ZeRO-3 (weights, gradients and optimizer state sharded), the same 8-bit state,
#   --recompute-ffn, B=2 x 32.
source benchmarks/device_lib.sh big27.log smi27b.csv
S7="benchmarks/bench_train.py --model Qwen2.5-7B --gpus 2 --backend triton --seq-len 1024 --warmup-steps 2 --steps 5
 --lmhead-chunks 4 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --transient-quants
 --memory-table"
E="--matmul-dtype e4m3 --lmhead-dtype e4m3"
run 7b_e4m3_b4 120 $S7 $E --batch-size 4 --grad-accumulation 32
run 7b_e4m3_b8 120 $S7 $E --batch-size 8 --grad-accumulation 16
run 7b_bf16_b4 130 $S7 --batch-size 4 --grad-accumulation 32
S14="benchmarks/bench_train.py --model Qwen2.5-14B --gpus 2 --backend triton --seq-len 1024 --warmup-steps 1 --steps 3
 --lmhead-chunks 8 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --zero-level 3
 --recompute-ffn --batch-size 2 --grad-accumulation 32 --memory-table"
run 14b_e4m3 $(( 585 - ($(date +%s) - T0) > 150 ? 150 : 585 - ($(date +%s) - T0) )) $S14 --matmul-dtype e4m3
[ $(( $(date +%s) - T0 )) -lt 430 ] && run 14b_bf16 $(( 585 - ($(date +%s) - T0) )) $S14
stop_smi 10
grep -E "^== |tokens/s|Error|error:" "$L" | cut -c1-240
