#!/usr/bin/env bash
# Session 29 call C, one H200, carry .whl: cuDNN's attention replaced altogether by our Triton kernels (forward with
# one document per window, i.e. plain causal; the bit-reproducible backward), engine alone, 0.5B bf16 B=32 x 4 with
# CUDA graphs, alternated with the default (cuDNN forward and backward). In isolation (call B) ours took 0.310 +
# 0.850 ms per layer against cuDNN's 0.338 + 0.901 at these heads.
source benchmarks/device_lib.sh s29c.log smi_s29c.csv
E="benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --seq-len 1024 --batch-size 32 --grad-accumulation 4 --steps 8 --cuda-graphs"
run base1 150 $E
run tri1 150 $E --triton-attention
run base2 150 $E
run tri2 150 $E --triton-attention
stop_smi 10
grep -hE "^== |^step [0-9]|RESULT|Error" "$L" | cut -c1-200 | tail -60
