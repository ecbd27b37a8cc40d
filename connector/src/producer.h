// ProducerSide: the prefill worker's half of the layerwise connector. It listens on the
// control port, handshakes with consumers (importing their cache regions), accepts their
// hand-offs, and once a step's metadata schedules a request's save, posts each layer of it
// right after that layer's attention: the K runs, then the V runs with the layer notice, to
// the consumer (or pipeline stage) that owns the layer. For device caches the posts are
// ordered after the layer's work on its stream by an event; the host never waits for it.
//
// Request ids are the consumers': each consumer's (each pipeline group's) are their own
// namespace, and the engine knows a request by an id scoped by it (ScopedRequestId), so
// two consumers may both hand over "req-0". The stages of one pipeline-parallel decode
// group name the group in their hello and share its namespace: their hand-offs of one
// request id are one request.
//
// A request's lifecycle (SendState):
//   kGathering -> kQueued   every layer has a destination (all stages of a pipeline handed
//                           it over); the engine is given it to prefill
//   kQueued    -> kSending  a step's metadata scheduled its save
//   kSending   -> kDone     every layer was posted and every transfer completed
//   any        -> kFailed   a consumer was lost or aborted it, a transfer failed or missed
//                           send_timeout_ms, the engine finished it unsent, the other
//                           stages never came
//   kFailed    -> kStopped  its transfers have all ended and its consumers were told
// TakeOutput reports kDone and kStopped requests that the engine was given as finished
// sending, and forgets them.
//
// Thread safety: thread-safe. One mutex guards requests and links; no control-channel send
// happens under it (transport posts do: they never block).
#ifndef KVSTREAM_CONNECTOR_SRC_PRODUCER_H_
#define KVSTREAM_CONNECTOR_SRC_PRODUCER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "control_messages.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/connector/connector_stats.h"
#include "kvstream/connector/kv_connector.h"
#include "kvstream/connector/kv_connector_worker.h"
#include "kvstream/transfer/control_channel.h"
#include "layer_send.h"
#include "worker_shared.h"

namespace kvstream {
namespace internal {

class ProducerSide {
 public:
  explicit ProducerSide(WorkerShared& shared) : shared_(shared) {}
  ~ProducerSide() { Stop(); }
  ProducerSide(const ProducerSide&) = delete;
  ProducerSide& operator=(const ProducerSide&) = delete;

  // Listens on kv_ip:kv_port and starts accepting consumers. Unavailable when the port
  // cannot be bound.
  absl::Status Start();
  // Joins the threads and releases every transfer. REQUIRES: shared.stopping is set.
  void Stop();
  std::string control_address() const;

  // Prepares what device caches need (streams, events, checksum engine). Called once the
  // layers are registered.
  absl::Status Prepare(const LayerTable& table);

  // The step's saves and finished requests.
  absl::Status Bind(const KvConnectorMetadata& metadata);
  // Posts `layer_name` of every request this step saves, ordered after `stream`'s work.
  absl::Status PostLayer(absl::string_view layer_name, const KvCache& cache, void* stream);
  // The first error a post of this step met.
  absl::Status StepError() const;
  void ClearStep();

  // From the progress loop: completes, fails and times out transfers, tells consumers
  // about failed requests. Returns whether anything is outstanding.
  bool Poll();

  void TakeOutput(KvConnectorOutput& out);
  // Control connections served now (threads not yet joined), and those refused so far
  // because max_connections were being served.
  int64_t connections() const;
  uint64_t connections_refused() const { return refused_.load(); }
  int64_t BlocksInFlight(std::map<std::string, int64_t>* by_peer) const;
  std::vector<RequestSendStats> TakeSendStats();

 private:
  // One connected consumer.
  struct ConsumerLink {
    std::string engine_id;
    std::string name;   // the engine id escaped and quoted, for messages and logs
    std::string group;  // its hello's pipeline group (empty: none)
    // The namespace of its request ids (ScopedRequestId): its pipeline group's when it is
    // a pipeline stage (the stages of one group hand a request over together), else its
    // own (its engine id, made unique among the live links).
    std::string scope;
    PeerId peer = 0;
    int64_t remote_num_blocks = 0;
    // The layers it registered, which are the layers it receives: all of ours, or one
    // pipeline stage's range of them.
    std::set<int32_t> layers;
    // By layer index: the consumer's K and V regions.
    std::map<int32_t, std::pair<std::unique_ptr<RemoteMemory>, std::unique_ptr<RemoteMemory>>>
        regions;
    std::shared_ptr<ControlConnection> conn;
    std::atomic<bool> alive{true};
    // Requests handed over on this link and not yet done or stopped, and their prompt
    // tokens (bounded by max_requests_per_consumer / max_tokens_per_consumer). Guarded
    // by the producer's mu_.
    int64_t active_requests = 0;
    int64_t active_tokens = 0;
  };

  struct Destination {
    std::shared_ptr<ConsumerLink> link;
    std::vector<int32_t> dest_blocks;
    uint64_t attempt = 0;  // the consumer's hand-off, echoed in every layer notice
  };

