#!/usr/bin/env bash
# Session 16, call 1 (nvidia-h100-x1; carry .whl): --document-masking on the GPU (cuDNN + score bias): the
# attention cost alone, the fused-vs-exact tests, the end-to-end cost at Qwen2.5-0.5B with documents of 200-2000
# tokens (same shards with and without the flag), then issue 26's pending GPU tests (Triton QK-norm, GPT-2 ops,
# whole tiny-qwen3 / tiny-gpt2 models, CUDA-graph replay for GPT-2 and for document masking).
source benchmarks/device_lib.sh s16a.log smi16a.csv
export PYTHONUNBUFFERED=1
run attn_doc_05b 60 benchmarks/attention_doc_mask.py
run attn_doc_q3 60 benchmarks/attention_doc_mask.py --heads 16 8 128 --batch-size 16
run test_docmask_gpu 120 -m pytest -q -p no:cacheprovider -m gpu -s -rs tests/test_document_masking_gpu.py
python3 benchmarks/make_packed_docs.py /tmp/docs --tokens 8000000 | tee -a "$L"
E2E="benchmarks/bench_train.py --model Qwen2.5-0.5B --batch-size 32 --steps 20 --warmup-steps 5 --backend triton --use-cuda-graphs --train-file /tmp/docs/train-*.bin"
run e2e_plain 120 $E2E --json $OUT/e2e_plain.json
run e2e_docs 120 $E2E --document-masking --json $OUT/e2e_docs.json
run test_triton26 180 -m pytest -q -p no:cacheprovider -m gpu -s -rs tests/test_triton_gpu.py -k "qk_norm or qwen3 or gpt2"
G=tests/test_cuda_graphs.py::test_graph_replay_equals_eager
run test_graphs26 200 -m pytest -q -p no:cacheprovider -m gpu -s -rs "$G[triton-None-False-Qwen2.5-0.5B-True]" \
  "$G[triton-e4m3-False-gpt2-True]" "$G[triton-None-False-gpt2-False]" "$G[triton-e4m3-False-gpt2-False]"
stop_smi 10
grep -E "^\| |passed|failed|Error|error:|tokens/s|cosine|max change|per window|== " "$L" | cut -c1-230 | tail -60
