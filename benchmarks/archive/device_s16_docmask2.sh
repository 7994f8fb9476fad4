#!/usr/bin/env bash
# Session 16, call 2 (nvidia-h100-x1; carry .whl): the tile-skipping Triton attention under --document-masking:
# kernel times (4 variants), fused-vs-exact GPU tests for both kernel choices, the end-to-end cost at
# Qwen2.5-0.5B (documents of 200-2000 tokens; same shards with and without the flag), CUDA-graph replay with
# document masking, then Qwen3-0.6B's speed rows (bf16, e4m3 + FP8 head) beside the HF baseline.
source benchmarks/device_lib.sh s16b.log smi16b.csv
export PYTHONUNBUFFERED=1
run attn_doc_05b 60 benchmarks/attention_doc_mask.py
run attn_doc_q3 60 benchmarks/attention_doc_mask.py --heads 16 8 128 --batch-size 16
run test_docmask_gpu 150 -m pytest -q -p no:cacheprovider -m gpu -s -rs tests/test_document_masking_gpu.py
python3 benchmarks/make_packed_docs.py /tmp/docs --tokens 8000000 | tee -a "$L"
E2E="benchmarks/bench_train.py --model Qwen2.5-0.5B --batch-size 32 --steps 20 --warmup-steps 5 --backend triton --use-cuda-graphs --train-file /tmp/docs/train-*.bin"
run e2e_plain 120 $E2E --json $OUT/e2e_plain.json
run e2e_docs 120 $E2E --document-masking --json $OUT/e2e_docs.json
G=tests/test_cuda_graphs.py::test_graph_replay_equals_eager
run test_graphs_docs 120 -m pytest -q -p no:cacheprovider -m gpu -s -rs "$G[triton-None-False-Qwen2.5-0.5B-True]" \
  "$G[triton-e4m3-False-gpt2-True]"
left=$(( 585 - ($(date +%s) - T0) ))
PYTHONPATH=/tmp/site:$PWD timeout -s INT $left python3 benchmarks/speed_table.py --models Qwen3-0.6B \
  --backends triton --matmul-dtypes bf16 e4m3 --fp8-head --row-timeout-s 120 --log $OUT/speed_table.log \
  --json-out $OUT/table-qwen3-0.6b.json --markdown-out $OUT/table-qwen3-0.6b.md 2>&1 | tail -8 >> "$L"
stop_smi 10
grep -E "^\| |passed|failed|Error|error:|tokens/s|cosine|max change|per window|== " "$L" | cut -c1-230 | tail -70
