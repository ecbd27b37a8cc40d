// PagedKernelParams: the plain struct the CUDA attention kernels take by value, built once
// per call from the public PagedAttentionParams (backend.h) after validation. Everything a
// kernel reads is a device pointer or a number; the fp8 scales travel by value so that a
// kernel needs no extra memory read to dequantise.
#ifndef KVSTREAM_ATTENTION_CUDA_KERNEL_PARAMS_H_
#define KVSTREAM_ATTENTION_CUDA_KERNEL_PARAMS_H_

#include <cstdint>
#include <initializer_list>

#include "absl/status/statusor.h"
#include "kvstream/attention/backend.h"

namespace kvstream {
namespace internal {

// Per-head fp8 scales carried by value; caches with more KV heads are rejected.
inline constexpr int kMaxKernelScales = 128;

struct PagedKernelParams {
  // q:   [num_tokens, num_heads, head_size]      (q_token_stride, q_head_stride; dim 1)
  // out: [num_tokens, num_heads, head_size_v]    (o_token_stride, o_head_stride; dim 1)
  const void* q;
  void* out;
  int64_t q_token_stride;
  int64_t q_head_stride;
  int64_t o_token_stride;
  int64_t o_head_stride;
  // k_cache: [num_blocks, block_size, num_kv_heads, head_size]    (k_* strides; dim 1)
  // v_cache: [num_blocks, block_size, num_kv_heads, head_size_v]  (v_* strides; dim 1)
  // NHD and HND differ only in these strides.
  const void* k_cache;
  const void* v_cache;
  int64_t k_block_stride;
  int64_t k_token_stride;
  int64_t k_head_stride;
  int64_t v_block_stride;
  int64_t v_token_stride;
  int64_t v_head_stride;
  int64_t num_blocks;
  // query_start_loc: [num_seqs + 1]; seq_lens: [num_seqs];
  // block_table: [num_seqs, block_table_stride]. Device memory, already validated.
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  const int32_t* block_table;
  int64_t block_table_stride;
  int64_t num_tokens;  // rows of q and out
  int32_t num_seqs;
  int32_t max_query_len;
  int32_t max_seq_len;
  // For the host's launch planning only (kernels do not read it): the sum over sequences of
  // the keys a query sees (seq_len, at most sliding_window), from the host mirror of
  // seq_lens; 0 when there is none.
  int64_t total_visible_keys;
  int32_t num_heads;
  int32_t num_kv_heads;
  int32_t head_size;
  int32_t head_size_v;
  int32_t block_size;
  float scale;            // softmax scale (not premultiplied by log2(e))
  int32_t causal;         // 1: bottom-right aligned causal mask
  int32_t sliding_window;  // <= 0: none
  float logits_soft_cap;  // <= 0: none
  const float* alibi_slopes;  // [num_heads] device memory, or null
  // fp8 caches: dequantised value = stored * scale; num_scales is 1 (per tensor) or
  // num_kv_heads (per head). 1.0 and num_scales = 1 for 16/32-bit caches.
  int32_t num_scales;
  float k_scale[kMaxKernelScales];
  float v_scale[kMaxKernelScales];
};

// The scale a kernel uses for KV head `h`.
inline float KernelKScale(const PagedKernelParams& p, int h) {
  return p.k_scale[p.num_scales == 1 ? 0 : h];
}

// The padded head dimension of the tensor-core kernels (their template argument) for these
// head sizes. REQUIRES: 0 < head_size, head_size_v <= 256.
inline int PaddedHeadDim(int head_size, int head_size_v) {
  const int larger = head_size > head_size_v ? head_size : head_size_v;
  return larger <= 64 ? 64 : larger <= 128 ? 128 : 256;
}

// Whether 16-byte copies of rows of `row_elems` elements of `elem_bytes` each, at `base`
// plus any combination of `strides` (in elements), are all 16-byte aligned.
inline bool RowsAligned16(const void* base, int64_t elem_bytes, int64_t row_elems,
                          std::initializer_list<int64_t> strides) {
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0 || (row_elems * elem_bytes) % 16 != 0) {
    return false;
  }
  for (int64_t s : strides) {
    if ((s * elem_bytes) % 16 != 0) return false;
  }
  return true;
}

// Validates `params` (ValidatePagedAttention) and the CUDA-specific limits (device cache,
// unit dim strides, at most kMaxKernelScales scales), then builds the kernel struct.
// InvalidArgument naming the problem otherwise.
absl::StatusOr<PagedKernelParams> MakePagedKernelParams(const PagedAttentionParams& params);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_KERNEL_PARAMS_H_
