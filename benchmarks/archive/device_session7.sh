#!/usr/bin/env bash
# Prepared in session 6 for the next GPU session, on branch wgrad-overlap (nvidia-h100-x1; carry .whl):
#   git checkout wgrad-overlap && bash benchmarks/archive/device_session7.sh
# Go / no-go for the block wgrads on a side stream beside the dgrad chain (llmq_ray/wgrad_overlap.py; results
# "Against the bars (session 6)"), none of it run on a GPU yet:
# 1. GPU tests: cuBLASLt's SM count target (every candidate exact, its own plan); the side stream (made to start
#    late) and its CUDA-graph replay give the bits of the same wgrads run in order; one micro-step's gradients
#    against the plain order (block weight gradients within 2 bf16 steps, the rest bit-identical).
# 2. benchmarks/overlap_probe.py: a GEMM's time under sustained load against its SM count target (power-bound?),
#    and one wgrad beside swiglu_backward / rmsnorm_backward against the two in sequence.
# 3. The step: 1.5B bf16 B=16 x 4, alternating plain / side-stream wgrads at 100 and 116 SMs.
source benchmarks/device_lib.sh session7.log smi7.csv
run gpu_tests 150 -m pytest -m gpu -p no:cacheprovider -q -rA -s tests/test_fp8_gpu.py tests/test_wgrad_overlap.py -k "sm_count or every_candidate or wgrad"
run probe 150 benchmarks/overlap_probe.py
E15="benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-1.5B --batch-size 16 --grad-accumulation 4 --steps 6"
run plain_15b 60 $E15
run side100_15b 60 $E15 --overlap-wgrad 100
run side116_15b 60 $E15 --overlap-wgrad 116
run plain_15b_2 60 $E15
run side100_15b_2 60 $E15 --overlap-wgrad 100
run side116_15b_2 60 $E15 --overlap-wgrad 116
stop_smi 10
grep -E "PASSED|FAILED|^ERROR|wgrad overlap:" "$L" | cut -c1-200 | tail -24
grep -E "^PROBE|^[12]\. " "$L" | cut -c1-200
grep -E "^== |^RESULT" "$L" | cut -c1-220 | tail -16
