// The UCX transport (see ucx_transport.h): the Transport facade over UcxCore
// (ucx/ucx_core.h), which holds the peers and transfers and whose callbacks move transfers
// on. This file validates arguments, registers memory, connects, and posts writes: UCX puts
// or, over TCP, write pieces (ucx/am_writes.h, which says why), then the core's flush and
// notification; jobs for the copy threads; or, between device regions, staged writes
// (ucx/staged_engine.h, which documents that protocol).
//
// Threading: every UCX call runs with UcxCore::mu held (see ucx/ucx_core.h). The user's
// peer-error callback is queued by the core and called by Progress() after mu is released.
//
// Copy threads (UcxTransportOptions::copy_threads): where the remote key maps the peer's
// memory into this process (ucp_rkey_ptr: a shared-memory segment from the peer's
// AllocateMemory), PostWrite queues the segments on a CopyPool instead of putting them and
// the transfer starts in kCopying; the pool thread that copies its last byte takes mu and
// moves it on to the flush and the notification (UcxCore::Pump). Destroying a registration
// or remote memory fails the transfers still copying from or into it, so no copy outlives
// the memory it touches.
//
// Memory: registrations and allocations are made in ucx/ucx_memory.cc.
//
// Destruction: the copy threads are joined first, then UcxCore::Shutdown force-closes every
// endpoint and progresses until every request has called back (bounded), so no callback
// can outlive its target.
#include "kvstream/transfer/ucx_transport.h"

#include <ucp/api/ucp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "copy_pool.h"
#include "segment_check.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/logging.h"
#include "kvstream/common/status_macros.h"
#include "ucx/am_writes.h"
#include "ucx/staged_cuda.h"
#include "ucx/staged_engine.h"
#include "ucx/ucx_core.h"
#include "ucx/ucx_handles.h"
#include "ucx/ucx_memory.h"
#include "ucx/ucx_setup.h"
#include "ucx/ucx_status.h"
#include "ucx/ucx_wire.h"

namespace kvstream {
namespace internal {
namespace {

// --- The transport ---

class UcxTransport final : public Transport {
 public:
  using Transport::PostWrite;
  UcxTransport(std::shared_ptr<UcxCore> core, std::unique_ptr<CopyPool> pool)
      : core_(std::move(core)), pool_(std::move(pool)) {}
  ~UcxTransport() override {
    // The copy threads first: once joined, no copy is running and no job calls back.
    pool_.reset();
    core_->Shutdown();
  }

  absl::string_view name() const override { return "ucx"; }

  TransportCapabilities capabilities() const override {
    TransportCapabilities caps;
    caps.one_sided_write = true;
    caps.notifications = true;
    caps.host_memory = true;
    // Staged through pinned host memory (no UCX CUDA transport is needed).
    caps.device_memory = BuiltWithCuda();
    caps.inter_process = true;
    caps.inter_node = core_->network;
    // Not delivered_at_completion: a send over TCP completes once in the socket, and a
    // staged device write before the peer scattered it.
    return caps;
  }

  absl::StatusOr<std::string> LocalInfo() override {
    absl::MutexLock lock(&core_->mu);
    return core_->local_info;
  }

  absl::StatusOr<std::unique_ptr<MemoryRegistration>> RegisterMemory(void* base, size_t length,
                                                                     MemoryKind kind) override {
    return RegisterUcxMemory(core_, base, length, kind);
  }

  absl::StatusOr<std::unique_ptr<MemoryRegistration>> AllocateMemory(size_t length,
                                                                      MemoryKind kind) override {
    return AllocateUcxMemory(core_, length, kind);
  }

  absl::StatusOr<PeerId> Connect(absl::string_view peer_info) override {
    ASSIGN_OR_RETURN(UcxWorkerInfo info, DecodeWorkerInfo(peer_info));
    absl::MutexLock lock(&core_->mu);
    RETURN_IF_ERROR(CheckNotShutDown("Connect"));
    core_->refused_uids.erase(info.uid);  // heard from again
    UcxPeer* peer = nullptr;
    for (auto& [id, p] : core_->peers) {
      if (p->uid != info.uid || p->disconnected || !p->status.ok()) continue;
      if (p->connected) {
        // Already connected (one endpoint per peer transport): what it sends from now on
        // carries the info's fence epoch, which the peer accepts.
        p->stamp = std::max(p->stamp, info.fence_epoch);
        return id;
      }
      peer = p.get();  // known from its notifications: give it an endpoint
    }
    const bool fresh = peer == nullptr;
    if (fresh) peer = core_->NewPeer(info.uid);
    peer->stamp = std::max(peer->stamp, info.fence_epoch);
    absl::Status status = core_->ConnectPeer(peer, info.address);
    if (!status.ok()) {
      if (fresh) core_->peers.erase(peer->id);
      return status;
    }
    return peer->id;
  }

