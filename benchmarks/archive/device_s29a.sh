#!/usr/bin/env bash
# Session 29 calls A-B, one H200, carry .whl: RoPE's backward folded into our Triton attention backward's dQ/dK stores.
# 1) its GPU tests (compiled kernels: the interpreter tests of test_triton_kernels.py run compiled here, and the
#    realistic-shape check of test_triton_gpu.py); 2) the attention alone at 0.5B and 7B heads (folded vs separate
#    pass vs cuDNN's parts into rope_backward_from); 3) the engine, 0.5B bf16 B=32 x 4 with CUDA graphs, alternated:
#    cuDNN (the default) / our backward with the fold / our backward without it / cuDNN again.
# Ran at 25b0978 + the compile fix (calls A and B; A failed to compile in Triton, B measured). The fold was reverted
# after call B: it saved nothing measurable at 0.5B heads and was slower at 7B heads (benchmarks/LOG.md, 2026-11-29).
source benchmarks/device_lib.sh s29a.log smi_s29a.csv
git log --oneline -1 2>/dev/null | tee -a "$L"
PYTHONPATH=/tmp/site:$PWD timeout -s INT 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs \
  tests/test_triton_gpu.py tests/test_document_masking.py -k "attention or rope or document" >> "$L" 2>&1
echo "== gpu tests A rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"
PYTHONPATH=/tmp/site:$PWD timeout -s INT 300 python3 -m pytest -q -p no:cacheprovider -rfEs -o addopts="" \
  tests/test_triton_kernels.py -k "attention or rope" >> "$L" 2>&1
echo "== kernel tests (compiled) rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"
run att05 120 benchmarks/attention_doc_mask.py
run att7 120 benchmarks/attention_doc_mask.py --heads 28 4 128 --batch-size 8
E="benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --seq-len 1024 --batch-size 32 --grad-accumulation 4 --steps 8 --cuda-graphs"
run base1 150 $E
run fold 150 $E --triton-attention-backward
run nofold 150 $E --triton-attention-backward --no-rope-fold
run fold2 150 $E --triton-attention-backward
run base2 150 $E
stop_smi 10
grep -hE "^== |^\| |passed|failed|FAILED|tokens/s|RESULT|Error" "$L" | cut -c1-200 | tail -60
