// ProducerPeers (producer_peers.h).
#include "producer_peers.h"

#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvstream {
namespace internal {

absl::StatusOr<std::shared_ptr<ProducerPeers::Link>> ProducerPeers::LinkFor(
    const std::string& host, int port) {
  const std::string key = absl::StrCat(host, ":", port);
  size_t open = 0;
  {
    absl::MutexLock lock(&threads_mu_);
    JoinFinished();
    open = readers_.size();
  }
  {
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(key);
    if (it == peers_.end()) {
      // Peers seen once and gone are kept for their backoff; bounded all the same.
      if (peers_.size() >= 4 * options_.max_connections + 16) {
        for (auto p = peers_.begin(); p != peers_.end();) {
          const PeerState s = p->second.lifecycle.state();
          p = s == PeerState::kDown || s == PeerState::kNew ? peers_.erase(p) : std::next(p);
        }
      }
      it = peers_.emplace(key, Peer(PeerLifecycle(key, options_.reconnect))).first;
    }
    Peer& peer = it->second;
    if (peer.lifecycle.state() == PeerState::kUp) return peer.link;
    if (open >= options_.max_connections) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "cannot connect to producer ", absl::CHexEscape(key), ": links to ", open,
          " producers are open (max_connections ", options_.max_connections, ")"));
    }
    absl::StatusOr<PeerLifecycle::Action> action = peer.lifecycle.Admit(absl::Now());
    if (!action.ok()) return action.status();
    // kConnect: this thread owns the attempt until Connected or Failed below.
  }
  absl::StatusOr<Dialed> dialed = options_.dial(host, port);
  std::shared_ptr<Link> link;
  {
    absl::MutexLock lock(&mu_);
    Peer& peer = peers_.at(key);
    if (!dialed.ok()) {
      peer.lifecycle.Failed(absl::Now(), dialed.status());
      return dialed.status();
    }
    link = std::make_shared<Link>();
    link->conn = std::move(dialed->conn);
    link->address = key;
    link->engine_id = std::move(dialed->engine_id);
    link->transport_peer = dialed->transport_peer;
    link->serial = next_serial_++;
    peer.link = link;
    peer.engine_id = link->engine_id;
    peer.lifecycle.Connected(absl::Now());
  }
  absl::MutexLock lock(&threads_mu_);
  auto done = std::make_shared<std::atomic<bool>>(false);
  readers_.push_back({std::thread([this, link, done] {
                        ReaderLoop(link);
                        done->store(true);
                      }),
                      done});
  return link;
}

std::shared_ptr<ProducerPeers::Link> ProducerPeers::Find(const std::string& address) const {
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(address);
  return it == peers_.end() ? nullptr : it->second.link;
}

void ProducerPeers::Lose(Link& link, const absl::Status& why) {
  if (!link.alive.exchange(false)) return;
  link.conn->Close();
  if (options_.on_end) options_.on_end(link);
  {
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(link.address);
    if (it != peers_.end() && it->second.link.get() == &link) {
      it->second.link.reset();
      it->second.lifecycle.Lost(absl::Now(), why);
    }
  }
  if (options_.on_lost) options_.on_lost(link, why);
}

PeerState ProducerPeers::state(const std::string& address) const {
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(address);
  return it == peers_.end() ? PeerState::kNew : it->second.lifecycle.state();
}

std::string ProducerPeers::engine_id(const std::string& address) const {
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(address);
  return it == peers_.end() ? std::string() : it->second.engine_id;
}

int64_t ProducerPeers::times_up(const std::string& address) const {
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(address);
  return it == peers_.end() ? 0 : it->second.lifecycle.times_up();
}

int64_t ProducerPeers::connections() const {
  absl::MutexLock lock(&threads_mu_);
  return static_cast<int64_t>(readers_.size());
}

void ProducerPeers::ReaderLoop(const std::shared_ptr<Link>& link) {
  while (options_.stopping == nullptr || !options_.stopping->load()) {
    absl::StatusOr<ConnectorMessage> msg =
        ReceiveConnectorMessage(*link->conn, absl::Now() + absl::Milliseconds(100));
    if (!msg.ok()) {
      if (absl::IsDeadlineExceeded(msg.status()) && !link->conn->closed()) continue;
      Lose(*link, msg.status());
      return;
    }
    if (options_.on_message) options_.on_message(*link, std::move(*msg));
  }
}

void ProducerPeers::JoinFinished() {
  for (auto it = readers_.begin(); it != readers_.end();) {
    if (it->done->load()) {
      it->thread.join();
      it = readers_.erase(it);
    } else {
      ++it;
    }
  }
}

void ProducerPeers::Stop() {
  std::vector<Reader> readers;
  {
    absl::MutexLock lock(&threads_mu_);
    readers = std::move(readers_);
    readers_.clear();
  }
  for (Reader& r : readers) r.thread.join();
  absl::MutexLock lock(&mu_);
  peers_.clear();
}

}  // namespace internal
}  // namespace kvstream
