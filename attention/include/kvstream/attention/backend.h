// Attention backends: the params struct every implementation takes (CPU reference, CPU
// fast path, CUDA), the AttentionBackend interface the Attention layer calls, and the
// factory by name.
//
// The params struct is plain data (pointers, strides in elements, sizes), so that kernels
// can take it by value and one test can run every backend on the same inputs.
//
// Semantics, per query token at position qp of a sequence with seq_len keys (positions
// 0..seq_len-1) and query head h, with g = h / (num_heads / num_kv_heads) its KV head:
//   s_j = scale * dot(q, k_j)                       k_j dequantised: k_cache * k_scale
//   s_j = cap * tanh(s_j / cap)                     when logits_soft_cap > 0
//   s_j += alibi_slopes[h] * (j - qp)               when alibi_slopes != nullptr
//   mask: causal      j <= qp
//         window w>0  |qp - j| <= w - 1  (and the causal mask when causal)
//   out = sum_j softmax(s)_j * v_j                  v_j dequantised likewise
// A query row that sees no key (only possible with non-causal masks of size 0) gets zeros.
#ifndef KVSTREAM_ATTENTION_BACKEND_H_
#define KVSTREAM_ATTENTION_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvstream/cache/cache_update.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/common/dtype.h"

namespace kvstream {

struct PagedAttentionParams {
  // q:   [num_tokens, num_heads, head_size]     element strides below; dim stride 1
  // out: [num_tokens, num_heads, head_size_v]   rows past query_start_loc[num_seqs] untouched
  const void* q = nullptr;
  DType q_dtype = DType::kBFloat16;
  int64_t q_token_stride = 0;
  int64_t q_head_stride = 0;
  void* out = nullptr;
  DType out_dtype = DType::kBFloat16;
  int64_t o_token_stride = 0;
  int64_t o_head_stride = 0;
  int64_t num_tokens = 0;

  // The paged cache (spec gives block_size, num_kv_heads, head sizes, dtype, scales).
  KvCacheView cache;

  // Batch: query_start_loc [num_seqs + 1], seq_lens [num_seqs],
  // block_table [num_seqs, block_table_stride].
  const int32_t* query_start_loc = nullptr;
  const int32_t* seq_lens = nullptr;
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0;
  int32_t num_seqs = 0;
  int32_t max_query_len = 0;
  int32_t max_seq_len = 0;

  int32_t num_heads = 0;
  float scale = 1.0f;
  bool causal = true;
  int32_t sliding_window = 0;  // <= 0: no window
  float logits_soft_cap = 0;   // <= 0: no cap
  const float* alibi_slopes = nullptr;  // [num_heads] or null

  // Device batches. When cache.memory is kDevice, q, out, query_start_loc, seq_lens,
  // block_table and alibi_slopes are device pointers, and validation (which never reads
  // device memory) reads these host copies of the same arrays instead. Required then
  // (alibi only when alibi_slopes is set); ignored for host caches.
  struct HostMirror {
    const int32_t* query_start_loc = nullptr;
    const int32_t* seq_lens = nullptr;
    const int32_t* block_table = nullptr;
    const float* alibi_slopes = nullptr;
  };
  HostMirror host;
};

// Checks the params: pointers, sizes, num_heads a multiple of num_kv_heads, dtypes,
// query_len <= seq_len, every block id used in [0, num_blocks), fp8 scales present. The
// error names what is wrong. Every backend calls it before touching memory.
absl::Status ValidatePagedAttention(const PagedAttentionParams& params);

// An attention implementation. Thread-compatible: one layer calls it at a time.
class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  virtual absl::string_view name() const = 0;
  // Whether the backend can run on caches and activations in `memory`.
  virtual bool SupportsMemory(MemoryKind memory) const = 0;
  // Writes this step's keys and values into the cache. Errors as ValidateCacheUpdate.
  virtual absl::Status UpdateCache(const CacheUpdateParams& params) = 0;
  // Runs attention. Errors as ValidatePagedAttention; on error `out` may be partly written.
  virtual absl::Status Forward(const PagedAttentionParams& params) = 0;
};

// Backends by name: "cpu" (the fast path), "cpu_reference" (the golden reference: plain
// loops, double accumulation; slow), "cuda" (cuda_attention.h: device 0, its own stream;
// FailedPrecondition saying why in builds without CUDA or on machines without a GPU).
// NotFound for any other name, listing the choices. AttentionBackendNames() lists "cuda"
// only in builds with CUDA. `batch_invariant`: every output row independent of the rest of
// the call (the CPU backends always are; for "cuda" see CudaBackendOptions).
absl::StatusOr<std::unique_ptr<AttentionBackend>> CreateAttentionBackend(
    absl::string_view name, bool batch_invariant = false);
std::vector<std::string> AttentionBackendNames();

}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_BACKEND_H_