  absl::StatusOr<PeerId> Accept(absl::string_view peer_info) override {
    ASSIGN_OR_RETURN(UcxWorkerInfo info, DecodeWorkerInfo(peer_info));
    absl::MutexLock lock(&core_->mu);
    RETURN_IF_ERROR(CheckNotShutDown("Accept"));
    if (info.uid == core_->uid) {
      return absl::InvalidArgumentError("UCX Accept: the peer info is this transport's own");
    }
    core_->refused_uids.erase(info.uid);
    return core_->PeerForUid(info.uid)->id;
  }

  absl::StatusOr<std::unique_ptr<RemoteMemory>> ImportRemote(
      PeerId peer_id, absl::string_view descriptor) override {
    ASSIGN_OR_RETURN(UcxMemoryDescriptor d, DecodeMemoryDescriptor(descriptor));
    absl::MutexLock lock(&core_->mu);
    ASSIGN_OR_RETURN(UcxPeer * peer, UsablePeer(peer_id, "ImportRemote"));
    if (d.kind == UcxRegionKind::kDevice) {
      return std::unique_ptr<RemoteMemory>(
          new UcxRemote(core_, peer_id, d.address, d.length, d.region_id));
    }
    ucp_rkey_h raw_rkey = nullptr;
    absl::Status status = UcxStatusToStatus(
        ucp_ep_rkey_unpack(peer->ep.get(), d.rkey.data(), &raw_rkey), "ep_rkey_unpack",
        peer->label);
    if (!status.ok()) {
      // The bytes passed the checksum, so this is a descriptor UCX cannot use here (for
      // example from a transport with other memory domains): still the caller's input.
      return absl::InvalidArgumentError(status.message());
    }
    UcxRkey rkey(NoOwner{}, raw_rkey);  // destroyed (under mu) if the region is refused
    // Where the key maps the region here, this process writes into it itself (UCX's
    // shared-memory puts, or the copy threads): every byte the descriptor claims must lie in
    // what the key really mapped, or a write would run off the peer's segment.
    ASSIGN_OR_RETURN(char* mapped,
                     MapPeerRegion(core_.get(), *peer, rkey.get(), d.address, d.length,
                                   "ImportRemote: the host region"));
    // With copy threads, writes go straight into the region where the key maps it here.
    if (pool_ == nullptr) mapped = nullptr;
    return std::unique_ptr<RemoteMemory>(
        new UcxRemote(core_, peer_id, d.address, d.length, std::move(rkey), mapped));
  }

