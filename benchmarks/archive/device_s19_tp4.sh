#!/usr/bin/env bash
# Issue 28, call D on nvidia-h100-x2 (carry .whl): after the vocabulary-parallel embedding and LM head -- the GPU
# tests again, then Qwen2.5-7B bf16 at 1k, ZeRO-3 vs --tensor-parallel 2 side by side (device_s19_tp.sh's recipe).
source benchmarks/device_lib.sh tp4.log smi_tp4.csv
PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -s \
  tests/test_tensor_parallel_gpu.py 2>&1 | tail -15 | tee -a "$L"
S7="benchmarks/bench_train.py --model Qwen2.5-7B --gpus 2 --backend triton --warmup-steps 3 --steps 8
 --lmhead-chunks 4 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --recompute-ffn
 --grad-accumulation 4 --seq-len 1024 --batch-size 4"
run 7b_tp2v_t1024 130 $S7 --tensor-parallel 2 --json "$OUT/7b_tp2v_t1024.json"
run 7b_zero3_t1024 130 $S7 --zero-level 3 --json "$OUT/7b_zero3_t1024.json"
stop_smi 10
grep -E "^== |tokens/s|Error|error:|passed|failed" "$L" | cut -c1-260
