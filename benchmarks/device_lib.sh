# Shared preamble of the benchmarks/device_*.sh scripts (sourced, not run): `source benchmarks/device_lib.sh LOG SMI`
# on the device machine, from the repository root, with .whl carried.
#   - installs the Ray wheels of .whl into /tmp/site and exports the environment every run needs
#     (NCCL_NVLS_ENABLE=0: NVLink multicast off; no usage stats, no auth; expandable segments);
#   - OUT (default /tmp/out), L = $OUT/LOG (the log), S = $OUT/SMI (nvidia-smi: SM clock, power, temperature,
#     utilisation every second, from now until stop_smi), T0 = the start time;
#   - run NAME TIMEOUT ARGS...: `python3 ARGS` with this tree on the path, its output appended to $L, cut with
#     SIGINT after TIMEOUT seconds (so a Ray run releases the GPU); prints "== NAME rc RC SECONDS";
#     run_in TREE NAME TIMEOUT ARGS...: the same with the tree TREE (e.g. an untracked anchor copy) on the path;
#   - stop_smi EVERY: stops the logger and appends one "SM MHz W C" sample per EVERY seconds to $L.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L="$OUT/$1"; S="$OUT/$2"
T0=$(date +%s)
run_in() { tree=$1; name=$2; tmo=$3; shift 3; echo "== $name $(( $(date +%s) - T0 ))s" >> "$L"
  PYTHONPATH=/tmp/site:$PWD/$tree timeout -s INT -k 20 $tmo python3 "$@" >> "$L" 2>&1
  echo "== $name rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"; }
run() { run_in . "$@"; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$L"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,utilization.gpu --format=csv,noheader -l 1 > "$S" 2>&1 &
SMI=$!
stop_smi() { kill $SMI; echo "== smi: SM MHz, W, C every $1 s" >> "$L"
  awk -F', ' -v n="$1" 'NR % n == 0 {printf "%s %s %s | ", $2, $3, $4} END {print ""}' "$S" >> "$L"; }
