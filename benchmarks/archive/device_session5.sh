#!/usr/bin/env bash
# Prepared 2026-11-23 (session 4) for the next GPU session (nvidia-h100-x1; carry .whl). Run from branch
# atomic-absmax with ./anchor_main = `git archive main` (untracked) beside it:
#   git archive main backends llmq_ray benchmarks/engine_step.py | (mkdir -p anchor_main && tar -x -C anchor_main)
#   bash benchmarks/archive/device_session5.sh
# 1. GPU tests not yet run on a GPU: the FP8 SwiGLU backward at a ragged shape (16000 x 4860), the SwiGLU kernels
#    and the FP8 quantize / deterministic attention kernels after main's tidies (799b3fb, 5159a82: shared code moved
#    into jit helpers), and this branch (absmax folded in with an
#    exact int32 atomic max after a zeroing, instead of per-program partials and a one-program finishing kernel:
#    1,056 such launches per 4 micro-steps at 1.5B, 7.5 ms).
# 2. Alternating A/B of main vs the branch at 1.5B e4m3 (4 micro-steps) and 0.5B bf16 / e4m3 B=32.
source benchmarks/device_lib.sh session5.log smi5.csv
run gpu_tests 200 -m pytest -m gpu -p no:cacheprovider -q -rfE -s tests/test_triton_gpu.py tests/test_fp8_gpu.py \
  tests/test_cuda_graphs.py -k "not recompile"
E15="benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-1.5B --batch-size 16 --matmul-dtype e4m3 --steps 6 --grad-accumulation 4"
E05="benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-0.5B --batch-size 32 --steps 10"
for i in 1 2; do
  run_in anchor_main main_15b_e4m3_ga4_$i 50 anchor_main/$E15
  run branch_15b_e4m3_ga4_$i 50 $E15
done
run_in anchor_main main_05b_e4m3 40 anchor_main/$E05 --matmul-dtype e4m3
run branch_05b_e4m3 40 $E05 --matmul-dtype e4m3
run_in anchor_main main_05b_bf16 40 anchor_main/$E05
run branch_05b_bf16 40 $E05
run prof_branch_15b_e4m3 55 $E15 --profile
run prof_branch_15b_bf16 55 benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-1.5B --batch-size 16 \
  --steps 3 --grad-accumulation 4 --profile
# Probe for the next change: can cuBLASLt be reached (FP8 GEMM with beta = 1 for the wgrad accumulation)?
python3 - >> "$L" 2>&1 <<'PY'
import glob, shutil, os, torch
print("PROBE torch", torch.__version__, torch.version.cuda)
tp = os.path.dirname(torch.__file__)
hs = glob.glob("/usr/**/cublasLt.h", recursive=True) + glob.glob(tp + "/../nvidia/**/cublasLt.h", recursive=True)
print("PROBE headers", hs[:6])
if hs: shutil.copy(hs[0], os.environ.get("OUT", "/tmp/out") + "/cublasLt.h")
libs = glob.glob(tp + "/../nvidia/**/libcublasLt.so*", recursive=True) + glob.glob("/usr/**/libcublasLt.so*", recursive=True)
print("PROBE libs", libs[:6])
try:
    import cupy; print("PROBE cupy", cupy.__version__)
    from cupy_backends.cuda.libs import cublaslt
    print("PROBE cupy cublaslt", [n for n in dir(cublaslt) if not n.startswith("_")][:80])
except Exception as e: print("PROBE no cupy cublaslt:", e)
PY
stop_smi 10
grep -E "passed|failed|^FAILED|^ERROR|swiglu_backward_fp8|differs" "$L" | cut -c1-160 | tail -14
grep -E "^== |^RESULT|^KERNELS [a-z]|^KERNELS wall|^PROBE" "$L" | cut -c1-400 | tail -70
