#!/usr/bin/env bash
# Ran at commit 90fe610 (its tools are there; main later removed what this call showed slower or inconclusive).
# Session 6, call 3 (nvidia-h100-x1; carry .whl). After call 2 (the fused SwiGLU GEMMs lose in the step; now off):
# 1. Where a 1.5B bf16 step goes, with the top kernels by time (the attention's helper kernels, ~20 ms per step).
# 2. Only the backward fused (alone 4% faster than dgrad + swiglu_backward at 1.5B): alternating A/B in the step.
# 3. The bf16 GEMM algorithms timed under sustained load (each run back to back for 200 ms first, so at the clock
#    the 700 W cap allows), against the same survey timed cold: does the ranking change under the cap?
# 4. The 1.5B bf16 bar through Ray on this lease (16 x 16).
source benchmarks/device_lib.sh session6c.log smi6c.csv
E15="benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-1.5B --batch-size 16 --grad-accumulation 4"
run profile_15b 80 $E15 --steps 3 --profile
run apart_15b 60 $E15 --steps 6 --swiglu-gemm none
run bwdfused_15b 60 $E15 --steps 6 --swiglu-gemm backward
run apart_15b_2 60 $E15 --steps 6 --swiglu-gemm none
run bwdfused_15b_2 60 $E15 --steps 6 --swiglu-gemm backward
run algos_cold 60 benchmarks/gemm_algos.py --model Qwen2.5-1.5B --tokens 16384 --kinds bf16,bf16+= --reps 20
run algos_sustained 120 benchmarks/gemm_algos.py --model Qwen2.5-1.5B --tokens 16384 --kinds bf16,bf16+= --reps 20 --sustain-ms 200
run ray_15b_bf16 120 benchmarks/bench_train.py --gpus 1 --backend triton --seq-len 1024 --use-cuda-graphs --opt-m-dtype bf16 --opt-v-dtype bf16 --model Qwen2.5-1.5B --batch-size 16 --grad-accumulation 16 --steps 6 --warmup-steps 2
stop_smi 10
grep -E "^KERNELS|^TOPKERNEL|^GAPS streams" "$L" | cut -c1-200
grep -E "GEMMALGOS|^[a-z_]+\.(fwd|dgrad|wgrad) " "$L" | cut -c1-200
grep -E "^== |^RESULT|tokens/s" "$L" | cut -c1-220 | tail -24
