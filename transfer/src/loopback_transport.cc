// The loopback transport: Transport instances of one process joined by a LoopbackFabric.
//
// Everything on a fabric is guarded by the fabric's one mutex. That is slow for a real
// transport but right for a test double: the copy of a transfer's bytes and the delivery of
// its notification happen atomically with respect to every other transport call, so a
// deregistration racing a write can never leave the memcpy on freed memory. Writes are
// queued by PostWrite and performed by the posting transport's Progress(), in post order.
#include "kvstream/transfer/loopback_transport.h"

#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <new>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "kvstream/common/status_macros.h"
#include "loopback_fabric.h"
#include "segment_check.h"

namespace kvstream {

namespace {

using State = LoopbackFabric::State;
using internal::LoopbackNode;
using internal::loopback::kDescriptorPrefix;
using internal::loopback::kInfoPrefix;
using internal::loopback::kVersion;
using internal::loopback::LoopbackTransfer;
using internal::loopback::PeerEntry;
using internal::loopback::Phase;
using internal::loopback::Region;

// Memory from AllocateMemory (operator new with alignment, freed with the matching delete).
struct AlignedDelete {
  void operator()(char* p) const {
    ::operator delete(p, std::align_val_t(kMinAllocationAlignment));
  }
};
using AlignedBuffer = std::unique_ptr<char, AlignedDelete>;

// A registered region; one from AllocateMemory also owns its memory (`owned`), freed after
// the region is deregistered.
class LoopbackRegistration final : public MemoryRegistration {
 public:
  LoopbackRegistration(std::shared_ptr<State> state, uint64_t node, uint64_t region, void* base,
                       size_t length, MemoryKind kind, AlignedBuffer owned = nullptr)
      : owned_(std::move(owned)), state_(std::move(state)), node_(node), region_(region),
        base_(base), length_(length), kind_(kind),
        descriptor_(absl::StrCat(kDescriptorPrefix, ":", kVersion, ":", node, ":", region, ":",
                                 length)) {}
  ~LoopbackRegistration() override {
    absl::MutexLock lock(&state_->mu);
    if (LoopbackNode* node = state_->Find(node_)) node->regions.erase(region_);
  }
  LoopbackRegistration(const LoopbackRegistration&) = delete;
  LoopbackRegistration& operator=(const LoopbackRegistration&) = delete;

  void* base() const override { return base_; }
  size_t length() const override { return length_; }
  MemoryKind memory_kind() const override { return kind_; }
  const std::string& descriptor() const override { return descriptor_; }
  uint64_t node() const { return node_; }
  uint64_t region() const { return region_; }

 private:
  AlignedBuffer owned_;  // first: destroyed last, after the destructor deregistered it
  std::shared_ptr<State> state_;
  uint64_t node_;
  uint64_t region_;
  void* base_;
  size_t length_;
  MemoryKind kind_;
  std::string descriptor_;
};

class LoopbackRemote final : public RemoteMemory {
 public:
  LoopbackRemote(uint64_t owner, PeerId peer, uint64_t region, size_t length)
      : owner_(owner), peer_(peer), region_(region), length_(length) {}
  PeerId peer() const override { return peer_; }
  size_t length() const override { return length_; }
  uint64_t owner() const { return owner_; }
  uint64_t region() const { return region_; }

 private:
  uint64_t owner_;  // the node that imported it
  PeerId peer_;
  uint64_t region_;
  size_t length_;
};

class LoopbackTransport final : public Transport {
 public:
  using Transport::PostWrite;
  LoopbackTransport(std::shared_ptr<State> state, uint64_t node)
      : state_(std::move(state)), node_id_(node) {}

  ~LoopbackTransport() override {
    absl::MutexLock lock(&state_->mu);
    // Peers that write to this node from now on find it gone and fail those transfers.
    state_->nodes.erase(node_id_);
  }

  absl::string_view name() const override { return "loopback"; }

  TransportCapabilities capabilities() const override {
    TransportCapabilities caps;
    caps.one_sided_write = true;
    caps.notifications = true;
    caps.host_memory = true;
    caps.device_memory = false;
    caps.inter_process = false;
    caps.inter_node = false;
    caps.delivered_at_completion = true;  // Progress copies, then completes
    return caps;
  }

