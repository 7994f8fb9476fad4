#!/usr/bin/env bash
# Session 27 call A, one H200, carry .whl: the Triton classifier's launch shapes (benchmarks/classifier_grid.py,
# bf16 in place and FP8 q, 32,768 x 151,936), its GPU tests, then the 0.5B bf16 engine with CUDA graphs at B=32 x 4,
# alternated: today's launch (one program per row) / the sweep's best / today's / best.
# Ran at 31e4b32; the grid-stride launch, classifier_grid.py and --classifier-launch were reverted after it (no gain:
# benchmarks/LOG.md, 2026-11-28 session 27); `git show 31e4b32` has them.
source benchmarks/device_lib.sh s27a.log smi_s27a.csv
run grid_bf16 120 benchmarks/classifier_grid.py --best-out $OUT/best.json
run grid_fp8 120 benchmarks/classifier_grid.py --fp8
PYTHONPATH=/tmp/site:$PWD timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider -rfEs \
  tests/test_triton_gpu.py tests/test_triton_kernels.py -k classifier >> "$L" 2>&1
echo "== classifier tests rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"
BEST=$(cat $OUT/best.json)
E="benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --seq-len 1024 --grad-accumulation 4 --steps 8 --cuda-graphs --batch-size 32"
run base1 100 $E
run best1 100 $E --classifier-launch "$BEST"
run base2 100 $E
run best2 100 $E --classifier-launch "$BEST"
stop_smi 10
grep -hE "^== |^programs|^best|RESULT|passed|failed|Error" "$L" | cut -c1-200 | tail -50
