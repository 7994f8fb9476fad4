#!/usr/bin/env bash
# One device call (1 GPU): GPU tests of the changed kernels (AdamW random bits, fused dy absmax in the swiglu
# and RMSNorm backward), speed with CUDA graphs at B=16/32, the cuDNN attention output layouts, and a bf16
# profile. Everything goes into $OUT/speed3.log; the summary is printed last.
export PYTHONPATH=$PWD; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L="$OUT/speed3.log"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$L"
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_gpu.py tests/test_fp8_gpu.py tests/test_cuda_graphs.py >> "$L" 2>&1
grep -E "passed|failed" "$L" | tail -1
python3 - >> "$L" 2>&1 <<'PY'
import math, torch
aten = torch.ops.aten
B, T, H, KV, D = 2, 256, 14, 2, 64
qkv = torch.randn(B, T, H + 2 * KV, D, device="cuda", dtype=torch.bfloat16)
q = qkv[:, :, :H].transpose(1, 2); k = qkv[:, :, H:H + KV].transpose(1, 2); v = qkv[:, :, H + KV:].transpose(1, 2)
o, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=1 / 8)[:2]
print("LAYOUT cudnn out", tuple(o.shape), o.stride(), "lse", tuple(lse.shape), lse.stride())
do = torch.randn_like(o.transpose(1, 2).contiguous()).transpose(1, 2)
ph = torch.zeros((), dtype=torch.int64, device="cuda")
dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(do, q, k, v, o, lse, ph, ph, None, None, None, T, T, 0.0, True, scale=1 / 8)
print("LAYOUT cudnn dq", dq.stride(), "dk", dk.stride(), "dv", dv.stride())
PY
grep LAYOUT "$L"
run() { name=$1; shift; echo "== $name" >> "$L"; timeout 150 python3 "$@" >> "$L" 2>&1; }
E="benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton"
run bf16_b16 $E --batch-size 16 --cuda-graphs
run e4m3_b16 $E --batch-size 16 --matmul-dtype e4m3 --cuda-graphs
run bf16_b32 $E --batch-size 32 --steps 5 --cuda-graphs
run e4m3_b32 $E --batch-size 32 --steps 5 --matmul-dtype e4m3 --cuda-graphs
run e4m3_15b $E --model Qwen2.5-1.5B --batch-size 16 --steps 4 --matmul-dtype e4m3 --cuda-graphs
run bf16_15b $E --model Qwen2.5-1.5B --batch-size 16 --steps 4 --cuda-graphs
run profile_bf16 $E --batch-size 16 --steps 2 --profile
sed -n '/== profile_bf16/,$p' "$L" | sed -n '/Name/,$p' | cut -c1-62,120-175 | head -34
grep RESULT "$L"
