#!/usr/bin/env bash
# Session 25, one H100, carry .whl and build/s25_base (a `git archive` of 4b6536c: before the FP8 tile change).
# Part 1: GPU tests of the new tiles (test_triton_gpu, test_triton_kernels on CUDA) and of --kept-quants-gib
# (test_offload on CUDA), then issue 25's 7B e4m3 row (B=6 x 21, --fp8-delayed-swiglu-scale) with the new tiles
# and --kept-quants-gib $KEPT. Part 2: the same row with the new tiles alone, and on the base tree.
source benchmarks/device_lib.sh s25_kept_$1.log smi_s25_kept_$1.csv
C="benchmarks/bench_train.py --model Qwen2.5-7B --gpus 1 --backend triton --seq-len 1024 --warmup-steps 2
 --lmhead-chunks 4 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --matmul-dtype
 e4m3 --lmhead-dtype e4m3 --transient-quants --memory-table --steps 7 --batch-size 6 --grad-accumulation 21
 --fp8-delayed-swiglu-scale"
if [ "$1" = 1 ]; then
  PYTHONPATH=/tmp/site:$PWD timeout -s INT 240 python3 -m pytest -o addopts="" -q -p no:cacheprovider \
    tests/test_triton_gpu.py tests/test_triton_kernels.py tests/test_offload.py -k "not print_kernel_timings" \
    >> "$L" 2>&1; echo "== tests rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"
  run 7b_kept 175 $C --kept-quants-gib ${KEPT:-1.4} --json "$OUT/7b_kept.json"
else
  run 7b_tiles 175 $C --json "$OUT/7b_tiles.json"
  run_in build/s25_base 7b_base 175 $C --json "$OUT/7b_base.json"
fi
stop_smi 10
grep -hE "^== |passed|failed|FAILED|set-up|tokens/s|peak|Error|error|fp8 |weights" "$L" | cut -c1-220
