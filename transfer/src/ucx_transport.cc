// The UCX transport (see ucx_transport.h).
//
// Threading: the worker is created with UCS_THREAD_MODE_SERIALIZED and every UCX call this
// file makes (including those of the handle owners) runs with UcxCore::mu held, so UCX sees
// one thread at a time. UCX runs our callbacks (request completion, endpoint error, active
// message) only from inside calls we make - ucp_worker_progress, and ucp_ep_close_nbx for a
// forced close - so the callbacks run with mu held too and touch the core directly. The
// user's peer-error callback is different: it is queued and called by Progress() after mu
// is released.
//
// A transfer: every segment is posted with ucp_put_nbx (no callback; a returned request is
// freed at once, since the flush below covers it), then one ucp_ep_flush_nbx; when the flush
// completes - all puts are then complete at the target - the notification is sent as an
// eager active message whose header carries the sender's uid, so the receiver can name the
// sender even if it never connected back. The transfer is kDone when that send completes.
//
// Copy threads (UcxTransportOptions::copy_threads): where the remote key maps the peer's
// memory into this process (ucp_rkey_ptr: a shared-memory segment from the peer's
// AllocateMemory), PostWrite queues the segments on a CopyPool instead of putting them and
// the transfer starts in kCopying; the pool thread that copies its last byte takes mu and
// moves it on to the flush and the notification. A peer's transfers wait in `waiting`, in
// post order, until their copies are done and every earlier one has moved on, so that a
// notification still follows the data of every write posted before it (a put transfer or a
// notification posted behind a copying transfer waits there too). A transfer that fails or
// is cancelled while copying abandons its job, which returns once no piece of it is being
// copied; destroying a registration or remote memory fails the transfers still copying from
// or into it the same way, so no copy outlives the memory it touches.
//
// Memory: RegisterMemory maps caller-owned memory (ucp_mem_map); AllocateMemory has UCX
// allocate it (UCP_MEM_MAP_ALLOCATE), which over shared memory gives a sysv/posix segment the
// writer attaches through the remote key, so its puts are direct copies. The core remembers
// allocations by address so that RegisterMemory of a range inside one shares its memory
// handle and packed key (a fresh ucp_mem_map would get a key without the segment); the
// handle is shared (SharedMemHandle) and unmapped with its last registration.
//
// Lifetimes: transfers and peers live in maps owned by the core; UCX callbacks receive raw
// pointers to them. A transfer released while a UCX request still points at it moves to
// `zombies` until the request's callback; a disconnected peer is erased only once its
// endpoint has closed. The transport's destructor force-closes every endpoint and progresses
// until every request has called back (bounded), so no callback can outlive its target.
#include "kvstream/transfer/ucx_transport.h"

#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "copy_pool.h"
#include "kvstream/common/logging.h"
#include "kvstream/common/status_macros.h"
#include "ucx/ucx_handles.h"
#include "ucx/ucx_status.h"
#include "ucx/ucx_wire.h"

namespace kvstream {
namespace internal {
namespace {

// Active-message id of notifications (any id is fine: only kvstream uses this worker).
constexpr unsigned kNotificationAmId = 17;
// How long the destructor waits for UCX to return every outstanding request.
constexpr absl::Duration kShutdownTimeout = absl::Seconds(10);
// Bound on ucp_worker_progress calls per Progress(), so Progress never spins for long.
constexpr int kMaxProgressCalls = 64;

struct UcxCore;
struct UcxPeer;

// kCopying: in its peer's `waiting` queue (copies in flight, or an earlier transfer to the
// peer still waiting); kFlushing, kNotifying: a UCX request in flight.
enum class Phase { kCopying, kFlushing, kNotifying, kDone, kFailed };

struct UcxTransfer {
  UcxCore* core = nullptr;
  TransferId id = 0;
  UcxPeer* peer = nullptr;  // valid while the transfer is active
  Phase phase = Phase::kFlushing;
  absl::Status status;
  void* request = nullptr;  // the pending flush or active-message request, if any
  bool released = false;
  NotificationHeader header{};
  std::string payload;
  // Copy threads: the job copying the segments (null for a transfer with nothing to copy,
  // and once it has moved on); the handles it reads and writes through.
  std::shared_ptr<CopyJob> job;
  const void* local_handle = nullptr;
  const void* remote_handle = nullptr;

  bool active() const {
    return phase == Phase::kCopying || phase == Phase::kFlushing || phase == Phase::kNotifying;
  }
  // Whether bytes of its own remain to be copied.
  bool copying() const { return job != nullptr && !job->finished(); }
};

struct UcxPeer {
  UcxCore* core = nullptr;
  PeerId id = 0;
  uint64_t uid = 0;
  std::string label;  // "peer 3 (uid 0x...)" for messages
  UcxEndpoint ep;     // empty for a peer known only from its notifications, or once closing
  bool connected = false;
  bool disconnected = false;  // Disconnect() was called: erase once the close is done
  void* close_request = nullptr;
  absl::Status status;                // OK while healthy
  std::set<UcxTransfer*> outstanding;  // active transfers to this peer
  std::deque<UcxTransfer*> waiting;    // kCopying transfers, in post order
};

// A memory handle shared by the registration that allocated its memory and registrations of
// ranges inside it (the memory is unmapped, and for an allocation freed, with the last).
using SharedMemHandle = std::shared_ptr<UcxMemHandle>;

struct UcxAllocation {
  size_t length = 0;
  SharedMemHandle memh;
  std::string rkey;  // packed once; every registration inside the allocation sends it
};

struct UcxCore {
  absl::Mutex mu;
  // Declaration order is destruction order in reverse: peers and transfers go before the
  // worker, the worker before the context.
  UcxContext context;
  UcxWorker worker;
  uint64_t uid = 0;
  std::string local_info;
  bool network = false;  // the chosen transports can leave this host

