// WorkerShared: what a worker's producer side and consumer side share: the configuration,
// the transport, the stats and the registered layers. Owned by the worker, which outlives
// both sides.
#ifndef KVSTREAM_CONNECTOR_SRC_WORKER_SHARED_H_
#define KVSTREAM_CONNECTOR_SRC_WORKER_SHARED_H_

#include <atomic>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "control_messages.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/connector/config.h"
#include "kvstream/transfer/control_channel.h"
#include "kvstream/transfer/transport.h"
#include "layer_table.h"
#include "stats_book.h"

namespace kvstream {
namespace internal {

struct WorkerShared {
  WorkerShared(KvTransferConfig c, std::unique_ptr<Transport> t)
      : config(std::move(c)), transport(std::move(t)) {}

  // The registered layers; null before RegisterKvCaches. Immutable once published.
  std::shared_ptr<const LayerTable> layers() const {
    absl::MutexLock lock(&mu);
    return layer_table;
  }
  void PublishLayers(std::shared_ptr<const LayerTable> table) {
    absl::MutexLock lock(&mu);
    layer_table = std::move(table);
  }

  // Our side of a handshake: the engine id, the secret, the hello, the deadline.
  absl::StatusOr<HandshakeOptions> Handshake(const LayerTable* table) const {
    HandshakeOptions hs;
    hs.local.engine_id = config.engine_id;
    ASSIGN_OR_RETURN(ConnectorHello hello, LocalHello(table, *transport));
    hello.group = PipelineGroup(config);
    ASSIGN_OR_RETURN(hs.local.payload, EncodeConnectorHello(hello));
    hs.secret = config.kvstream.secret;
    hs.deadline = absl::Now() + absl::Milliseconds(config.kvstream.handshake_timeout_ms);
    return hs;
  }

  // Set when something is posted or handed off, so that the progress loop stops napping.
  void Wake() { outstanding.store(true); }

  const KvTransferConfig config;
  const std::unique_ptr<Transport> transport;
  StatsBook stats;
  std::atomic<bool> stopping{false};
  std::atomic<bool> outstanding{false};

 private:
  mutable absl::Mutex mu;
  std::shared_ptr<const LayerTable> layer_table ABSL_GUARDED_BY(mu);
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_SRC_WORKER_SHARED_H_
