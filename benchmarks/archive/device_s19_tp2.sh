#!/usr/bin/env bash
# Issue 28, call B on nvidia-h100-x2 (carry .whl): the GPU tests again (e4m3 added), then Qwen2.5-7B ZeRO-3 vs
# --tensor-parallel 2 at 8k tokens per sequence in bf16 and at 1k in e4m3 (FP8 block GEMMs + FP8 LM head); the
# recipe of device_s19_tp.sh (8-bit optimizer state, --recompute-ffn, --lmhead-chunks 4, grad-accumulation 4).
source benchmarks/device_lib.sh tp2.log smi_tp2.csv
PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -s \
  tests/test_tensor_parallel_gpu.py 2>&1 | tail -15 | tee -a "$L"
S7="benchmarks/bench_train.py --model Qwen2.5-7B --gpus 2 --backend triton --warmup-steps 3 --steps 8
 --lmhead-chunks 4 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --recompute-ffn
 --grad-accumulation 4"
E="--matmul-dtype e4m3 --lmhead-dtype e4m3"
run 7b_zero3_t8192 140 $S7 --seq-len 8192 --batch-size 1 --zero-level 3 --json "$OUT/7b_zero3_t8192.json"
run 7b_tp2_t8192 140 $S7 --seq-len 8192 --batch-size 1 --tensor-parallel 2 --json "$OUT/7b_tp2_t8192.json"
run 7b_zero3_e4m3_t1024 140 $S7 $E --seq-len 1024 --batch-size 4 --zero-level 3 --json "$OUT/7b_zero3_e4m3_t1024.json"
run 7b_tp2_e4m3_t1024 140 $S7 $E --seq-len 1024 --batch-size 4 --tensor-parallel 2 --json "$OUT/7b_tp2_e4m3_t1024.json"
stop_smi 10
grep -E "^== |tokens/s|Error|error:|passed|failed" "$L" | cut -c1-260
