#!/usr/bin/env bash
# Session 26 call E, one H100, carry .whl: GPU runs of the review fixes -- the FP8 tile kernels in non-square tiles
# (byte-equal to the default tiles), the SwiGLU/quantization FP8 tests after the fallback helper, the FP8 weight
# copy placements and the --kept-quants-gib refusal on CUDA.
source benchmarks/device_lib.sh s26e.log smi_s26e.csv
PYTHONPATH=/tmp/site:$PWD timeout -s INT 240 python3 -m pytest -o addopts="" -q -p no:cacheprovider -rfEs \
  tests/test_triton_kernels.py tests/test_offload.py tests/test_fp8_gpu.py \
  -k "tiles or swiglu or quantize or kept or fp8_weight_copies or transient" >> "$L" 2>&1
echo "== tests rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"
stop_smi 10
grep -hE "^== |passed|failed|FAILED|ERROR|Error" "$L" | cut -c1-220 | tail -20
