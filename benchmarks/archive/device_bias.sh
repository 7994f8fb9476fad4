#!/usr/bin/env bash
# Session 4 (2026-11-23), call 2 (nvidia-h100-x1; carry .whl; needs ./anchor_main = `git archive` of the commit
# before the change, untracked): the Triton bias gradient (one read of dqkv, max|dqkv| from the same read) in
# place of torch's dout.float().sum(0) (a cast copy and a reduce, ~0.2 ms per layer at 0.5B B=32).
#   GPU tests of the new kernel and of the FP8 / CUDA-graph model paths that now take their dqkv scale from it;
#   then alternating A/B (anchor_main vs this tree) at 0.5B B=32 with CUDA graphs, and 1.5B B=16, B=48 at 0.5B.
source benchmarks/device_lib.sh "bias.log" "smi_bias.csv"
nvidia-smi -q -d PERFORMANCE > "$OUT/perf_idle.txt" 2>&1
run gpu_tests 200 -m pytest -m gpu -p no:cacheprovider -q -rfE -s tests/test_triton_gpu.py tests/test_fp8_gpu.py \
  tests/test_cuda_graphs.py -k "not recompile"
E="benchmarks/engine_step.py --backend triton --cuda-graphs --steps 10 --model Qwen2.5-0.5B --batch-size 32"
for i in 1 2; do
  run_in anchor_main anchor_05b_bf16_$i 45 anchor_main/$E
  run new_05b_bf16_$i 45 $E
  run_in anchor_main anchor_05b_e4m3_$i 45 anchor_main/$E --matmul-dtype e4m3
  run new_05b_e4m3_$i 45 $E --matmul-dtype e4m3
done
nvidia-smi -q -d PERFORMANCE > "$OUT/perf_hot.txt" 2>&1
E15="benchmarks/engine_step.py --backend triton --cuda-graphs --steps 10 --model Qwen2.5-1.5B --batch-size 16"
run new_15b_e4m3 60 $E15 --matmul-dtype e4m3
run new_15b_bf16 60 $E15
run new_05b_e4m3_b48 45 benchmarks/engine_step.py --backend triton --cuda-graphs --steps 10 --model Qwen2.5-0.5B \
  --batch-size 48 --matmul-dtype e4m3
stop_smi 5
grep -E "Event Reasons|Power Cap|Thermal|Slowdown|: Active" "$OUT/perf_hot.txt" | head -20 | tee -a "$L"
grep -E "passed|failed|^FAILED|^ERROR|max error|bias_backward" "$L" | tail -30
grep -E "^== |^RESULT" "$L" | cut -c1-220 | tail -40
