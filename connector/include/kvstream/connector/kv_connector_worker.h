// KvConnectorWorker: a connector's worker side (kv_connector.h for the whole shape). It is
// every attention layer's TransferHook; what it does in a step comes only from the step's
// KvConnectorMetadata, and what it learned goes back only through TakeOutput.
//
// Caches may live in host or device memory (KvCacheView::memory). For device caches the hook
// is ordered on CUDA streams: AfterAttention records an event on the layer's stream and the
// transport's copy waits for it on the device; BeforeAttention waits on the host (with the
// deadline) only for the layer's arrival notice, which the transport delivers after the data
// is in place, so the stream's later work sees the data. Nothing synchronises the host with
// the compute stream.
//
// Thread safety: every method may be called from any thread (internal state is
// synchronised); the hook methods are called on the thread running the forward pass.
#ifndef KVSTREAM_CONNECTOR_KV_CONNECTOR_WORKER_H_
#define KVSTREAM_CONNECTOR_KV_CONNECTOR_WORKER_H_

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvstream/attention/transfer_hook.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/common/dtype.h"
#include "kvstream/connector/config.h"
#include "kvstream/connector/kv_connector.h"

namespace kvstream {

inline constexpr size_t kMaxModelFingerprintBytes = 512;

// What the engine's model allows, for the producer's checks of every hand-off and for the
// compatibility hash. Zero / empty: unknown (not checked).
struct KvModelInfo {
  int32_t vocab_size = 0;     // token ids must lie in [0, vocab_size); hashed
  int64_t max_model_len = 0;  // the longest prompt a request may have
  // Anything else that changes the numbers (weights, shapes, positional encoding), as free
  // text; hashed and shown to peers in the compatibility description. At most
  // kMaxModelFingerprintBytes.
  std::string fingerprint;
};

class KvConnectorWorker : public TransferHook {
 public:
  ~KvConnectorWorker() override = default;

  virtual KvRole role() const = 0;
  virtual const KvTransferConfig& config() const = 0;

  // Memory for KV caches of `kind` that this connector's peers can write fastest (UCX over
  // shared memory: one-sided, no receiver progress needed), zero-filled, 64-byte aligned.
  // The memory stays valid while the returned pointer (or a copy) lives and must be released
  // before the connector is destroyed. Caches in memory of the engine's own work too.
  // InvalidArgument for a kind the transport cannot allocate.
  virtual absl::StatusOr<std::shared_ptr<void>> AllocateCacheMemory(size_t bytes,
                                                                    MemoryKind kind) = 0;

  // The engine's model. Call before RegisterKvCaches (it goes into the compatibility hash);
  // FailedPrecondition after, InvalidArgument for negative limits or a fingerprint over
  // kMaxModelFingerprintBytes. Without it nothing is checked against the model, and both
  // peers must leave it unset to be compatible.
  virtual absl::Status SetModelInfo(const KvModelInfo& info) = 0;

  // The layers' caches by layer name (each name must hold exactly one layer index; every
  // cache the same spec, block count and memory kind). Registers their memory with the
  // transport. Call once, before any step; a failed call leaves nothing registered. Their
  // memory must stay valid until the connector is destroyed (its peers may write into it
  // until then), unless it came from AllocateCacheMemory, whose release deregisters it.
  virtual absl::Status RegisterKvCaches(const std::map<std::string, KvCache*>& caches) = 0;

  // This step's metadata (it replaces the previous step's). A load for a request already
  // loading, or metadata naming requests the worker does not know, is ignored where
  // harmless and an InvalidArgument otherwise.
  virtual absl::Status BindConnectorMetadata(const KvConnectorMetadata& metadata) = 0;
  // Consumer: hands this step's loads to their producers (connecting on first use). Does
  // not wait for any KV. A producer that cannot be reached makes the request a load error.
  virtual absl::Status StartLoadKv() = 0;
  // The end of a step's saves. Saves are posted by AfterAttention and finish in the
  // background: a request's blocks stay allocated until an output reports its sends done,
  // and only the sent token range is read, so nothing needs to wait here. Returns the first
  // error a save of this step met while posting (the request is then failed).
  virtual absl::Status WaitForSave() = 0;
  virtual void ClearConnectorMetadata() = 0;

  // What happened since the last call: sends finished, loads finished, load errors (with
  // their blocks and reasons), requests handed over by consumers. Never blocks.
  virtual absl::StatusOr<KvConnectorOutput> TakeOutput() = 0;

  // Producer: the control address it listens on ("ip:port").
  virtual std::string control_address() const = 0;

  // Totals over every peer. Never blocks on transfers.
  virtual ConnectorStats stats() const = 0;
  // The same counters per peer, sorted by peer. They add up to stats(), except wait_ms (a
  // wait for a layer that several producers still owed counts for each of them) and a
  // producer's blocks_in_flight (a request split over pipeline stages counts for each).
  virtual std::vector<PeerConnectorStats> peer_stats() const = 0;
  // Consumer: stats of requests whose layers all arrived, since the last call.
  virtual std::vector<RequestTransferStats> TakeRequestStats() = 0;
  // Producer: stats of requests whose sends all ended, since the last call (at most the
  // latest kMaxSendStatsKept; older ones are dropped untaken).
  virtual std::vector<RequestSendStats> TakeSendStats() = 0;
  static constexpr size_t kMaxSendStatsKept = 4096;
};

}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_KV_CONNECTOR_WORKER_H_
