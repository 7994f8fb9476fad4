#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (carry .whl and runs/shake = tiny-shakespeare tokenized with
# `python -m llmq_ray.data_pipeline.tokenize --input tinyshakespeare.txt --out runs/shake`):
# 1) the loss curve of 2 GPUs (ZeRO-1, grad-accumulation 1) against 1 GPU (grad-accumulation 2) over the same
#    global batch and data order; 2) scaling: tokens/s per GPU on 1 and 2 GPUs, random tokens.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
COMMON="--model Qwen2.5-0.5B --from-scratch --train-file runs/shake/train-*.bin --eval-file runs/shake/eval.bin --batch-size 16 --seq-len 1024 --steps 30 --backend triton --model-dtype bf16 --eval-every-n-steps 0 --no-export --sample-tokens 0"
run() { name=$1; shift; timeout 280 python3 "$@" > "$OUT/$name.log" 2>&1; echo "== $name (rc $?)"; tail -${TAILN:-6} "$OUT/$name.log"; }
run curve_1gpu examples/train.py $COMMON --gpus 1 --grad-accumulation 2 --out-dir "$OUT/g1" --log-file "$OUT/curve_1gpu.json"
run curve_2gpu examples/train.py $COMMON --gpus 2 --grad-accumulation 1 --out-dir "$OUT/g2" --log-file "$OUT/curve_2gpu.json"
TAILN=10 run scale_1gpu benchmarks/bench_train.py --model Qwen2.5-0.5B --batch-size 16 --steps 20 --gpus 1 --backend triton --json "$OUT/scale_1gpu.json"
TAILN=10 run scale_2gpu benchmarks/bench_train.py --model Qwen2.5-0.5B --batch-size 16 --steps 20 --gpus 2 --backend triton --json "$OUT/scale_2gpu.json"
python3 benchmarks/compare_loss_curves.py "$OUT/curve_1gpu.json" "$OUT/curve_2gpu.json" --labels "1 GPU" "2 GPUs" --every 3
