// StatsBook (stats_book.h).
#include "stats_book.h"

namespace kvstream {
namespace internal {

void StatsBook::LayerSent(const std::string& peer, uint64_t bytes, double latency_ms) {
  absl::MutexLock lock(&mu_);
  for (ConnectorStats* s : {&totals_, &by_peer_[peer]}) {
    s->bytes_sent += bytes;
    ++s->layers_sent;
    s->ObserveLatency(latency_ms);
  }
}

void StatsBook::LayerReceived(const std::string& peer, uint64_t bytes, double latency_ms) {
  absl::MutexLock lock(&mu_);
  for (ConnectorStats* s : {&totals_, &by_peer_[peer]}) {
    s->bytes_received += bytes;
    ++s->layers_received;
    if (latency_ms >= 0) s->ObserveLatency(latency_ms);
  }
}

void StatsBook::LoadError(const std::string& peer) {
  absl::MutexLock lock(&mu_);
  ++totals_.load_errors;
  ++by_peer_[peer].load_errors;
}

void StatsBook::SendFailure(const std::set<std::string>& peers) {
  absl::MutexLock lock(&mu_);
  ++totals_.send_failures;
  for (const std::string& p : peers) ++by_peer_[p].send_failures;
}

void StatsBook::Waited(const std::set<std::string>& peers, double ms) {
  absl::MutexLock lock(&mu_);
  totals_.wait_ms += ms;
  for (const std::string& p : peers) by_peer_[p].wait_ms += ms;
}

void StatsBook::Exposed(const std::string& peer, double ms) {
  absl::MutexLock lock(&mu_);
  totals_.exposed_ms += ms;
  by_peer_[peer].exposed_ms += ms;
}

void StatsBook::Handshake(const std::string& peer, bool ok) {
  absl::MutexLock lock(&mu_);
  for (ConnectorStats* s : {&totals_, &by_peer_[peer]}) ++(ok ? s->handshakes : s->handshake_failures);
}

ConnectorStats StatsBook::Totals() const {
  absl::MutexLock lock(&mu_);
  return totals_;
}

std::map<std::string, ConnectorStats> StatsBook::ByPeer() const {
  absl::MutexLock lock(&mu_);
  return by_peer_;
}

}  // namespace internal
}  // namespace kvstream
