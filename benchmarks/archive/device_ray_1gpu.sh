#!/usr/bin/env bash
# One device call (1 GPU, carry .whl): the whole Ray runtime on one GPU — torch and triton backends — with Ray's
# own overhead (coordinator wall time per step minus the time inside the worker's train_step).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
run() { name=$1; shift; timeout 280 python3 "$@" > "$OUT/$name.log" 2>&1; echo "== $name (rc $?)"; tail -12 "$OUT/$name.log"; }
run ray_torch_05b_b16 benchmarks/bench_train.py --model Qwen2.5-0.5B --batch-size 16 --steps 15 --gpus 1 --backend torch --json "$OUT/ray_torch_05b_b16.json"
run ray_triton_05b_b16 benchmarks/bench_train.py --model Qwen2.5-0.5B --batch-size 16 --steps 25 --gpus 1 --backend triton --json "$OUT/ray_triton_05b_b16.json"