  absl::StatusOr<TransferId> PostWrite(PeerId peer_id, const MemoryRegistration& local,
                                       const RemoteMemory& remote,
                                       absl::Span<const Segment> segments,
                                       absl::string_view notification,
                                       const WriteOrder& order) override {
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
    // Every segment is checked before anything is posted: a bad batch posts nothing.
    RETURN_IF_ERROR(CheckSegments("UCX", segments, reg->length(), rem->length()));
    if (reg->device() != rem->device()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "UCX PostWrite: writes from ", reg->device() ? "device" : "host", " memory into ",
          rem->device() ? "device" : "host",
          " memory are not supported (both sides must be device memory, or both host)"));
    }
    RETURN_IF_ERROR(CheckOrder(order, notification, reg->device()));
    absl::MutexLock lock(&core_->mu);
    ASSIGN_OR_RETURN(UcxPeer * peer, UsablePeer(peer_id, "PostWrite"));
    if (reg->device()) {
      return PostStagedWrite(core_.get(), peer, *reg, *rem, segments, notification, order);
    }
    if (pool_ != nullptr && rem->mapped() != nullptr) {
      return PostCopies(peer, *reg, *rem, segments, notification);
    }
    if (core_->am_writes) {
      UcxTransfer* t = NewTransfer(peer, notification);
      absl::Status posted =
          PostWritePieces(core_.get(), t, static_cast<const char*>(reg->base()), reg->memh(),
                          rem->address(), segments);
      if (!posted.ok()) {
        DropTransfer(t);
        return posted;
      }
      return FlushAndNotify(t);
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
      ProgressStaged(core_.get());
      if (core_->maintenance) core_->Maintain();
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
    // Its write pieces and notifications still on their way are dropped from now on, and
    // what it sent before now stays dropped after an Accept (ucx_wire.h: fence epoch).
    core_->Fence(peer->uid);
    // A healthy endpoint is closed gracefully (its pending operations flushed); a failed
    // one must be forced. Either way Progress() finishes the close and erases the peer.
    if (peer->ep) peer->close_request = peer->ep.StartClose(/*force=*/!peer->status.ok());
    core_->maintenance = true;
    core_->Maintain();
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
  // The WriteOrder rules of transport.h: GPU ordering applies to device writes only.
  static absl::Status CheckOrder(const WriteOrder& order, absl::string_view notification,
                                 bool device) {
    if (!device) {
      if (order.ready_event != nullptr || order.notification_tail != nullptr) {
        return absl::InvalidArgumentError(
            "UCX PostWrite: a ready event or notification tail was given for a write of host "
            "memory (GPU ordering applies to device memory)");
      }
      return absl::OkStatus();
    }
    if ((order.notification_tail == nullptr) != (order.notification_tail_bytes == 0)) {
      return absl::InvalidArgumentError(
          "UCX PostWrite: notification_tail and notification_tail_bytes must be given together");
    }
    if (order.notification_tail != nullptr &&
        (order.ready_event == nullptr || notification.empty() ||
         order.notification_tail_bytes > kMaxNotificationTailBytes)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "UCX PostWrite: a notification tail needs a ready event, a non-empty notification "
          "and at most ", kMaxNotificationTailBytes, " bytes (", order.notification_tail_bytes,
          " given)"));
    }
    return absl::OkStatus();
  }

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
    t->watermark = peer->staged_posted;
    core_->transfers.emplace(t->id, std::move(owned));
    peer->outstanding.insert(t);
    return t;
  }

  // The flush and notification of what was posted so far: at once, or, behind transfers
  // still waiting for their copies, in turn.
  absl::StatusOr<TransferId> StartFlushAndNotify(UcxPeer* peer, absl::string_view notification)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu) {
    return FlushAndNotify(NewTransfer(peer, notification));
  }

  // The same for a transfer already made (whose writes are posted).
  absl::StatusOr<TransferId> FlushAndNotify(UcxTransfer* t)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu) {
    UcxPeer* peer = t->peer;
    const TransferId id = t->id;
    if (!peer->waiting.empty()) {
      t->phase = Phase::kCopying;  // nothing of its own to copy: no job
      peer->waiting.push_back(t);
      return id;
    }
    absl::Status status = core_->StartFlush(t);
    if (!status.ok()) {
      if (!t->write_headers.empty()) core_->orphan_headers.push_back(std::move(t->write_headers));
      DropTransfer(t);
      return status;
    }
    return id;
  }

  // Forgets a transfer that was never handed to UCX as a whole (its post failed).
  void DropTransfer(UcxTransfer* t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu) {
    t->peer->outstanding.erase(t);
    core_->transfers.erase(t->id);
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

  std::shared_ptr<UcxCore> core_;
  std::unique_ptr<CopyPool> pool_;  // copy threads, if any (UcxTransportOptions::copy_threads)
};

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
  if (options.staged_chunk_bytes < kMinStagedChunkBytes ||
      options.staged_chunk_bytes > kMaxStagedChunkBytes ||
      options.staged_chunk_bytes % kStagingAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "UCX transport: staged_chunk_bytes ", options.staged_chunk_bytes,
        " is not a multiple of ", kStagingAlignment, " in [", kMinStagedChunkBytes, ", ",
        kMaxStagedChunkBytes, "]"));
  }
  if (options.staged_slots < 2 || options.staged_slots > static_cast<int>(kMaxStagedSlots)) {
    return absl::InvalidArgumentError(absl::StrCat("UCX transport: staged_slots ",
                                                   options.staged_slots, " is outside 2..",
                                                   kMaxStagedSlots));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<UcxCore> core, CreateUcxCore(options));
  core->staged_options.chunk_bytes = options.staged_chunk_bytes;
  core->staged_options.slots = static_cast<uint32_t>(options.staged_slots);
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
