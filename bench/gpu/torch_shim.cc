// A C ABI over kvstream's CUDA attention backend, for attention_vs_torch.py: Python passes
// torch tensors' device pointers and strides, kvstream runs on them on torch's current
// stream, so both libraries see the very same inputs. Not part of the library's API.
//
// Every function returns 0 on success; otherwise a non-zero absl::StatusCode with the
// message copied into `error` (NUL-terminated, truncated to error_len).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kvstream/attention/backend.h"
#include "kvstream/attention/cuda_attention.h"
#include "kvstream/cache/kv_cache_spec.h"
#include "kvstream/common/dtype.h"
#include "kvstream/common/status_macros.h"

extern "C" {

// Mirrored field by field by the ctypes Structure in attention_vs_torch.py.
struct KvsAttentionArgs {
  uint64_t q;             // device, [num_tokens, num_heads, head_size]
  uint64_t out;           // device, [num_tokens, num_heads, head_size_v]
  const char* q_dtype;    // "bfloat16", "float16", "float32"
  const char* out_dtype;
  int64_t q_token_stride, q_head_stride, o_token_stride, o_head_stride, num_tokens;
  uint64_t k_cache, v_cache;  // device, logical [num_blocks, block_size, kv_heads, head]
  const char* cache_dtype;    // also "fp8_e4m3", "fp8_e5m2"
  int64_t k_block_stride, k_token_stride, k_head_stride;
  int64_t v_block_stride, v_token_stride, v_head_stride;
  int64_t num_blocks;
  int32_t block_size, num_kv_heads, head_size, head_size_v;
  uint64_t k_scale_host, v_scale_host;  // host float[num_scales] (fp8), else 0
  int32_t num_scales;
  uint64_t query_start_loc, seq_lens, block_table;  // device int32
  uint64_t host_query_start_loc, host_seq_lens, host_block_table;  // host copies
  int64_t block_table_stride;
  int32_t num_seqs, max_query_len, max_seq_len, num_heads;
  float scale;
  int32_t causal, sliding_window;
  float soft_cap;
  uint64_t alibi_slopes, host_alibi_slopes;  // device / host float[num_heads], or 0
  uint64_t stream;                           // cudaStream_t (torch.cuda.current_stream())
  int32_t iterations;                        // Forward calls in a row (>= 1), for timing
};

}  // extern "C"

namespace {

template <typename T>
T* Ptr(uint64_t address) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(address));
}

