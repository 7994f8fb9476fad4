#!/usr/bin/env bash
# Session 17, call 1 (nvidia-h100-x1; carry .whl): tile shapes of the Triton attention kernels under
# --document-masking at Qwen2.5-0.5B's heads (benchmarks/attention_tiles.py), the winners written into TILES of
# this copy of the tree, then the end-to-end cost at Qwen2.5-0.5B (documents of 200-2000 tokens; the same shards
# with and without the flag), the GPU tests of the kernels and the attention microbenchmark.
source benchmarks/device_lib.sh s17a.log smi17a.csv
export PYTHONUNBUFFERED=1
run tiles_05b 230 benchmarks/attention_tiles.py --json-out $OUT/tiles64.json
cp backends/triton/attention_fwd.py /tmp/fwd.orig; cp backends/triton/attention_bwd.py /tmp/bwd.orig
python3 - "$OUT/tiles64.json" <<'PY' >> "$L" 2>&1
import json, re, sys
best = json.load(open(sys.argv[1]))
for path, new in (("backends/triton/attention_fwd.py", f"64: {tuple(best['fwd'])}"),
                  ("backends/triton/attention_bwd.py", f"64: ({tuple(best['dkdv'])}, {tuple(best['dq'])})")):
    src = open(path).read()
    pat = r"64: \(\(\d+, \d+, \d+, \d+\), \(\d+, \d+, \d+, \d+\)\)" if "bwd" in path else r"64: \(\d+, \d+, \d+, \d+\)"
    src, n = re.subn(pat, new, src, count=1)
    assert n == 1, path
    open(path, "w").write(src)
    print("TILES", path, new)
PY
diff /tmp/fwd.orig backends/triton/attention_fwd.py >> "$L"; diff /tmp/bwd.orig backends/triton/attention_bwd.py >> "$L"
python3 benchmarks/make_packed_docs.py /tmp/docs --tokens 8000000 | tee -a "$L"
E2E="benchmarks/bench_train.py --model Qwen2.5-0.5B --batch-size 32 --steps 20 --warmup-steps 5 --backend triton --use-cuda-graphs --train-file /tmp/docs/train-*.bin"
run e2e_plain 110 $E2E --json $OUT/e2e_plain.json
run e2e_docs 110 $E2E --document-masking --json $OUT/e2e_docs.json
run test_docmask_gpu 120 -m pytest -q -p no:cacheprovider -m gpu -s -rs tests/test_document_masking_gpu.py \
  tests/test_triton_gpu.py -k "determin or document or Document"
run attn_doc_05b 50 benchmarks/attention_doc_mask.py
stop_smi 10
grep -E "^\| |passed|failed|Error|error:|tokens/s|cosine vs current [0-8]|max change|per window|== |TILES" "$L" | cut -c1-230 | tail -60
