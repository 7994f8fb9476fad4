#!/usr/bin/env bash
# Session 30 call A, one H200, carry .whl: the whole GPU-marked suite after the test-harness changes (tests/conftest.py: a Ray temp root per pytest process, two xdist processes on CPU machines only; tests/_cluster_serve.py: a Ray temp folder of its own).
source benchmarks/device_lib.sh s30a.log smi_s30a.csv
PYTHONPATH=/tmp/site:$PWD timeout -s INT 420 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs >> "$L" 2>&1
echo "== gpu suite rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"
stop_smi 10
grep -hE "^== |passed|failed|FAILED|ERROR" "$L" | cut -c1-220 | tail -30