  absl::StatusOr<std::string> LocalInfo() override {
    absl::MutexLock lock(&state_->mu);
    return absl::StrCat(kInfoPrefix, ":", kVersion, ":", node_id_, ":", Self().name);
  }

  absl::StatusOr<std::unique_ptr<MemoryRegistration>> RegisterMemory(void* base, size_t length,
                                                                     MemoryKind kind) override {
    if (base == nullptr || length == 0) {
      return absl::InvalidArgumentError("loopback RegisterMemory: null or empty range");
    }
    if (kind == MemoryKind::kDevice) {
      return absl::InvalidArgumentError("loopback RegisterMemory: device memory is not supported");
    }
    return Register(base, length, kind, nullptr);
  }

  // Plain aligned heap memory registered as usual: every loopback write is a memcpy anyway,
  // and a registration of a range inside it needs nothing from the allocation.
  absl::StatusOr<std::unique_ptr<MemoryRegistration>> AllocateMemory(size_t length,
                                                                      MemoryKind kind) override {
    if (length == 0) return absl::InvalidArgumentError("loopback AllocateMemory: zero length");
    if (kind != MemoryKind::kHost) {
      return absl::InvalidArgumentError(absl::StrCat("loopback AllocateMemory: cannot allocate ",
                                                     MemoryKindName(kind), " memory"));
    }
    AlignedBuffer memory(static_cast<char*>(
        ::operator new(length, std::align_val_t(kMinAllocationAlignment), std::nothrow)));
    if (memory == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("loopback AllocateMemory: cannot allocate ", length, " bytes"));
    }
    std::memset(memory.get(), 0, length);
    char* base = memory.get();
    return Register(base, length, kind, std::move(memory));
  }

  absl::StatusOr<PeerId> Accept(absl::string_view peer_info) override {
    absl::MutexLock lock(&state_->mu);
    ASSIGN_OR_RETURN(LoopbackNode * other, FindInfo(peer_info, "Accept"));
    LoopbackNode& self = Self();
    if (other == &self) {
      return absl::InvalidArgumentError("loopback Accept: the peer info is this transport's own");
    }
    self.refused.erase(other->id);
    return self.PeerIdFor(*other);
  }

  absl::StatusOr<PeerId> Connect(absl::string_view peer_info) override {
    absl::MutexLock lock(&state_->mu);
    ASSIGN_OR_RETURN(LoopbackNode * other, FindInfo(peer_info, "Connect"));
    const uint64_t node_id = other->id;
    LoopbackNode& self = Self();
    self.refused.erase(node_id);
    for (auto& [id, entry] : self.peers) {
      if (entry.node_id == node_id && entry.status.ok()) {
        entry.connected = true;
        return id;
      }
    }
    PeerId id = self.next_peer++;
    PeerEntry entry;
    entry.node_id = node_id;
    entry.name = other->name;
    entry.connected = true;
    if (other->failed) entry.status = PeerError(id, other->name, other->failure);
    self.peers.emplace(id, std::move(entry));
    return id;
  }

