#!/usr/bin/env bash
# Session 17, call 4 (nvidia-h100-x1; carry .whl): the GPU tests of the attention kernels with the new TILES (head
# sizes 64 and 128) and of GPT-2 (the padded LM head), then GPT-2 124M beside the HF baseline in this lease, the
# engine at GPT-2 124M without Ray (as call 3), and GPT-2 1558M's row.
source benchmarks/device_lib.sh s17d.log smi17d.csv
export PYTHONUNBUFFERED=1
G=tests/test_cuda_graphs.py::test_graph_replay_equals_eager
run tests_gpu 120 -m pytest -q -p no:cacheprovider -m gpu -s -rs tests/test_document_masking_gpu.py \
  tests/test_triton_gpu.py -k "determin or document or Document or gpt2 or GPT"
run tests_graphs 90 -m pytest -q -p no:cacheprovider -m gpu -rs "$G[triton-None-False-gpt2-False]" \
  "$G[triton-e4m3-False-gpt2-True]" "$G[triton-None-False-Qwen2.5-0.5B-True]"
run gpt2_engine 70 benchmarks/engine_step.py --model gpt2 --backend triton --batch-size 64 --grad-accumulation 2 --steps 5 --cuda-graphs
for m in gpt2 gpt2-xl; do
  hf=""; [ $m = gpt2-xl ] && hf="--no-hf-baseline"
  left=$(( 590 - ($(date +%s) - T0) ))
  PYTHONPATH=/tmp/site:$PWD timeout -s INT $left python3 benchmarks/speed_table.py --models $m $hf \
    --backends triton --matmul-dtypes bf16 --row-timeout-s 150 --log $OUT/speed_table.log \
    --json-out $OUT/table-$m.json --markdown-out $OUT/table-$m.md 2>&1 | tail -8 >> "$L"
  echo "== table $m rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"
done
stop_smi 10
grep -E "^\| |RESULT|passed|failed|Error|error:|== |cosine [0-9]" "$L" | cut -c1-200 | tail -60
