// The golden reference for paged attention (semantics in backend.h): plain loops over every
// sequence, query token, head and key, in double, written to be read next to the contract
// rather than to be fast. Tests trust it; nothing in the library's hot path calls it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "kvstream/attention/backend.h"
#include "kvstream/attention/cpu_attention.h"
#include "kvstream/common/numeric.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace {

// Element (key position j, KV head g, dim d) of K or V, dequantised.
double LoadCache(const void* base, const CacheStrides& strides, const KvCacheView& cache,
                 const int32_t* block_row, int64_t j, int g, int d, const float* scales) {
  const int64_t block_size = cache.spec.block_size;
  const int64_t block = block_row[j / block_size];
  const double x =
      LoadAsFloat(base, cache.spec.dtype, strides.Offset(block, j % block_size, g, d));
  if (!IsFp8(cache.spec.dtype)) return x;
  return x * static_cast<double>(scales[cache.num_scales == 1 ? 0 : g]);
}

bool Visible(const PagedAttentionParams& p, int64_t qp, int64_t j) {
  if (p.causal && j > qp) return false;
  if (p.sliding_window > 0 && std::llabs(qp - j) > p.sliding_window - 1) return false;
  return true;
}

}  // namespace

absl::Status RunAttentionReference(const PagedAttentionParams& p) {
  RETURN_IF_ERROR(ValidatePagedAttention(p));
  if (p.cache.memory == MemoryKind::kDevice) {
    return absl::InvalidArgumentError("paged attention: the CPU reference needs a host cache");
  }
  const KvCacheView& cache = p.cache;
  const int head_size = cache.spec.head_size;
  const int head_size_v = cache.spec.head_size_v;
  const int group = p.num_heads / cache.spec.num_kv_heads;

  std::vector<double> scores;
  std::vector<double> acc(static_cast<size_t>(head_size_v));
  for (int32_t s = 0; s < p.num_seqs; ++s) {
    const int64_t seq_len = p.seq_lens[s];
    const int64_t first_row = p.query_start_loc[s];
    const int64_t query_len = p.query_start_loc[s + 1] - first_row;
    const int32_t* block_row = p.block_table + s * p.block_table_stride;
    scores.assign(static_cast<size_t>(seq_len), 0.0);
    for (int64_t t = 0; t < query_len; ++t) {
      const int64_t qp = seq_len - query_len + t;  // bottom-right aligned
      for (int h = 0; h < p.num_heads; ++h) {
        const int g = h / group;
        const int64_t q_base = (first_row + t) * p.q_token_stride + h * p.q_head_stride;
        double max_score = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < seq_len; ++j) {
          if (!Visible(p, qp, j)) continue;
          double dot = 0;
          for (int d = 0; d < head_size; ++d) {
            dot += static_cast<double>(LoadAsFloat(p.q, p.q_dtype, q_base + d)) *
                   LoadCache(cache.k, cache.k_strides, cache, block_row, j, g, d, cache.k_scale);
          }
          double score = static_cast<double>(p.scale) * dot;
          if (p.logits_soft_cap > 0) {
            const double cap = p.logits_soft_cap;
            score = cap * std::tanh(score / cap);
          }
          if (p.alibi_slopes != nullptr) {
            score += static_cast<double>(p.alibi_slopes[h]) * static_cast<double>(j - qp);
          }
          scores[static_cast<size_t>(j)] = score;
          max_score = std::max(max_score, score);
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        double sum = 0;
        for (int64_t j = 0; j < seq_len; ++j) {
          if (!Visible(p, qp, j)) continue;
          const double w = std::exp(scores[static_cast<size_t>(j)] - max_score);
          sum += w;
          for (int d = 0; d < head_size_v; ++d) {
            acc[static_cast<size_t>(d)] +=
                w * LoadCache(cache.v, cache.v_strides, cache, block_row, j, g, d, cache.v_scale);
          }
        }
        const int64_t o_base = (first_row + t) * p.o_token_stride + h * p.o_head_stride;
        for (int d = 0; d < head_size_v; ++d) {
          // No visible key (sum == 0) gives zeros, as the contract says.
          const double value = sum > 0 ? acc[static_cast<size_t>(d)] / sum : 0.0;
          StoreFromFloat(p.out, p.out_dtype, o_base + d, static_cast<float>(value));
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvstream
