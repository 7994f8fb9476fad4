#!/usr/bin/env bash
# One device call (nvidia-h100-x1; carry .whl): the GPU tests touched last (offload incl. cupy zero-copy, ZeRO-3
# with FP8 quants where present, CUDA graphs), then Qwen2.5-7B on one H100 with bf16 master weights (the
# weights are the master, written with stochastic rounding) so only Adam m/v stream over PCIe (60 GB per update
# instead of 120), grad-accumulation 16 (131k tokens per update): bf16 without recomputation, e4m3 with
# --recompute-ffn (the FP8 weight copies need the room).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L="$OUT/final.log"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$L"
timeout 240 python3 -m pytest -m gpu -p no:cacheprovider -rfE tests/test_offload.py tests/test_zero3.py tests/test_cuda_graphs.py tests/test_fp8_gpu.py >> "$L" 2>&1
echo "GPU tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$L" | tail -6
COMMON="--model Qwen2.5-7B --gpus 1 --backend triton --batch-size 8 --seq-len 1024 --grad-accumulation 16 --steps 5 --warmup-steps 2
 --lmhead-chunks 4 --master-dtype bf16 --opt-m-dtype bf16 --opt-v-dtype bf16 --offload-opt-m --offload-opt-v --memory-table"
run() { name=$1; shift; echo "== $name" >> "$L"; timeout 230 python3 "$@" >> "$L" 2>&1; echo "== $name rc $?"; }
run 7b_bf16 benchmarks/bench_train.py $COMMON --model-dtype bf16
run 7b_e4m3 benchmarks/bench_train.py $COMMON --model-dtype bf16 --matmul-dtype e4m3 --recompute-ffn
grep -E "^== |^tokens/s|^step |torch allocated|host: sum|activations|FP8 copies" "$L"
