#!/usr/bin/env bash
# One device call (1 GPU; carry .whl and runs/shake): the GPU test suite, FP8 speed after the output-buffer fix,
# and issue 6's convergence check: 300 steps of Qwen2.5-0.5B from scratch on tiny-shakespeare, bf16 vs e4m3.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_gpu.py tests/test_torch_ref_gpu.py tests/test_triton_gpu.py tests/test_triton_kernels.py tests/test_optim.py > "$OUT/pytest_gpu.log" 2>&1; tail -3 "$OUT/pytest_gpu.log"
run() { name=$1; shift; timeout 200 python3 "$@" > "$OUT/$name.log" 2>&1; grep RESULT "$OUT/$name.log" || tail -3 "$OUT/$name.log"; }
run triton_05b_e4m3_b16 benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --batch-size 16 --matmul-dtype e4m3
run triton_05b_bf16_b16 benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --batch-size 16
COMMON="--model Qwen2.5-0.5B --from-scratch --train-file runs/shake/train-*.bin --eval-file runs/shake/eval.bin --batch-size 16 --seq-len 1024 --steps 300 --gpus 1 --backend triton --model-dtype bf16 --eval-every-n-steps 100 --no-export --sample-tokens 0"
timeout 200 python3 examples/train.py $COMMON --out-dir "$OUT/bf16" --log-file "$OUT/conv_bf16.json" > "$OUT/conv_bf16.log" 2>&1; tail -2 "$OUT/conv_bf16.log"
timeout 200 python3 examples/train.py $COMMON --matmul-dtype e4m3 --out-dir "$OUT/e4m3" --log-file "$OUT/conv_e4m3.json" > "$OUT/conv_e4m3.log" 2>&1; tail -2 "$OUT/conv_e4m3.log"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def tail_loss(name):
    log = json.load(open(f"{out}/{name}.json"))
    steps = [r["loss"] for r in log if r.get("log") == "step"]
    evals = [r["loss"] for r in log if r.get("log") == "eval"]
    return len(steps), sum(steps[-10:]) / 10, evals
for name in ("conv_bf16", "conv_e4m3"):
    try:
        print(name, tail_loss(name))
    except Exception as exc:
        print(name, "failed:", exc)
try:
    (_, a, ea), (_, b, eb) = tail_loss("conv_bf16"), tail_loss("conv_e4m3")
    print(f"last-10-step mean loss: bf16 {a:.4f} e4m3 {b:.4f} relative difference {abs(a - b) / a:.2%}; final eval bf16 {ea[-1]:.4f} e4m3 {eb[-1]:.4f}")
except Exception as exc:
    print("comparison failed:", exc)
PY
