// LayerRegistry: one engine's attention layers by name and its per-step forward context
// (vLLM's static_forward_context plus get_forward_context). There is one registry per
// engine and no process-wide state, so several engines can live in one process.
//
//   LayerRegistry registry;
//   ASSIGN_OR_RETURN(auto attn, Attention::Create(options, &registry));  // registers itself
//   RETURN_IF_ERROR(registry.BindKvCache("model.layers.0.self_attn.attn", cache.get()));
//   registry.SetForwardContext({&metadata});
//   RETURN_IF_ERROR(attn->Forward(q, k, v, out));
//
// Layer names drive everything else (routing, transfer tags, metrics), so a duplicate name
// is an error. Thread-compatible: an engine drives its registry from one thread at a time.
// The registry must outlive its layers; it does not own them, the caches or the hook.
#ifndef KVSTREAM_ATTENTION_LAYER_REGISTRY_H_
#define KVSTREAM_ATTENTION_LAYER_REGISTRY_H_

#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvstream/attention/metadata.h"
#include "kvstream/attention/transfer_hook.h"
#include "kvstream/cache/kv_cache.h"

namespace kvstream {

class Attention;

// What a forward step runs with. metadata == nullptr or dummy_run marks a profiling/dummy
// run: layers then write zeros, update no cache and call no hook.
// Layers whose cache is in device memory also need `device`, the same metadata uploaded.
struct ForwardContext {
  const AttentionMetadata* metadata = nullptr;
  bool dummy_run = false;
  const DeviceAttentionMetadata* device = nullptr;
  bool is_real() const { return metadata != nullptr && !dummy_run; }
};

class LayerRegistry {
 public:
  LayerRegistry() = default;
  LayerRegistry(const LayerRegistry&) = delete;
  LayerRegistry& operator=(const LayerRegistry&) = delete;

  // Adds `layer` under `name`. AlreadyExists for a duplicate name (the message names it),
  // InvalidArgument for an empty name or null layer. Attention::Create calls this.
  absl::Status Register(absl::string_view name, Attention* layer);
  // Removes `name` and its cache binding; no-op for unknown names. Attention's destructor
  // calls this.
  void Unregister(absl::string_view name);

  // NotFound, naming the layer and how many are registered, for an unknown name.
  absl::StatusOr<Attention*> Get(absl::string_view name) const;
  bool Contains(absl::string_view name) const { return layers_.contains(name); }
  // In registration order.
  const std::vector<std::string>& layer_names() const { return order_; }

  // Binds the layer's paged cache (not owned). NotFound for an unknown layer;
  // FailedPrecondition for a layer that shares another layer's KV (it has no cache of its
  // own); InvalidArgument when the cache's spec is not the layer's (both named).
  absl::Status BindKvCache(absl::string_view name, KvCache* cache);
  // The cache the layer reads: its own, or for a KV-sharing layer its target's.
  // FailedPrecondition when none is bound.
  absl::StatusOr<KvCache*> KvCacheFor(absl::string_view name) const;

  void SetForwardContext(ForwardContext context) { context_ = context; }
  const ForwardContext& forward_context() const { return context_; }

  // Binds the transfer hook (not owned); nullptr unbinds.
  void SetTransferHook(TransferHook* hook) { hook_ = hook; }
  TransferHook* transfer_hook() const { return hook_; }

 private:
  absl::flat_hash_map<std::string, Attention*> layers_;
  absl::flat_hash_map<std::string, KvCache*> caches_;
  std::vector<std::string> order_;
  ForwardContext context_;
  TransferHook* hook_ = nullptr;
};

}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_LAYER_REGISTRY_H_