  // Memory from AllocateMemory, by base address, so that RegisterMemory of a range inside
  // one reuses its memory handle (and so its shared-memory remote key).
  std::map<uintptr_t, UcxAllocation> allocations ABSL_GUARDED_BY(mu);
  std::map<PeerId, std::unique_ptr<UcxPeer>> peers ABSL_GUARDED_BY(mu);
  std::map<TransferId, std::unique_ptr<UcxTransfer>> transfers ABSL_GUARDED_BY(mu);
  std::map<UcxTransfer*, std::unique_ptr<UcxTransfer>> zombies ABSL_GUARDED_BY(mu);
  std::vector<Notification> inbox ABSL_GUARDED_BY(mu);
  std::vector<std::pair<PeerId, absl::Status>> peer_errors ABSL_GUARDED_BY(mu);
  PeerErrorCallback callback ABSL_GUARDED_BY(mu);
  PeerId next_peer ABSL_GUARDED_BY(mu) = 1;
  TransferId next_transfer ABSL_GUARDED_BY(mu) = 1;
  bool maintenance ABSL_GUARDED_BY(mu) = false;  // some peer needs closing or erasing
  bool shut_down ABSL_GUARDED_BY(mu) = false;

  ~UcxCore() {
    // Handles (registrations, remote keys) are gone by now: each holds a reference.
    allocations.clear();
    peers.clear();
    transfers.clear();
    zombies.clear();
  }

  UcxPeer* NewPeer(uint64_t peer_uid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto peer = std::make_unique<UcxPeer>();
    peer->core = this;
    peer->id = next_peer++;
    peer->uid = peer_uid;
    peer->label = absl::StrCat("peer ", peer->id, " (uid ", absl::Hex(peer_uid), ")");
    UcxPeer* raw = peer.get();
    peers.emplace(raw->id, std::move(peer));
    return raw;
  }

  // The peer under which notifications from `sender_uid` are reported: the connected one
  // if any, else one created for it.
  PeerId PeerIdForUid(uint64_t sender_uid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    UcxPeer* found = nullptr;
    for (auto& [id, peer] : peers) {
      if (peer->uid != sender_uid || peer->disconnected) continue;
      if (found == nullptr || (peer->connected && !found->connected)) found = peer.get();
    }
    if (found == nullptr) found = NewPeer(sender_uid);
    return found->id;
  }

  void FailTransfer(UcxTransfer* t, absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (!t->active()) return;
    UcxPeer* peer = t->peer;
    peer->outstanding.erase(t);
    const bool was_waiting = t->phase == Phase::kCopying;
    t->phase = Phase::kFailed;
    t->status = std::move(status);
    if (t->copying()) CopyPool::Abandon(*t->job);
    t->job.reset();
    if (was_waiting) {
      auto it = std::find(peer->waiting.begin(), peer->waiting.end(), t);
      if (it != peer->waiting.end()) peer->waiting.erase(it);
      Pump(peer);  // the transfers behind it may go on
    }
  }

  // Moves the peer's waiting transfers on to their flush, in post order, as far as their
  // copies are done.
  void Pump(UcxPeer* peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    while (!peer->waiting.empty() && peer->status.ok() && !peer->disconnected && peer->ep &&
           !shut_down) {
      UcxTransfer* t = peer->waiting.front();
      if (t->copying()) return;
      peer->waiting.pop_front();
      t->job.reset();
      absl::Status status = StartFlush(t);
      if (!status.ok()) FailTransfer(t, std::move(status));
    }
  }

  // A copy job's `done`: every byte of transfer `id` is in the peer's memory.
  void CopiesDone(TransferId id) ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    auto it = transfers.find(id);
    if (it == transfers.end() || it->second->phase != Phase::kCopying) return;
    Pump(it->second->peer);
  }

  // Fails the transfers still copying from or into `handle` (a registration or remote
  // memory being destroyed): when this returns, none of their pieces is being copied.
  void FailCopiesThrough(const void* handle, absl::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (auto& [id, t] : transfers) {
      if (t->phase != Phase::kCopying || !t->copying()) continue;
      if (t->local_handle != handle && t->remote_handle != handle) continue;
      FailTransfer(t.get(), absl::CancelledError(absl::StrCat(
                                "UCX transfer ", id, " to ", t->peer->label, " cancelled: ",
                                what, " was destroyed while the transfer was copying")));
    }
  }

  // Flushes the endpoint, then sends the notification (OnFlushed).
  absl::Status StartFlush(UcxTransfer* t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  void CompleteTransfer(UcxTransfer* t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    t->peer->outstanding.erase(t);
    t->phase = Phase::kDone;
  }

  // Marks the peer failed (first error wins), fails its outstanding transfers with the
  // error, and schedules the forced close UCX requires after an endpoint error.
  void FailPeer(UcxPeer* peer, const absl::Status& error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (!peer->status.ok()) return;
    peer->status = error;
    std::vector<UcxTransfer*> outstanding(peer->outstanding.begin(), peer->outstanding.end());
    for (UcxTransfer* t : outstanding) FailTransfer(t, error);
    // A peer the user already disconnected from is not news to report.
    if (!peer->disconnected) peer_errors.emplace_back(peer->id, error);
    maintenance = true;
  }

  // A UCX request finished: forget it, and delete the transfer if it was released.
  // Returns false when the transfer no longer exists.
  bool RequestDone(UcxTransfer* t, void* request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    ucp_request_free(request);
    t->request = nullptr;
    if (t->released) {
      zombies.erase(t);
      return false;
    }
    return true;
  }

  void SendNotification(UcxTransfer* t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
};

// --- UCX callbacks (run inside UCX calls made with UcxCore::mu held) ---

void OnAmSent(void* request, ucs_status_t status, void* user_data)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  auto* t = static_cast<UcxTransfer*>(user_data);
  UcxCore* core = t->core;
  if (!core->RequestDone(t, request) || t->phase != Phase::kNotifying) return;
  if (status == UCS_OK) {
    core->CompleteTransfer(t);
  } else {
    core->FailTransfer(t, UcxStatusToStatus(status, "am_send_nbx", t->peer->label));
  }
}

void OnFlushed(void* request, ucs_status_t status, void* user_data)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  auto* t = static_cast<UcxTransfer*>(user_data);
  UcxCore* core = t->core;
  if (!core->RequestDone(t, request) || t->phase != Phase::kFlushing) return;
  if (status == UCS_OK) {
    core->SendNotification(t);
  } else {
    core->FailTransfer(t, UcxStatusToStatus(status, "ep_flush_nbx", t->peer->label));
  }
}

void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  auto* peer = static_cast<UcxPeer*>(arg);
  peer->core->FailPeer(peer, UcxStatusToStatus(status, "endpoint error", peer->label));
}

ucs_status_t OnNotification(void* arg, const void* header, size_t header_length, void* data,
                            size_t length, const ucp_am_recv_param_t* param)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  auto* core = static_cast<UcxCore*>(arg);
  absl::StatusOr<uint64_t> sender = DecodeNotificationHeader(
      absl::string_view(static_cast<const char*>(header), header_length));
  if (!sender.ok()) {
    Log(LogLevel::kWarning, absl::StrCat("UCX: dropped a malformed notification: ",
                                         sender.status().message()));
    return UCS_OK;
  }
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    // Senders force eager; a rendezvous message is not from this version of kvstream.
    Log(LogLevel::kWarning, "UCX: dropped a rendezvous notification");
    return UCS_OK;
  }
  Notification n;
  n.peer = core->PeerIdForUid(*sender);
  n.payload.assign(static_cast<const char*>(data), length);
  core->inbox.push_back(std::move(n));
  return UCS_OK;
}

