// KvConnector: moves KV caches between a prefill (producer) and a decode (consumer) worker,
// with the semantics of vLLM's KVConnectorBase_V1. It has a scheduler side, which decides
// per request how many prompt tokens come from remote and what each step must load or
// save, and a worker side, which does it around every attention layer (it is the layer's
// TransferHook). Both sides may live in one object, as they do in kvstream's workers.
//
// A step on the consumer (push mode, the decode worker D receives):
//   scheduler: GetNumNewMatchedTokens(req)   -> prompt_len - 1 tokens come from remote
//              UpdateStateAfterAlloc(req, blocks, n)
//              meta = BuildConnectorMeta(scheduled)
//   worker:    BindConnectorMetadata(meta); StartLoadKv()   (hands requests to producers)
//              per layer: BeforeAttention(layer) waits for that layer's KV (with a deadline)
//              WaitForSave(); ClearConnectorMetadata()
//              GetFinished(), GetBlockIdsWithLoadErrors() / TakeLoadErrors()
// On the producer (P): TakeIncomingRequests() gives the requests consumers handed over;
// after its scheduler allocated blocks (UpdateStateAfterAlloc) and scheduled the prefill,
// AfterAttention(layer) posts the layer's blocks to the consumer without blocking, and
// RequestFinished() keeps the blocks until GetFinished() reports the sends done.
//
// Thread safety: the scheduler-side and worker-side methods are called from the engine's
// thread(s); internal state is synchronised, so scheduler and worker may run on two threads.
#ifndef KVSTREAM_CONNECTOR_KV_CONNECTOR_H_
#define KVSTREAM_CONNECTOR_KV_CONNECTOR_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvstream/attention/transfer_hook.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/connector/config.h"

namespace kvstream {

// Where a consumer's request is prefilled (vLLM's kv_transfer_params).
struct RemotePrefill {
  std::string host;
  int32_t port = 0;
};

struct KvRequest {
  std::string request_id;
  std::vector<int32_t> prompt_token_ids;
  // Consumer: set when the prompt's KV should come from this producer.
  std::optional<RemotePrefill> remote_prefill;
};

struct MatchedTokens {
  int32_t num_tokens = 0;  // prompt tokens whose KV will come from remote
  bool load_async = false; // false: the request runs this step, waiting layer by layer
};

// One request scheduled in a step, as the scheduler side sees it.
struct ScheduledRequest {
  std::string request_id;
  int32_t num_computed_tokens = 0;   // tokens in the cache before this step
  int32_t num_scheduled_tokens = 0;  // tokens computed this step
};

// What the scheduler side hands the worker side for one step.
struct KvConnectorMetadata {
  struct Load {  // consumer: hand the request to its producer
    std::string request_id;
    std::vector<int32_t> prompt_token_ids;
    std::vector<int32_t> block_ids;  // destination blocks, token order
    int32_t num_tokens = 0;          // tokens expected from remote
    RemotePrefill remote;
  };
  struct Save {  // producer: push these blocks this step, layer by layer
    std::string request_id;
    std::vector<int32_t> block_ids;  // local blocks, token order
    int32_t num_tokens = 0;
  };
  std::vector<Load> loads;
  std::vector<std::string> waits;  // consumer: requests of this step that expect remote KV
  std::vector<Save> saves;
};

struct FinishedRequests {
  std::set<std::string> finished_sending;  // producer: sends done (or failed); free the blocks
  std::set<std::string> finished_recving;  // consumer: every layer arrived (or failed)
};

// What moved, for reports and metrics.
struct ConnectorStats {
  uint64_t bytes_sent = 0;       // producer: bytes of layers whose transfer completed
  uint64_t layers_sent = 0;
  uint64_t bytes_received = 0;   // consumer: bytes of layers that arrived and verified
  uint64_t layers_received = 0;
  uint64_t load_errors = 0;
  uint64_t send_failures = 0;
  double wait_ms = 0;            // consumer: time BeforeAttention blocked
  double exposed_ms = 0;         // consumer: of which layers were already in flight
  int64_t blocks_in_flight = 0;  // blocks of requests still being sent or received
  // Per-layer transfer latency (producer: post to completion; consumer: post to verified
  // arrival, same-host clocks), as a histogram over kLatencyBucketsMs (+Inf last).
  static constexpr double kLatencyBucketsMs[] = {0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 1000};
  static constexpr int kLatencyBuckets = sizeof(kLatencyBucketsMs) / sizeof(double) + 1;
  uint64_t latency_counts[kLatencyBuckets] = {};  // non-cumulative
  double latency_sum_ms = 0;
  void ObserveLatency(double ms) {
    int b = 0;
    while (b < kLatencyBuckets - 1 && ms > kLatencyBucketsMs[b]) ++b;
    ++latency_counts[b];
    latency_sum_ms += ms;
  }
};

// The counters of the traffic with one peer. On a producer the peers are its consumers, on
// a consumer its producers, named by the engine id they gave at handshake (or by their
// control address while no handshake succeeded).
struct PeerConnectorStats {
  std::string peer;
  ConnectorStats stats;
};

// Consumer: one request's transfer, once all its layers arrived.
struct RequestTransferStats {
  std::string request_id;
  uint64_t bytes = 0;
  std::vector<double> layer_arrival_ms;  // per layer index, ms after the hand-off
  double wait_ms = 0;                    // time BeforeAttention blocked while it waited
  // Sum over layers of (arrival - post) on one host's monotonic clock: the time the bytes
  // spent in flight (meaningless across hosts).
  double transfer_ms = 0;
  // The part of wait_ms spent on layers already posted and in flight: transfer time the
  // prefill compute did not hide.
  double exposed_ms = 0;
};

struct LoadError {
  std::string request_id;
  std::vector<int32_t> block_ids;
  absl::Status status;  // DeadlineExceeded, Unavailable (peer lost), DataLoss (checksum), ...
};

class KvConnector : public TransferHook {
 public:
  ~KvConnector() override = default;

