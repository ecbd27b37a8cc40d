// ConsumerSide: the decode worker's half of the layerwise connector. It hands each load of
// the step's metadata to its producer over the control channel (its links and their
// lifecycle, reconnection included, are ProducerPeers'), receives the producer's layer notices (from the worker's
// progress loop), verifies every layer (byte count, checksum), and makes the forward pass
// wait, layer by layer and with a deadline, for the layers of the step's requests.
//
// A request's lifecycle (RecvState):
//   kPending  -> kLoading   StartLoads handed it to its producer
//   kLoading  -> kComplete  every layer arrived and verified
//   kComplete -> kReported  TakeOutput reported it finished during a step that waits for
//                           it (kept until the step ends, so its remaining waits count)
//   kPending  -> kStopped   the hand-off failed (the producer is down, unreachable,
//                           incompatible, or the send failed): nothing can land
//   kLoading  -> kFailed    a layer missed its deadline, failed its checksum, the producer
//                           refused or stopped it, the link broke, or the engine finished it
//   kFailed   -> kStopped   the producer's stop notice came (through the transport, behind
//                           every write of the request: OnStopNotice), the link is gone, or
//                           the abort deadline passed (the link is then closed); a link that
//                           ends fences the producer's transport off first (FenceOff). The
//                           producer's AbortMsg on the control channel stops it too where the
//                           transport's completions mean delivery (TransportCapabilities::
//                           delivered_at_completion); elsewhere it only says why, as it can
//                           overtake writes still in the transport's socket.
//   kLoading  -> kStopped   the producer's stop notice came first (failed, then stopped)
// A layer's lifecycle within a request (LayerState):
//   kMissing   -> kChecking   its notice is being checked on the host (byte count, and for
//                             host caches the checksum)
//   kChecking  -> kArrived    checked (host caches, or no checksum)
//   kChecking  -> kLanded     device cache: in place, its checksum not yet verified
//   kLanded    -> kVerifying  its GPU verification started
//   kVerifying -> kArrived    verified
// A device layer's verification is deferred so that the decode worker's GPU work comes in
// as few bursts as it can (on a GPU shared with the producer, every burst is a switch of
// contexts that the producer's prefill pays for): the forward pass starts it when it
// reaches the layer (WaitForLayer, then the layer's own kernels follow at once), a request
// no step waits for has all its layers verified together once the last one landed (Poll),
// and ClearStep waits for the verdicts of the step's requests before the engine reads the
// step's outputs, so that a corrupt layer still fails its request in that step.
// A load error is reported when the request fails; kComplete and kStopped requests are
// reported finished (their blocks may be freed) by TakeOutput, which forgets kStopped ones;
// ClearStep forgets kReported ones, recording their RequestTransferStats.
//
// Thread safety: thread-safe. One mutex guards the requests (ProducerPeers has its own, taken
// after this one, never before); the forward pass
// blocks in WaitForLayer without holding it (absl::Mutex::AwaitWithDeadline), and no
// control-channel send happens under it.
#ifndef KVSTREAM_CONNECTOR_SRC_CONSUMER_H_
#define KVSTREAM_CONNECTOR_SRC_CONSUMER_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "control_messages.h"
#include "kvstream/connector/kv_connector.h"
#include "layer_notice.h"
#include "device_verifier.h"
#include "layer_runs.h"
#include "producer_peers.h"
#include "worker_shared.h"

namespace kvstream {
namespace internal {

class ConsumerSide {
 public:
  explicit ConsumerSide(WorkerShared& shared);
  ~ConsumerSide() { Stop(); }
  ConsumerSide(const ConsumerSide&) = delete;
  ConsumerSide& operator=(const ConsumerSide&) = delete;

  // Joins the reader threads. Idempotent. REQUIRES: shared.stopping is set.
  void Stop();

  // Prepares what device caches need (the checksum verifier). Called once the layers are
  // registered.
  absl::Status Prepare(const LayerTable& table);

  // The step's loads (new requests), waits and finished requests.
  absl::Status Bind(const KvConnectorMetadata& metadata);
  // Hands the step's loads over (connecting on first use). Never waits for KV.
  absl::Status StartLoads();
  // Blocks until `layer_name` arrived for every request of the step's waits, or until the
  // deadline, which fails the requests still missing it (load errors; the layer then runs
  // for the rest of the batch). OK unless the call itself is wrong.
  absl::Status WaitForLayer(absl::string_view layer_name);
  void ClearStep();

  // From the progress loop: a layer notice, and periodic work (verifications finished on the
  // GPU, abort deadlines). Poll returns whether anything is outstanding.
  void OnNotice(const Notification& notification);
  bool Poll();

  void TakeOutput(KvConnectorOutput& out);
  // Blocks of requests whose producer may still write, in total and by producer.
  int64_t BlocksInFlight(std::map<std::string, int64_t>* by_peer) const;
  std::vector<RequestTransferStats> TakeRequestStats();
  // Producer links with a reader thread not yet joined.
  int64_t connections() const;

 private:
  using ProducerLink = ProducerPeers::Link;

