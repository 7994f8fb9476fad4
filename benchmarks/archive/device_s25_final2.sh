#!/usr/bin/env bash
# Session 25, one H100, carry .whl: GPU tests after the storage-less d_up_gate (FP8 on triton) -- the triton
# kernel tests on CUDA, the FP8 whole-model checks, CUDA graphs with e4m3 -- then issue 25's 7B e4m3 row through
# Ray with the 0.43 GiB it frees given to --kept-quants-gib (1.8).
source benchmarks/device_lib.sh s25_final2.log smi_s25_final2.csv
PYTHONPATH=/tmp/site:$PWD timeout -s INT 170 python3 -m pytest -o addopts="" -q -p no:cacheprovider -x \
  tests/test_triton_kernels.py tests/test_fp8_gpu.py tests/test_cuda_graphs.py -k "not cublaslt and not tuning" >> "$L" 2>&1
echo "== tests rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"
run 7b_final2 175 benchmarks/bench_train.py --model Qwen2.5-7B --gpus 1 --backend triton --seq-len 1024 --warmup-steps 2 \
 --lmhead-chunks 4 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --matmul-dtype e4m3 \
 --lmhead-dtype e4m3 --transient-quants --memory-table --steps 8 --batch-size 6 --grad-accumulation 21 \
 --fp8-delayed-swiglu-scale --kept-quants-gib 1.8 --json "$OUT/7b_final2.json"
stop_smi 10
grep -hE "^== |passed|failed|FAILED|set-up|^step|tokens/s|peak|free on|FP8 copies|Error|error" "$L" | cut -c1-220