  absl::StatusOr<std::unique_ptr<RemoteMemory>> ImportRemote(
      PeerId peer, absl::string_view descriptor) override {
    std::vector<absl::string_view> parts = absl::StrSplit(descriptor, ':');
    uint64_t node_id = 0;
    uint64_t region = 0;
    uint64_t length = 0;
    if (parts.size() != 5 || parts[0] != kDescriptorPrefix || parts[1] != kVersion ||
        !absl::SimpleAtoi(parts[2], &node_id) || !absl::SimpleAtoi(parts[3], &region) ||
        !absl::SimpleAtoi(parts[4], &length) || length == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("loopback ImportRemote: malformed descriptor '", descriptor, "'"));
    }
    absl::MutexLock lock(&state_->mu);
    LoopbackNode& self = Self();
    ASSIGN_OR_RETURN(PeerEntry * entry, FindPeer(self, peer, "ImportRemote"));
    if (entry->node_id != node_id) {
      return absl::InvalidArgumentError(absl::StrCat(
          "loopback ImportRemote: the descriptor belongs to another transport than ",
          self.PeerName(peer)));
    }
    if (!entry->status.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("loopback ImportRemote: ", entry->status.message()));
    }
    // The fabric can check what a real transport cannot: that the region exists as described.
    LoopbackNode* other = state_->Find(node_id);
    auto region_it = other == nullptr ? decltype(other->regions)::iterator()
                                      : other->regions.find(region);
    if (other == nullptr || region_it == other->regions.end() ||
        region_it->second.length != length) {
      return absl::InvalidArgumentError(absl::StrCat(
          "loopback ImportRemote: ", self.PeerName(peer), " has no region ", region, " of ",
          length, " bytes"));
    }
    return std::unique_ptr<RemoteMemory>(new LoopbackRemote(node_id_, peer, region, length));
  }

  absl::StatusOr<TransferId> PostWrite(PeerId peer, const MemoryRegistration& local,
                                       const RemoteMemory& remote,
                                       absl::Span<const Segment> segments,
                                       absl::string_view notification,
                                       const WriteOrder& order) override {
    if (order.ready_event != nullptr || order.notification_tail != nullptr) {
      return absl::InvalidArgumentError(
          "loopback PostWrite: a ready event or notification tail was given, but this transport "
          "moves host memory only");
    }
    const auto* reg = dynamic_cast<const LoopbackRegistration*>(&local);
    const auto* rem = dynamic_cast<const LoopbackRemote*>(&remote);
    if (reg == nullptr || reg->node() != node_id_) {
      return absl::InvalidArgumentError(
          "loopback PostWrite: the local registration is not from this transport");
    }
    if (rem == nullptr || rem->owner() != node_id_ || rem->peer() != peer) {
      return absl::InvalidArgumentError(absl::StrCat(
          "loopback PostWrite: the remote memory was not imported from peer ", peer,
          " by this transport"));
    }
    // Every segment is checked before anything is posted: a bad batch posts nothing.
    RETURN_IF_ERROR(internal::CheckSegments("loopback", segments, reg->length(), rem->length()));
    LoopbackTransfer transfer;
    transfer.local_region = reg->region();
    transfer.remote_region = rem->region();
    transfer.segments.assign(segments.begin(), segments.end());
    transfer.notification = std::string(notification);
    return Enqueue(peer, std::move(transfer), "PostWrite");
  }

  absl::StatusOr<TransferId> PostNotification(PeerId peer, absl::string_view payload) override {
    if (payload.empty()) {
      return absl::InvalidArgumentError("loopback PostNotification: empty payload");
    }
    LoopbackTransfer transfer;
    transfer.notification = std::string(payload);
    return Enqueue(peer, std::move(transfer), "PostNotification");
  }

  absl::StatusOr<TransferState> Test(TransferId id) override {
    absl::MutexLock lock(&state_->mu);
    ASSIGN_OR_RETURN(LoopbackTransfer * t, FindTransfer(id));
    switch (t->phase) {
      case Phase::kQueued:
        return TransferState::kInProgress;
      case Phase::kDone:
        return TransferState::kDone;
      case Phase::kFailed:
        break;
    }
    return t->status;
  }

  absl::Status Cancel(TransferId id) override {
    absl::MutexLock lock(&state_->mu);
    ASSIGN_OR_RETURN(LoopbackTransfer * t, FindTransfer(id));
    if (t->phase == Phase::kQueued) {
      t->phase = Phase::kFailed;
      t->status = absl::CancelledError(absl::StrCat("loopback transfer ", id, " cancelled"));
    }
    return absl::OkStatus();
  }

  void Release(TransferId id) override {
    absl::MutexLock lock(&state_->mu);
    // A queued transfer is dropped from the queue lazily by Progress().
    Self().transfers.erase(id);
  }

  absl::Status Progress() override {
    std::vector<std::pair<PeerId, absl::Status>> errors;
    PeerErrorCallback callback;
    {
      absl::MutexLock lock(&state_->mu);
      LoopbackNode& self = Self();
      while (!self.queue.empty()) {
        TransferId id = self.queue.front();
        self.queue.pop_front();
        auto it = self.transfers.find(id);
        if (it == self.transfers.end() || it->second.phase != Phase::kQueued) continue;
        Execute(self, id, it->second);
      }
      errors.swap(self.peer_errors);
      if (!errors.empty()) callback = self.callback;
    }
    // Outside the lock: the callback may take its own locks.
    if (callback) {
      for (const auto& [peer, error] : errors) callback(peer, error);
    }
    return absl::OkStatus();
  }

  std::vector<Notification> PollNotifications() override {
    absl::MutexLock lock(&state_->mu);
    std::vector<Notification> out;
    out.swap(Self().inbox);
    return out;
  }

  absl::Status Disconnect(PeerId peer) override {
    absl::MutexLock lock(&state_->mu);
    LoopbackNode& self = Self();
    ASSIGN_OR_RETURN(PeerEntry * entry, FindPeer(self, peer, "Disconnect"));
    self.refused.insert(entry->node_id);
    for (auto& [id, transfer] : self.transfers) {
      if (transfer.peer == peer && transfer.phase == Phase::kQueued) {
        transfer.phase = Phase::kFailed;
        transfer.status = absl::CancelledError(
            absl::StrCat("loopback transfer ", id, " cancelled: disconnected from ",
                         self.PeerName(peer)));
      }
    }
    self.peers.erase(peer);
    return absl::OkStatus();
  }

  absl::Status PeerStatus(PeerId peer) override {
    absl::MutexLock lock(&state_->mu);
    ASSIGN_OR_RETURN(PeerEntry * entry, FindPeer(Self(), peer, "PeerStatus"));
    return entry->status;
  }

  void SetPeerErrorCallback(PeerErrorCallback callback) override {
    absl::MutexLock lock(&state_->mu);
    Self().callback = std::move(callback);
  }

  static absl::Status PeerError(PeerId peer, absl::string_view name, const absl::Status& error) {
    return absl::Status(error.code(), absl::StrCat("loopback peer '", name, "' (id ", peer,
                                                   ") failed: ", error.message()));
  }

 private:
  absl::StatusOr<std::unique_ptr<MemoryRegistration>> Register(void* base, size_t length,
                                                               MemoryKind kind,
                                                               AlignedBuffer owned) {
    absl::MutexLock lock(&state_->mu);
    LoopbackNode& self = Self();
    uint64_t region = self.next_region++;
    Region r;
    r.base = static_cast<char*>(base);
    r.length = length;
    self.regions.emplace(region, r);
    return std::unique_ptr<MemoryRegistration>(
        new LoopbackRegistration(state_, node_id_, region, base, length, kind, std::move(owned)));
  }

  LoopbackNode& Self() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
    // The node lives as long as this transport: only the destructor erases it.
    return *state_->Find(node_id_);
  }

  // The node whose LocalInfo() is `peer_info`: InvalidArgument when malformed, NotFound when
  // no such transport is on this fabric.
  absl::StatusOr<LoopbackNode*> FindInfo(absl::string_view peer_info, absl::string_view op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
    std::vector<absl::string_view> parts = absl::StrSplit(peer_info, absl::MaxSplits(':', 3));
    uint64_t node_id = 0;
    if (parts.size() != 4 || parts[0] != kInfoPrefix || !absl::SimpleAtoi(parts[2], &node_id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("loopback ", op, ": malformed peer info '", peer_info, "'"));
    }
    if (parts[1] != kVersion) {
      return absl::InvalidArgumentError(
          absl::StrCat("loopback ", op, ": unsupported peer info version ", parts[1]));
    }
    LoopbackNode* other = state_->Find(node_id);
    if (other == nullptr || other->name != parts[3]) {
      return absl::NotFoundError(
          absl::StrCat("loopback ", op, ": no transport '", parts[3], "' on this fabric"));
    }
    return other;
  }

  absl::StatusOr<PeerEntry*> FindPeer(LoopbackNode& self, PeerId peer, absl::string_view op) {
    auto it = self.peers.find(peer);
    if (it == self.peers.end()) {
      return absl::NotFoundError(absl::StrCat("loopback ", op, ": unknown peer ", peer));
    }
    return &it->second;
  }

  absl::StatusOr<LoopbackTransfer*> FindTransfer(TransferId id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
    auto& transfers = Self().transfers;
    auto it = transfers.find(id);
    if (it == transfers.end()) {
      return absl::NotFoundError(absl::StrCat("loopback: unknown transfer ", id));
    }
    return &it->second;
  }

  absl::StatusOr<TransferId> Enqueue(PeerId peer, LoopbackTransfer transfer,
                                     absl::string_view op) {
    absl::MutexLock lock(&state_->mu);
    LoopbackNode& self = Self();
    ASSIGN_OR_RETURN(PeerEntry * entry, FindPeer(self, peer, op));
    if (!entry->connected) {
      return absl::FailedPreconditionError(absl::StrCat(
          "loopback ", op, ": not connected to ", self.PeerName(peer), " (call Connect)"));
    }
    if (!entry->status.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("loopback ", op, ": ", entry->status.message()));
    }
    TransferId id = self.next_transfer++;
    transfer.peer = peer;
    self.transfers.emplace(id, std::move(transfer));
    self.queue.push_back(id);
    return id;
  }

  // Copies the transfer's bytes, then delivers its notification: the receiver can never see
  // the notification before the data, because both happen under the fabric lock in this
  // order.
  void Execute(LoopbackNode& self, TransferId id, LoopbackTransfer& t)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
    const PeerEntry& entry = self.peers.at(t.peer);
    LoopbackNode* dest = state_->Find(entry.node_id);
    if (dest == nullptr) {
      self.FailPeer(t.peer, absl::UnavailableError(
                                absl::StrCat(self.PeerName(t.peer), " is gone (destroyed)")));
      return;
    }
    if (dest->refused.count(self.id) != 0) {
      t.phase = Phase::kFailed;
      t.status = absl::FailedPreconditionError(
          absl::StrCat("loopback transfer ", id, " to ", self.PeerName(t.peer),
                       ": dropped by the receiver, which disconnected from this transport"));
      return;
    }
    if (!t.segments.empty()) {
      auto src = self.regions.find(t.local_region);
      auto dst = dest->regions.find(t.remote_region);
      if (src == self.regions.end() || dst == dest->regions.end()) {
        t.phase = Phase::kFailed;
        t.status = absl::FailedPreconditionError(absl::StrCat(
            "loopback transfer ", id, " to ", self.PeerName(t.peer), ": the ",
            src == self.regions.end() ? "local" : "remote",
            " region was deregistered before the write"));
        return;
      }
      for (const Segment& s : t.segments) {
        if (s.length == 0) continue;
        std::memmove(dst->second.base + s.remote_offset, src->second.base + s.local_offset,
                     s.length);
      }
    }
    if (!t.notification.empty()) {
      Notification n;
      n.peer = dest->PeerIdFor(self);
      n.payload = std::move(t.notification);
      dest->inbox.push_back(std::move(n));
    }
    t.phase = Phase::kDone;
  }

  std::shared_ptr<State> state_;
  uint64_t node_id_;
};

}  // namespace

