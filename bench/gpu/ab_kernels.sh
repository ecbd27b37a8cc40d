#!/usr/bin/env bash
# A/B of a CUDA kernel change on a GPU host: builds kvstream_bench_cuda_kernels from two
# source trees (A, the baseline, and B, the change) side by side, then runs the benchmarks
# matching FILTER from each, alternating A, B, A, B (ROUNDS pairs, default 2) so that a
# drift of the clock touches both alike, and prints one line per benchmark with every
# round's figure (the counter COUNTER, default TFLOP/s) and B's median over A's.
#
#   bench/gpu/ab_kernels.sh TREE_A TREE_B FILTER [cmake args...]
#
# A tree is a source checkout (e.g. `git worktree add /tmp/a main`, or an unpacked
# `git archive`); each is built in TREE/build-ab with -DKVSTREAM_CUDA=ON and without
# tests or transfer libraries. Needs what bench/gpu/run_on_gpu_host.sh needs.
set -u -o pipefail
tree_a=${1:?usage: ab_kernels.sh TREE_A TREE_B FILTER [cmake args...]}
tree_b=${2:?usage: ab_kernels.sh TREE_A TREE_B FILTER [cmake args...]}
filter=${3:?usage: ab_kernels.sh TREE_A TREE_B FILTER [cmake args...]}
shift 3
rounds=${ROUNDS:-2}
counter=${COUNTER:-TFLOP/s}
jobs=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))
build() {
  cmake -S "$1" -B "$1/build-ab" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVSTREAM_CUDA=ON \
    -DKVSTREAM_BUILD_TRANSFER=OFF -DKVSTREAM_BUILD_TESTS=OFF -DKVSTREAM_PYTHON_TESTS=OFF "${@:2}" \
    > "$1/build-ab.log" 2>&1 &&
    cmake --build "$1/build-ab" -j "$jobs" --target kvstream_bench_cuda_kernels \
      >> "$1/build-ab.log" 2>&1
}
build "$tree_a" "$@" & pid_a=$!
build "$tree_b" "$@" & pid_b=$!
failed=0
wait "$pid_a" || { echo "A failed to build: $tree_a/build-ab.log" >&2; failed=1; }
wait "$pid_b" || { echo "B failed to build: $tree_b/build-ab.log" >&2; failed=1; }
[ "$failed" = 0 ] || exit 1
results=$(mktemp -d)
for round in $(seq 1 "$rounds"); do
  for side in a b; do
    tree=$tree_a
    [ "$side" = b ] && tree=$tree_b
    "$tree/build-ab/bench/kvstream_bench_cuda_kernels" --benchmark_filter="$filter" \
      --benchmark_format=csv > "$results/$side.$round.csv" 2> /dev/null || {
      echo "benchmark run $side.$round failed" >&2
      exit 1
    }
  done
done
python3 - "$results" "$rounds" "$counter" <<'PY'
import csv, statistics, sys
results, rounds, counter = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def load(side, r):
    with open(f"{results}/{side}.{r}.csv") as f:
        lines = [l for l in f if l.startswith("name,") or l.startswith('"')]
    return {row["name"]: float(row[counter]) for row in csv.DictReader(lines) if row.get(counter)}
a = [load("a", r) for r in range(1, rounds + 1)]
b = [load("b", r) for r in range(1, rounds + 1)]
print(f"{'benchmark':<70} {'A (' + counter + ')':>20} {'B':>20} {'B/A':>6}")
for name in a[0]:
    va = [x[name] for x in a if name in x]
    vb = [x[name] for x in b if name in x]
    if not vb:
        continue
    ratio = statistics.median(vb) / statistics.median(va)
    fa = " ".join(f"{v:.1f}" for v in va)
    fb = " ".join(f"{v:.1f}" for v in vb)
    print(f"{name.split('/iterations')[0]:<70} {fa:>20} {fb:>20} {ratio:6.3f}")
PY
