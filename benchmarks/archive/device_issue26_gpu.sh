#!/usr/bin/env bash
# Issue 26, prepared in session 15 for the next one-GPU lease (nvidia-h100-x1; carry .whl), two calls:
#   bash benchmarks/archive/device_issue26_gpu.sh tests    # the new GPU checks, then Qwen3-0.6B's speed rows
#   bash benchmarks/archive/device_issue26_gpu.sh speed    # Qwen3-1.7B and GPT-2 124M / 1558M rows
# tests: the fused Triton QK-norm at Qwen3-0.6B shapes (fp32, bf16) and compiled (tests/test_triton_kernels.py),
# whole-model bf16 gradients triton / cupy vs torch on tiny-qwen3 (cosine >= 0.99), CUDA-graph replay == eager
# for GPT-2 (bf16, e4m3); speed rows through speed_table.py with the HF baseline beside them (T=1024, B=16).
PART=${1:?"usage: device_issue26_gpu.sh tests|speed"}
source benchmarks/device_lib.sh gpu26-$PART.log smi26-$PART.csv
export PYTHONUNBUFFERED=1
table() { PYTHONPATH=/tmp/site:$PWD timeout $(( 585 - ($(date +%s) - T0) )) python3 benchmarks/speed_table.py \
  --backends triton --row-timeout-s 120 --log $OUT/speed_table.log "$@" 2>&1 | tail -2 | tee -a "$L"; }
case $PART in
tests)
  PYTHONPATH=/tmp/site:$PWD timeout 280 python3 -m pytest -q -p no:cacheprovider -m gpu -s -rs \
    tests/test_triton_gpu.py tests/test_cupy_gpu.py tests/test_cuda_graphs.py -k "qk_norm or qwen3 or gpt2" \
    2>&1 | tail -30 | tee -a "$L"
  PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py \
    -k qk_norm 2>&1 | tail -3 | tee -a "$L"
  table --models Qwen3-0.6B --matmul-dtypes bf16 e4m3 --fp8-head --markdown-out $OUT/table-qwen3-0.6b.md ;;
speed)
  table --models Qwen3-1.7B --matmul-dtypes bf16 e4m3 --fp8-head --markdown-out $OUT/table-qwen3-1.7b.md
  table --models gpt2 gpt2-xl --matmul-dtypes bf16 --markdown-out $OUT/table-gpt2.md ;;
esac
cat $OUT/table-*.md >> "$L" 2>/dev/null
stop_smi 10
grep -E "passed|failed|tokens/s|^\| " "$L" | cut -c1-220