  enum class RecvState { kPending, kLoading, kComplete, kReported, kFailed, kStopped };
  enum class LayerState : uint8_t { kMissing, kChecking, kLanded, kVerifying, kArrived };
  // Whether the forward pass may use the layer (its verdict may still be to come).
  static bool InPlace(LayerState s) {
    return s == LayerState::kLanded || s == LayerState::kVerifying || s == LayerState::kArrived;
  }

  struct RecvRequest {
    RecvState state = RecvState::kPending;
    KvConnectorMetadata::Load load;
    std::string producer;     // the producer's address ("host:port")
    uint64_t link = 0;        // the serial of the link it was handed to (0: none yet)
    std::string producer_id;  // its engine id once handed off (metrics label)
    uint64_t attempt = 0;     // this hand-off's (HandOffMsg::attempt); notices must match
    std::vector<LayerState> layers;  // by layer index
    std::vector<LayerNotice> landed;  // by layer index: the notices of kLanded layers
    int32_t in_place = 0;             // layers kLanded, kVerifying or kArrived
    int32_t arrived = 0;              // layers kArrived
    absl::Status error;
    absl::Time abort_deadline = absl::InfiniteFuture();
    absl::Time handoff_time;
    uint64_t handoff_ns = 0;  // the same, MonotonicNs
    // Timing and volume, for RequestTransferStats (per layer index).
    std::vector<double> layer_ms;
    std::vector<uint64_t> post_ns;
    std::vector<uint64_t> arrival_ns;
    std::vector<double> in_flight_ms;
    double transfer_ms = 0;
    double exposed_ms = 0;
    double wait_ms = 0;
    double complete_ms = 0;
    uint64_t bytes = 0;
  };

  using Abort = std::pair<std::shared_ptr<ProducerLink>, AbortMsg>;

  // A device layer's verification to start (outside mu_).
  struct Verification {
    LayerNotice notice;
    std::vector<int32_t> block_ids;
    int32_t num_tokens = 0;
  };

  static const std::string& PeerOf(const RecvRequest& r) {
    return r.producer_id.empty() ? r.producer : r.producer_id;
  }

  // ProducerPeers' dialer: connects to a producer and handshakes.
  absl::StatusOr<ProducerPeers::Dialed> Dial(const std::string& host, int port);
  absl::Status HandOff(const KvConnectorMetadata::Load& load);
  // From a link's reader: a message, and the link's end (its requests fail).
  void OnMessage(ProducerLink& link, const ConnectorMessage& message);
  void LinkLost(ProducerLink& link, const absl::Status& why);
  // A stop notice (layer_notice.h) from the producer a request was handed to: it stops.
  void OnStopNotice(const Notification& notification);
  // At a link's end, before LinkLost lets its requests' blocks be freed: disconnects the
  // producer's transport peer, so that its writes still on their way (a partition that
  // heals, a killed producer whose kernel still sends what its socket held) are dropped
  // instead of landing in blocks that another request may hold by then (transport.h:
  // Disconnect). The next link's handshake accepts its writes again (Dial).
  void FenceOff(ProducerLink& link);
  // The live link a request of `r` was handed to, or null when that link is gone.
  std::shared_ptr<ProducerLink> LinkOf(const RecvRequest& r) const;
  void Fail(RecvRequest& r, absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MarkStopped(RecvRequest& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void QueueAbort(RecvRequest& r, std::vector<Abort>& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SendAborts(const std::vector<Abort>& aborts);
  void Arrived(const std::string& id, const LayerNotice& notice, const absl::Status& verdict);
  // Notes that `notice`'s layer of `r` is in place (arrival time and time in flight).
  void RecordLanding(RecvRequest& r, const LayerNotice& notice) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves `r`'s kLanded layers (only `layer`, or all with -1) to kVerifying, into `out`.
  void TakeLanded(RecvRequest& r, int32_t layer, std::vector<Verification>& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts them on the GPU (a failure to start fails its request). Without mu_.
  void StartVerifications(std::vector<Verification> verifications)
      ABSL_LOCKS_EXCLUDED(mu_, verifier_mu_);
  // Whether no request of the step's waits has a layer in place but not yet verified.
  bool StepVerified() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  WorkerShared& shared_;
  // Device caches with checksums: set by Prepare; used by the progress thread (Poll) and
  // the forward pass (WaitForLayer, ClearStep), under verifier_mu_ (never taken before mu_
  // is released, nor mu_ under it).
  std::unique_ptr<DeviceVerifier> device_verifier_;
  absl::Mutex verifier_mu_;

  mutable absl::Mutex mu_;
  std::map<std::string, RecvRequest> recv_ ABSL_GUARDED_BY(mu_);
  std::vector<KvConnectorMetadata::Load> step_loads_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> waits_ ABSL_GUARDED_BY(mu_);
  std::vector<LoadError> errors_ ABSL_GUARDED_BY(mu_);  // not yet reported
  std::vector<RequestTransferStats> finished_stats_ ABSL_GUARDED_BY(mu_);
  // Hand-off attempts: a random start (so that a restarted worker's attempts differ from
  // its predecessor's) and a counter.
  uint64_t next_attempt_ ABSL_GUARDED_BY(mu_) = 0;

  // Last: destroyed first, so that its readers, which call back into this class, end
  // before anything they touch.
  ProducerPeers peers_;
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_SRC_CONSUMER_H_
