// The CUDA cache update's launch constants (CTA shape, chunk size, the most fp8 scales) and
// KernelParams, the struct the kernel (cache_update.cuh) takes by value: pointers, strides,
// sizes, the fp8 scales with what the quotient paths need of their reciprocals, and the
// walk's precomputed steps. Filled and validated by the launcher (cache_update.cu).
#ifndef KVSTREAM_CACHE_CUDA_CACHE_UPDATE_PARAMS_CUH_
#define KVSTREAM_CACHE_CUDA_CACHE_UPDATE_PARAMS_CUH_

#include <cstdint>

#include "cache_update_host.h"

namespace kvstream {
namespace internal {
namespace cache_update {

// Per-head fp8 scales travel by value; caches with more KV heads are rejected.
inline constexpr int kMaxScales = 128;
inline constexpr int kWarpsPerCta = 8;
inline constexpr int kThreadsPerCta = kWarpsPerCta * 32;
inline constexpr int kVecElems = 8;

// One fp8 scale and what the quotient paths need of its reciprocal, from the host (see
// Fp8ReciprocalBracket, Fp8SplitReciprocalLow); the split is one 8-byte load.
struct alignas(16) Fp8ScaleConsts {
  float scale;
  float recip;       // RN(1 / scale), IEEE division
  float recip_down;  // the largest float <= the real 1 / scale; the split's high part
  float recip_low;   // the split's low part (Fp8SplitReciprocalLow)
  float recip_up;    // the smallest float >= the real 1 / scale
};

struct KernelParams {
  // key:   [num_tokens, num_kv_heads, head_size]    (key_token_stride, key_head_stride; dim 1)
  // value: [num_tokens, num_kv_heads, head_size_v]  (value_token_stride, value_head_stride)
  const void* key;
  const void* value;
  int64_t key_token_stride;
  int64_t key_head_stride;
  int64_t value_token_stride;
  int64_t value_head_stride;
  // slot_mapping: [num_tokens] device memory; slot = block * block_size + offset, -1 skipped.
  // Slots outside [0, num_slots) are skipped too (validation has rejected them on the host;
  // this only keeps a device copy that disagrees with its host mirror from writing wild).
  const int64_t* slot_mapping;
  int64_t num_tokens;
  int64_t num_slots;
  // k_cache: [num_blocks, block_size, num_kv_heads, head_size]    (k_* strides, elements)
  // v_cache: [num_blocks, block_size, num_kv_heads, head_size_v]  (v_* strides, elements)
  void* k_cache;
  void* v_cache;
  int64_t k_block_stride;
  int64_t k_token_stride;
  int64_t k_head_stride;
  int64_t k_dim_stride;
  int64_t v_block_stride;
  int64_t v_token_stride;
  int64_t v_head_stride;
  int64_t v_dim_stride;
  int32_t block_size;
  int32_t num_kv_heads;
  int32_t head_size;
  int32_t head_size_v;
  // fp8 caches: stored = fp8(x / scale); 1 scale (per tensor) or num_kv_heads (per head).
  // Unused (num_scales = 0) for 16/32-bit caches.
  int32_t num_scales;
  // Per scale: K's at [0, kMaxScales), V's at [kMaxScales, 2 * kMaxScales), so that one
  // index (ScaleIndex) finds a chunk's.
  Fp8ScaleConsts fp8_scale[2 * kMaxScales];
  // Vector paths (LaneWalk): a step of 32 chunks moves a lane's chunk by *_step_head heads
  // and *_step_first elements (< the head size), plus a carry; chunks per head (head size
  // / 8) as magic numbers, to locate a lane's first chunk in K and in V.
  int32_t k_step_first;
  int32_t k_step_head;
  int32_t v_step_first;
  int32_t v_step_head;
  DivMagic k_chunks_per_head;
  DivMagic v_chunks_per_head;
  // The regular walk (WalkTokenRegular), where the launcher takes it: log2 of the runs per
  // head R, K's groups of kRegularGroup steps, and what a step of 32 runs moves a lane's
  // offsets by (32 / R heads).
  int32_t run_shift;
  int32_t regular_k_groups;
  uint32_t step_in;   // 32 / R heads of an input row (K's and V's head strides are equal)
  uint32_t step_out;  // ... of a cache row (K's and V's equal too)
};

}  // namespace cache_update
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_CACHE_CUDA_CACHE_UPDATE_PARAMS_CUH_
