#!/usr/bin/env bash
# Ran at commit ce64dd3 (its tools are there; main later removed what this call showed slower or inconclusive).
# Session 6, call 2 (nvidia-h100-x1; carry .whl): the SwiGLU fused into its GEMMs (backends/triton/swiglu_gemm.py).
# 1. GPU tests: the fused kernels at 0.5B / 1.5B / ragged shapes, the whole model triton vs torch (bf16, fused
#    path), CUDA graphs (eager vs replay with the fused kernels).
# 2. The kernels alone: fused vs the tuned cuBLAS GEMM + the SwiGLU kernel, per MLP of 0.5B (B=32) and 1.5B (B=16).
# 3. The step: alternating A/B, fused (default) vs apart (--swiglu-gemm none), 1.5B bf16 B=16 x 4 and 0.5B bf16 B=32.
source benchmarks/device_lib.sh session6b.log smi6b.csv
run gpu_tests 200 -m pytest -m gpu -p no:cacheprovider -q -rA -s tests/test_triton_gpu.py -k "swiglu_gemm or whole_model" 
run graphs 150 -m pytest -m gpu -p no:cacheprovider -q -rfE -s tests/test_cuda_graphs.py -k "not recompile"
run kernels 120 benchmarks/swiglu_gemm_bench.py --model Qwen2.5-0.5B --model Qwen2.5-1.5B --tokens 32768 16384
E15="benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-1.5B --batch-size 16 --steps 6 --grad-accumulation 4"
E05="benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-0.5B --batch-size 32 --steps 10"
run apart_15b 60 $E15 --swiglu-gemm none
run fused_15b 60 $E15
run apart_15b_2 60 $E15 --swiglu-gemm none
run fused_15b_2 60 $E15
run apart_05b 45 $E05 --swiglu-gemm none
run fused_05b 45 $E05
stop_smi 10
grep -E "[0-9] passed|[0-9] failed|^FAILED|^ERROR|fused|Error" "$L" | cut -c1-220 | tail -30
grep -E "^== |^RESULT|ms  " "$L" | cut -c1-220 | tail -40
