#!/usr/bin/env bash
# Session 29 call E, one H200, carry .whl: the whole GPU-marked suite at the final HEAD (the run lock after review, with this machine's filelock). Changes on the
# driver side (the run lock of the out-dir, earlier checkpoints moved aside as the run starts, calls after a run
# ended refused, separator and eval checks); the suite's trainer runs on CUDA go through all of them.
source benchmarks/device_lib.sh s29e.log smi_s29e.csv
python3 -c "import filelock; print(\"filelock\", filelock.__version__)" | tee -a "$L"
PYTHONPATH=/tmp/site:$PWD timeout -s INT 420 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs >> "$L" 2>&1
echo "== gpu suite rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"
stop_smi 10
grep -hE "^== |passed|failed|FAILED|ERROR" "$L" | cut -c1-220 | tail -30
