#!/usr/bin/env bash
# Prepared 2026-11-23 (session 2), branch det-attn-bwd (nvidia-h100-x1; no Ray needed; ~2 minutes): is cuDNN's
# attention backward bit-reproducible at 0.5B/1.5B/7B shapes, and the GPU checks + timing of the
# --deterministic-attention kernels (benchmarks/attention_determinism.py, tests/test_triton_gpu.py).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L="$OUT/det_attn.log"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$L"
timeout -s INT 60 python3 benchmarks/attention_determinism.py >> "$L" 2>&1; echo "determinism rc=$?" | tee -a "$L"
timeout -s INT 240 python3 -m pytest -m gpu -p no:cacheprovider -q -s -rfE tests/test_triton_gpu.py \
  -k "deterministic_attention or kernel_timings" >> "$L" 2>&1; echo "tests rc=$?" | tee -a "$L"
grep -E "^DETERMINISM|cuDNN backward|attention_backward|passed|failed|^FAILED" "$L" | cut -c1-200
