#!/usr/bin/env bash
# One device call: FP8 GPU tests, then single-process engine timings (torch / triton, bf16 / e4m3) next to the
# HF torch.compile baseline, 0.5B and 1.5B. Logs go to $OUT; the RESULT lines are printed last.
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -m gpu tests/test_fp8_gpu.py -q -p no:cacheprovider -s > "$OUT/fp8_gpu_tests.log" 2>&1; tail -3 "$OUT/fp8_gpu_tests.log"
run() { name=$1; shift; timeout 240 python3 "$@" > "$OUT/$name.log" 2>&1; grep RESULT "$OUT/$name.log" || tail -3 "$OUT/$name.log"; }
run triton_05b_bf16 benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --batch-size 16
run triton_05b_e4m3 benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --batch-size 16 --matmul-dtype e4m3
run torch_05b_bf16 benchmarks/engine_step.py --model Qwen2.5-0.5B --backend torch --batch-size 16 --steps 4
run hf_05b benchmarks/hf_baseline.py --model Qwen2.5-0.5B --batch-size 16
run triton_15b_bf16 benchmarks/engine_step.py --model Qwen2.5-1.5B --backend triton --batch-size 8 --steps 5
run triton_15b_e4m3 benchmarks/engine_step.py --model Qwen2.5-1.5B --backend triton --batch-size 8 --steps 5 --matmul-dtype e4m3
timeout 200 python3 benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --batch-size 16 --steps 2 --profile > "$OUT/profile_triton_05b_bf16.log" 2>&1
timeout 200 python3 benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --batch-size 16 --steps 2 --profile --matmul-dtype e4m3 > "$OUT/profile_triton_05b_e4m3.log" 2>&1
echo "== summary"; grep -h RESULT "$OUT"/*.log
