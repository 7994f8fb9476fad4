#!/usr/bin/env bash
# Session 27 call D, 2x H200 (nvidia-h200-x2), carry .whl: ZeRO-3 with kept FP8 weight copies over NCCL (the new
# two-GPU test), the rest of the two-GPU module, the ZeRO-3 tests (gloo, on this machine's CPUs) and the kept-copies
# GPU tests in tests/test_offload.py.
source benchmarks/device_lib.sh s27d.log smi_s27d.csv
nvidia-smi -L | tee -a "$L"
PYTHONPATH=/tmp/site:$PWD timeout -s INT 400 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs -s \
  tests/test_two_gpus.py >> "$L" 2>&1
echo "== two-gpu tests rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"
PYTHONPATH=/tmp/site:$PWD timeout -s INT 150 python3 -m pytest -m "gpu or not gpu" -q -p no:cacheprovider -rfEs \
  tests/test_zero3.py tests/test_offload.py -k "zero3 or kept" >> "$L" 2>&1
echo "== zero3/kept tests rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"
stop_smi 10
grep -hE "^== |passed|failed|FAILED|ERROR|Error" "$L" | cut -c1-220 | tail -30
