#!/usr/bin/env bash
# Session 31 call D, one H200, carry .whl: the whole GPU-marked suite after the trainer's choice of Ray
# (llmq_ray/train/ray_target.py: a fresh instance now gets address="local" explicitly; no file names a cluster
# on this machine).
source benchmarks/device_lib.sh s31d.log smi_s31d.csv
PYTHONPATH=/tmp/site:$PWD timeout -s INT 420 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs >> "$L" 2>&1
echo "== gpu suite rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"
stop_smi 30
grep -hE "^== |passed|failed|FAILED|ERROR" "$L" | cut -c1-220 | tail -30