void UcxCore::SendNotification(UcxTransfer* t) {
  if (t->payload.empty()) {
    CompleteTransfer(t);
    return;
  }
  ucp_request_param_t param;
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_AM_SEND_FLAG_EAGER;
  param.cb.send = OnAmSent;
  param.user_data = t;
  ucs_status_ptr_t request =
      ucp_am_send_nbx(t->peer->ep.get(), kNotificationAmId, t->header.data(), t->header.size(),
                      t->payload.data(), t->payload.size(), &param);
  if (request == nullptr) {
    CompleteTransfer(t);
  } else if (UCS_PTR_IS_ERR(request)) {
    FailTransfer(t, UcxStatusToStatus(UCS_PTR_STATUS(request), "am_send_nbx", t->peer->label));
  } else {
    t->request = request;
    t->phase = Phase::kNotifying;
  }
}

absl::Status UcxCore::StartFlush(UcxTransfer* t) {
  t->phase = Phase::kFlushing;
  ucp_request_param_t param;
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = OnFlushed;
  param.user_data = t;
  ucs_status_ptr_t request = ucp_ep_flush_nbx(t->peer->ep.get(), &param);
  if (UCS_PTR_IS_ERR(request)) {
    return UcxStatusToStatus(UCS_PTR_STATUS(request), "ep_flush_nbx", t->peer->label);
  }
  if (request == nullptr) {
    SendNotification(t);  // the flush completed at once
  } else {
    t->request = request;
  }
  return absl::OkStatus();
}

// --- Handles ---

// A registration: of memory the caller owns, of memory AllocateMemory allocated (`allocated`:
// it owns the allocation's entry in UcxCore::allocations), or of a range inside the latter
// (sharing the allocation's memory handle).
class UcxRegistration final : public MemoryRegistration {
 public:
  UcxRegistration(std::shared_ptr<UcxCore> core, SharedMemHandle memh, void* base,
                  size_t length, MemoryKind kind, std::string descriptor, bool allocated)
      : core_(std::move(core)), memh_(std::move(memh)), base_(base), length_(length),
        kind_(kind), descriptor_(std::move(descriptor)), allocated_(allocated) {}
  ~UcxRegistration() override {
    absl::MutexLock lock(&core_->mu);
    core_->FailCopiesThrough(this, "its local registration");
    if (allocated_) core_->allocations.erase(reinterpret_cast<uintptr_t>(base_));
    memh_.reset();  // unmaps (and frees an allocation) if this was the last user
  }

  void* base() const override { return base_; }
  size_t length() const override { return length_; }
  MemoryKind memory_kind() const override { return kind_; }
  const std::string& descriptor() const override { return descriptor_; }
  const UcxCore* core() const { return core_.get(); }
  ucp_mem_h memh() const { return memh_->get(); }

 private:
  std::shared_ptr<UcxCore> core_;
  SharedMemHandle memh_;
  void* base_;
  size_t length_;
  MemoryKind kind_;
  std::string descriptor_;
  bool allocated_;
};

class UcxRemote final : public RemoteMemory {
 public:
  // `mapped`: where the region's first byte is mapped into this process, or null.
  UcxRemote(std::shared_ptr<UcxCore> core, PeerId peer, uint64_t address, uint64_t length,
            UcxRkey rkey, char* mapped)
      : core_(std::move(core)), peer_(peer), address_(address), length_(length),
        rkey_(std::move(rkey)), mapped_(mapped) {}
  ~UcxRemote() override {
    absl::MutexLock lock(&core_->mu);
    core_->FailCopiesThrough(this, "its remote memory");
    rkey_.Reset();  // unmaps a mapped segment
  }

  PeerId peer() const override { return peer_; }
  size_t length() const override { return length_; }
  const UcxCore* core() const { return core_.get(); }
  uint64_t address() const { return address_; }
  ucp_rkey_h rkey() const { return rkey_.get(); }
  char* mapped() const { return mapped_; }

 private:
  std::shared_ptr<UcxCore> core_;
  PeerId peer_;
  uint64_t address_;
  uint64_t length_;
  UcxRkey rkey_;
  char* mapped_;
};

bool SegmentFits(uint64_t offset, uint64_t length, uint64_t region_length) {
  return length <= region_length && offset <= region_length - length;
}

// --- The transport ---

class UcxTransport final : public Transport {
 public:
  using Transport::PostWrite;
  UcxTransport(std::shared_ptr<UcxCore> core, std::unique_ptr<CopyPool> pool)
      : core_(std::move(core)), pool_(std::move(pool)) {}
  ~UcxTransport() override {
    // The copy threads first: once joined, no copy is running and no job calls back.
    pool_.reset();
    Shutdown();
  }

  absl::string_view name() const override { return "ucx"; }

  TransportCapabilities capabilities() const override {
    TransportCapabilities caps;
    caps.one_sided_write = true;
    caps.notifications = true;
    caps.host_memory = true;
    caps.device_memory = false;  // Debian's UCX has no CUDA transports
    caps.inter_process = true;
    caps.inter_node = core_->network;
    return caps;
  }