absl::StatusOr<kvstream::PagedAttentionParams> ToParams(const KvsAttentionArgs& a) {
  using kvstream::DType;
  kvstream::PagedAttentionParams p;
  ASSIGN_OR_RETURN(p.q_dtype, kvstream::ParseDType(a.q_dtype == nullptr ? "" : a.q_dtype));
  ASSIGN_OR_RETURN(p.out_dtype, kvstream::ParseDType(a.out_dtype == nullptr ? "" : a.out_dtype));
  ASSIGN_OR_RETURN(DType cache_dtype,
                   kvstream::ParseDType(a.cache_dtype == nullptr ? "" : a.cache_dtype));
  p.q = Ptr<const void>(a.q);
  p.out = Ptr<void>(a.out);
  p.q_token_stride = a.q_token_stride;
  p.q_head_stride = a.q_head_stride;
  p.o_token_stride = a.o_token_stride;
  p.o_head_stride = a.o_head_stride;
  p.num_tokens = a.num_tokens;
  kvstream::KvCacheView& c = p.cache;
  c.k = Ptr<void>(a.k_cache);
  c.v = Ptr<void>(a.v_cache);
  c.k_strides = {a.k_block_stride, a.k_token_stride, a.k_head_stride, 1};
  c.v_strides = {a.v_block_stride, a.v_token_stride, a.v_head_stride, 1};
  c.num_blocks = a.num_blocks;
  c.spec.block_size = a.block_size;
  c.spec.num_kv_heads = a.num_kv_heads;
  c.spec.head_size = a.head_size;
  c.spec.head_size_v = a.head_size_v;
  c.spec.dtype = cache_dtype;
  c.memory = kvstream::MemoryKind::kDevice;
  if (kvstream::IsFp8(cache_dtype)) {
    c.spec.quant_mode = a.num_scales == 1 ? kvstream::KvQuantMode::kPerTensor
                                          : kvstream::KvQuantMode::kPerHead;
    c.k_scale = Ptr<const float>(a.k_scale_host);
    c.v_scale = Ptr<const float>(a.v_scale_host);
    c.num_scales = a.num_scales;
  }
  p.query_start_loc = Ptr<const int32_t>(a.query_start_loc);
  p.seq_lens = Ptr<const int32_t>(a.seq_lens);
  p.block_table = Ptr<const int32_t>(a.block_table);
  p.block_table_stride = a.block_table_stride;
  p.host.query_start_loc = Ptr<const int32_t>(a.host_query_start_loc);
  p.host.seq_lens = Ptr<const int32_t>(a.host_seq_lens);
  p.host.block_table = Ptr<const int32_t>(a.host_block_table);
  p.num_seqs = a.num_seqs;
  p.max_query_len = a.max_query_len;
  p.max_seq_len = a.max_seq_len;
  p.num_heads = a.num_heads;
  p.scale = a.scale;
  p.causal = a.causal != 0;
  p.sliding_window = a.sliding_window;
  p.logits_soft_cap = a.soft_cap;
  p.alibi_slopes = Ptr<const float>(a.alibi_slopes);
  p.host.alibi_slopes = Ptr<const float>(a.host_alibi_slopes);
  return p;
}

// One backend per stream, kept for the life of the process (its workspace is reused).
absl::StatusOr<kvstream::AttentionBackend*> BackendFor(uint64_t stream) {
  static auto* backends = new std::map<uint64_t, std::unique_ptr<kvstream::AttentionBackend>>();
  auto it = backends->find(stream);
  if (it != backends->end()) return it->second.get();
  kvstream::CudaBackendOptions options;
  options.stream = Ptr<void>(stream);
  ASSIGN_OR_RETURN(std::unique_ptr<kvstream::AttentionBackend> backend,
                   kvstream::CreateCudaAttentionBackend(options));
  kvstream::AttentionBackend* raw = backend.get();
  backends->emplace(stream, std::move(backend));
  return raw;
}

int Report(const absl::Status& status, char* error, int error_len) {
  if (error != nullptr && error_len > 0) {
    const std::string text(status.message());
    const size_t n = std::min(text.size(), static_cast<size_t>(error_len - 1));
    std::memcpy(error, text.data(), n);
    error[n] = '\0';
  }
  return static_cast<int>(status.code());
}

absl::Status Forward(const KvsAttentionArgs& args) {
  if (args.iterations < 1) {
    return absl::InvalidArgumentError(absl::StrCat("iterations must be >= 1, got ",
                                                   args.iterations));
  }
  ASSIGN_OR_RETURN(kvstream::PagedAttentionParams params, ToParams(args));
  ASSIGN_OR_RETURN(kvstream::AttentionBackend * backend, BackendFor(args.stream));
  for (int i = 0; i < args.iterations; ++i) RETURN_IF_ERROR(backend->Forward(params));
  return absl::OkStatus();
}

}  // namespace

extern "C" {

// Runs the "cuda" backend's Forward `iterations` times on args->stream; returns at once
// (the work is enqueued). 0, or an absl::StatusCode with the message in `error`.
__attribute__((visibility("default"))) int kvstream_attention_forward(
    const KvsAttentionArgs* args, char* error, int error_len) {
  if (args == nullptr) return Report(absl::InvalidArgumentError("args is null"), error, error_len);
  return Report(Forward(*args), error, error_len);
}

}  // extern "C"
