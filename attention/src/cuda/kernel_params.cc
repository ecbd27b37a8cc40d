// MakePagedKernelParams: the public params checked and flattened for the CUDA kernels.
#include "cuda/kernel_params.h"

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {
namespace {

absl::Status Invalid(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("cuda paged attention: ", what));
}

}  // namespace

absl::StatusOr<PagedKernelParams> MakePagedKernelParams(const PagedAttentionParams& params) {
  RETURN_IF_ERROR(ValidatePagedAttention(params));
  const KvCacheView& cache = params.cache;
  if (cache.memory != MemoryKind::kDevice) {
    return Invalid(absl::StrCat("the cache must be in device memory, got ",
                                MemoryKindName(cache.memory)));
  }
  if (cache.k_strides.dim != 1 || cache.v_strides.dim != 1) {
    return Invalid(absl::StrCat("cache dim strides must be 1, got k=", cache.k_strides.dim,
                                " v=", cache.v_strides.dim));
  }
  PagedKernelParams p{};
  p.q = params.q;
  p.out = params.out;
  p.q_token_stride = params.q_token_stride;
  p.q_head_stride = params.q_head_stride;
  p.o_token_stride = params.o_token_stride;
  p.o_head_stride = params.o_head_stride;
  p.k_cache = cache.k;
  p.v_cache = cache.v;
  p.k_block_stride = cache.k_strides.block;
  p.k_token_stride = cache.k_strides.token;
  p.k_head_stride = cache.k_strides.head;
  p.v_block_stride = cache.v_strides.block;
  p.v_token_stride = cache.v_strides.token;
  p.v_head_stride = cache.v_strides.head;
  p.num_blocks = cache.num_blocks;
  p.query_start_loc = params.query_start_loc;
  p.seq_lens = params.seq_lens;
  p.block_table = params.block_table;
  p.block_table_stride = params.block_table_stride;
  p.num_tokens = params.num_tokens;
  p.num_seqs = params.num_seqs;
  p.max_query_len = params.max_query_len;
  p.max_seq_len = params.max_seq_len;
  p.total_visible_keys = 0;
  if (params.host.seq_lens != nullptr) {
    for (int32_t i = 0; i < params.num_seqs; ++i) {
      const int64_t len = params.host.seq_lens[i];
      p.total_visible_keys +=
          params.sliding_window > 0 ? std::min<int64_t>(len, params.sliding_window) : len;
    }
  }
  p.num_heads = params.num_heads;
  p.num_kv_heads = cache.spec.num_kv_heads;
  p.head_size = cache.spec.head_size;
  p.head_size_v = cache.spec.head_size_v;
  p.block_size = cache.spec.block_size;
  p.scale = params.scale;
  p.causal = params.causal ? 1 : 0;
  p.sliding_window = params.sliding_window;
  p.logits_soft_cap = params.logits_soft_cap;
  p.alibi_slopes = params.alibi_slopes;
  p.num_scales = 1;
  p.k_scale[0] = 1.0f;
  p.v_scale[0] = 1.0f;
  if (IsFp8(cache.spec.dtype)) {
    if (cache.num_scales > kMaxKernelScales) {
      return Invalid(absl::StrCat("at most ", kMaxKernelScales, " per-head fp8 scales, got ",
                                  cache.num_scales));
    }
    p.num_scales = cache.num_scales;
    for (int i = 0; i < cache.num_scales; ++i) {
      p.k_scale[i] = cache.k_scale[i];
      p.v_scale[i] = cache.v_scale[i];
    }
  }
  return p;
}

}  // namespace internal
}  // namespace kvstream
