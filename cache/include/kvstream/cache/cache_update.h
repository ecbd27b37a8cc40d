// The cache update: new tokens' keys and values written into their slots of the paged
// cache (vLLM's reshape_and_cache_flash). The params struct is shared by the CPU and CUDA
// implementations so that one test compares both; the two write identical bytes.
//
// 16/32-bit caches: the input is converted to the cache dtype (bit-exact copy when the
// dtypes match; round to nearest even otherwise). fp8 caches: each element becomes
// fp8(x / scale) with saturation at the format's largest finite value, the scale being the
// tensor's or the element's KV head's.
#ifndef KVSTREAM_CACHE_CACHE_UPDATE_H_
#define KVSTREAM_CACHE_CACHE_UPDATE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/cache/kv_cache_spec.h"
#include "kvstream/common/dtype.h"
#include "kvstream/common/tensor.h"

namespace kvstream {

struct CacheUpdateParams {
  // key:   [num_tokens, num_kv_heads, head_size]   (element strides below; dim stride 1)
  // value: [num_tokens, num_kv_heads, head_size_v]
  const void* key = nullptr;
  const void* value = nullptr;
  int64_t key_token_stride = 0;
  int64_t key_head_stride = 0;
  int64_t value_token_stride = 0;
  int64_t value_head_stride = 0;
  DType input_dtype = DType::kBFloat16;
  // slot_mapping: [num_tokens]; -1 = padding, skipped.
  const int64_t* slot_mapping = nullptr;
  int64_t num_tokens = 0;
  // The destination: the layer's cache view (pointers, strides, spec, fp8 scales).
  KvCacheView cache;
  // Device caches (cache.memory == kDevice): key, value and slot_mapping are device
  // pointers, and validation, which never reads device memory, reads this host copy of
  // slot_mapping instead. Required then (when num_tokens > 0); ignored otherwise.
  const int64_t* host_slot_mapping = nullptr;
};

// Checks sizes, dtypes, pointers, scales and every slot (-1 or in range; for a device cache
// the slots of host_slot_mapping, which must then be set). Reads only host memory. The
// error names what is wrong (for a slot: the token index and the slot). Shared by all
// implementations.
absl::Status ValidateCacheUpdate(const CacheUpdateParams& params);

// CPU implementation. Validates first; on error nothing is written. FailedPrecondition for
// a device cache.
absl::Status CacheUpdateCpu(const CacheUpdateParams& params);

// CUDA implementation, bit for bit the same cache contents as CacheUpdateCpu. REQUIRES:
// cache.memory == kDevice; key, value and slot_mapping in device memory; host_slot_mapping
// set (validation reads it; the kernel reads slot_mapping). Validates, then enqueues the
// kernel on `cuda_stream` (a cudaStream_t; null: the legacy default stream) and returns
// without waiting; the caller orders later readers after the stream. On error nothing is
// enqueued and nothing written: InvalidArgument as ValidateCacheUpdate (or for a device
// cache with more than 128 per-head scales), FailedPrecondition for a non-device cache or
// in builds without CUDA, a CUDA launch error otherwise. The fp8 scales are read on the host
// at the call and passed by value. Thread-safe (no shared state).
absl::Status CacheUpdateCuda(const CacheUpdateParams& params, void* cuda_stream);

// Convenience over tensors: key [num_tokens, num_kv_heads, head_size] and value
// [num_tokens, num_kv_heads, head_size_v] (any dtype-compatible strides with a contiguous
// last dimension) into host `cache`.
absl::Status ReshapeAndCache(const TensorView& key, const TensorView& value, KvCache& cache,
                             absl::Span<const int64_t> slot_mapping);

}  // namespace kvstream

#endif  // KVSTREAM_CACHE_CACHE_UPDATE_H_