LoopbackFabric::LoopbackFabric() : state_(std::make_shared<State>()) {}
LoopbackFabric::~LoopbackFabric() = default;

absl::StatusOr<std::unique_ptr<Transport>> LoopbackFabric::CreateTransport(
    const std::string& name) {
  if (name.empty()) {
    return absl::InvalidArgumentError("loopback CreateTransport: empty name");
  }
  absl::MutexLock lock(&state_->mu);
  if (state_->FindByName(name) != nullptr) {
    return absl::AlreadyExistsError(
        absl::StrCat("loopback CreateTransport: a transport named '", name, "' exists"));
  }
  auto node = std::make_unique<LoopbackNode>();
  node->id = state_->next_node++;
  node->name = name;
  uint64_t id = node->id;
  state_->nodes.emplace(id, std::move(node));
  return std::unique_ptr<Transport>(new LoopbackTransport(state_, id));
}

void LoopbackFabric::FailEndpoint(const std::string& name, const absl::Status& error) {
  absl::Status cause = error.ok() ? absl::UnavailableError("failed by FailEndpoint") : error;
  absl::MutexLock lock(&state_->mu);
  LoopbackNode* failed = state_->FindByName(name);
  if (failed == nullptr) return;
  failed->failed = true;
  failed->failure = cause;
  for (auto& [id, node] : state_->nodes) {
    for (auto& [peer, entry] : node->peers) {
      if (entry.node_id == failed->id) {
        node->FailPeer(peer, LoopbackTransport::PeerError(peer, name, cause));
      }
    }
  }
}

}  // namespace kvstream
