#!/usr/bin/env bash
# Ran at commit 2d2ff80 (its tools are there; main later removed what this call showed slower or inconclusive).
# Session 6, call 5 (nvidia-h100-x1; carry .whl). The fused classifier with a few programs per SM walking the rows
# (so a row's second read can come from L2) instead of one program per row (its 2 reads + 1 write of the 1.5B
# logits run at ~2.9 TB/s, 20.5 ms per step of 4 micro-steps).
# 1. GPU kernel tests of the classifier (default launch). 2. The launch shapes alone (classifier_bench.py).
# 3. Alternating A/B in the 1.5B bf16 step: one program per row vs the fastest shape of 2.
source benchmarks/device_lib.sh session6e.log smi6e.csv
run gpu_tests 60 -m pytest -m gpu -p no:cacheprovider -q -rA -s tests/test_triton_gpu.py -k "classifier"
run bench 60 benchmarks/classifier_bench.py --rows 16384 --vocab 151936
BEST=$(awk '/^BEST/ {print $2 "," $3 "," $4}' "$L"); echo "== best launch $BEST" | tee -a "$L"
E15="benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-1.5B --batch-size 16 --grad-accumulation 4 --steps 6"
run row_15b 60 $E15 --classifier-launch 0,0,4096
run best_15b 60 $E15 --classifier-launch $BEST
run row_15b_2 60 $E15 --classifier-launch 0,0,4096
run best_15b_2 60 $E15 --classifier-launch $BEST
stop_smi 10
grep -E "[0-9] passed|[0-9] failed|^FAILED|^ERROR|^classifier|^BEST" "$L" | cut -c1-220
grep -E "^== |^RESULT" "$L" | cut -c1-220 | tail -16
