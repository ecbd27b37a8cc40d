// StatsBook: a worker's transfer counters, in total and per peer (the peer's engine id, or
// its control address before a handshake named it). Thread-safe; never blocks for long.
// blocks_in_flight is not kept here: the producer and consumer sides compute it from their
// requests when asked.
#ifndef KVSTREAM_CONNECTOR_SRC_STATS_BOOK_H_
#define KVSTREAM_CONNECTOR_SRC_STATS_BOOK_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kvstream/connector/connector_stats.h"

namespace kvstream {
namespace internal {

class StatsBook {
 public:
  // A layer transfer to `peer` completed (`latency_ms`: post to completion).
  void LayerSent(const std::string& peer, uint64_t bytes, double latency_ms);
  // A layer from `peer` arrived and verified (`latency_ms`: post to verified arrival; < 0 when
  // the clocks do not allow it).
  void LayerReceived(const std::string& peer, uint64_t bytes, double latency_ms);
  void LoadError(const std::string& peer);
  // A request's sends failed; `peers` are its consumers (each is charged, the total once).
  void SendFailure(const std::set<std::string>& peers);
  // BeforeAttention blocked `ms`, while `peers` still owed the layer (each is charged).
  void Waited(const std::set<std::string>& peers, double ms);
  void Exposed(const std::string& peer, double ms);
  // Consumer: a link to `peer` was made (`ok`) or could not be.
  void Handshake(const std::string& peer, bool ok);

  ConnectorStats Totals() const;
  std::map<std::string, ConnectorStats> ByPeer() const;

 private:
  mutable absl::Mutex mu_;
  ConnectorStats totals_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, ConnectorStats> by_peer_ ABSL_GUARDED_BY(mu_);
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_SRC_STATS_BOOK_H_
