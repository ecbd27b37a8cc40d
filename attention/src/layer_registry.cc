// LayerRegistry: layer names, cache bindings and the forward context of one engine.
#include "kvstream/attention/layer_registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kvstream/attention/attention.h"

namespace kvstream {

absl::Status LayerRegistry::Register(absl::string_view name, Attention* layer) {
  if (name.empty()) return absl::InvalidArgumentError("layer registry: empty layer name");
  if (layer == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("layer registry: null layer for '", name, "'"));
  }
  if (!layers_.emplace(std::string(name), layer).second) {
    return absl::AlreadyExistsError(absl::StrCat("Duplicate layer name: ", name));
  }
  order_.emplace_back(name);
  return absl::OkStatus();
}

void LayerRegistry::Unregister(absl::string_view name) {
  if (layers_.erase(name) == 0) return;
  caches_.erase(name);
  order_.erase(std::remove(order_.begin(), order_.end(), name), order_.end());
}

absl::StatusOr<Attention*> LayerRegistry::Get(absl::string_view name) const {
  auto it = layers_.find(name);
  if (it == layers_.end()) {
    return absl::NotFoundError(absl::StrCat("no attention layer named '", name, "' (",
                                            layers_.size(), " layers registered)"));
  }
  return it->second;
}

absl::Status LayerRegistry::BindKvCache(absl::string_view name, KvCache* cache) {
  auto it = layers_.find(name);
  if (it == layers_.end()) {
    return absl::NotFoundError(
        absl::StrCat("cannot bind a KV cache to unknown layer '", name, "'"));
  }
  const Attention& layer = *it->second;
  if (layer.shares_kv()) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer '", name, "' shares the KV cache of '",
                     *layer.options().kv_sharing_target_layer_name,
                     "' and has no cache of its own"));
  }
  if (cache == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("null KV cache for layer '", name, "'"));
  }
  if (cache->spec() != layer.kv_cache_spec()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV cache for layer '", name, "' has spec ", cache->spec().DebugString(),
        " but the layer needs ", layer.kv_cache_spec().DebugString()));
  }
  caches_[name] = cache;
  return absl::OkStatus();
}

absl::StatusOr<KvCache*> LayerRegistry::KvCacheFor(absl::string_view name) const {
  auto it = layers_.find(name);
  if (it == layers_.end()) {
    return absl::NotFoundError(absl::StrCat("no attention layer named '", name, "'"));
  }
  const std::string& owner = it->second->kv_cache_owner();
  auto c = caches_.find(owner);
  if (c == caches_.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no KV cache bound for layer '", owner, "'",
        owner == name ? std::string() : absl::StrCat(" (shared by '", name, "')")));
  }
  return c->second;
}

}  // namespace kvstream
