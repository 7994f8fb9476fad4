#!/usr/bin/env bash
# One device call on nvidia-h100-x1 (carry .whl), under 8 minutes: Qwen2.5-7B from scratch on ONE GPU.
# 7.6B parameters: bf16 weights (15 GB) + bf16 gradients (15 GB) + activations stay on the GPU; the fp32 master
# (30 GB) and bf16 Adam m/v (15 GB each) live in pinned host memory and stream through the GPU in 32M-element
# chunks, double-buffered, at every update (--offload-master/--offload-opt-m/--offload-opt-v).
# 0) the offload flags on CUDA are bit-identical to the resident run (tiny model; torch + triton, zero-copy too);
# 1) bf16, 2) e4m3: 8 steps of B=8 x T=1024 x grad-accumulation 8 (65k tokens/step), tokens/s over the last 5,
#    peak memory, and rank 0's memory table (device rows + host rows).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2
echo "== offload bit-identity on CUDA"; timeout 100 python3 -m pytest -q -m gpu tests/test_offload.py 2>&1 | tail -4
COMMON="--model Qwen2.5-7B --gpus 1 --backend triton --batch-size 8 --seq-len 1024 --grad-accumulation 8 --steps 8 --warmup-steps 3
 --lmhead-chunks 4 --recompute-ffn --master-dtype fp32 --opt-m-dtype bf16 --opt-v-dtype bf16
 --offload-master --offload-opt-m --offload-opt-v --memory-table"
run() { name=$1; shift; timeout 200 python3 "$@" > "$OUT/$name.log" 2>&1; echo "== $name (rc $?)"; grep -v "^step  *[0-9]" "$OUT/$name.log" | tail -30; grep "^step" "$OUT/$name.log" | tail -4; }
run 7b_bf16 benchmarks/bench_train.py $COMMON --model-dtype bf16 --json "$OUT/7b_bf16.json"
run 7b_e4m3 benchmarks/bench_train.py $COMMON --model-dtype bf16 --matmul-dtype e4m3 --json "$OUT/7b_e4m3.json"
