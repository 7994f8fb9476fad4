#!/usr/bin/env bash
# Session 17, call 7 (nvidia-h100-x1; carry .whl): issue 25 lever -- is our Triton attention backward (mask-skipping,
# tuned tiles) now faster than cuDNN's dense one without document masking? Microbench at 0.5B, 1.5B (12/2 x 128)
# and 7B (28/4 x 128) heads, then Qwen2.5-0.5B through the engine (no Ray) with cuDNN's backward and with ours (the
# GEMMs tuned in both), alternated twice.
source benchmarks/device_lib.sh s17g.log smi17g.csv
export PYTHONUNBUFFERED=1
run attn_05b 50 benchmarks/attention_doc_mask.py
run attn_15b 50 benchmarks/attention_doc_mask.py --heads 12 2 128 --batch-size 16
run attn_7b 50 benchmarks/attention_doc_mask.py --heads 28 4 128 --batch-size 8
ES="benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --batch-size 32 --steps 20 --cuda-graphs"
for i in 1 2; do  # (call 8: call 7 lost these rows and the microbench to two script errors)
  run e2e_cudnn_$i 60 $ES
  run e2e_tritonbwd_$i 60 $ES --triton-attention-backward
done
stop_smi 10
grep -E "^\| |RESULT|Error|error:|== " "$L" | cut -c1-200 | tail -40
