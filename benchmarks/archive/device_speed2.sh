#!/usr/bin/env bash
# One device call (1 GPU): speed after the FP8 changes (overwrite-first wgrad, fused dual-layout quantization),
# bf16 vs e4m3 at B=16 and B=32, and a profile of the e4m3 step.
export PYTHONPATH=$PWD; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
run() { name=$1; shift; timeout 200 python3 "$@" > "$OUT/$name.log" 2>&1; grep RESULT "$OUT/$name.log" || tail -3 "$OUT/$name.log"; }
run bf16_b16 benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --batch-size 16
run e4m3_b16 benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --batch-size 16 --matmul-dtype e4m3
run bf16_b32 benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --batch-size 32 --steps 5
run e4m3_b32 benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --batch-size 32 --steps 5 --matmul-dtype e4m3
run e4m3_15b benchmarks/engine_step.py --model Qwen2.5-1.5B --backend triton --batch-size 16 --steps 4 --matmul-dtype e4m3
run bf16_15b benchmarks/engine_step.py --model Qwen2.5-1.5B --backend triton --batch-size 16 --steps 4
timeout 150 python3 benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --batch-size 16 --steps 2 --profile --matmul-dtype e4m3 > "$OUT/profile_e4m3.log" 2>&1
sed -n '/Name/,$p' "$OUT/profile_e4m3.log" | cut -c1-60,120-175 | head -22
