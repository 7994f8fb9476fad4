#!/usr/bin/env bash
# The GPU-marked test suite on one GPU (kernels at realistic shapes, FP8, cuDNN attention, the GPU paths of the
# engine); from the repository root on the device machine, carry .whl (Ray's wheels, see device_lib.sh):
#   bash benchmarks/gpu_tests.sh          # the whole `pytest -m gpu` (2-3 minutes on one H200)
#   bash benchmarks/gpu_tests.sh -k fp8   # extra pytest arguments narrow it
# The log (pytest's summary, pass / fail lines) and nvidia-smi samples go to $OUT. (Last run as session 31's call
# D, benchmarks/LOG.md.)
source benchmarks/device_lib.sh gpu_tests.log smi_gpu_tests.csv
PYTHONPATH=/tmp/site:$PWD timeout -s INT 420 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs "$@" >> "$L" 2>&1
echo "== gpu suite rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"
stop_smi 30
grep -hE "^== |passed|failed|FAILED|ERROR" "$L" | cut -c1-220 | tail -30