  absl::StatusOr<std::string> LocalInfo() override { return core_->local_info; }

  absl::StatusOr<std::unique_ptr<MemoryRegistration>> RegisterMemory(void* base, size_t length,
                                                                     MemoryKind kind) override {
    if (base == nullptr || length == 0) {
      return absl::InvalidArgumentError("UCX RegisterMemory: null or empty range");
    }
    if (kind == MemoryKind::kDevice) {
      return absl::InvalidArgumentError(
          "UCX RegisterMemory: device memory is not supported (this UCX has no CUDA transports)");
    }
    absl::MutexLock lock(&core_->mu);
    // Inside an allocation: a fresh ucp_mem_map of it would give a key without the
    // shared-memory part (UCX's shared-memory domains cannot register memory, only allocate
    // it), and puts would fall back to active-message emulation.
    const uintptr_t address = reinterpret_cast<uintptr_t>(base);
    auto it = core_->allocations.upper_bound(address);
    if (it != core_->allocations.begin()) {
      --it;
      const uintptr_t offset = address - it->first;
      if (offset < it->second.length && length <= it->second.length - offset) {
        return std::unique_ptr<MemoryRegistration>(
            new UcxRegistration(core_, it->second.memh, base, length, kind,
                                Descriptor(address, length, it->second.rkey),
                                /*allocated=*/false));
      }
    }
    ucp_mem_map_params_t params;
    params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    params.address = base;
    params.length = length;
    ucp_mem_h raw_memh = nullptr;
    RETURN_IF_ERROR(
        UcxStatusToStatus(ucp_mem_map(core_->context.get(), &params, &raw_memh), "mem_map"));
    auto memh = std::make_shared<UcxMemHandle>(core_->context.get(), raw_memh);
    ASSIGN_OR_RETURN(std::string rkey, PackRkey(memh->get()));
    return std::unique_ptr<MemoryRegistration>(
        new UcxRegistration(core_, std::move(memh), base, length, kind,
                            Descriptor(address, length, rkey), /*allocated=*/false));
  }

  absl::StatusOr<std::unique_ptr<MemoryRegistration>> AllocateMemory(size_t length,
                                                                      MemoryKind kind) override {
    if (length == 0) return absl::InvalidArgumentError("UCX AllocateMemory: zero length");
    if (kind != MemoryKind::kHost) {
      return absl::InvalidArgumentError(absl::StrCat("UCX AllocateMemory: cannot allocate ",
                                                     MemoryKindName(kind), " memory"));
    }
    SharedMemHandle memh;
    void* base = nullptr;
    std::string rkey;
    {
      absl::MutexLock lock(&core_->mu);
      // UCX picks the allocator by UCX_ALLOC_PRIO (by default its sysv, then posix
      // shared-memory domains where those transports are enabled, else anonymous mmap), and
      // registers the memory with every other memory domain.
      ucp_mem_map_params_t params;
      params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                          UCP_MEM_MAP_PARAM_FIELD_FLAGS;
      params.address = nullptr;
      params.length = length;
      params.flags = UCP_MEM_MAP_ALLOCATE;
      ucp_mem_h raw_memh = nullptr;
      RETURN_IF_ERROR(UcxStatusToStatus(ucp_mem_map(core_->context.get(), &params, &raw_memh),
                                        absl::StrCat("mem_map (allocate ", length, " bytes)")));
      // Declared after the lock: released under it if anything below fails.
      auto allocated = std::make_shared<UcxMemHandle>(core_->context.get(), raw_memh);
      ucp_mem_attr_t attr;
      attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
      RETURN_IF_ERROR(UcxStatusToStatus(ucp_mem_query(raw_memh, &attr), "mem_query"));
      if (attr.address == nullptr || attr.length < length ||
          reinterpret_cast<uintptr_t>(attr.address) % kMinAllocationAlignment != 0) {
        return absl::InternalError(absl::StrCat(
            "UCX AllocateMemory: UCX returned ", attr.length, " bytes at ",
            absl::Hex(reinterpret_cast<uintptr_t>(attr.address)),
            " for ", length, " bytes aligned to ", kMinAllocationAlignment));
      }
      base = attr.address;
      ASSIGN_OR_RETURN(rkey, PackRkey(raw_memh));
      memh = std::move(allocated);
    }
    // Not every UCX allocator zero-fills (heap does not). Nobody else can reach the memory
    // before it is returned, so this needs no lock; it also faults the pages in now rather
    // than during the first transfers.
    std::memset(base, 0, length);
    const uintptr_t address = reinterpret_cast<uintptr_t>(base);
    std::string descriptor = Descriptor(address, length, rkey);
    absl::MutexLock lock(&core_->mu);
    UcxAllocation allocation;
    allocation.length = length;
    allocation.memh = memh;
    allocation.rkey = std::move(rkey);
    core_->allocations[address] = std::move(allocation);
    return std::unique_ptr<MemoryRegistration>(new UcxRegistration(
        core_, std::move(memh), base, length, kind, std::move(descriptor), /*allocated=*/true));
  }

  absl::StatusOr<PeerId> Connect(absl::string_view peer_info) override {
    ASSIGN_OR_RETURN(UcxWorkerInfo info, DecodeWorkerInfo(peer_info));
    absl::MutexLock lock(&core_->mu);
    RETURN_IF_ERROR(CheckNotShutDown("Connect"));
    UcxPeer* peer = nullptr;
    for (auto& [id, p] : core_->peers) {
      if (p->uid != info.uid || p->disconnected || !p->status.ok()) continue;
      if (p->connected) return id;  // already connected: one endpoint per peer transport
      peer = p.get();               // known from its notifications: give it an endpoint
    }
    const bool fresh = peer == nullptr;
    if (fresh) peer = core_->NewPeer(info.uid);
    ucp_ep_params_t params;
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = reinterpret_cast<const ucp_address_t*>(info.address.data());
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = OnEndpointError;
    params.err_handler.arg = peer;
    ucp_ep_h ep = nullptr;
    absl::Status status =
        UcxStatusToStatus(ucp_ep_create(core_->worker.get(), &params, &ep), "ep_create",
                          peer->label);
    if (!status.ok()) {
      if (fresh) core_->peers.erase(peer->id);
      return status;
    }
    peer->ep = UcxEndpoint(core_->worker.get(), ep);
    peer->connected = true;
    return peer->id;
  }

