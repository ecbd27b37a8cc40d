#!/usr/bin/env bash
# On a GPU host: builds the kvstream command with CUDA and runs the time-to-first-token
# benchmark of docs/benchmarks.md: `kvstream demo --device=cuda` with Llama-3-8B shapes
# (random weights from the seed), a prefill and a decode worker process sharing GPU 0,
# each prompt length twice (the first of each pair warms up), one request at a time in the
# disaggregated and in the colocated run, with the decode worker loading each request
# asynchronously (the GPU demo's default) and layer by layer. Leaves each run's report and
# JSON in OUT_DIR (ttft-RUN-async.json, ttft-RUN-layerwise.json).
#
#   bench/gpu/ttft_on_gpu_host.sh BUILD_DIR OUT_DIR [cmake args...]
#
# RUNS: how many times the whole set runs (default 2); PROMPTS: the prompt lengths (default
# 1024,1024,8192,8192,32768,32768). Exit status: non-zero when the build or a run fails.
set -u -o pipefail
build=${1:?usage: ttft_on_gpu_host.sh BUILD_DIR OUT_DIR [cmake args...]}
out=${2:?usage: ttft_on_gpu_host.sh BUILD_DIR OUT_DIR [cmake args...]}
shift 2
src=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out"
cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVSTREAM_CUDA=ON "$@" \
  > "$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
cmake --build "$build" --target kvstream_cli > "$out/build.log" 2>&1 \
  || { grep -E "error" -A3 "$out/build.log" | head -40; exit 1; }
status=0
prompts=${PROMPTS:-1024,1024,8192,8192,32768,32768}
for i in $(seq 1 "${RUNS:-2}"); do
  for mode in async layerwise; do
    async=$([ $mode = async ] && echo true || echo false)
    "$build/launch/kvstream" demo --device=cuda --model=llama3-8b --prompts="$prompts" \
      --decode-steps=1 --one-at-a-time --num-blocks=2200 --load-async=$async \
      --json="$out/ttft-$i-$mode.json" > "$out/ttft-$i-$mode.txt" 2>&1 || status=1
    echo "== run $i, $mode (exit $status)"
    sed -n '/^request/,/^total/p' "$out/ttft-$i-$mode.txt"
  done
done
exit $status
