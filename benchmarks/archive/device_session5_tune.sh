#!/usr/bin/env bash
# Session 5, call 3 (nvidia-h100-x1; carry .whl). Run from branch gemm-tuning with ./anchor_main =
# `git archive main backends llmq_ray benchmarks/engine_step.py` (untracked) beside it.
# 1. GPU tests: cuBLASLt bf16 GEMMs in every layout and every candidate, the tuned backend GEMMs, FP8 beta = 1,
#    the CUDA-graph runs (tuned choices captured), whole-model triton vs torch.
# 2. Alternating A/B of main (cuBLASLt only for the FP8 accumulation) vs the branch (every GEMM tuned):
#    1.5B bf16 and e4m3 (4 micro-steps), 0.5B bf16 and e4m3.
source benchmarks/device_lib.sh session5_tune.log smi5_tune.csv
run gpu_tests 240 -m pytest -m gpu -p no:cacheprovider -q -rfE -s tests/test_fp8_gpu.py tests/test_cuda_graphs.py \
  tests/test_triton_gpu.py -k "not recompile"
E15="benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-1.5B --batch-size 16 --steps 6 --grad-accumulation 4"
E05="benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-0.5B --batch-size 32 --steps 10"
for i in 1 2; do
  run_in anchor_main main_15b_bf16_$i 55 anchor_main/$E15
  run branch_15b_bf16_$i 55 $E15
  run_in anchor_main main_15b_e4m3_$i 55 anchor_main/$E15 --matmul-dtype e4m3
  run branch_15b_e4m3_$i 55 $E15 --matmul-dtype e4m3
done
run_in anchor_main main_05b_bf16 40 anchor_main/$E05
run branch_05b_bf16 40 $E05
run_in anchor_main main_05b_e4m3 40 anchor_main/$E05 --matmul-dtype e4m3
run branch_05b_e4m3 40 $E05 --matmul-dtype e4m3
stop_smi 10
grep -E "[0-9] passed|[0-9] failed|^FAILED|^ERROR|cuBLASLt|tuned bf16" "$L" | cut -c1-220 | tail -24
grep -E "^== |^RESULT" "$L" | cut -c1-220 | tail -50