  absl::StatusOr<std::unique_ptr<RemoteMemory>> ImportRemote(
      PeerId peer_id, absl::string_view descriptor) override {
    ASSIGN_OR_RETURN(UcxMemoryDescriptor d, DecodeMemoryDescriptor(descriptor));
    absl::MutexLock lock(&core_->mu);
    ASSIGN_OR_RETURN(UcxPeer * peer, UsablePeer(peer_id, "ImportRemote"));
    ucp_rkey_h raw_rkey = nullptr;
    absl::Status status = UcxStatusToStatus(
        ucp_ep_rkey_unpack(peer->ep.get(), d.rkey.data(), &raw_rkey), "ep_rkey_unpack",
        peer->label);
    if (!status.ok()) {
      // The bytes passed the checksum, so this is a descriptor UCX cannot use here (for
      // example from a transport with other memory domains): still the caller's input.
      return absl::InvalidArgumentError(status.message());
    }
    // With copy threads, writes go straight into the region where the key maps it here.
    void* mapped = nullptr;
    if (pool_ != nullptr && ucp_rkey_ptr(raw_rkey, d.address, &mapped) != UCS_OK) {
      mapped = nullptr;
    }
    return std::unique_ptr<RemoteMemory>(new UcxRemote(core_, peer_id, d.address, d.length,
                                                       UcxRkey(NoOwner{}, raw_rkey),
                                                       static_cast<char*>(mapped)));
  }

  absl::StatusOr<TransferId> PostWrite(PeerId peer_id, const MemoryRegistration& local,
                                       const RemoteMemory& remote,
                                       absl::Span<const Segment> segments,
                                       absl::string_view notification,
                                       const WriteOrder& order) override {
    if (order.ready_event != nullptr || order.notification_tail != nullptr) {
      return absl::InvalidArgumentError(
          "UCX PostWrite: a ready event or notification tail was given, but this transport "
          "moves host memory only");
    }
    const auto* reg = dynamic_cast<const UcxRegistration*>(&local);
    const auto* rem = dynamic_cast<const UcxRemote*>(&remote);
    if (reg == nullptr || reg->core() != core_.get()) {
      return absl::InvalidArgumentError(
          "UCX PostWrite: the local registration is not from this transport");
    }
    if (rem == nullptr || rem->core() != core_.get() || rem->peer() != peer_id) {
      return absl::InvalidArgumentError(absl::StrCat(
          "UCX PostWrite: the remote memory was not imported from peer ", peer_id,
          " by this transport"));
    }
    // Every segment is checked before the first put: a bad batch posts nothing.
    for (size_t i = 0; i < segments.size(); ++i) {
      const Segment& s = segments[i];
      if (!SegmentFits(s.local_offset, s.length, reg->length()) ||
          !SegmentFits(s.remote_offset, s.length, rem->length())) {
        return absl::OutOfRangeError(absl::StrCat(
            "UCX PostWrite: segment ", i, " (local ", s.local_offset, ", remote ",
            s.remote_offset, ", length ", s.length, ") is outside the local region (",
            reg->length(), " bytes) or the remote one (", rem->length(), " bytes)"));
      }
    }
    absl::MutexLock lock(&core_->mu);
    ASSIGN_OR_RETURN(UcxPeer * peer, UsablePeer(peer_id, "PostWrite"));
    if (pool_ != nullptr && rem->mapped() != nullptr) {
      return PostCopies(peer, *reg, *rem, segments, notification);
    }
    ucp_ep_h ep = peer->ep.get();
    // No callback: a put's completion is observed through the flush that follows. The
    // memory handle spares UCX a registration-cache lookup per segment.
    ucp_request_param_t put_param;
    put_param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
    put_param.memh = reg->memh();
    char* local_base = static_cast<char*>(reg->base());
    const uint64_t remote_base = rem->address();
    ucp_rkey_h rkey = rem->rkey();
    for (const Segment& s : segments) {
      if (s.length == 0) continue;
      ucs_status_ptr_t request = ucp_put_nbx(ep, local_base + s.local_offset, s.length,
                                             remote_base + s.remote_offset, rkey, &put_param);
      if (UCS_PTR_IS_PTR(request)) {
        ucp_request_free(request);
      } else if (UCS_PTR_IS_ERR(request)) {
        // Earlier puts of this batch may land; nothing will report them.
        return UcxStatusToStatus(UCS_PTR_STATUS(request), "put_nbx", peer->label);
      }
    }
    return StartFlushAndNotify(peer, notification);
  }

  absl::StatusOr<TransferId> PostNotification(PeerId peer_id,
                                              absl::string_view payload) override {
    if (payload.empty()) {
      return absl::InvalidArgumentError("UCX PostNotification: empty payload");
    }
    absl::MutexLock lock(&core_->mu);
    ASSIGN_OR_RETURN(UcxPeer * peer, UsablePeer(peer_id, "PostNotification"));
    // Flushed too, so a notification alone is still ordered after earlier writes to the peer.
    return StartFlushAndNotify(peer, payload);
  }

  absl::StatusOr<TransferState> Test(TransferId id) override {
    absl::MutexLock lock(&core_->mu);
    ASSIGN_OR_RETURN(UcxTransfer * t, FindTransfer(id));
    switch (t->phase) {
      case Phase::kCopying:
      case Phase::kFlushing:
      case Phase::kNotifying:
        return TransferState::kInProgress;
      case Phase::kDone:
        return TransferState::kDone;
      case Phase::kFailed:
        break;
    }
    return t->status;
  }

  absl::Status Cancel(TransferId id) override {
    absl::MutexLock lock(&core_->mu);
    ASSIGN_OR_RETURN(UcxTransfer * t, FindTransfer(id));
    // Once the flush completed the data is in place and the notification is handed to UCX,
    // which cannot take it back: the transfer has in effect finished and completes kDone.
    if (t->phase == Phase::kCopying || t->phase == Phase::kFlushing) {
      core_->FailTransfer(t, absl::CancelledError(absl::StrCat("UCX transfer ", id, " to ",
                                                               t->peer->label, " cancelled")));
    }
    return absl::OkStatus();
  }

