#!/usr/bin/env bash
# Session 5, call 2 (nvidia-h100-x1; carry .whl). Run from branch cublaslt-accumulate with ./anchor_main =
# `git archive main backends llmq_ray benchmarks/engine_step.py` (untracked) beside it.
# 1. GPU tests of the cuBLASLt FP8 GEMM with beta = 1 (backends/cublaslt.py) and the CUDA-graph runs that
#    accumulate through it (e4m3, 2 micro-steps).
# 2. The GEMM survey: torch's choice against every cuBLASLt heuristic candidate, 1.5B shapes.
# 3. Alternating A/B of main vs the branch: 1.5B e4m3 B=16 with 4 and 16 micro-steps per update.
source benchmarks/device_lib.sh session5_lt.log smi5_lt.csv
run gpu_tests 200 -m pytest -m gpu -p no:cacheprovider -q -rfE -s tests/test_fp8_gpu.py tests/test_cuda_graphs.py \
  -k "not recompile"
run gemm_algos 120 benchmarks/gemm_algos.py --model Qwen2.5-1.5B --tokens 16384
E15="benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-1.5B --batch-size 16 --matmul-dtype e4m3"
for i in 1 2; do
  run_in anchor_main main_15b_e4m3_ga4_$i 50 anchor_main/$E15 --steps 6 --grad-accumulation 4
  run branch_15b_e4m3_ga4_$i 50 $E15 --steps 6 --grad-accumulation 4
done
run_in anchor_main main_15b_e4m3_ga16 70 anchor_main/$E15 --steps 3 --grad-accumulation 16
run branch_15b_e4m3_ga16 70 $E15 --steps 3 --grad-accumulation 16
stop_smi 10
grep -E "passed|failed|^FAILED|^ERROR|cuBLASLt beta" "$L" | cut -c1-200 | tail -14
grep -E "^== |^RESULT|^GEMMALGOS|^[a-z_]+\.(fwd|dgrad|wgrad) " "$L" | cut -c1-220 | tail -70
