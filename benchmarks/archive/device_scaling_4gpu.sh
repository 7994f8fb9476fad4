#!/usr/bin/env bash
# One device call on nvidia-h200-x4 (carry .whl, runs/shake): issue 10 on 4 GPUs — Qwen2.5-1.5B bf16 on 1 and 4
# GPUs (ZeRO-1), 1.5B e4m3 on 4 GPUs, 7B bf16 on 4 GPUs, and the loss curves of 1 GPU (grad-accumulation 4)
# against 4 GPUs (grad-accumulation 1) over the same global batch (0.5B on tiny-shakespeare, 20 steps).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L="$OUT/scaling4.log"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee "$L"
run() { name=$1; shift; echo "== $name" >> "$L"; timeout 150 python3 "$@" >> "$L" 2>&1; echo "== $name rc $?"; grep -A1 "^Qwen" "$L" | tail -1; }
B="benchmarks/bench_train.py --backend triton --warmup-steps 3"
run b15_g1 $B --model Qwen2.5-1.5B --batch-size 16 --steps 8 --gpus 1
run b15_g4 $B --model Qwen2.5-1.5B --batch-size 16 --steps 8 --gpus 4
run b15_g4_e4m3 $B --model Qwen2.5-1.5B --batch-size 16 --steps 8 --gpus 4 --matmul-dtype e4m3
run b7_g4 $B --model Qwen2.5-7B --batch-size 4 --steps 7 --gpus 4
C="examples/train.py --model Qwen2.5-0.5B --from-scratch --train-file runs/shake/train-*.bin --eval-file runs/shake/eval.bin --batch-size 16 --seq-len 1024 --steps 20 --backend triton --model-dtype bf16 --eval-every-n-steps 0 --no-export --sample-tokens 0 --no-progress"
timeout 120 python3 $C --gpus 1 --grad-accumulation 4 --out-dir "$OUT/c1" --log-file "$OUT/curve_g1.json" > /dev/null 2>&1; echo "curve g1 rc $?"
timeout 120 python3 $C --gpus 4 --grad-accumulation 1 --out-dir "$OUT/c4" --log-file "$OUT/curve_g4.json" > /dev/null 2>&1; echo "curve g4 rc $?"
python3 benchmarks/compare_loss_curves.py "$OUT/curve_g1.json" "$OUT/curve_g4.json" --labels "1 GPU (x4 acc.)" "4 GPUs" --every 2
grep -E "^Qwen|^tokens/s" "$L"