  void Release(TransferId id) override {
    absl::MutexLock lock(&core_->mu);
    auto it = core_->transfers.find(id);
    if (it == core_->transfers.end()) return;
    std::unique_ptr<UcxTransfer> t = std::move(it->second);
    core_->transfers.erase(it);
    core_->FailTransfer(t.get(), absl::CancelledError(absl::StrCat("UCX transfer ", id,
                                                                   " released")));
    if (t->request != nullptr) {
      // UCX still holds a pointer to it: its callback deletes it.
      t->released = true;
      UcxTransfer* raw = t.get();
      core_->zombies.emplace(raw, std::move(t));
    }
  }

  absl::Status Progress() override {
    std::vector<std::pair<PeerId, absl::Status>> errors;
    PeerErrorCallback callback;
    {
      absl::MutexLock lock(&core_->mu);
      for (int i = 0; i < kMaxProgressCalls && ucp_worker_progress(core_->worker.get()) != 0;
           ++i) {
      }
      if (core_->maintenance) Maintain();
      if (!core_->peer_errors.empty()) {
        errors.swap(core_->peer_errors);
        callback = core_->callback;
      }
    }
    // Outside the lock: the callback may take its own locks (it must not call us).
    if (callback) {
      for (const auto& [peer, error] : errors) callback(peer, error);
    }
    return absl::OkStatus();
  }

  std::vector<Notification> PollNotifications() override {
    absl::MutexLock lock(&core_->mu);
    std::vector<Notification> out;
    out.swap(core_->inbox);
    return out;
  }

  absl::Status Disconnect(PeerId peer_id) override {
    absl::MutexLock lock(&core_->mu);
    auto it = core_->peers.find(peer_id);
    if (it == core_->peers.end() || it->second->disconnected) {
      return absl::NotFoundError(absl::StrCat("UCX Disconnect: unknown peer ", peer_id));
    }
    UcxPeer* peer = it->second.get();
    std::vector<UcxTransfer*> outstanding(peer->outstanding.begin(), peer->outstanding.end());
    for (UcxTransfer* t : outstanding) {
      core_->FailTransfer(t, absl::CancelledError(absl::StrCat(
                                 "UCX transfer ", t->id, " cancelled: disconnected from ",
                                 peer->label)));
    }
    peer->disconnected = true;
    // A healthy endpoint is closed gracefully (its pending operations flushed); a failed
    // one must be forced. Either way Progress() finishes the close and erases the peer.
    if (peer->ep) peer->close_request = peer->ep.StartClose(/*force=*/!peer->status.ok());
    core_->maintenance = true;
    Maintain();
    return absl::OkStatus();
  }

  absl::Status PeerStatus(PeerId peer_id) override {
    absl::MutexLock lock(&core_->mu);
    auto it = core_->peers.find(peer_id);
    if (it == core_->peers.end() || it->second->disconnected) {
      return absl::NotFoundError(absl::StrCat("UCX PeerStatus: unknown peer ", peer_id));
    }
    return it->second->status;
  }

  void SetPeerErrorCallback(PeerErrorCallback callback) override {
    absl::MutexLock lock(&core_->mu);
    core_->callback = std::move(callback);
  }

 private:
  absl::Status CheckNotShutDown(absl::string_view op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu) {
    if (core_->shut_down) {
      return absl::FailedPreconditionError(absl::StrCat("UCX ", op, ": transport shut down"));
    }
    return absl::OkStatus();
  }