  enum class SendState { kGathering, kQueued, kSending, kDone, kFailed, kStopped };

  struct SendRequest {
    SendState state = SendState::kGathering;
    std::string id;           // the engine's: ScopedRequestId(scope, consumer_id)
    std::string consumer_id;  // the consumers' own, in every message and notice to them
    std::vector<Destination> dests;
    std::map<int32_t, size_t> route;  // layer index -> index in dests
    absl::Time gather_deadline = absl::InfiniteFuture();  // for the hand-offs still missing
    std::vector<int32_t> prompt;
    int32_t num_tokens = 0;
    std::vector<int32_t> local_blocks;
    std::set<int32_t> layers_posted;
    std::vector<TransferId> pending;
    // Per layer index (RequestSendStats), sized at the first completed send.
    std::vector<uint64_t> ready_ns;
    std::vector<uint64_t> sent_ns;
    uint64_t bytes_sent = 0;
    absl::Time deadline = absl::InfiniteFuture();
    std::string stop_reason;
    bool released = false;  // given to the engine (reported incoming)
    bool settled = false;   // done or stopped: no longer counted against its consumers
  };

  // What a completed V transfer (the one with the notice) means for the stats.
  struct LayerSend {
    int32_t layer = 0;
    uint64_t bytes = 0;
    uint64_t post_ns = 0;
    std::string peer;  // the consumer's engine id
  };

  // The id the engine knows a consumer's request by: "<scope>/<escaped request id>"
  // (hashed where that would exceed kMaxIdBytes). Distinct scopes never give one id.
  static std::string ScopedRequestId(absl::string_view scope, absl::string_view request_id);
  // The scope of a link that just passed its handshake.
  std::string ScopeFor(const ConsumerLink& link) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void AcceptLoop();
  void ConsumerLoop(std::shared_ptr<ControlConnection> conn);
  absl::Status ImportConsumer(const HelloMsg& hello, ConsumerLink& link);
  absl::Status AcceptHandOff(const HandOffMsg& m, const std::shared_ptr<ConsumerLink>& link);
  absl::Status CheckHandOff(const HandOffMsg& m, const ConsumerLink& link,
                            const SendRequest* other) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool HandleAbort(const AbortMsg& m, const std::shared_ptr<ConsumerLink>& link);
  void ConsumerLost(const std::shared_ptr<ConsumerLink>& link, const absl::Status& why);
  void Fail(SendRequest& s, const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells `link`'s consumer, through the transport and behind every write posted to it so
  // far, that nothing of attempt `attempt` of its request `request_id` is on its way any
  // more (a StopNotice). Best effort: a consumer that never gets it gives the link up at
  // its abort deadline.
  void PostStopNotice(const ConsumerLink& link, const std::string& request_id,
                      uint64_t attempt, absl::string_view reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Once a request is done or stopped: it no longer counts against its consumers' bounds.
  void Settle(SendRequest& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static std::string DestinationNames(const SendRequest& s);
  static bool HasDestination(const SendRequest& s, const std::shared_ptr<ConsumerLink>& link);

  WorkerShared& shared_;
  std::unique_ptr<LayerSender> sender_;  // made by Prepare
  std::unique_ptr<ControlListener> listener_;
  std::thread accept_thread_;
  // One thread per control connection, joined by the accept loop once it is done, so
  // that a connection's resources (its stack above all) go with it.
  struct ConnectionThread {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  void JoinFinished() ABSL_EXCLUSIVE_LOCKS_REQUIRED(threads_mu_);
  mutable absl::Mutex threads_mu_;
  std::vector<ConnectionThread> readers_ ABSL_GUARDED_BY(threads_mu_);
  std::atomic<uint64_t> refused_{0};

  mutable absl::Mutex mu_;
  std::map<std::string, SendRequest> send_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<ConsumerLink>> links_ ABSL_GUARDED_BY(mu_);
  uint64_t link_serial_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> step_saves_ ABSL_GUARDED_BY(mu_);
  absl::Status step_error_ ABSL_GUARDED_BY(mu_);
  // Requests a pipeline stage's hand-off was rejected for before any other stage handed
  // them over: the other stages' hand-offs are refused until `until` (then forgotten).
  struct RejectedStage {
    std::string why;
    absl::Time until;
  };
  std::map<std::string, RejectedStage> rejected_stages_ ABSL_GUARDED_BY(mu_);
  std::map<TransferId, LayerSend> layer_sends_ ABSL_GUARDED_BY(mu_);
  // Stop notices in flight (layer_notice.h), released by Poll once they ended.
  std::vector<TransferId> stop_notices_ ABSL_GUARDED_BY(mu_);
  std::deque<RequestSendStats> send_stats_ ABSL_GUARDED_BY(mu_);
  std::vector<IncomingRequest> incoming_ ABSL_GUARDED_BY(mu_);
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_SRC_PRODUCER_H_
