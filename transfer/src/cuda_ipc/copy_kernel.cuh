// The cuda_ipc copy kernels (copy_kernel.h says what they compute and how work is cut).
#ifndef KVSTREAM_TRANSFER_CUDA_IPC_COPY_KERNEL_CUH_
#define KVSTREAM_TRANSFER_CUDA_IPC_COPY_KERNEL_CUH_

#include <cstdint>

#include "cuda_ipc/copy_kernel.h"

namespace kvstream {
namespace internal {

// A field of the chunked kernel's table (zero-copy tables: cache-volatile, see RingTable).
__device__ inline uint64_t TableLoad(const uint64_t* p, bool zero_copy) {
  return zero_copy ? __ldcv(p) : __ldg(p);
}

// The index of the segment holding chunk `chunk`: the last s with first_chunk <= chunk.
// Called by a whole warp; a 32-way search (3 rounds for 16k segments instead of 14 for a
// binary one), since each round is one dependent L2 read.
__device__ inline uint32_t FindSegment(const IpcCopySegment* segments, uint32_t n,
                                       uint64_t chunk, bool zc) {
  const int lane = threadIdx.x & 31;
  uint32_t lo = 0;  // invariant: segments[lo].first_chunk <= chunk (first_chunk[0] is 0)
  uint32_t hi = n;  // the answer is in [lo, hi)
  while (hi - lo > 32) {
    const uint32_t step = (hi - lo + 31) / 32;
    const uint32_t idx = lo + lane * step;
    const bool le = idx < hi && TableLoad(&segments[idx].first_chunk, zc) <= chunk;
    const unsigned mask = __ballot_sync(0xffffffffu, le);
    const uint32_t k = 31 - __clz(mask);  // lanes 0..k hold; lane 0 always does
    lo += k * step;
    hi = min(hi, lo + step);
  }
  const uint32_t idx = lo + lane;
  const bool le = idx < hi && TableLoad(&segments[idx].first_chunk, zc) <= chunk;
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
    const uint32_t s = FindSegment(p.segments, p.num_segments, begin, p.zero_copy);
    if (threadIdx.x == 0) first_segment = s;
  }
  __syncthreads();

  // Every thread walks the same segments (uniform control flow); the entries come from L1
  // (device tables).
  uint32_t seg = first_segment;
  uint64_t src = TableLoad(&p.segments[seg].src, p.zero_copy);
  uint64_t dst = TableLoad(&p.segments[seg].dst, p.zero_copy);
  uint64_t length = TableLoad(&p.segments[seg].length, p.zero_copy);
  uint64_t first = TableLoad(&p.segments[seg].first_chunk, p.zero_copy);
  for (uint64_t c = begin; c < end; ++c) {
    while (c >= first + (length + kChunk - 1) / kChunk) {
      ++seg;
      src = TableLoad(&p.segments[seg].src, p.zero_copy);
      dst = TableLoad(&p.segments[seg].dst, p.zero_copy);
      length = TableLoad(&p.segments[seg].length, p.zero_copy);
      first = TableLoad(&p.segments[seg].first_chunk, p.zero_copy);
    }
    const uint64_t offset = (c - first) * kChunk;
    const uint64_t n = length - offset < kChunk ? length - offset : kChunk;
    CopyChunk<kVectors>(reinterpret_cast<const char*>(src) + offset,
                        reinterpret_cast<char*>(dst) + offset, n);
  }
}

// --- Per-segment kernels (copy_kernel.h) ---

// Copies `n` bytes from src to dst with the `kThreads` threads of one unit; `t` is the
// calling thread's index in the unit. Every thread issues its kVectors loads of a pass
// before its stores.
template <int kThreads, int kVectors>
__device__ inline void CopyRun(const char* src, char* dst, uint64_t n, uint32_t t) {
  const uintptr_t s = reinterpret_cast<uintptr_t>(src);
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst);
  if (((s ^ d) & 15) != 0) {
    for (uint64_t i = t; i < n; i += kThreads) dst[i] = src[i];
    return;
  }
  uint64_t head = (16 - (s & 15)) & 15;
  if (head > n) head = n;
  if (t < head) dst[t] = src[t];
  const uint64_t nvec = (n - head) >> 4;
  const int4* vs = reinterpret_cast<const int4*>(src + head);
  int4* vd = reinterpret_cast<int4*>(dst + head);
  constexpr uint64_t kPass = static_cast<uint64_t>(kThreads) * kVectors;
  uint64_t i = t;
  // Plain loads and stores: evict-first ones (__ldcs / __stcs) with at least 4 CTAs per SM
  // measured no faster on an H200 (docs/benchmarks.md).
  for (; i + static_cast<uint64_t>(kVectors - 1) * kThreads < nvec; i += kPass) {
    int4 v[kVectors];
#pragma unroll
    for (int k = 0; k < kVectors; ++k) v[k] = __ldg(&vs[i + k * kThreads]);
#pragma unroll
    for (int k = 0; k < kVectors; ++k) vd[i + k * kThreads] = v[k];
  }
  if (i < nvec) {
    int4 v[kVectors];
#pragma unroll
    for (int k = 0; k < kVectors; ++k) {
      if (i + k * kThreads < nvec) v[k] = __ldg(&vs[i + k * kThreads]);
    }
#pragma unroll
    for (int k = 0; k < kVectors; ++k) {
      if (i + k * kThreads < nvec) vd[i + k * kThreads] = v[k];
    }
  }
  const uint64_t done = head + (nvec << 4);
  if (t < n - done) dst[done + t] = src[done + t];
}