  // The peer, if it can take new work: NotFound for an unknown or disconnected one,
  // FailedPrecondition for a failed one or one we never connected to.
  absl::StatusOr<UcxPeer*> UsablePeer(PeerId peer_id, absl::string_view op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu) {
    RETURN_IF_ERROR(CheckNotShutDown(op));
    auto it = core_->peers.find(peer_id);
    if (it == core_->peers.end() || it->second->disconnected) {
      return absl::NotFoundError(absl::StrCat("UCX ", op, ": unknown peer ", peer_id));
    }
    UcxPeer* peer = it->second.get();
    if (!peer->status.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("UCX ", op, ": ", peer->label,
                                                        " has failed: ", peer->status.message()));
    }
    if (!peer->ep) {
      return absl::FailedPreconditionError(
          absl::StrCat("UCX ", op, ": not connected to ", peer->label, " (call Connect)"));
    }
    return peer;
  }

  absl::StatusOr<std::string> PackRkey(ucp_mem_h memh) ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu) {
    void* buffer = nullptr;
    size_t size = 0;
    RETURN_IF_ERROR(
        UcxStatusToStatus(ucp_rkey_pack(core_->context.get(), memh, &buffer, &size), "rkey_pack"));
    std::string rkey(static_cast<const char*>(buffer), size);
    ucp_rkey_buffer_release(buffer);
    return rkey;
  }

  static std::string Descriptor(uintptr_t address, size_t length, const std::string& rkey) {
    UcxMemoryDescriptor descriptor;
    descriptor.address = address;
    descriptor.length = length;
    descriptor.rkey = rkey;
    return EncodeMemoryDescriptor(descriptor);
  }

  absl::StatusOr<UcxTransfer*> FindTransfer(TransferId id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu) {
    auto it = core_->transfers.find(id);
    if (it == core_->transfers.end()) {
      return absl::NotFoundError(absl::StrCat("UCX: unknown transfer ", id));
    }
    return it->second.get();
  }

  // A new active transfer to `peer`, known to the core and the peer.
  UcxTransfer* NewTransfer(UcxPeer* peer, absl::string_view notification)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu) {
    auto owned = std::make_unique<UcxTransfer>();
    UcxTransfer* t = owned.get();
    t->core = core_.get();
    t->id = core_->next_transfer++;
    t->peer = peer;
    t->payload.assign(notification.data(), notification.size());
    if (!t->payload.empty()) t->header = EncodeNotificationHeader(core_->uid);
    core_->transfers.emplace(t->id, std::move(owned));
    peer->outstanding.insert(t);
    return t;
  }

  // The flush and notification of what was posted so far: at once, or, behind transfers
  // still waiting for their copies, in turn.
  absl::StatusOr<TransferId> StartFlushAndNotify(UcxPeer* peer, absl::string_view notification)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu) {
    UcxTransfer* t = NewTransfer(peer, notification);
    const TransferId id = t->id;
    if (!peer->waiting.empty()) {
      t->phase = Phase::kCopying;  // nothing of its own to copy: no job
      peer->waiting.push_back(t);
      return id;
    }
    absl::Status status = core_->StartFlush(t);
    if (!status.ok()) {
      peer->outstanding.erase(t);
      core_->transfers.erase(id);
      return status;
    }
    return id;
  }

  // PostWrite through the copy threads: the segments are copied into the peer's mapped
  // region by the pool, then the transfer flushes and notifies in its turn (Pump).
  absl::StatusOr<TransferId> PostCopies(UcxPeer* peer, const UcxRegistration& local,
                                        const UcxRemote& remote,
                                        absl::Span<const Segment> segments,
                                        absl::string_view notification)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu) {
    std::vector<CopyPiece> pieces;
    pieces.reserve(segments.size());
    const char* local_base = static_cast<const char*>(local.base());
    for (const Segment& s : segments) {
      if (s.length == 0) continue;
      CopyPiece piece;
      piece.src = local_base + s.local_offset;
      piece.dst = remote.mapped() + s.remote_offset;
      piece.length = s.length;
      pieces.push_back(piece);
    }
    UcxTransfer* t = NewTransfer(peer, notification);
    t->phase = Phase::kCopying;
    t->local_handle = &local;
    t->remote_handle = &remote;
    peer->waiting.push_back(t);
    // `done` takes mu, which this thread holds until PostWrite returns: it cannot run
    // before t->job is set.
    t->job = pool_->Submit(pieces, [core = core_.get(), id = t->id] { core->CopiesDone(id); });
    return t->id;
  }

  // Closes endpoints of failed peers, finishes closes, and erases disconnected peers whose
  // endpoint has closed.
  void Maintain() ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu) {
    bool again = false;
    for (auto it = core_->peers.begin(); it != core_->peers.end();) {
      UcxPeer* peer = it->second.get();
      if (!peer->status.ok() && peer->ep) peer->close_request = peer->ep.StartClose(true);
      if (peer->close_request != nullptr &&
          ucp_request_check_status(peer->close_request) != UCS_INPROGRESS) {
        ucp_request_free(peer->close_request);
        peer->close_request = nullptr;
      }
      if (peer->disconnected && peer->close_request == nullptr && peer->outstanding.empty()) {
        it = core_->peers.erase(it);
        continue;
      }
      again = again || peer->close_request != nullptr;
      ++it;
    }
    core_->maintenance = again;
  }

  // Fails every transfer, force-closes every endpoint and waits (bounded) until UCX has
  // returned every request, so that no callback can run on freed memory later.
  void Shutdown() {
    absl::MutexLock lock(&core_->mu);
    core_->shut_down = true;
    for (auto& [id, t] : core_->transfers) {
      core_->FailTransfer(t.get(), absl::CancelledError("UCX transport destroyed"));
    }
    for (auto& [id, peer] : core_->peers) {
      if (peer->ep) {
        void* request = peer->ep.StartClose(/*force=*/true);
        if (request != nullptr) {
          if (peer->close_request != nullptr) ucp_request_free(peer->close_request);
          peer->close_request = request;
        }
      }
    }
    const absl::Time deadline = absl::Now() + kShutdownTimeout;
    while (true) {
      bool pending = !core_->zombies.empty();
      for (auto& [id, t] : core_->transfers) pending = pending || t->request != nullptr;
      for (auto& [id, peer] : core_->peers) {
        if (peer->close_request != nullptr &&
            ucp_request_check_status(peer->close_request) != UCS_INPROGRESS) {
          ucp_request_free(peer->close_request);
          peer->close_request = nullptr;
        }
        pending = pending || peer->close_request != nullptr;
      }
      if (!pending) break;
      if (absl::Now() >= deadline) {
        // Leak what UCX may still call back into rather than free it under UCX's feet.
        Log(LogLevel::kError, "UCX transport destroyed with requests UCX did not return");
        for (auto& [id, t] : core_->transfers) {
          if (t->request != nullptr) (void)t.release();
        }
        for (auto& [raw, t] : core_->zombies) (void)t.release();
        for (auto& [id, peer] : core_->peers) {
          if (peer->close_request != nullptr) (void)peer.release();
        }
        break;
      }
      ucp_worker_progress(core_->worker.get());
    }
    core_->transfers.clear();
    core_->zombies.clear();
    core_->peers.clear();
    core_->inbox.clear();
  }

  std::shared_ptr<UcxCore> core_;
  std::unique_ptr<CopyPool> pool_;  // copy threads, if any (UcxTransportOptions::copy_threads)
};

// UCX_TLS for the options' tls.
std::string TlsFor(const std::string& tls) {
  if (tls == "shm") return "sm,self";
  if (tls == "tcp") return "tcp,self";
  return tls;
}

// Whether UCX_TLS allows a transport that reaches other hosts (anything but shared memory
// and self).
bool AllowsNetwork(const std::string& tls) {
  for (absl::string_view name : absl::StrSplit(tls, ',')) {
    if (!name.empty() && name[0] == '^') return true;  // "all but ...": networks included
    if (name != "sm" && name != "shm" && name != "posix" && name != "sysv" && name != "cma" &&
        name != "knem" && name != "xpmem" && name != "self") {
      return true;
    }
  }
  return false;
}

// Whether UCX_TLS may select UCX's posix/sysv shared-memory transports (to avoid UCX's
// warning about a setting no selected transport uses).
bool MayUseSharedMemory(const std::string& tls) {
  for (absl::string_view name : absl::StrSplit(tls, ',')) {
    if (name == "sm" || name == "shm" || name == "posix" || name == "sysv" || name == "all" ||
        (!name.empty() && name[0] == '^')) {
      return true;
    }
  }
  return false;
}

