// The loopback fabric's state (loopback_transport.cc): every transport of a LoopbackFabric
// is a node of it, with its regions, peers, queued transfers and inbox, all guarded by the
// fabric's one mutex (LoopbackFabric::State::mu).
#ifndef KVSTREAM_TRANSFER_SRC_LOOPBACK_FABRIC_H_
#define KVSTREAM_TRANSFER_SRC_LOOPBACK_FABRIC_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kvstream/transfer/loopback_transport.h"
#include "kvstream/transfer/transport.h"

namespace kvstream {
namespace internal {
namespace loopback {

// LocalInfo: "kvstream-loopback:1:<node id>:<name>"; descriptor:
// "kvstream-loopback-mem:1:<node id>:<region id>:<length>". Text, because nothing but
// loopback_transport.cc reads them, and versioned so a stale string is rejected rather than misread.
constexpr absl::string_view kInfoPrefix = "kvstream-loopback";
constexpr absl::string_view kDescriptorPrefix = "kvstream-loopback-mem";
constexpr absl::string_view kVersion = "1";

struct Region {
  char* base = nullptr;
  size_t length = 0;
};

struct PeerEntry {
  uint64_t node_id = 0;  // the fabric node this peer is
  std::string name;
  bool connected = false;  // false: known only because it sent us notifications
  absl::Status status;
};

enum class Phase { kQueued, kDone, kFailed };

struct LoopbackTransfer {
  PeerId peer = 0;
  uint64_t local_region = 0;
  uint64_t remote_region = 0;
  std::vector<Segment> segments;
  std::string notification;
  Phase phase = Phase::kQueued;
  absl::Status status;
};

}  // namespace loopback

// One transport's state inside the fabric.
struct LoopbackNode {
  uint64_t id = 0;
  std::string name;
  std::map<uint64_t, loopback::Region> regions;
  uint64_t next_region = 1;
  std::map<PeerId, loopback::PeerEntry> peers;
  PeerId next_peer = 1;
  std::map<TransferId, loopback::LoopbackTransfer> transfers;
  std::deque<TransferId> queue;  // transfers in post order, waiting for Progress()
  TransferId next_transfer = 1;
  std::vector<Notification> inbox;
  std::vector<std::pair<PeerId, absl::Status>> peer_errors;  // for the callback, unreported
  PeerErrorCallback callback;
  bool failed = false;  // FailEndpoint() was called on this node
  absl::Status failure;
  // Nodes this one disconnected from: their writes into it and their notifications are
  // dropped (their transfers fail) until Accept or Connect of them again.
  std::set<uint64_t> refused;

  std::string PeerName(PeerId peer) const {
    auto it = peers.find(peer);
    std::string peer_name = it == peers.end() ? std::string("?") : it->second.name;
    return absl::StrCat("loopback peer '", peer_name, "' (id ", peer, ")");
  }

  // Marks `peer` failed and fails its queued transfers. The callback runs later, from
  // Progress(), outside the fabric lock.
  void FailPeer(PeerId peer, const absl::Status& error) {
    auto it = peers.find(peer);
    if (it == peers.end() || !it->second.status.ok()) return;
    it->second.status = error;
    for (auto& entry : transfers) {
      loopback::LoopbackTransfer& transfer = entry.second;
      if (transfer.peer == peer && transfer.phase == loopback::Phase::kQueued) {
        transfer.phase = loopback::Phase::kFailed;
        transfer.status = error;
      }
    }
    peer_errors.emplace_back(peer, error);
  }

  // The id under which this node knows `other`, created on first contact.
  PeerId PeerIdFor(const LoopbackNode& other) {
    for (const auto& [peer, entry] : peers) {
      if (entry.node_id == other.id) return peer;
    }
    PeerId peer = next_peer++;
    loopback::PeerEntry entry;
    entry.node_id = other.id;
    entry.name = other.name;
    peers.emplace(peer, std::move(entry));
    return peer;
  }
};

}  // namespace internal

struct LoopbackFabric::State {
  absl::Mutex mu;
  uint64_t next_node ABSL_GUARDED_BY(mu) = 1;
  // Every node's fields are guarded by `mu` too.
  std::map<uint64_t, std::unique_ptr<internal::LoopbackNode>> nodes ABSL_GUARDED_BY(mu);

  internal::LoopbackNode* Find(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = nodes.find(id);
    return it == nodes.end() ? nullptr : it->second.get();
  }
  internal::LoopbackNode* FindByName(absl::string_view name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (auto& [id, node] : nodes) {
      if (node->name == name) return node.get();
    }
    return nullptr;
  }
};

}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_LOOPBACK_FABRIC_H_
