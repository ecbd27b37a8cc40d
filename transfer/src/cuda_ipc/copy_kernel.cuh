// The cuda_ipc copy kernel (copy_kernel.h says what it computes and how work is cut).
#ifndef KVSTREAM_TRANSFER_CUDA_IPC_COPY_KERNEL_CUH_
#define KVSTREAM_TRANSFER_CUDA_IPC_COPY_KERNEL_CUH_

#include <cstdint>

#include "cuda_ipc/copy_kernel.h"

namespace kvstream {
namespace internal {

// The index of the segment holding chunk `chunk`: the last s with first_chunk <= chunk.
// Called by a whole warp; a 32-way search (3 rounds for 16k segments instead of 14 for a
// binary one), since each round is one dependent L2 read.
__device__ inline uint32_t FindSegment(const IpcCopySegment* segments, uint32_t n,
                                       uint64_t chunk) {
  const int lane = threadIdx.x & 31;
  uint32_t lo = 0;  // invariant: segments[lo].first_chunk <= chunk (first_chunk[0] is 0)
  uint32_t hi = n;  // the answer is in [lo, hi)
  while (hi - lo > 32) {
    const uint32_t step = (hi - lo + 31) / 32;
    const uint32_t idx = lo + lane * step;
    const bool le = idx < hi && __ldg(&segments[idx].first_chunk) <= chunk;
    const unsigned mask = __ballot_sync(0xffffffffu, le);
    const uint32_t k = 31 - __clz(mask);  // lanes 0..k hold; lane 0 always does
    lo += k * step;
    hi = min(hi, lo + step);
  }
  const uint32_t idx = lo + lane;
  const bool le = idx < hi && __ldg(&segments[idx].first_chunk) <= chunk;
  const unsigned mask = __ballot_sync(0xffffffffu, le);
  return lo + (31 - __clz(mask));
}

// Copies `n` bytes (at most one chunk) from src to dst with the whole CTA.
template <int kVectors>
__device__ inline void CopyChunk(const char* src, char* dst, uint64_t n) {
  const uint32_t t = threadIdx.x;
  const uintptr_t s = reinterpret_cast<uintptr_t>(src);
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst);
  if (((s ^ d) & 15) != 0) {
    // Aligned differently: no common vector width worth having for KV blocks.
    for (uint64_t i = t; i < n; i += kIpcCopyThreads) dst[i] = src[i];
    return;
  }
  uint64_t head = (16 - (s & 15)) & 15;
  if (head > n) head = n;
  if (t < head) dst[t] = src[t];
  const uint64_t nvec = (n - head) / 16;
  const int4* vs = reinterpret_cast<const int4*>(src + head);
  int4* vd = reinterpret_cast<int4*>(dst + head);
  if (nvec == static_cast<uint64_t>(kIpcCopyThreads) * kVectors) {
    // A full chunk: every load issued before the first store.
    int4 v[kVectors];
#pragma unroll
    for (int k = 0; k < kVectors; ++k) v[k] = __ldg(&vs[t + k * kIpcCopyThreads]);
#pragma unroll
    for (int k = 0; k < kVectors; ++k) vd[t + k * kIpcCopyThreads] = v[k];
  } else {
    int4 v[kVectors];
#pragma unroll
    for (int k = 0; k < kVectors; ++k) {
      const uint64_t i = t + static_cast<uint64_t>(k) * kIpcCopyThreads;
      if (i < nvec) v[k] = __ldg(&vs[i]);
    }
#pragma unroll
    for (int k = 0; k < kVectors; ++k) {
      const uint64_t i = t + static_cast<uint64_t>(k) * kIpcCopyThreads;
      if (i < nvec) vd[i] = v[k];
    }
  }
  const uint64_t done = head + nvec * 16;
  if (t < n - done) dst[done + t] = src[done + t];
}

template <int kVectors>
__global__ void __launch_bounds__(kIpcCopyThreads) IpcCopyKernel(IpcCopyParams p) {
  constexpr uint64_t kChunk = static_cast<uint64_t>(kIpcCopyThreads) * kVectors * 16;
  const uint64_t per = p.num_chunks / gridDim.x;
  const uint64_t extra = p.num_chunks % gridDim.x;
  const uint64_t b = blockIdx.x;
  const uint64_t begin = b * per + (b < extra ? b : extra);
  const uint64_t end = begin + per + (b < extra ? 1 : 0);
  if (begin >= end) return;

  __shared__ uint32_t first_segment;
  if (threadIdx.x < 32) {
    const uint32_t s = FindSegment(p.segments, p.num_segments, begin);
    if (threadIdx.x == 0) first_segment = s;
  }
  __syncthreads();

  // Every thread walks the same segments (uniform control flow); the entries come from L1.
  uint32_t seg = first_segment;
  uint64_t src = __ldg(&p.segments[seg].src);
  uint64_t dst = __ldg(&p.segments[seg].dst);
  uint64_t length = __ldg(&p.segments[seg].length);
  uint64_t first = __ldg(&p.segments[seg].first_chunk);
  for (uint64_t c = begin; c < end; ++c) {
    while (c >= first + (length + kChunk - 1) / kChunk) {
      ++seg;
      src = __ldg(&p.segments[seg].src);
      dst = __ldg(&p.segments[seg].dst);
      length = __ldg(&p.segments[seg].length);
      first = __ldg(&p.segments[seg].first_chunk);
    }
    const uint64_t offset = (c - first) * kChunk;
    const uint64_t n = length - offset < kChunk ? length - offset : kChunk;
    CopyChunk<kVectors>(reinterpret_cast<const char*>(src) + offset,
                        reinterpret_cast<char*>(dst) + offset, n);
  }
}

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_CUDA_IPC_COPY_KERNEL_CUH_