uint64_t NewUid() {
  std::random_device device;
  uint64_t uid = (static_cast<uint64_t>(device()) << 32) ^ device();
  uid ^= static_cast<uint64_t>(getpid()) << 16;
  uid ^= static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
  return uid == 0 ? 1 : uid;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransportImpl(
    const UcxTransportOptions& options) {
  if (options.tls.empty()) {
    return absl::InvalidArgumentError("UCX transport: empty tls");
  }
  if (options.copy_threads < 0 || options.copy_threads > kMaxCopyThreads) {
    return absl::InvalidArgumentError(absl::StrCat("UCX transport: copy_threads ",
                                                   options.copy_threads, " is outside 0..",
                                                   kMaxCopyThreads));
  }
  ucp_config_t* raw_config = nullptr;
  RETURN_IF_ERROR(UcxStatusToStatus(ucp_config_read(nullptr, nullptr, &raw_config),
                                    "config_read"));
  UcxConfig config(NoOwner{}, raw_config);
  const std::string tls = TlsFor(options.tls);
  auto set = [&](const char* name, const std::string& value) {
    return UcxStatusToStatus(ucp_config_modify(config.get(), name, value.c_str()),
                             absl::StrCat("config_modify ", name, "=", value));
  };
  RETURN_IF_ERROR(set("TLS", tls));
  if (!options.net_devices.empty()) RETURN_IF_ERROR(set("NET_DEVICES", options.net_devices));
  // Keepalive probes are how a peer that died without closing its sockets, or whose
  // shared-memory segment just stops being read, is detected.
  const int64_t keepalive_ms = absl::ToInt64Milliseconds(options.keepalive_interval);
  if (keepalive_ms > 0) {
    RETURN_IF_ERROR(set("KEEPALIVE_INTERVAL", absl::StrCat(keepalive_ms, "ms")));
  }
  // Error mode PEER excludes transports without peer-failure support, and UCX's
  // shared-memory transports (posix, sysv) only advertise it when asked to; without them no
  // shared-memory transport carries active messages. The key is the field's name within the
  // transports' common "MM_" table (the environment spells it UCX_POSIX_ERROR_HANDLING).
  // UCX's adaptive progress leaves out of the worker's progress every interface that no local
  // endpoint uses, and arms it for events instead. A receiver never connects back over the
  // interface its peers write to (notifications arrive on the shared-memory FIFO), so with
  // it every notification found the receiver's interface armed and the sender paid a
  // sendto() to wake the receiver's async thread: about 10 us per transfer inside
  // ucp_am_send_nbx, half the time of a 1 MiB layer (docs/benchmarks-transfer.md, Run F).
  // Progressing every interface costs a few polls per Progress() with the few this
  // transport opens.
  RETURN_IF_ERROR(set("ADAPTIVE_PROGRESS", "n"));
  if (MayUseSharedMemory(tls)) {
    RETURN_IF_ERROR(set("MM_ERROR_HANDLING", "y"));
    // Puts into ordinary memory travel as active-message fragments of at most one FIFO
    // segment; 64 KiB segments (UCX's default is 8 KiB) carry a typical KV block in one
    // fragment and doubled the bandwidth of 16-64 MiB layers here (docs/benchmarks.md).
    // The cost is shared memory: FIFO_SIZE (64) segments per worker, 4 MiB.
    RETURN_IF_ERROR(set("MM_SEG_SIZE", "64k"));
  }
  for (const auto& [name, value] : options.ucx_config) RETURN_IF_ERROR(set(name.c_str(), value));

  auto core = std::make_shared<UcxCore>();
  ucp_params_t params;
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM;
  params.mt_workers_shared = 0;
  ucp_context_h context = nullptr;
  RETURN_IF_ERROR(UcxStatusToStatus(ucp_init(&params, config.get(), &context),
                                    absl::StrCat("init (UCX_TLS=", tls, ")")));
  core->context = UcxContext(NoOwner{}, context);

  ucp_worker_params_t worker_params;
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  ucp_worker_h worker = nullptr;
  RETURN_IF_ERROR(UcxStatusToStatus(ucp_worker_create(context, &worker_params, &worker),
                                    "worker_create"));
  core->worker = UcxWorker(NoOwner{}, worker);

  ucp_am_handler_param_t am;
  am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                  UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  am.id = kNotificationAmId;
  am.flags = UCP_AM_FLAG_WHOLE_MSG;
  am.cb = OnNotification;
  am.arg = core.get();
  RETURN_IF_ERROR(
      UcxStatusToStatus(ucp_worker_set_am_recv_handler(worker, &am), "set_am_recv_handler"));

  ucp_address_t* address = nullptr;
  size_t address_length = 0;
  RETURN_IF_ERROR(UcxStatusToStatus(ucp_worker_get_address(worker, &address, &address_length),
                                    "worker_get_address"));
  UcxWorkerInfo info;
  info.uid = NewUid();
  info.address.assign(reinterpret_cast<const char*>(address), address_length);
  ucp_worker_release_address(worker, address);
  core->uid = info.uid;
  core->local_info = EncodeWorkerInfo(info);
  core->network = AllowsNetwork(tls);
  std::unique_ptr<CopyPool> pool;
  if (options.copy_threads > 0) {
    const unsigned cpus = std::thread::hardware_concurrency();
    if (cpus != 0 && static_cast<unsigned>(options.copy_threads) >= cpus) {
      Log(LogLevel::kWarning,
          absl::StrCat("UCX transport: ", options.copy_threads, " copy threads on ", cpus,
                       " CPUs: they share cores with the threads that post and progress, "
                       "which can make transfers slower than without them"));
    }
    ASSIGN_OR_RETURN(pool, CopyPool::Create(options.copy_threads));
  }
  return std::unique_ptr<Transport>(new UcxTransport(std::move(core), std::move(pool)));
}

}  // namespace internal

absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(const UcxTransportOptions& options) {
  return internal::CreateUcxTransportImpl(options);
}

bool UcxWritesAreCopied(const RemoteMemory& remote) {
  const auto* ucx = dynamic_cast<const internal::UcxRemote*>(&remote);
  return ucx != nullptr && ucx->mapped() != nullptr;
}

}  // namespace kvstream
