#!/usr/bin/env bash
# One device call (nvidia-h100-x1; carry .whl): the pipelined optimizer stream (one copy stream per PCIe
# direction, three slots) against the old one-stream/two-slot order and the raw link, then Qwen2.5-7B on one H100
# (bf16 master weights, bf16 Adam m/v offloaded, B=8 x 16 micro-steps = 131k tokens per update): bf16 without
# recomputation, and e4m3 with --transient-quants (FP8 weight copies per layer, 13 GiB less) without
# recomputation (falls back to --recompute-swiglu if that does not fit).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L="$OUT/stream7b.log"
nvidia-smi --query-gpu=name,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader | tee "$L"
timeout 100 python3 benchmarks/offload_stream.py --numel 2000000000 >> "$L" 2>&1; echo "stream rc=$?"
COMMON="--model Qwen2.5-7B --gpus 1 --backend triton --batch-size 8 --seq-len 1024 --grad-accumulation 16 --steps 5 --warmup-steps 2
 --lmhead-chunks 4 --master-dtype bf16 --opt-m-dtype bf16 --opt-v-dtype bf16 --offload-opt-m --offload-opt-v --memory-table"
run() { name=$1; shift; echo "== $name" >> "$L"; timeout 200 python3 "$@" >> "$L" 2>&1; rc=$?; echo "== $name rc $rc" | tee -a "$L"; return $rc; }
run 7b_bf16 benchmarks/bench_train.py $COMMON --model-dtype bf16
run 7b_e4m3_transient benchmarks/bench_train.py $COMMON --model-dtype bf16 --matmul-dtype e4m3 --transient-quants \
  || run 7b_e4m3_transient_rswiglu benchmarks/bench_train.py $COMMON --model-dtype bf16 --matmul-dtype e4m3 --transient-quants --recompute-swiglu
grep -E "^== |^RESULT|^tokens/s|^step |torch allocated|host: sum|activations|fp8|Error|error" "$L" | tail -40
