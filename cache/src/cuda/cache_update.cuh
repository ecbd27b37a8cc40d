// The CUDA cache-update kernel (vLLM's reshape_and_cache_flash): each new token's keys and
// values written into its slot of the paged cache, converted to the cache dtype bit for bit
// as the CPU implementation does (common/numeric.h: round to nearest even, fp8 saturating,
// fp8(x / scale) with a true division, same-dtype copies keep every bit including NaN
// payloads). Header-only templates over a params struct passed by value; the launcher is
// cache_update.cu. The quotient x / scale is always the float the host's division gives:
// computed by a division, or by a way proven to give the same float (below).
//
// Work split: one warp per token, eight tokens per 256-thread CTA. A warp walks the K and
// V rows of its token (all KV heads) as one index space of 8-element chunks, 32 chunks per
// step (lane l takes chunk 32 s + l in step s), in batches of kUnroll steps: a lane issues
// a batch's loads (64 bytes: four 16-byte or two 32-byte chunks) before it converts and
// stores any (the fp8 fast paths: two half batches, each loaded again once stored), and
// the token's slot is read while the first batch's loads are in flight.
// A lane locates its chunk with a magic-number multiply at the start of a batch and then
// moves it by fixed steps (LaneWalk), so that a chunk's index math is a few adds, with
// its destination kept from load to store. Where K and V rows are regular (one head size,
// the same strides, a power-of-two number of chunks per head), the regular walk
// (WalkTokenRegular) finds every chunk from the lane's first with one multiply-add and no
// tests, lanes taking runs of two adjacent chunks on the fp8 paths. A scalar variant
// handles strides or sizes that 8-element vectors do not fit (odd head sizes, misaligned
// or dim-strided caches, rows beyond 32-bit offsets).
//
// fp8 caches (kReciprocal, the default) get fp8(x / scale) without a division per element.
// When every scale is 1 (the default) it is fp8(x); when every scale is a power of two,
// x * (1 / scale): 1 / scale is exact, so the product is x / scale rounded once. For
// 16-bit inputs and scales in [2^-30, 2^30] it is fma(x, high, RN(x * low)) with
// high + low a split of 1 / scale, which the launcher proves equal to the division for
// every such input, scale by scale, by exhaustion over the input's significands
// (Fp8SplitReciprocalExact). Otherwise (f32 inputs, a scale whose split fails the check,
// or kBracket), for scales in [2^-30, 2^30], x is multiplied by the floats just below and
// above 1 / scale (rounding toward zero and to nearest): the two products bracket the
// quotient the host's division gives, so where they convert to the same code, that is its
// code; where they do not (rounding boundaries in between, a few per million elements),
// the lane computes the quotient itself: a reciprocal plus two FMA corrections, the
// correctly rounded quotient (proof at FastQuotient). Quotients are converted two at a
// time with the packed cvt, and NaN codes made the host's on the packed bytes
// (HostNaNCodes). kDivision keeps the per-element division, for comparison.
//
// The part above `#if defined(__CUDACC__)` is plain C++ so that tests and benchmarks
// compiled by the host compiler can pick the method.
//
// The pieces, in the order they build on each other: cache_update_host.h (that plain C++
// part), cache_update_params.cuh (constants, KernelParams), cache_update_types.cuh (element
// types, bit-exact conversions), cache_update_vector.cuh (the vector paths' walks),
// cache_update_fp8.cuh (the fast fp8 quotients); here the scalar path and the kernel.
#ifndef KVSTREAM_CACHE_CUDA_CACHE_UPDATE_CUH_
#define KVSTREAM_CACHE_CUDA_CACHE_UPDATE_CUH_

#include <cstdint>

// The pieces are named from this folder: benchmarks include this header as
// cache/src/cuda/cache_update.cuh, with a cuda/ folder of attention's on their path.
#include "cache_update_host.h"

#if defined(__CUDACC__)

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "cache_update_fp8.cuh"
#include "cache_update_params.cuh"
#include "cache_update_types.cuh"
#include "cache_update_vector.cuh"

