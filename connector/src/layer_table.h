// LayerTable: the layers a worker registered with its connector, their memory registrations
// and the compatibility hash that peers must match.
//
// Built once by RegisterKvCaches (Create validates everything first and registers each
// layer's K and V memory with the transport) and immutable afterwards, so the producer and
// consumer sides share it without a lock (through a shared_ptr<const LayerTable>).
//
// The compatibility hash covers the protocol version, the cache spec (block size, heads,
// head sizes, dtype, quantisation), the K and V strides, the cache's memory kind and what
// the engine said of its model (vocabulary size and fingerprint, KvModelInfo): two workers
// whose hashes differ must not exchange KV. Which layers each side has is checked
// separately (pipeline stages have some of the producer's layers).
#ifndef KVSTREAM_CONNECTOR_SRC_LAYER_TABLE_H_
#define KVSTREAM_CONNECTOR_SRC_LAYER_TABLE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "control_messages.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/connector/config.h"
#include "kvstream/connector/kv_connector_worker.h"
#include "kvstream/transfer/transport.h"

namespace kvstream {
namespace internal {

// One registered layer (only layers that own their cache; layers sharing another's KV are
// not registered and not sent).
struct LayerEntry {
  std::string name;
  int32_t index = 0;
  KvCache* cache = nullptr;
  std::unique_ptr<MemoryRegistration> k_reg;
  std::unique_ptr<MemoryRegistration> v_reg;
};

class LayerTable {
 public:
  // Validates the caches (non-null, layer names that parse to distinct indices, one spec and
  // block count for all, one memory kind; a pipeline stage with an explicit partition owns
  // every layer it registers) and registers their memory with `transport`. InvalidArgument
  // naming the layer at fault; the transport's error when it cannot register the memory.
  // `model` goes into the compatibility hash and bounds what hand-offs may ask.
  // REQUIRES: `transport` outlives the table.
  static absl::StatusOr<std::unique_ptr<LayerTable>> Create(
      const std::map<std::string, KvCache*>& caches, const KvstreamSettings& settings,
      const KvModelInfo& model, Transport& transport);

  const std::vector<LayerEntry>& layers() const { return layers_; }
  const LayerEntry* ByName(absl::string_view name) const;
  const LayerEntry* ByIndex(int32_t index) const;
  const std::set<int32_t>& indices() const { return indices_; }
  int32_t count() const { return static_cast<int32_t>(layers_.size()); }
  // Max layer index + 1: the size of per-layer arrays indexed by layer.
  int32_t slots() const { return slots_; }
  int32_t block_size() const { return block_size_; }
  MemoryKind memory() const { return memory_; }
  // Blocks of every layer's cache: no request can ever hold more tokens than
  // num_blocks() * block_size().
  int64_t num_blocks() const { return num_blocks_; }
  const KvModelInfo& model() const { return model_; }
  // Any layer's view (they share spec and strides).
  KvCacheView view() const { return layers_.front().cache->view(); }

  uint64_t compat_hash() const { return compat_hash_; }
  const std::string& compat_description() const { return compat_description_; }
  // The K (tensor 0) and V (tensor 1) region of every layer, for the hello.
  std::vector<RegionDescriptor> Regions() const;

 private:
  LayerTable() = default;

  std::vector<LayerEntry> layers_;  // by index
  std::map<std::string, size_t, std::less<>> by_name_;
  std::map<int32_t, size_t> by_index_;
  std::set<int32_t> indices_;
  int32_t slots_ = 0;
  int32_t block_size_ = 0;
  MemoryKind memory_ = MemoryKind::kHost;
  int64_t num_blocks_ = 0;
  KvModelInfo model_;
  uint64_t compat_hash_ = 0;
  std::string compat_description_;
};

// This worker's introduction: the table's hash and regions (none before registration) and
// the transport's name and info.
absl::StatusOr<ConnectorHello> LocalHello(const LayerTable* table, Transport& transport);

// Whether a peer that introduced itself with `theirs` may exchange KV with us: same
// protocol version, same compatibility hash, same transport. FailedPrecondition naming what
// differs, quoting both sides' descriptions (the peer sees the message too).
absl::Status CheckCompatible(const LayerTable& mine, absl::string_view my_engine_id,
                             absl::string_view my_transport, const ConnectorHello& theirs,
                             absl::string_view their_engine_id);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_SRC_LAYER_TABLE_H_
