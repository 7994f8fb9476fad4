export PYTHONPATH=$PWD; OUT=${OUT:-/tmp/out}
python3 -m pytest -m gpu tests/test_fp8_gpu.py -q -p no:cacheprovider -s > "$OUT/fp8_gpu_tests.log" 2>&1; grep -E "grad cosine|passed|failed" "$OUT/fp8_gpu_tests.log"
run() { name=$1; shift; timeout 240 python3 "$@" > "$OUT/$name.log" 2>&1; grep RESULT "$OUT/$name.log" || tail -3 "$OUT/$name.log"; }
run triton_05b_e4m3 benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --batch-size 16 --matmul-dtype e4m3
run triton_05b_bf16_b32 benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --batch-size 32 --steps 5
run triton_05b_e4m3_b32 benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --batch-size 32 --steps 5 --matmul-dtype e4m3
run triton_15b_e4m3 benchmarks/engine_step.py --model Qwen2.5-1.5B --backend triton --batch-size 8 --steps 5 --matmul-dtype e4m3
timeout 200 python3 benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --batch-size 16 --steps 2 --profile --matmul-dtype e4m3 > "$OUT/profile_triton_05b_e4m3.log" 2>&1
