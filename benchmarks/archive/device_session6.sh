#!/usr/bin/env bash
# Prepared in session 5 for the next GPU session (nvidia-h100-x1; carry .whl). Run from main with ./anchor_5 =
# the tree measured in session 5's calls 3-5 (untracked):
#   git archive 6f47fd5 backends llmq_ray benchmarks/engine_step.py | (mkdir -p anchor_5 && tar -x -C anchor_5)
#   bash benchmarks/archive/device_session6.sh
# 1. GPU tests after the review fixes of e8f6be9 (not yet run on a GPU): every FP8 cuBLASLt candidate with beta 0
#    and 1, views at 16-byte offsets (alignment preferences), the tuned backend GEMMs, CUDA graphs, whole model.
# 2. The review fixes must not change speed: alternating A/B against anchor_5 at 0.5B bf16 and 1.5B e4m3.
source benchmarks/device_lib.sh session6.log smi6.csv
run gpu_tests 240 -m pytest -m gpu -p no:cacheprovider -q -rfE -s tests/test_fp8_gpu.py tests/test_cuda_graphs.py \
  tests/test_triton_gpu.py -k "not recompile"
E05="benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-0.5B --batch-size 32 --steps 10"
E15="benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-1.5B --batch-size 16 --steps 6 --grad-accumulation 4 --matmul-dtype e4m3"
run_in anchor_5 s5_05b_bf16 40 anchor_5/$E05
run now_05b_bf16 40 $E05
run_in anchor_5 s5_15b_e4m3 55 anchor_5/$E15
run now_15b_e4m3 55 $E15
stop_smi 10
grep -E "[0-9] passed|[0-9] failed|^FAILED|^ERROR|cuBLASLt|tuned bf16" "$L" | cut -c1-220 | tail -24
grep -E "^== |^RESULT" "$L" | cut -c1-220 | tail -20
