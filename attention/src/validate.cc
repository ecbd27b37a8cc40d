// ValidatePagedAttention: the one check every attention backend runs before it touches
// memory, so that a bad batch is an error naming the field, sequence or block at fault
// rather than an out-of-bounds read in a kernel.
#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kvstream/common/int_math.h"
#include "kvstream/attention/backend.h"
#include "kvstream/cache/kv_cache_spec.h"
#include "kvstream/common/dtype.h"

namespace kvstream {
namespace {

absl::Status Invalid(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("paged attention: ", what));
}

bool IsActivationDType(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

absl::Status ValidateStrides(absl::string_view name, const CacheStrides& s) {
  if (s.block < 0 || s.token < 0 || s.head < 0 || s.dim < 0) {
    return Invalid(absl::StrCat(name, " strides must be non-negative, got block=", s.block,
                                " token=", s.token, " head=", s.head, " dim=", s.dim));
  }
  return absl::OkStatus();
}

absl::Status ValidateScales(absl::string_view name, const float* scales, int count) {
  if (scales == nullptr) {
    return Invalid(absl::StrCat("fp8 cache needs ", name, " (cache.", name, " is null)"));
  }
  for (int i = 0; i < count; ++i) {
    if (!std::isfinite(scales[i]) || !(scales[i] > 0.0f)) {
      return Invalid(absl::StrCat("cache.", name, "[", i, "] = ", scales[i],
                                  " must be finite and > 0"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateCache(const KvCacheView& cache) {
  const KvCacheSpec& spec = cache.spec;
  if (cache.k == nullptr || cache.v == nullptr) {
    return Invalid(cache.k == nullptr ? "cache.k is null" : "cache.v is null");
  }
  if (cache.num_blocks <= 0) {
    return Invalid(absl::StrCat("cache.num_blocks must be positive, got ", cache.num_blocks));
  }
  if (spec.block_size <= 0 || spec.num_kv_heads <= 0 || spec.head_size <= 0 ||
      spec.head_size_v <= 0) {
    return Invalid(absl::StrCat("cache spec sizes must be positive, got block_size=",
                                spec.block_size, " num_kv_heads=", spec.num_kv_heads,
                                " head_size=", spec.head_size, " head_size_v=",
                                spec.head_size_v));
  }
  if (!IsFloatingPoint(spec.dtype)) {
    return Invalid(absl::StrCat("cache dtype ", DTypeName(spec.dtype),
                                " is not supported (float32, float16, bfloat16, fp8_e4m3, "
                                "fp8_e5m2)"));
  }
  if (auto st = ValidateStrides("cache.k_strides", cache.k_strides); !st.ok()) return st;
  if (auto st = ValidateStrides("cache.v_strides", cache.v_strides); !st.ok()) return st;

  if (!IsFp8(spec.dtype)) return absl::OkStatus();
  int expected_scales = 0;
  switch (spec.quant_mode) {
    case KvQuantMode::kPerTensor: expected_scales = 1; break;
    case KvQuantMode::kPerHead: expected_scales = spec.num_kv_heads; break;
    case KvQuantMode::kNone:
      return Invalid(absl::StrCat("fp8 cache (", DTypeName(spec.dtype),
                                  ") needs quant_mode per_tensor or per_head, got none"));
  }
  if (cache.num_scales != expected_scales) {
    return Invalid(absl::StrCat("fp8 cache with ",
                                spec.quant_mode == KvQuantMode::kPerTensor ? "per-tensor"
                                                                           : "per-head",
                                " scales needs num_scales=", expected_scales, ", got ",
                                cache.num_scales));
  }
  if (auto st = ValidateScales("k_scale", cache.k_scale, expected_scales); !st.ok()) return st;
  return ValidateScales("v_scale", cache.v_scale, expected_scales);
}

}  // namespace

absl::Status ValidatePagedAttention(const PagedAttentionParams& params) {
  if (params.q == nullptr) return Invalid("q is null");
  if (params.out == nullptr) return Invalid("out is null");
  if (params.query_start_loc == nullptr) return Invalid("query_start_loc is null");
  if (params.seq_lens == nullptr) return Invalid("seq_lens is null");
  if (params.block_table == nullptr) return Invalid("block_table is null");
  // Device batches are checked through their host copies; `p` below reads only host memory.
  PagedAttentionParams p = params;
  if (params.cache.memory == MemoryKind::kDevice) {
    if (params.host.query_start_loc == nullptr || params.host.seq_lens == nullptr ||
        params.host.block_table == nullptr) {
      return Invalid(
          "a device cache needs host copies of query_start_loc, seq_lens and block_table "
          "(params.host)");
    }
    if (params.alibi_slopes != nullptr && params.host.alibi_slopes == nullptr) {
      return Invalid("device alibi_slopes need a host copy (params.host.alibi_slopes)");
    }
    p.query_start_loc = params.host.query_start_loc;
    p.seq_lens = params.host.seq_lens;
    p.block_table = params.host.block_table;
    p.alibi_slopes = params.host.alibi_slopes;
  }
  if (p.num_tokens <= 0) {
    return Invalid(absl::StrCat("num_tokens must be positive, got ", p.num_tokens));
  }
  if (p.num_seqs <= 0) return Invalid(absl::StrCat("num_seqs must be positive, got ", p.num_seqs));
  if (p.num_heads <= 0) {
    return Invalid(absl::StrCat("num_heads must be positive, got ", p.num_heads));
  }
  if (p.block_table_stride <= 0) {
    return Invalid(absl::StrCat("block_table_stride must be positive, got ",
                                p.block_table_stride));
  }
  if (p.q_token_stride < 0 || p.q_head_stride < 0 || p.o_token_stride < 0 ||
      p.o_head_stride < 0) {
    return Invalid(absl::StrCat("q/out strides must be non-negative, got q_token_stride=",
                                p.q_token_stride, " q_head_stride=", p.q_head_stride,
                                " o_token_stride=", p.o_token_stride,
                                " o_head_stride=", p.o_head_stride));
  }
  if (!IsActivationDType(p.q_dtype)) {
    return Invalid(absl::StrCat("q_dtype ", DTypeName(p.q_dtype),
                                " is not supported (float32, float16, bfloat16)"));
  }
  if (!IsActivationDType(p.out_dtype)) {
    return Invalid(absl::StrCat("out_dtype ", DTypeName(p.out_dtype),
                                " is not supported (float32, float16, bfloat16)"));
  }
  if (auto st = ValidateCache(p.cache); !st.ok()) return st;
  const int num_kv_heads = p.cache.spec.num_kv_heads;
  if (p.num_heads % num_kv_heads != 0) {
    return Invalid(absl::StrCat("num_heads (", p.num_heads,
                                ") must be a multiple of cache num_kv_heads (", num_kv_heads,
                                ")"));
  }
  if (!std::isfinite(p.scale)) return Invalid(absl::StrCat("scale must be finite, got ", p.scale));
  if (!std::isfinite(p.logits_soft_cap)) {
    return Invalid(absl::StrCat("logits_soft_cap must be finite, got ", p.logits_soft_cap));
  }
  if (p.alibi_slopes != nullptr) {
    // The pointer must hold num_heads slopes; only their values can be checked here.
    for (int h = 0; h < p.num_heads; ++h) {
      if (!std::isfinite(p.alibi_slopes[h])) {
        return Invalid(absl::StrCat("alibi_slopes[", h, "] = ", p.alibi_slopes[h],
                                    " is not finite"));
      }
    }
  }

  // The batch: rows, lengths and every block a sequence reads.
  if (p.query_start_loc[0] < 0) {
    return Invalid(absl::StrCat("query_start_loc[0] must be >= 0, got ", p.query_start_loc[0]));
  }
  const int64_t block_size = p.cache.spec.block_size;
  for (int32_t s = 0; s < p.num_seqs; ++s) {
    const int32_t begin = p.query_start_loc[s];
    const int32_t end = p.query_start_loc[s + 1];
    if (end < begin) {
      return Invalid(absl::StrCat("query_start_loc is not monotone at sequence ", s, ": ",
                                  begin, " then ", end));
    }
    if (end > p.num_tokens) {
      return Invalid(absl::StrCat("sequence ", s, " query rows end at ", end,
                                  " past num_tokens ", p.num_tokens));
    }
    const int32_t query_len = end - begin;
    const int32_t seq_len = p.seq_lens[s];
    if (seq_len < 0) {
      return Invalid(absl::StrCat("sequence ", s, " has negative seq_len ", seq_len));
    }
    if (query_len > seq_len) {
      return Invalid(absl::StrCat("sequence ", s, " has query_len ", query_len,
                                  " > seq_len ", seq_len));
    }
    if (query_len > p.max_query_len) {
      return Invalid(absl::StrCat("sequence ", s, " has query_len ", query_len,
                                  " > max_query_len ", p.max_query_len));
    }
    if (seq_len > p.max_seq_len) {
      return Invalid(absl::StrCat("sequence ", s, " has seq_len ", seq_len, " > max_seq_len ",
                                  p.max_seq_len));
    }
    const int64_t blocks_used = CeilDiv(seq_len, block_size);
    if (blocks_used > p.block_table_stride) {
      return Invalid(absl::StrCat("sequence ", s, " needs ", blocks_used, " blocks for seq_len ",
                                  seq_len, " but block_table_stride is ",
                                  p.block_table_stride));
    }
    const int32_t* row = p.block_table + static_cast<int64_t>(s) * p.block_table_stride;
    for (int64_t b = 0; b < blocks_used; ++b) {
      if (row[b] < 0 || row[b] >= p.cache.num_blocks) {
        return Invalid(absl::StrCat("sequence ", s, " block_table[", b, "] = ", row[b],
                                    " is outside the cache's [0, ", p.cache.num_blocks, ")"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvstream
