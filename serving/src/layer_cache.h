// The synthetic models' per-layer attention options and KV caches (toy_model.h,
// cuda_model.h), made one way for both.
#ifndef KVSTREAM_SERVING_LAYER_CACHE_H_
#define KVSTREAM_SERVING_LAYER_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kvstream/attention/attention.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/common/dtype.h"
#include "kvstream/serving/model_config.h"

namespace kvstream {
namespace internal {

// The attention options of layer `layer` of a model of `config`: its heads and cache dtype,
// scale 1 / sqrt(head_size), activations of `dtype`, the backend named in config.backend.
AttentionOptions LayerAttentionOptions(const ToyModelConfig& config, int layer, DType dtype);

using CacheAllocator = std::function<absl::StatusOr<std::shared_ptr<void>>(size_t bytes)>;

// A cache of `num_blocks` blocks of `spec` in `layout`, in `memory`: with `allocate`, K then
// V in one allocation from it (dense in `layout`, V 64-byte aligned; the allocation is
// appended to `allocations`, which must outlive the cache; its contents are not cleared:
// nothing reads a slot before it is written), else owned and zero-filled (KvCache::Create).
// fp8 caches get the models' scales (0.05 for K and V, per tensor or per head). Errors of the
// allocator or of KvCache are returned; InvalidArgument for a null allocation.
absl::StatusOr<std::unique_ptr<KvCache>> CreateLayerCache(
    const KvCacheSpec& spec, KvLayout layout, int64_t num_blocks, MemoryKind memory,
    const CacheAllocator& allocate, std::vector<std::shared_ptr<void>>& allocations);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_SERVING_LAYER_CACHE_H_