namespace kvstream {
namespace internal {
namespace cache_update {

// Scalar path: any sizes and strides (dim strides included), one element per lane step.
template <typename In, typename Out>
__device__ __forceinline__ void UpdateTokenScalar(const KernelParams& p, int64_t token,
                                                  int64_t block, int64_t offset, int lane) {
  using InBits = typename In::Bits;
  using OutBits = typename Out::Bits;
  const InBits* __restrict__ key =
      static_cast<const InBits*>(p.key) + token * p.key_token_stride;
  const InBits* __restrict__ value =
      static_cast<const InBits*>(p.value) + token * p.value_token_stride;
  OutBits* __restrict__ k_dst =
      static_cast<OutBits*>(p.k_cache) + block * p.k_block_stride + offset * p.k_token_stride;
  OutBits* __restrict__ v_dst =
      static_cast<OutBits*>(p.v_cache) + block * p.v_block_stride + offset * p.v_token_stride;
  const int k_total = p.num_kv_heads * p.head_size;
  const int total = k_total + p.num_kv_heads * p.head_size_v;
#pragma unroll 4
  for (int idx = lane; idx < total; idx += 32) {
    const bool is_v = idx >= k_total;
    const int j = is_v ? idx - k_total : idx;
    const int per_head = is_v ? p.head_size_v : p.head_size;
    const int head = j / per_head;
    const int d = j - head * per_head;
    const float scale = Out::kFp8 ? ScaleFor(p, is_v, head) : 1.0f;
    if (is_v) {
      v_dst[head * p.v_head_stride + d * p.v_dim_stride] =
          Convert<In, Out>(value[head * p.value_head_stride + d], scale);
    } else {
      k_dst[head * p.k_head_stride + d * p.k_dim_stride] =
          Convert<In, Out>(key[head * p.key_head_stride + d], scale);
    }
  }
}

// Grid: ceil(num_tokens / kWarpsPerCta) CTAs of kThreadsPerCta threads; warp w of CTA b
// writes token b * kWarpsPerCta + w.
// kRegular (vector path): the regular walk, WalkTokenRegular (the launcher checked the
// shape and set its params). kFastFp8 (vector path, fp8 cache): UpdateTokenVecFp8 instead
// of UpdateTokenVec, with kQuotient as there.
// CTAs per SM the register budget is sized for: four (32 warps, 64 registers), so that at a
// few thousand tokens (one warp per token) a whole call runs in one wave instead of one and
// a fraction.
template <typename In, typename Out>
inline constexpr int kMinCtasPerSm = 4;

template <typename In, typename Out, bool kVectorized, bool kRegular = false,
          bool kFastFp8 = false, Fp8Quotient kQuotient = Fp8Quotient::kReciprocal>
__global__ void __launch_bounds__(kThreadsPerCta, (kMinCtasPerSm<In, Out>))
    CacheUpdateKernel(const __grid_constant__ KernelParams p) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t token =
      static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + static_cast<int64_t>(threadIdx.x >> 5);
  if (token >= p.num_tokens) return;
  if constexpr (kVectorized && kFastFp8) {
    UpdateTokenVecFp8<In, Out, kQuotient, kRegular>(p, token, p.slot_mapping + token, lane);
  } else if constexpr (kVectorized) {
    UpdateTokenVec<In, Out, kRegular>(p, token, p.slot_mapping + token, lane);
  } else {
    const int64_t slot = p.slot_mapping[token];
    if (slot < 0 || slot >= p.num_slots) return;  // padding (-1), or see KernelParams
    const int64_t block = slot / p.block_size;
    const int64_t offset = slot - block * p.block_size;
    UpdateTokenScalar<In, Out>(p, token, block, offset, lane);
  }
}

}  // namespace cache_update
}  // namespace internal
}  // namespace kvstream

#endif  // defined(__CUDACC__)

#endif  // KVSTREAM_CACHE_CUDA_CACHE_UPDATE_CUH_
