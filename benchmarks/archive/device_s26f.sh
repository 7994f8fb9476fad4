#!/usr/bin/env bash
# Session 26 call F, one H100, carry .whl: the last cheap levers for issue 25's 0.5B bf16 bar, engine alone with CUDA
# graphs, B=32 x 4, alternated: the base, --triton-attention-backward (our bit-reproducible kernel instead of
# cuDNN's, GEMMs still tuned), B=48 x 4 (larger GEMMs and logits), the base again.
source benchmarks/device_lib.sh s26f.log smi_s26f.csv
E="benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --seq-len 1024 --grad-accumulation 4 --steps 8 --cuda-graphs"
run base1 120 $E --batch-size 32
run tab 120 $E --batch-size 32 --triton-attention-backward
run b48 120 $E --batch-size 48
run base2 120 $E --batch-size 32
stop_smi 10
grep -hE "^== |RESULT|Error|error" "$L" | cut -c1-200 | tail -20
