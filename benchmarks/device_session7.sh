#!/usr/bin/env bash
# Prepared in session 6 for the next GPU session (nvidia-h100-x1; carry .whl): bash benchmarks/device_session7.sh
# This is main's version: the probe only. Branch wgrad-overlap's version of this file also runs the branch's GPU
# tests and an A/B in the step; run that one (git checkout wgrad-overlap) unless the branch was dropped.
# Go / no-go for running memory-bound kernels underneath the wgrad GEMMs (results "Against the bars (session 6)"):
# 1. GPU tests of cuBLASLt's SM count target (new, CPU-checked only): every candidate exact, a separate plan.
# 2. benchmarks/overlap_probe.py: GEMM time under sustained load against its SM count target (is it power-bound?),
#    and a wgrad on a side stream under swiglu_backward / rmsnorm_backward against the two in sequence.
# Worth building into the backward only if (2) shows a clear gain per pair (the step has ~0.76 ms of such
# memory-bound kernels per layer and micro-step at 1.5B, ~85 ms of a 1,085 ms step).
source benchmarks/device_lib.sh session7.log smi7.csv
run gpu_tests 120 -m pytest -m gpu -p no:cacheprovider -q -rA -s tests/test_fp8_gpu.py -k "sm_count or every_candidate or tuning"
run probe 200 benchmarks/overlap_probe.py
stop_smi 10
grep -E "PASSED|FAILED|^ERROR" "$L" | cut -c1-160 | tail -24
grep -E "^PROBE|^[12]\. " "$L" | cut -c1-200
