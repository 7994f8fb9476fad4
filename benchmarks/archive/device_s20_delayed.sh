#!/usr/bin/env bash
# Issue 25, session 20 (nvidia-h100-x1; carry .whl): the first GPU run of --fp8-delayed-swiglu-scale
# (device_issue25_delayed.sh, never run, plus a 1.5B pair): its GPU tests (kernel bytes against torch's float8
# casts; graph replay == eager), then 0.5B e4m3 + FP8 head, B=32, CUDA graphs, through Ray, without and with the
# flag, alternating, twice; then 1.5B e4m3 + FP8 head, B=16 x 16, once each.
source benchmarks/device_lib.sh delayed20.log smi20d.csv
PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE -o addopts="" \
  -m "gpu or not gpu" tests/test_triton_kernels.py tests/test_cuda_graphs.py tests/test_fp8_model.py \
  -k "delayed or swiglu_backward_fp8 or swiglu_forward_fp8" >> "$L" 2>&1
rc=$?; echo "gpu tests rc=$rc" | tee -a "$L"; grep -E "passed|failed" "$L" | tail -1
A="benchmarks/bench_train.py --model Qwen2.5-0.5B --backend triton --batch-size 32 --grad-accumulation 1 --steps 25
 --warmup-steps 5 --opt-m-dtype bf16 --opt-v-dtype bf16 --gpus 1 --matmul-dtype e4m3 --lmhead-dtype e4m3
 --use-cuda-graphs"
for k in 1 2; do
  run current_$k 90 $A --json "$OUT/current_$k.json"
  run delayed_$k 90 $A --fp8-delayed-swiglu-scale --json "$OUT/delayed_$k.json"
done
B="benchmarks/bench_train.py --model Qwen2.5-1.5B --backend triton --batch-size 16 --grad-accumulation 16 --steps 6
 --warmup-steps 2 --opt-m-dtype bf16 --opt-v-dtype bf16 --gpus 1 --matmul-dtype e4m3 --lmhead-dtype e4m3
 --use-cuda-graphs"
run current15 110 $B --json "$OUT/current15.json"
run delayed15 110 $B --fp8-delayed-swiglu-scale --json "$OUT/delayed15.json"
stop_smi 10
grep -E "^== |tokens/s" "$L"
