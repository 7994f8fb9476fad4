#!/usr/bin/env bash
# Session 25, one H100, carry .whl: the SwiGLU kernels' GPU tests at the final tiles (32 x 128, 8 warps), then
# issue 25's 7B e4m3 row through Ray: B=6 x 21, --fp8-delayed-swiglu-scale, --kept-quants-gib 1.4, 6 timed steps.
source benchmarks/device_lib.sh s25_final.log smi_s25_final.csv
PYTHONPATH=/tmp/site:$PWD timeout -s INT 150 python3 -m pytest -o addopts="" -q -p no:cacheprovider \
  tests/test_triton_gpu.py tests/test_triton_kernels.py -k "swiglu or fp8_quantize" >> "$L" 2>&1
echo "== tests rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"
run 7b_final 190 benchmarks/bench_train.py --model Qwen2.5-7B --gpus 1 --backend triton --seq-len 1024 --warmup-steps 2 \
 --lmhead-chunks 4 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --matmul-dtype e4m3 \
 --lmhead-dtype e4m3 --transient-quants --memory-table --steps 8 --batch-size 6 --grad-accumulation 21 \
 --fp8-delayed-swiglu-scale --kept-quants-gib 1.4 --json "$OUT/7b_final.json"
stop_smi 10
grep -hE "^== |passed|failed|FAILED|set-up|^step|tokens/s|peak|Error|error" "$L" | cut -c1-220
