#!/usr/bin/env bash
# Session 4 (2026-11-23), call 5 (nvidia-h100-x1; carry .whl; needs ./anchor_main = `git archive 078d19e`, the
# commit before the change, untracked): the two-pass FP8 SwiGLU backward (absmax pass, then both FP8 layouts of
# d(up+gate) straight from the SwiGLU math; no bf16 d(up+gate) written and read back).
#   GPU tests (bit-exact against backward + quantize at 0.5B shapes; FP8 model and CUDA-graph paths), an
#   alternating A/B at 1.5B e4m3 (4 micro-steps per update) and 0.5B e4m3, and 1.5B with 16 micro-steps.
source benchmarks/device_lib.sh "swiglu_fp8.log" "smi_swiglu_fp8.csv"
run gpu_tests 150 -m pytest -m gpu -p no:cacheprovider -q -rfE -s tests/test_triton_gpu.py tests/test_fp8_gpu.py \
  tests/test_cuda_graphs.py -k "swiglu or bias or timings or whole_model or fp8 or e4m3"
E15="benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-1.5B --batch-size 16 --matmul-dtype e4m3"
for i in 1 2; do
  run_in anchor_main anchor_15b_e4m3_ga4_$i 50 anchor_main/$E15 --steps 8 --grad-accumulation 4
  run new_15b_e4m3_ga4_$i 50 $E15 --steps 8 --grad-accumulation 4
done
E05="benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-0.5B --batch-size 32 --matmul-dtype e4m3 --steps 10"
run_in anchor_main anchor_05b_e4m3 40 anchor_main/$E05
run new_05b_e4m3 40 $E05
run new_15b_e4m3_ga16 60 $E15 --steps 4 --grad-accumulation 16
run new_15b_bf16_ga16 60 benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-1.5B --batch-size 16 \
  --steps 4 --grad-accumulation 16
stop_smi 10
grep -E "passed|failed|^FAILED|^ERROR|swiglu_backward|differs" "$L" | cut -c1-160 | tail -14
grep -E "^== |^RESULT" "$L" | cut -c1-200 | tail -30
