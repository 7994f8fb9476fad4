#!/usr/bin/env bash
# Issue 25, for the next lease (nvidia-h100-x1; carry .whl and .anchors): --fp8-delayed-swiglu-scale (the SwiGLU
# forward writes the down projection's FP8 input and the backward the up+gate gradient, each in one pass at the
# same layer's previous scale, instead of a separate quantization / an absmax pass first).
# 1. GPU tests of the new path (kernel bytes against torch's float8 casts; graphs replay == eager);
# 2. 0.5B e4m3 + FP8 head, B=32, CUDA graphs, through Ray: without and with the flag, alternating, twice.
# The loss check (4 seeds, 300 steps) is a second call:
#   KIND=dly EXTRA="--matmul-dtype e4m3 --lmhead-dtype e4m3 --fp8-delayed-swiglu-scale" LOG=conv25d.log \
#     bash benchmarks/archive/device_issue25_conv.sh 42 43 44 45   (carry runs/shake too), compared with
#   device_issue25_conv_head.sh's FP8 (current scaling) run of the same seeds.
source benchmarks/device_lib.sh delayed25.log smi25d.csv
PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE \
  -m "gpu or not gpu" tests/test_triton_kernels.py tests/test_cuda_graphs.py -k "swiglu_backward_fp8 or swiglu_forward_fp8 or equals_eager" >> "$L" 2>&1
rc=$?; echo "gpu tests rc=$rc" | tee -a "$L"; grep -E "passed|failed" "$L" | tail -1
[ $rc = 0 ] || exit 1
A="benchmarks/bench_train.py --model Qwen2.5-0.5B --backend triton --batch-size 32 --grad-accumulation 1 --steps 25 --warmup-steps 5 --opt-m-dtype bf16 --opt-v-dtype bf16 --gpus 1 --matmul-dtype e4m3 --lmhead-dtype e4m3 --use-cuda-graphs"
for k in 1 2; do
  run current_$k 100 $A
  run delayed_$k 100 $A --fp8-delayed-swiglu-scale
done
stop_smi 10
grep -E "^== |tokens/s" "$L"
