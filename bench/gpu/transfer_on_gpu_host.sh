#!/usr/bin/env bash
# On a GPU host: builds kvstream with CUDA and the transfer libraries, runs the GPU tests
# named in GPU_TESTS (default: every tests/gpu/*_gpu_test) and the device transfer
# benchmarks, and leaves every log in OUT_DIR.
#
#   bench/gpu/transfer_on_gpu_host.sh BUILD_DIR OUT_DIR [cmake args...]
#
# GPU_TESTS: space-separated test program names; BENCH=0 skips the benchmarks. Exit status:
# non-zero when the build or a GPU test fails.
set -u -o pipefail
build=${1:?usage: transfer_on_gpu_host.sh BUILD_DIR OUT_DIR [cmake args...]}
out=${2:?usage: transfer_on_gpu_host.sh BUILD_DIR OUT_DIR [cmake args...]}
shift 2
src=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out"
status=0
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVSTREAM_CUDA=ON "$@" \
  > "$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
cmake --build "$build" -j "$(nproc)" -- -k 0 > "$out/build.log" 2>&1 || { grep -E "error|Error" -A3 "$out/build.log" | head -60; exit 1; }
echo "build ok ($(date +%T))"
tests=${GPU_TESTS:-$(cd "$build/tests/gpu" && ls *_gpu_test)}
for name in $tests; do
  t="$build/tests/gpu/$name"
  if timeout "${GPU_TEST_TIMEOUT:-300}" "$t" --gtest_brief=1 > "$out/$name.log" 2>&1; then
    echo "$name: $(grep -E '^\[  PASSED  \]|SKIPPED' "$out/$name.log" | tail -1)"
  else
    status=1
    echo "$name: FAILED"
    grep -E -B2 -A8 "Failure|FAILED|Segmentation|Aborted" "$out/$name.log" | head -60
  fi
done
echo "GPU tests done ($(date +%T))"
if [ "${BENCH:-1}" != 0 ]; then
  for b in "kvstream_bench_cuda_ipc" "kvstream_bench_cuda_ipc --post-cost" \
           "kvstream_bench_copy_pattern --reps=30" \
           "kvstream_bench_layer_checksum --benchmark_repetitions=3 --benchmark_report_aggregates_only=true" \
           ${EXTRA_BENCH:-}; do
    exe=${b%% *}
    [ -x "$build/bench/$exe" ] || continue
    echo "== $b"
    timeout "${BENCH_TIMEOUT:-240}" "$build/bench/"$b 2>&1 | tee -a "$out/bench.txt" | tail -40
  done
fi
exit $status
