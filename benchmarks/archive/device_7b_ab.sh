#!/usr/bin/env bash
# One device call (nvidia-h100-x1; carry .whl): the CUDA-graph replay test (now compared in ulps), then an A/B of
# the overlapped update at 7B on one H100 (bf16, bf16 master, bf16 Adam m/v offloaded, B=8 x 16), 9 updates each.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L="$OUT/ab7b.log"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$L"
timeout 100 python3 -m pytest -m gpu -p no:cacheprovider -rfE -s tests/test_cuda_graphs.py >> "$L" 2>&1; echo "graphs GPU test rc=$?"
COMMON="--model Qwen2.5-7B --gpus 1 --backend triton --batch-size 8 --seq-len 1024 --grad-accumulation 16 --steps 9 --warmup-steps 2
 --lmhead-chunks 4 --master-dtype bf16 --opt-m-dtype bf16 --opt-v-dtype bf16 --offload-opt-m --offload-opt-v --model-dtype bf16"
run() { name=$1; shift; echo "== $name" >> "$L"; timeout 230 python3 "$@" >> "$L" 2>&1; rc=$?; echo "== $name rc $rc" | tee -a "$L"; return $rc; }
run 7b_bf16_overlap benchmarks/bench_train.py $COMMON
run 7b_bf16_serial benchmarks/bench_train.py $COMMON --no-overlap-update
grep -E "^== |^tokens/s|^step |ulps|^FAILED|passed|failed|Error" "$L" | tail -40
