// The small device helpers of the prefill attention kernel (prefill_attention.cuh): the
// shared PTX pieces it uses (mma_ptx.cuh), cache elements read as the query's type, the
// swizzled shared-memory offset of an element, the keys a query position may see, and a
// head's fp8 scale.
#ifndef KVSTREAM_ATTENTION_CUDA_PREFILL_HELPERS_CUH_
#define KVSTREAM_ATTENTION_CUDA_PREFILL_HELPERS_CUH_

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_common.cuh"
#include "cuda/kernel_params.h"
#include "cuda/mma_ptx.cuh"
#include "cuda/prefill_config.cuh"

namespace kvstream {
namespace internal {
namespace cuda {

// ---------------------------------------------------------------------------------------
// Small device helpers: PTX wrappers and conversions.

// The shared PTX pieces (mma_ptx.cuh).
using ptx::CpAsync16;
using ptx::CpAsyncCommit;
using ptx::CpAsyncWaitGroup;
using ptx::FastExp2;
using ptx::Fp8ChunkTo;
using ptx::LdMatrixX4;
using ptx::LdMatrixX4Trans;
using ptx::Log2IfPowerOfTwo;
using ptx::Mma16816;
using ptx::PackPair;
using ptx::PairBits;
using ptx::RowOffsets;
using ptx::SmemAddress;
using ptx::SwizzledChunk;

template <typename T>
__device__ __forceinline__ T CacheElementAs(const void* base, int64_t index, int cache_kind) {
  if (cache_kind == kPrefillCache16) return static_cast<const T*>(base)[index];
  const uint8_t code = static_cast<const uint8_t*>(base)[index];
  float x;
  if (cache_kind == kPrefillCacheE4M3) {
    __nv_fp8_e4m3 v;
    v.__x = code;
    x = ToFloat(v);
  } else {
    __nv_fp8_e5m2 v;
    v.__x = code;
    x = ToFloat(v);
  }
  return FromFloat<T>(x);
}

// Byte offset of element `col` of row `row` in the same tile.
template <int D>
__device__ __forceinline__ uint32_t SwizzledElement(int row, int col) {
  return SwizzledChunk<D>(row, col >> 3) + static_cast<uint32_t>((col & 7) * 2);
}

// The keys a query at position qp may see: [VisibleLo, VisibleHi], both inclusive.
__device__ __forceinline__ int VisibleLo(const PagedKernelParams& p, int qp) {
  return p.sliding_window > 0 ? max(0, qp - p.sliding_window + 1) : 0;
}
__device__ __forceinline__ int VisibleHi(const PagedKernelParams& p, int qp, int seq_len) {
  if (p.causal) return qp;
  if (p.sliding_window > 0) return min(seq_len - 1, qp + p.sliding_window - 1);
  return seq_len - 1;
}

__device__ __forceinline__ float ScaleOfHead(const float* scales, int num_scales, int head) {
  return scales[num_scales == 1 ? 0 : head];
}

}  // namespace cuda
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_PREFILL_HELPERS_CUH_
