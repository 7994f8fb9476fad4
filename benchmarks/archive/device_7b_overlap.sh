#!/usr/bin/env bash
# One device call (nvidia-h100-x1; carry .whl): the overlapped update's GPU test, then Qwen2.5-7B on one H100
# with the update beside the next forward (bf16 master weights, bf16 Adam m/v offloaded, B=8 x 16 micro-steps =
# 131k tokens per update; bf16 and e4m3 with --transient-quants, no recomputation), then the other GPU tests of
# the parts touched this session with the time left.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L="$OUT/overlap7b.log"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$L"
timeout 120 python3 -m pytest -m gpu -p no:cacheprovider -rfE tests/test_update_overlap.py >> "$L" 2>&1; echo "overlap GPU test rc=$?"
COMMON="--model Qwen2.5-7B --gpus 1 --backend triton --batch-size 8 --seq-len 1024 --grad-accumulation 16 --steps 6 --warmup-steps 2
 --lmhead-chunks 4 --master-dtype bf16 --opt-m-dtype bf16 --opt-v-dtype bf16 --offload-opt-m --offload-opt-v --memory-table"
run() { name=$1; shift; echo "== $name" >> "$L"; timeout 200 python3 "$@" >> "$L" 2>&1; rc=$?; echo "== $name rc $rc" | tee -a "$L"; return $rc; }
run 7b_bf16_overlap benchmarks/bench_train.py $COMMON --model-dtype bf16
run 7b_e4m3_transient_overlap benchmarks/bench_train.py $COMMON --model-dtype bf16 --matmul-dtype e4m3 --transient-quants
left=$((575 - SECONDS)); echo "== gpu tests with ${left}s" >> "$L"
[ $left -gt 30 ] && timeout $left python3 -m pytest -m gpu -p no:cacheprovider -rfE tests/test_offload.py tests/test_fp8_gpu.py tests/test_cuda_graphs.py tests/test_zero3.py >> "$L" 2>&1
echo "other GPU tests rc=$?"
grep -E "^== |^tokens/s|^step |torch allocated|FP8 copies|^FAILED|^ERROR|passed|failed|Error" "$L" | tail -40
