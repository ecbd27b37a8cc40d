// LayerTable (layer_table.h): registered layers and the compatibility hash.
#include "layer_table.h"

#include <algorithm>
#include <utility>

#include <xxhash.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/connector/block_copy_plan.h"
#include "kvstream/connector/layer_name.h"
#include "kvstream/connector/layer_routing.h"
#include "kvstream/connector/layerwise_connector.h"

namespace kvstream {
namespace internal {

absl::StatusOr<std::unique_ptr<LayerTable>> LayerTable::Create(
    const std::map<std::string, KvCache*>& caches, const KvstreamSettings& settings,
    const KvModelInfo& model, Transport& transport) {
  if (caches.empty()) return absl::InvalidArgumentError("no KV caches to register");
  std::unique_ptr<LayerTable> t(new LayerTable());
  const KvCache* first = nullptr;
  for (const auto& [name, cache] : caches) {
    if (cache == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("null KV cache for layer '", name, "'"));
    }
    ASSIGN_OR_RETURN(int32_t index, ParseLayerIndex(name));
    if (!t->indices_.insert(index).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("two layers map to index ", index, " (second: '", name, "')"));
    }
    if (first == nullptr) {
      first = cache;
    } else if (cache->spec() != first->spec() || cache->num_blocks() != first->num_blocks() ||
               cache->view().memory != first->view().memory) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer '", name, "' has cache ", cache->spec().DebugString(), " (",
          cache->num_blocks(), " blocks, ", MemoryKindName(cache->view().memory),
          " memory), layer '", t->layers_.front().name, "' has ", first->spec().DebugString(),
          " (", first->num_blocks(), " blocks, ", MemoryKindName(first->view().memory), ")"));
    }
    LayerEntry e;
    e.name = name;
    e.index = index;
    e.cache = cache;
    t->layers_.push_back(std::move(e));
  }
  std::sort(t->layers_.begin(), t->layers_.end(),
            [](const LayerEntry& a, const LayerEntry& b) { return a.index < b.index; });
  // A pipeline stage with an explicit partition knows its range now; with the even split
  // it learns the model's layer count from the producer at handshake.
  if (settings.pipeline_parallel_size > 1 && !settings.pipeline_layers.empty()) {
    const LayerRange own = settings.pipeline_layers[settings.pipeline_rank];
    for (const LayerEntry& e : t->layers_) {
      if (!own.Contains(e.index)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "pipeline rank ", settings.pipeline_rank, " owns layers ", FormatLayerRange(own),
            " (pipeline_layers ", FormatLayerRanges(settings.pipeline_layers),
            ") but a cache was registered for layer ", e.index, " ('", e.name, "')"));
      }
    }
  }
  const KvCacheView v = t->layers_.front().cache->view();
  t->block_size_ = v.spec.block_size;
  t->memory_ = v.memory;
  t->slots_ = t->layers_.back().index + 1;
  t->num_blocks_ = v.num_blocks;
  t->model_ = model;
  // The model's part: what changes the numbers (max_model_len does not: it only bounds).
  const std::string model_part =
      model.vocab_size > 0 || !model.fingerprint.empty()
          ? absl::StrCat(", vocabulary ", model.vocab_size, ", model [",
                         absl::CHexEscape(model.fingerprint), "]")
          : std::string(", model unknown");
  t->compat_description_ = absl::StrCat(
      "protocol ", kLayerwiseProtocolVersion, ", ", v.spec.DebugString(), ", K strides ",
      v.k_strides.block, "/", v.k_strides.token, "/", v.k_strides.head, "/", v.k_strides.dim,
      ", V strides ", v.v_strides.block, "/", v.v_strides.token, "/", v.v_strides.head, "/",
      v.v_strides.dim, ", ", MemoryKindName(v.memory), " memory", model_part);
  const uint64_t seed = XXH3_64bits_withSeed("kvstream-layerwise", 18, kLayerwiseProtocolVersion);
  t->compat_hash_ =
      XXH3_64bits_withSeed(t->compat_description_.data(), t->compat_description_.size(), seed);
  for (size_t i = 0; i < t->layers_.size(); ++i) {
    LayerEntry& e = t->layers_[i];
    const KvCacheView cv = e.cache->view();
    const size_t es = DTypeSize(cv.spec.dtype);
    const uint64_t kb = TensorExtentBytes(cv.k_strides, cv.num_blocks, cv.spec.block_size,
                                          cv.spec.num_kv_heads, cv.spec.head_size, es);
    const uint64_t vb = TensorExtentBytes(cv.v_strides, cv.num_blocks, cv.spec.block_size,
                                          cv.spec.num_kv_heads, cv.spec.head_size_v, es);
    ASSIGN_OR_RETURN(e.k_reg, transport.RegisterMemory(cv.k, kb, cv.memory));
    ASSIGN_OR_RETURN(e.v_reg, transport.RegisterMemory(cv.v, vb, cv.memory));
    t->by_name_[e.name] = i;
    t->by_index_[e.index] = i;
  }
  return t;
}

const LayerEntry* LayerTable::ByName(absl::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &layers_[it->second];
}

const LayerEntry* LayerTable::ByIndex(int32_t index) const {
  auto it = by_index_.find(index);
  return it == by_index_.end() ? nullptr : &layers_[it->second];
}

std::vector<RegionDescriptor> LayerTable::Regions() const {
  std::vector<RegionDescriptor> regions;
  regions.reserve(2 * layers_.size());
  for (const LayerEntry& e : layers_) {
    regions.push_back({e.index, 0, e.k_reg->descriptor()});
    regions.push_back({e.index, 1, e.v_reg->descriptor()});
  }
  return regions;
}

absl::StatusOr<ConnectorHello> LocalHello(const LayerTable* table, Transport& transport) {
  ConnectorHello h;
  h.protocol_version = kLayerwiseProtocolVersion;
  h.transport = std::string(transport.name());
  ASSIGN_OR_RETURN(h.transport_info, transport.LocalInfo());
  if (table != nullptr) {
    h.compat_hash = table->compat_hash();
    h.compat_description = table->compat_description();
    h.regions = table->Regions();
  }
  return h;
}

absl::Status CheckCompatible(const LayerTable& mine, absl::string_view my_engine_id,
                             absl::string_view my_transport, const ConnectorHello& theirs,
                             absl::string_view their_engine_id) {
  const std::string peer = absl::StrCat("'", absl::CHexEscape(their_engine_id), "'");
  if (theirs.protocol_version != kLayerwiseProtocolVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "peer ", peer, " speaks protocol ", theirs.protocol_version, ", engine '",
        absl::CHexEscape(my_engine_id),
        "' speaks ", kLayerwiseProtocolVersion));
  }
  if (theirs.compat_hash != mine.compat_hash()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "KV cache compatibility mismatch between engine '", absl::CHexEscape(my_engine_id), "' [",
        mine.compat_description(), "] and peer ", peer, " [",
        absl::CHexEscape(theirs.compat_description), "]"));
  }
  if (theirs.transport != my_transport) {
    return absl::FailedPreconditionError(absl::StrCat(
        "peer ", peer, " uses transport '", absl::CHexEscape(theirs.transport), "', engine '",
        absl::CHexEscape(my_engine_id), "' uses '", my_transport, "'"));
  }
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace kvstream
