// CreateLayerCache (layer_cache.h).
#include "layer_cache.h"

#include <cmath>
#include <utility>

#include "kvstream/common/status_macros.h"
#include "kvstream/common/tensor.h"

namespace kvstream {
namespace internal {

AttentionOptions LayerAttentionOptions(const ToyModelConfig& config, int layer, DType dtype) {
  AttentionOptions o;
  o.num_heads = config.num_heads;
  o.num_kv_heads = config.num_kv_heads;
  o.head_size = config.head_size;
  o.scale = 1.0f / std::sqrt(static_cast<float>(config.head_size));
  o.kv_cache_dtype = config.kv_cache_dtype;
  o.dtype = dtype;
  o.block_size = config.block_size;
  o.backend = config.backend;
  o.prefix = config.LayerName(layer);
  return o;
}

absl::StatusOr<std::unique_ptr<KvCache>> CreateLayerCache(
    const KvCacheSpec& spec, KvLayout layout, int64_t num_blocks, MemoryKind memory,
    const CacheAllocator& allocate, std::vector<std::shared_ptr<void>>& allocations) {
  std::unique_ptr<KvCache> cache;
  if (allocate) {
    const size_t k_bytes = static_cast<size_t>(num_blocks) * spec.KBytesPerBlock();
    const size_t v_off = (k_bytes + 63) / 64 * 64;
    const size_t v_bytes = static_cast<size_t>(num_blocks) * spec.VBytesPerBlock();
    ASSIGN_OR_RETURN(std::shared_ptr<void> allocation, allocate(v_off + v_bytes));
    if (allocation == nullptr) {
      return absl::InvalidArgumentError("layer cache: the allocator returned no memory");
    }
    char* base = static_cast<char*>(allocation.get());
    const CacheStrides ks = MakeCacheStrides(spec, layout, false);
    const CacheStrides vs = MakeCacheStrides(spec, layout, true);
    TensorView k(base, spec.dtype, {num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size},
                 {ks.block, ks.token, ks.head, ks.dim}, memory);
    TensorView v(base + v_off, spec.dtype,
                 {num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size_v},
                 {vs.block, vs.token, vs.head, vs.dim}, memory);
    ASSIGN_OR_RETURN(cache, KvCache::Borrow(spec, k, v));
    allocations.push_back(std::move(allocation));
  } else {
    KvCache::Options o;
    o.spec = spec;
    o.layout = layout;
    o.num_blocks = num_blocks;
    o.memory = memory;
    ASSIGN_OR_RETURN(cache, KvCache::Create(o));
  }
  if (IsFp8(cache->spec().dtype)) {
    const size_t n = cache->spec().quant_mode == KvQuantMode::kPerHead
                         ? static_cast<size_t>(spec.num_kv_heads)
                         : 1u;
    std::vector<float> scales(n, 0.05f);
    RETURN_IF_ERROR(cache->SetScales(scales, scales));
  }
  return cache;
}

}  // namespace internal
}  // namespace kvstream
