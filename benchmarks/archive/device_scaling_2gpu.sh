#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (carry .whl): issue 10's measurements that 2 GPUs allow — Qwen2.5-1.5B on
# 1 and 2 GPUs with ZeRO-1 and ZeRO-2 (bf16), and Qwen2.5-7B on 2 GPUs with ZeRO-1 (bf16, B=4).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
run() { name=$1; shift; timeout 200 python3 "$@" > "$OUT/$name.log" 2>&1; echo "== $name (rc $?)"; tail -2 "$OUT/$name.log"; }
run b15_g1_z1 benchmarks/bench_train.py --model Qwen2.5-1.5B --batch-size 16 --steps 10 --warmup-steps 3 --gpus 1 --backend triton --json "$OUT/b15_g1_z1.json"
run b15_g2_z1 benchmarks/bench_train.py --model Qwen2.5-1.5B --batch-size 16 --steps 10 --warmup-steps 3 --gpus 2 --backend triton --json "$OUT/b15_g2_z1.json"
run b15_g2_z2 benchmarks/bench_train.py --model Qwen2.5-1.5B --batch-size 16 --steps 10 --warmup-steps 3 --gpus 2 --backend triton --zero-level 2 --json "$OUT/b15_g2_z2.json"
run b7_g2_z1 benchmarks/bench_train.py --model Qwen2.5-7B --batch-size 4 --steps 8 --warmup-steps 3 --gpus 2 --backend triton --json "$OUT/b7_g2_z1.json"
