#!/usr/bin/env bash
# Profiles the CUDA attention and cache-update kernels with Nsight Compute on a GPU host, one
# launch each at the benchmark shapes, and leaves the reports (text) in OUT_DIR; then the
# wgmma prefill kernel and, where torch is installed, torch's cuDNN prefill kernel with
# their SASS and stall samples.
#
#   bench/gpu/profile_kernels.sh BUILD_DIR OUT_DIR
#
# BUILD_DIR is a build with -DKVSTREAM_CUDA=ON (bench/gpu/run_on_gpu_host.sh makes one).
# The benchmark holds its stream behind a host-released kernel while it enqueues; under a
# profiler that replays kernels that kernel would wait for its timeout at every batch, so
# KVSTREAM_BENCH_NO_HOLD=1 leaves it out (the benchmark's own timings are then meaningless).
set -u -o pipefail
build=${1:?usage: profile_kernels.sh BUILD_DIR OUT_DIR}
out=${2:?usage: profile_kernels.sh BUILD_DIR OUT_DIR}
mkdir -p "$out"
bench="$build/bench/kvstream_bench_cuda_kernels"
[ -x "$bench" ] || { echo "no $bench: build with -DKVSTREAM_CUDA=ON first" >&2; exit 1; }
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
[ -x "$ncu" ] || { echo "Nsight Compute (ncu) not found" >&2; exit 1; }
status=0
# name  benchmark filter  kernel-name regex
while read -r name filter kernel; do
  KVSTREAM_BENCH_NO_HOLD=1 timeout 120 "$ncu" --kernel-name "regex:$kernel" --launch-skip 2 \
    --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section LaunchStats --section ComputeWorkloadAnalysis \
    --section InstructionStats --section SchedulerStats \
    "$bench" --benchmark_filter="$filter" > "$out/ncu_$name.txt" 2>&1 || status=1
  echo "$name: $(grep -E '^ +Duration' "$out/ncu_$name.txt" | head -1 | tr -s ' ')"
done <<'LIST'
decode_tma Decode/seqs:64/seq_len:4096/kernel:2/splits:0 DecodeTma
decode_tc Decode/seqs:64/seq_len:4096/kernel:1/splits:0 DecodeTcKernel
decode_cuda_cores Decode/seqs:64/seq_len:4096/kernel:0/splits:0 DecodeSplit
prefill_fast Prefill/tokens:8192/block:16/kernel:1/heads_outer:0 PrefillAttention
prefill_wgmma_bs16 Prefill/tokens:8192/block:16/kernel:2/heads_outer:0 PrefillWgmma
prefill_wgmma_pairs_bs16 Prefill/tokens:8192/block:16/kernel:3/heads_outer:0 PrefillWgmma
prefill_wgmma_bs64 Prefill/tokens:8192/block:64/kernel:2/heads_outer:0 PrefillWgmma
prefill_wgmma_bs64_32k Prefill/tokens:32768/block:64/kernel:2/heads_outer:0 PrefillWgmma
prefill_wgmma_bs64_32k_outer Prefill/tokens:32768/block:64/kernel:2/heads_outer:1 PrefillWgmma
cache_update_bf16 CacheUpdate/tokens:65536/fp8:0/method:0 CacheUpdate
cache_update_fp8 CacheUpdate/tokens:65536/fp8:1/method:0 CacheUpdate
LIST

# The wgmma prefill kernel (the launcher's defaults, 64-key pages) beside torch's cuDNN
# kernel for the same shape (8k tokens causal, bf16, d128, 32 query heads; SDPA's cuDNN
# backend on contiguous K and V), each with its SASS and per-instruction stall samples
# (sass_NAME.csv; docs/benchmarks.md, "The softmax and the products' descriptors").
profile_sass() {  # NAME KERNEL_REGEX COMMAND...
  local name=$1 kernel=$2
  shift 2
  KVSTREAM_BENCH_NO_HOLD=1 timeout 150 "$ncu" --kernel-name "regex:$kernel" --launch-skip 2 \
    --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section ComputeWorkloadAnalysis --section InstructionStats --section SourceCounters \
    --import-source no -o "$out/$name" "$@" > "$out/ncu_$name.log" 2>&1 || status=1
  "$ncu" -i "$out/$name.ncu-rep" --page details > "$out/ncu_$name.txt" 2>&1 || status=1
  "$ncu" -i "$out/$name.ncu-rep" --page source --csv --print-source sass \
    > "$out/sass_$name.csv" 2>&1 || status=1
  echo "$name: $(grep -E '^ +Duration' "$out/ncu_$name.txt" | head -1 | tr -s ' ')"
}
profile_sass prefill_wgmma_sass PrefillWgmma "$bench" \
  --benchmark_filter='BM_Prefill/tokens:8192/block:64/kernel:2/heads_outer:1/persistent:0/schedule:0/'
if python3 -c "import torch" 2> /dev/null; then
  profile_sass prefill_cudnn_sass '(?i)(sdpa|fmha|flash|attn)' python3 -c '
import torch
from torch.nn.attention import sdpa_kernel, SDPBackend
q, k, v = (torch.randn(1, 32, 8192, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    for _ in range(4):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
torch.cuda.synchronize()
'
fi
exit $status
