#!/usr/bin/env bash
# Session 4 (2026-11-23), call 5 (nvidia-h100-x1; carry .whl; needs ./anchor_main = `git archive 078d19e`, the
# commit before the change, untracked): the two-pass FP8 SwiGLU backward (absmax pass, then both FP8 layouts of
# d(up+gate) straight from the SwiGLU math; no bf16 d(up+gate) written and read back).
#   GPU tests (bit-exact against backward + quantize at 0.5B shapes; FP8 model and CUDA-graph paths), an
#   alternating A/B at 1.5B e4m3 (4 micro-steps per update) and 0.5B e4m3, and 1.5B with 16 micro-steps.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L="$OUT/swiglu_fp8.log"; S="$OUT/smi_swiglu_fp8.csv"
T0=$(date +%s)
run() { name=$1; tmo=$2; tree=$3; shift 3; echo "== $name $(( $(date +%s) - T0 ))s" >> "$L"
  PYTHONPATH=/tmp/site:$PWD/$tree timeout -s INT -k 20 $tmo python3 "$@" >> "$L" 2>&1
  echo "== $name rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$L"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,utilization.gpu --format=csv,noheader -l 1 > "$S" 2>&1 &
SMI=$!
run gpu_tests 150 . -m pytest -m gpu -p no:cacheprovider -q -rfE -s tests/test_triton_gpu.py tests/test_fp8_gpu.py \
  tests/test_cuda_graphs.py -k "swiglu or bias or timings or whole_model or fp8 or e4m3"
E15="benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-1.5B --batch-size 16 --matmul-dtype e4m3"
for i in 1 2; do
  run anchor_15b_e4m3_ga4_$i 50 anchor_main anchor_main/$E15 --steps 8 --grad-accumulation 4
  run new_15b_e4m3_ga4_$i 50 . $E15 --steps 8 --grad-accumulation 4
done
E05="benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-0.5B --batch-size 32 --matmul-dtype e4m3 --steps 10"
run anchor_05b_e4m3 40 anchor_main anchor_main/$E05
run new_05b_e4m3 40 . $E05
run new_15b_e4m3_ga16 60 . $E15 --steps 4 --grad-accumulation 16
run new_15b_bf16_ga16 60 . benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-1.5B --batch-size 16 \
  --steps 4 --grad-accumulation 16
kill $SMI
echo "== smi: SM MHz, W, C every 10 s" >> "$L"
awk -F', ' 'NR % 10 == 0 {printf "%s %s %s | ", $2, $3, $4} END {print ""}' "$S" >> "$L"
grep -E "passed|failed|^FAILED|^ERROR|swiglu_backward|differs" "$L" | cut -c1-160 | tail -14
grep -E "^== |^RESULT" "$L" | cut -c1-200 | tail -30
