#!/usr/bin/env bash
# One device call for the CuPy backend (about 5 minutes on an H100; needs python3, torch, triton, cupy, no Ray):
#   1. kernel load time: a fresh process with an empty CUPY_CACHE_DIR (NVRTC compiles every module), then a
#      second process with the same cache (cubins loaded from disk; the bar is < 2 s);
#   2. python3 -m pytest -m gpu tests/test_cupy_gpu.py (every kernel vs torch_ref, FP8 bit-exact, model grads);
#   3. the per-kernel timing table, triton vs cupy, at 0.5B shapes (benchmarks/kernel_timing.py);
#   4. full-step tokens/s of Qwen2.5-0.5B from scratch, B=16, T=1024, triton vs cupy in bf16 and e4m3;
#   5. a short check that the Triton GPU tests still pass on the shared checks (tests/kernel_checks.py).
# 5. the full Triton GPU tests (they share tests/kernel_checks.py with the CuPy ones).
# Logs go to $OUT; the summary table is printed last.
#   bash benchmarks/archive/device_cupy.sh
set -u
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export CUPY_CACHE_DIR=$(mktemp -d /tmp/cupy-cache-XXXXXX)   # empty: the first process compiles
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import cupy, torch, triton; from cupy.cuda import compiler; print('torch', torch.__version__, 'triton', triton.__version__, 'cupy', cupy.__version__, 'nvrtc', compiler._get_nvrtc_version())" 2>&1 | tee -a "$OUT/gpu.txt"

LOAD='
import sys, time
t0 = time.perf_counter()
import torch
torch.zeros(1, device="cuda")
t1 = time.perf_counter()
from backends import get_backend
be = get_backend("cupy", "cuda")
t2 = time.perf_counter()
be.compile_all()
torch.cuda.synchronize()
t3 = time.perf_counter()
per = " ".join(f"{m}={s:.2f}" for m, s in be.k.compile_seconds.items())
print(f"LOAD {sys.argv[1]}: kernels ready {t3 - t1:.2f} s after torch+CUDA init ({t1 - t0:.2f} s): "
      f"import cupy + backend {t2 - t1:.2f} s, all modules {t3 - t2:.2f} s [{per}] arch {be.k.arch}")
'
echo "== 1. kernel load, cold then warm (CUPY_CACHE_DIR=$CUPY_CACHE_DIR)"
timeout 240 python3 -c "$LOAD" cold > "$OUT/load_cold.log" 2>&1; tail -1 "$OUT/load_cold.log"
timeout 60 python3 -c "$LOAD" warm > "$OUT/load_warm.log" 2>&1; tail -1 "$OUT/load_warm.log"
ls "$CUPY_CACHE_DIR" | wc -l | sed 's/^/cached cubins: /'

echo "== 2. GPU tests"
timeout 360 python3 -m pytest -m gpu tests/test_cupy_gpu.py -q -p no:cacheprovider -s -rfE > "$OUT/cupy_gpu_tests.log" 2>&1
grep -E "max error|worst|grad cosine|modules ready" "$OUT/cupy_gpu_tests.log" | head -60
tail -15 "$OUT/cupy_gpu_tests.log"

echo "== 3. kernel timings"
timeout 240 python3 benchmarks/kernel_timing.py --backends triton,cupy --reps 20 > "$OUT/kernel_timing.md" 2> "$OUT/kernel_timing.err"
cat "$OUT/kernel_timing.md"; tail -5 "$OUT/kernel_timing.err"

echo "== 4. full steps, Qwen2.5-0.5B B=16 T=1024"
step() { name=$1; shift; timeout 200 python3 benchmarks/engine_step.py --model Qwen2.5-0.5B --batch-size 16 --seq-len 1024 --steps 6 "$@" > "$OUT/$name.log" 2>&1; grep RESULT "$OUT/$name.log" || tail -5 "$OUT/$name.log"; }
step triton_bf16 --backend triton
step cupy_bf16 --backend cupy
step triton_e4m3 --backend triton --matmul-dtype e4m3
step cupy_e4m3 --backend cupy --matmul-dtype e4m3
step cupy_e4m3_graphs --backend cupy --matmul-dtype e4m3 --cuda-graphs

echo "== 5. Triton GPU tests on the shared checks (subset)"
timeout 240 python3 -m pytest -m gpu tests/test_triton_gpu.py tests/test_fp8_gpu.py -q -p no:cacheprovider -rfE \
  > "$OUT/triton_gpu_tests.log" 2>&1; tail -3 "$OUT/triton_gpu_tests.log"

echo "== summary"
cat "$OUT/gpu.txt"
grep -h "^LOAD" "$OUT"/load_*.log
echo "cupy GPU tests:   $(tail -1 "$OUT/cupy_gpu_tests.log")"
echo "triton GPU tests: $(tail -1 "$OUT/triton_gpu_tests.log")"
grep -h "sum" "$OUT/kernel_timing.md" | sed 's/^/kernel time sum (ms, triton | cupy): /'
printf "| %-6s | %-5s | %10s | %9s | %7s |\n" backend dtype "tokens/s" "step ms" "MFU"
for f in triton_bf16 cupy_bf16 triton_e4m3 cupy_e4m3 cupy_e4m3_graphs; do
  line=$(grep -h RESULT "$OUT/$f.log" 2>/dev/null)
  tps=$(echo "$line" | sed -n 's/.*tokens_per_s=\([0-9]*\).*/\1/p'); ms=$(echo "$line" | sed -n 's/.*median_step_ms=\([0-9.]*\).*/\1/p')
  mfu=$(echo "$line" | sed -n 's/.*MFU_vs_989=\([0-9.%]*\).*/\1/p')
  printf "| %-6s | %-5s | %10s | %9s | %7s |\n" "${f%_*}" "${f#*_}" "${tps:-FAILED}" "${ms:--}" "${mfu:--}"
done
