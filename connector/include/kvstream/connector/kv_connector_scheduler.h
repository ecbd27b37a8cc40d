// KvConnectorScheduler: a connector's scheduler side (kv_connector.h for the whole shape).
// It holds only what the scheduler's process knows: per request, its lifecycle as the
// scheduler sees it (consumer: awaiting hand-off -> loading -> loaded or failed; producer:
// queued -> allocated -> saving -> sent), its blocks and token counts. It never touches a
// transport, a socket or a cache; what happened in the workers reaches it only through
// UpdateConnectorOutput.
//
// Thread safety: thread-compatible (the engine's scheduler calls it from one thread).
#ifndef KVSTREAM_CONNECTOR_KV_CONNECTOR_SCHEDULER_H_
#define KVSTREAM_CONNECTOR_KV_CONNECTOR_SCHEDULER_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvstream/connector/config.h"
#include "kvstream/connector/kv_connector.h"

namespace kvstream {

class KvConnectorScheduler {
 public:
  virtual ~KvConnectorScheduler() = default;

  virtual KvRole role() const = 0;

  // Prompt tokens beyond `num_computed_tokens` whose KV a producer will provide (consumer,
  // for requests with a remote_prefill: all but the last prompt token; otherwise 0).
  virtual absl::StatusOr<MatchedTokens> GetNumNewMatchedTokens(const KvRequest& request,
                                                               int32_t num_computed_tokens) = 0;

  // Records the blocks the scheduler allocated for the request (consumer: the destination of
  // `num_external_tokens` remote tokens, handed to the worker in the next metadata;
  // producer: where the prefill of an incoming request writes). InvalidArgument when the
  // blocks cannot hold the tokens; AlreadyExists for a request already loading.
  virtual absl::Status UpdateStateAfterAlloc(const KvRequest& request,
                                             absl::Span<const int32_t> block_ids,
                                             int32_t num_external_tokens) = 0;

  // The step's metadata for the scheduled requests: new loads, the requests whose layers the
  // worker must wait for, the saves whose prefill completes this step, and the requests the
  // engine finished while their KV was still arriving.
  virtual absl::StatusOr<KvConnectorMetadata> BuildConnectorMeta(
      absl::Span<const ScheduledRequest> scheduled) = 0;

  // The workers' report of a step (or of several). Updates each request's lifecycle: loads
  // that arrived or failed, sends that finished, requests handed over by consumers
  // (producer; TakeIncomingRequests returns them).
  virtual absl::Status UpdateConnectorOutput(const KvConnectorOutput& output) = 0;

  // The request finished (or was aborted). Returns true when a worker still uses its
  // blocks: the engine frees them once a later output lists the request as finished sending
  // or receiving. Unknown requests: false.
  virtual absl::StatusOr<bool> RequestFinished(const std::string& request_id) = 0;

  // Producer: requests handed over by consumers (from the outputs) since the last call.
  virtual std::vector<KvRequest> TakeIncomingRequests() = 0;
};

}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_KV_CONNECTOR_SCHEDULER_H_