// A table of IpcCopySegment entries in device memory or (kZeroCopy) mapped pinned memory.
// Zero-copy entries are read cache-volatile: a ring entry's previous contents may still sit
// in a cache from an earlier launch.
template <IpcTableSource kSource>
struct RingTable {
  const IpcCopySegment* segments;
  uint32_t num_segments;
  __device__ uint32_t size() const { return num_segments; }
  __device__ uint64_t Field(uint32_t i, uint32_t f) const {
    const uint64_t* p = reinterpret_cast<const uint64_t*>(segments + i) + f;
    return kSource == IpcTableSource::kZeroCopy ? __ldcv(p) : __ldg(p);
  }
};

// A table in the kernel's parameters (a __grid_constant__ parameter, read in place).
template <uint32_t kCapacity>
struct ParamTableView {
  const IpcParamTable<kCapacity>* table;
  __device__ uint32_t size() const { return table->num_segments; }
  __device__ uint64_t Field(uint32_t i, uint32_t f) const {
    const IpcParamSegment& e = table->segments[i];
    return f == 0 ? e.src : (f == 1 ? e.dst : e.length);
  }
};

// Entry fields: 0 src, 1 dst, 2 length. Threads 0..2 of a unit load them (the next entry's
// while the unit copies the current one) and share them.
template <IpcCopyUnit kUnit, int kVectors, typename Table>
__device__ inline void SegmentCopy(const Table& table) {
  const uint32_t n = table.size();
  if (kUnit == IpcCopyUnit::kCta || kUnit == IpcCopyUnit::kWideCta) {
    constexpr int kThreads = kIpcUnitCtaThreads<kUnit>;
    const uint32_t t = threadIdx.x;
    const uint64_t units = gridDim.x;
    uint64_t i = blockIdx.x;
    if (i >= n) return;  // the whole CTA
    __shared__ uint64_t entry[2][3];
    if (t < 3) entry[0][t] = table.Field(static_cast<uint32_t>(i), t);
    __syncthreads();
    int buf = 0;
    for (; i < n; i += units) {
      const char* src = reinterpret_cast<const char*>(entry[buf][0]);
      char* dst = reinterpret_cast<char*>(entry[buf][1]);
      const uint64_t length = entry[buf][2];
      const bool more = i + units < n;
      uint64_t next = 0;
      if (more && t < 3) next = table.Field(static_cast<uint32_t>(i + units), t);
      CopyRun<kThreads, kVectors>(src, dst, length, t);
      if (more && t < 3) entry[buf ^ 1][t] = next;
      __syncthreads();  // entry[buf ^ 1] written; entry[buf] no longer read
      buf ^= 1;
    }
  } else {
    const uint32_t lane = threadIdx.x & 31;
    const uint64_t units = static_cast<uint64_t>(gridDim.x) * kIpcWarpsPerCta;
    uint64_t i = static_cast<uint64_t>(blockIdx.x) * kIpcWarpsPerCta + threadIdx.x / 32;
    if (i >= n) return;  // the whole warp
    uint64_t mine = lane < 3 ? table.Field(static_cast<uint32_t>(i), lane) : 0;
    for (; i < n; i += units) {
      const uint64_t src = __shfl_sync(0xffffffffu, mine, 0);
      const uint64_t dst = __shfl_sync(0xffffffffu, mine, 1);
      const uint64_t length = __shfl_sync(0xffffffffu, mine, 2);
      // The next entry's load is in flight during the copy.
      if (i + units < n && lane < 3) mine = table.Field(static_cast<uint32_t>(i + units), lane);
      CopyRun<32, kVectors>(reinterpret_cast<const char*>(src), reinterpret_cast<char*>(dst),
                            length, lane);
    }
  }
}

template <IpcTableSource kSource, IpcCopyUnit kUnit, int kVectors>
__global__ void __launch_bounds__(kIpcUnitCtaThreads<kUnit>)
    IpcSegmentCopyKernel(const IpcCopySegment* segments, uint32_t num_segments) {
  SegmentCopy<kUnit, kVectors>(RingTable<kSource>{segments, num_segments});
}

template <uint32_t kCapacity, IpcCopyUnit kUnit, int kVectors>
__global__ void __launch_bounds__(kIpcUnitCtaThreads<kUnit>)
    IpcSegmentCopyParamKernel(const __grid_constant__ IpcParamTable<kCapacity> table) {
  SegmentCopy<kUnit, kVectors>(ParamTableView<kCapacity>{&table});
}

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_CUDA_IPC_COPY_KERNEL_CUH_