  virtual KvRole role() const = 0;
  virtual const KvTransferConfig& config() const = 0;

  // ---- scheduler side ----

  // Prompt tokens beyond `num_computed_tokens` whose KV a producer will provide.
  virtual absl::StatusOr<MatchedTokens> GetNumNewMatchedTokens(const KvRequest& request,
                                                               int32_t num_computed_tokens) = 0;
  // Records the blocks the scheduler allocated for the request (consumer: the destination of
  // `num_external_tokens` remote tokens; producer: where the prefill writes).
  virtual absl::Status UpdateStateAfterAlloc(const KvRequest& request,
                                             absl::Span<const int32_t> block_ids,
                                             int32_t num_external_tokens) = 0;
  // The step's metadata for the scheduled requests.
  virtual absl::StatusOr<KvConnectorMetadata> BuildConnectorMeta(
      absl::Span<const ScheduledRequest> scheduled) = 0;
  // The request finished (or was aborted). Returns true when the connector still uses its
  // blocks: the engine frees them once GetFinished() lists the request.
  virtual absl::StatusOr<bool> RequestFinished(const std::string& request_id) = 0;

  // Producer: requests handed over by consumers since the last call.
  virtual std::vector<KvRequest> TakeIncomingRequests() = 0;

  // ---- worker side ----

  // Memory for KV caches that this connector's peers can write fastest (UCX over shared
  // memory: one-sided, no receiver progress needed), zero-filled, 64-byte aligned. The
  // memory stays valid while the returned pointer (or a copy) lives and must be released
  // before the connector is destroyed. Engines that own their caches should use it; caches
  // in ordinary memory work too (UCX then emulates the writes).
  virtual absl::StatusOr<std::shared_ptr<void>> AllocateCacheMemory(size_t bytes) = 0;

  // The layers' caches by layer name (each name must hold exactly one layer index).
  // Registers their memory with the transport. Call once, before any step.
  virtual absl::Status RegisterKvCaches(const std::map<std::string, KvCache*>& caches) = 0;
  virtual absl::Status BindConnectorMetadata(const KvConnectorMetadata& metadata) = 0;
  // Consumer: hands this step's loads to their producers (connecting on first use). Does
  // not wait for any KV. A producer that cannot be reached makes the request a load error.
  virtual absl::Status StartLoadKv() = 0;
  // The end of a step's saves. Saves are posted by AfterAttention and finish in the
  // background: a request's blocks stay allocated until GetFinished() reports its sends
  // done, and only the sent token range is read, so nothing needs to wait here. Returns the
  // first error a save of this step met while posting (the request is then failed).
  virtual absl::Status WaitForSave() = 0;
  virtual void ClearConnectorMetadata() = 0;
  virtual absl::StatusOr<FinishedRequests> GetFinished() = 0;
  virtual std::set<int32_t> GetBlockIdsWithLoadErrors() = 0;
  // Load errors since the last call, with their reasons.
  virtual std::vector<LoadError> TakeLoadErrors() = 0;

  // Producer: the control address it listens on ("ip:port").
  virtual std::string control_address() const = 0;

  // Totals over every peer. Thread-safe; never blocks on transfers.
  virtual ConnectorStats stats() const = 0;
  // The same counters per peer, sorted by peer. They add up to stats(), except wait_ms (a
  // wait for a layer that several producers still owed counts for each of them) and a
  // producer's blocks_in_flight (a request split over pipeline stages counts for each).
  virtual std::vector<PeerConnectorStats> peer_stats() const = 0;
  // Consumer: stats of requests whose layers all arrived, since the last call.
  virtual std::vector<RequestTransferStats> TakeRequestStats() = 0;
};

}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_KV_CONNECTOR_H_
