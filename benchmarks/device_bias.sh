#!/usr/bin/env bash
# Session 4 (2026-11-23), call 2 (nvidia-h100-x1; carry .whl; needs ./anchor_main = `git archive` of the commit
# before the change, untracked): the Triton bias gradient (one read of dqkv, max|dqkv| from the same read) in
# place of torch's dout.float().sum(0) (a cast copy and a reduce, ~0.2 ms per layer at 0.5B B=32).
#   GPU tests of the new kernel and of the FP8 / CUDA-graph model paths that now take their dqkv scale from it;
#   then alternating A/B (anchor_main vs this tree) at 0.5B B=32 with CUDA graphs, and 1.5B B=16, B=48 at 0.5B.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L="$OUT/bias.log"; S="$OUT/smi_bias.csv"
T0=$(date +%s)
# run NAME TIMEOUT TREE ARGS...: python3 TREE/ARGS[0] ... with TREE on the path
run() { name=$1; tmo=$2; tree=$3; shift 3; echo "== $name $(( $(date +%s) - T0 ))s" >> "$L"
  PYTHONPATH=/tmp/site:$PWD/$tree timeout -s INT -k 20 $tmo python3 "$@" >> "$L" 2>&1
  echo "== $name rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$L"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,utilization.gpu --format=csv,noheader -l 1 > "$S" 2>&1 &
SMI=$!
nvidia-smi -q -d PERFORMANCE > "$OUT/perf_idle.txt" 2>&1
run gpu_tests 200 . -m pytest -m gpu -p no:cacheprovider -q -rfE -s tests/test_triton_gpu.py tests/test_fp8_gpu.py \
  tests/test_cuda_graphs.py -k "not recompile"
E="benchmarks/engine_step.py --backend triton --cuda-graphs --steps 10 --model Qwen2.5-0.5B --batch-size 32"
for i in 1 2; do
  run anchor_05b_bf16_$i 45 anchor_main anchor_main/$E
  run new_05b_bf16_$i 45 . $E
  run anchor_05b_e4m3_$i 45 anchor_main anchor_main/$E --matmul-dtype e4m3
  run new_05b_e4m3_$i 45 . $E --matmul-dtype e4m3
done
nvidia-smi -q -d PERFORMANCE > "$OUT/perf_hot.txt" 2>&1
E15="benchmarks/engine_step.py --backend triton --cuda-graphs --steps 10 --model Qwen2.5-1.5B --batch-size 16"
run new_15b_e4m3 60 . $E15 --matmul-dtype e4m3
run new_15b_bf16 60 . $E15
run new_05b_e4m3_b48 45 . benchmarks/engine_step.py --backend triton --cuda-graphs --steps 10 --model Qwen2.5-0.5B \
  --batch-size 48 --matmul-dtype e4m3
kill $SMI
echo "== smi: SM MHz, W, C, util every 5 s" >> "$L"
awk -F', ' 'NR % 5 == 0 {printf "%s %s %s %s | ", $2, $3, $4, $5} END {print ""}' "$S" >> "$L"
grep -E "Event Reasons|Power Cap|Thermal|Slowdown|: Active" "$OUT/perf_hot.txt" | head -20 | tee -a "$L"
grep -E "passed|failed|^FAILED|^ERROR|max error|bias_backward" "$L" | tail -30
grep -E "^== |^RESULT" "$L" | cut -c1-220 | tail -40
