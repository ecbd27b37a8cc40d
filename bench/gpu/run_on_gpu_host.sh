#!/usr/bin/env bash
# Builds kvstream's compute libraries with CUDA on a GPU host, runs the GPU tests (in
# parallel gtest shards; GPU_TEST_SHARDS, default one per core), the CUDA kernel benchmarks
# and the comparison with torch, and leaves every log in OUT_DIR.
#
#   bench/gpu/run_on_gpu_host.sh BUILD_DIR OUT_DIR [cmake args...]
#
# Needs nvcc, CMake, a C++17 compiler, Abseil, GoogleTest and Google Benchmark (pass
# -DCMAKE_PREFIX_PATH=... for ones outside the system paths) and Python with torch for the
# comparison. The transfer libraries are not built (-DKVSTREAM_BUILD_TRANSFER=OFF), so UCX
# is not needed. Exit status: non-zero when a build step, a GPU test or the torch check fails.
set -u -o pipefail
build=${1:?usage: run_on_gpu_host.sh BUILD_DIR OUT_DIR [cmake args...]}
out=${2:?usage: run_on_gpu_host.sh BUILD_DIR OUT_DIR [cmake args...]}
shift 2
src=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out"
status=0

nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVSTREAM_CUDA=ON \
  -DKVSTREAM_BUILD_TRANSFER=OFF "$@" > "$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
cmake --build "$build" -j "$(nproc)" > "$out/build.log" 2>&1 || { grep -E "error|Error" "$out/build.log" | head -40; exit 1; }
echo "build ok ($(date +%T))"

# Each test binary: its timing tests (*Performance*) alone first, so that their figures
# are the GPU's own, then the rest in as many gtest shards as the host has cores, side by
# side (the golden CPU reference, not the GPU, is what takes the time: the prefill test is
# about 15 minutes in one process).
shards=${GPU_TEST_SHARDS:-$(nproc)}
for t in "$build"/tests/gpu/*_gpu_test; do
  name=$(basename "$t")
  failed=0
  timeout "${GPU_TEST_TIMEOUT:-300}" "$t" --gtest_brief=0 --gtest_filter='*Performance*' \
    > "$out/$name.perf.log" 2>&1 || failed=1
  grep -E '^\[ PERF' "$out/$name.perf.log" || true
  pids=()
  for i in $(seq 0 $((shards - 1))); do
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i timeout "${GPU_TEST_TIMEOUT:-300}" "$t" \
      --gtest_brief=1 --gtest_filter='-*Performance*' > "$out/$name.$i.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  cat "$out/$name".*.log > "$out/$name.log" && rm -f "$out/$name".[0-9]*.log
  passed=$(grep -oE '^\[  PASSED  \] [0-9]+' "$out/$name.log" | awk '{s += $NF} END {print s + 0}')
  if [ "$failed" = 0 ]; then
    echo "$name: $passed tests passed ($shards shards)"
  else
    status=1
    echo "$name: FAILED ($(grep -c '^\[  FAILED  \]' "$out/$name.log") failed lines, $passed passed)"
    grep -E -A6 "Failure" "$out/$name.log" | head -40
  fi
done
echo "GPU tests done ($(date +%T))"
if [ -x "$build/bench/kvstream_bench_cuda_kernels" ]; then
  "$build/bench/kvstream_bench_cuda_kernels" --benchmark_counters_tabular=true \
    > "$out/cuda_kernels_bench.txt" 2>&1 || status=1
  cat "$out/cuda_kernels_bench.txt"
fi
echo "kernel benchmarks done ($(date +%T))"
shim=$(find "$build" -name 'libkvstream_torch_shim.so' | head -1)
if [ -n "$shim" ] && python3 -c "import torch" 2> /dev/null; then
  timeout "${TORCH_TIMEOUT:-300}" python3 -W ignore "$src/bench/gpu/attention_vs_torch.py" --lib "$shim" \
    --json "$out/attention_vs_torch.json" 2>&1 | tee "$out/attention_vs_torch.txt" || status=1
fi
exit $status
