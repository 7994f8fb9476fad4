#!/usr/bin/env bash
# Session 28 call A, one H200, carry .whl: the whole GPU-marked suite at this session's HEAD (its changes are
# driver-side checks: setting types, --steps against the resumed checkpoint, window counts, one fit() per
# trainer; the GPU suite's trainer runs on CUDA go through all of them).
source benchmarks/device_lib.sh s28a.log smi_s28a.csv
git log --oneline -1 2>/dev/null | tee -a "$L"
PYTHONPATH=/tmp/site:$PWD timeout -s INT 400 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs >> "$L" 2>&1
echo "== gpu suite rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"
stop_smi 10
grep -hE "^== |passed|failed|FAILED|ERROR" "$L" | cut -c1-220 | tail -30
