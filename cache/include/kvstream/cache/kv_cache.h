// KvCache: one layer's paged K and V buffers, owned by kvstream or borrowed from an engine,
// plus the fp8 scales. Kernels and transports see it through KvCacheView, a plain struct of
// pointers and strides (KvCacheSpec and CacheStrides in kv_cache_spec.h).
//
//   ASSIGN_OR_RETURN(auto cache, KvCache::Create({spec, KvLayout::kHND, /*num_blocks=*/1024}));
//   RETURN_IF_ERROR(cache->SetScales({0.02f}, {0.03f}));   // fp8, per tensor
//
// Borrowed caches keep whatever strides the engine's tensors have; nothing assumes a layout.
// Owned caches live in host, pinned-host or (with CUDA) device memory; view().memory says
// which, and the fp8 scales stay in host memory whatever the kind.
//
// Thread-compatible: the buffers are written by cache updates and transfers that the caller
// orders; SetScales() must not race with readers.
#ifndef KVSTREAM_CACHE_KV_CACHE_H_
#define KVSTREAM_CACHE_KV_CACHE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvstream/cache/kv_cache_spec.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/dtype.h"
#include "kvstream/common/tensor.h"

namespace kvstream {

// What kernels receive. Pointers are not owned.
struct KvCacheView {
  // k: logically [num_blocks, block_size, num_kv_heads, head_size], addressed by k_strides.
  // v: logically [num_blocks, block_size, num_kv_heads, head_size_v], addressed by v_strides.
  void* k = nullptr;
  void* v = nullptr;
  CacheStrides k_strides;
  CacheStrides v_strides;
  int64_t num_blocks = 0;
  KvCacheSpec spec;
  // fp8 only: num_scales entries each (1 = per tensor, num_kv_heads = per head); else null.
  // Host memory for every memory kind: CUDA launchers pass the scales to kernels by value.
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int num_scales = 0;
  MemoryKind memory = MemoryKind::kHost;
};

class KvCache {
 public:
  struct Options {
    KvCacheSpec spec;
    KvLayout layout = KvLayout::kNHD;
    int64_t num_blocks = 0;
    MemoryKind memory = MemoryKind::kHost;
  };

  // Allocates zero-filled K and V buffers (64-byte aligned) of options.memory: kHost
  // (aligned_alloc), kPinned (cudaMallocHost) or kDevice (cudaMalloc on the calling
  // thread's current device; blocks until the zero fill has finished). InvalidArgument for a
  // bad spec or num_blocks <= 0; ResourceExhausted when the memory cannot be had;
  // Unimplemented for pinned or device memory in builds without CUDA; FailedPrecondition
  // when no GPU can be used. fp8 caches start with all scales 1.0.
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(const Options& options);

  // Wraps an engine's tensors without copying. `k` and `v` must be 4-D with logical shape
  // [num_blocks, block_size, num_kv_heads, head_size(_v)] matching `spec`, dtype spec.dtype,
  // any non-negative strides with dim stride 1; errors name the mismatch. The memory must
  // outlive the KvCache.
  static absl::StatusOr<std::unique_ptr<KvCache>> Borrow(const KvCacheSpec& spec, TensorView k,
                                                          TensorView v);

  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;
  ~KvCache();

  const KvCacheSpec& spec() const { return spec_; }
  int64_t num_blocks() const { return num_blocks_; }
  // The layout the strides match, if they match one of the two dense layouts.
  std::optional<KvLayout> layout() const;
  bool owned() const { return owned_; }

  KvCacheView view() const;
  TensorView k() const { return k_; }  // logical 4-D views, see Borrow()
  TensorView v() const { return v_; }

  // Sets fp8 scales. Each span has 1 entry (per-tensor mode) or num_kv_heads entries
  // (per-head mode), as spec().quant_mode says; every scale finite and > 0. InvalidArgument
  // otherwise, or FailedPrecondition when the cache is not fp8. On error nothing changes.
  absl::Status SetScales(absl::Span<const float> k_scale, absl::Span<const float> v_scale);
  absl::Span<const float> k_scales() const { return k_scale_; }
  absl::Span<const float> v_scales() const { return v_scale_; }

 private:
  KvCache() = default;

  KvCacheSpec spec_;
  int64_t num_blocks_ = 0;
  bool owned_ = false;
  Tensor k_storage_;  // host memory; empty when borrowed or not in host memory
  Tensor v_storage_;
  DeviceBuffer k_device_;  // pinned or device memory; empty otherwise
  DeviceBuffer v_device_;
  TensorView k_;
  TensorView v_;
  std::vector<float> k_scale_;
  std::vector<float> v_scale_;
};

}  // namespace kvstream

#endif  // KVSTREAM_CACHE_KV_CACHE_H_
