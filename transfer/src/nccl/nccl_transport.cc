// The nccl transport (nccl_transport.h): memory, peers, posting and the per-transfer calls.
// Creation is in nccl_create.cc, a batch's GPU work in nccl_enqueue.cc, what Progress
// advances in nccl_progress.cc.
#include <unistd.h>

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/logging.h"
#include "kvstream/common/status_macros.h"
#include "nccl/nccl_api.h"
#include "nccl/nccl_transport_impl.h"
#include "nccl/nccl_wire.h"
#include "device_argument_checks.h"
#include "segment_check.h"
#include "ucx/staged_cuda.h"

namespace kvstream {
namespace internal {
namespace {

// Connecting the side connection waits only while the peer's accept backlog is full.
constexpr absl::Duration kConnectTimeout = absl::Seconds(5);

std::string UuidText(absl::string_view uuid) { return absl::BytesToHexString(uuid); }

}  // namespace

NcclTransport::NcclTransport(NcclSetup setup)
    : options_(setup.options),
      device_(setup.options.device),
      uid_(setup.uid),
      nccl_version_(setup.nccl_version),
      device_uuid_(std::move(setup.device_uuid)),
      copy_grid_(setup.copy_grid),
      port_(setup.port),
      listener_label_(absl::StrCat("nccl listener ", setup.options.listen_host, ":", setup.port)),
      listener_(std::move(setup.listener)),
      order_(std::move(setup.order)) {}

NcclTransport::~NcclTransport() { Shutdown(); }

TransportCapabilities NcclTransport::capabilities() const {
  TransportCapabilities caps;
  // One-sided for the caller: the receiving transport's Progress posts the receives itself.
  caps.one_sided_write = true;
  caps.notifications = true;
  caps.host_memory = false;
  caps.device_memory = true;
  caps.inter_process = true;
  caps.inter_node = true;
  // Not delivered_at_completion: the peer scatters from its staging buffer after the receive.
  return caps;
}

absl::StatusOr<std::string> NcclTransport::LocalInfo() {
  NcclPeerInfo info;
  info.uid = uid_;
  info.pid = static_cast<uint32_t>(getpid());
  info.job_id = options_.job_id;
  info.nccl_version = nccl_version_;
  info.device = device_;
  info.device_uuid = device_uuid_;
  info.host = options_.listen_host;
  info.port = port_;
  return EncodeNcclPeerInfo(info);
}

absl::StatusOr<std::unique_ptr<MemoryRegistration>> NcclTransport::RegisterMemory(
    void* base, size_t length, MemoryKind kind) {
  RETURN_IF_ERROR(CheckDeviceRegistration("nccl", base, length, kind));
  return Register(base, length, DeviceBuffer());
}

absl::StatusOr<std::unique_ptr<MemoryRegistration>> NcclTransport::AllocateMemory(
    size_t length, MemoryKind kind) {
  RETURN_IF_ERROR(CheckDeviceAllocation("nccl", length, kind));
  CudaDeviceScope scope(device_);
  RETURN_IF_ERROR(scope.status());
  ASSIGN_OR_RETURN(DeviceBuffer memory, DeviceBuffer::CreateZeroed(length, MemoryKind::kDevice));
  void* base = memory.data();
  return Register(base, length, std::move(memory));
}

absl::StatusOr<std::unique_ptr<MemoryRegistration>> NcclTransport::Register(void* base,
                                                                          size_t length,
                                                                          DeviceBuffer owned) {
  {
    CudaDeviceScope scope(device_);
    RETURN_IF_ERROR(scope.status());
    ASSIGN_OR_RETURN(const int device, DeviceOfRange(base, length));
    if (device != device_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "nccl RegisterMemory: the range is memory of GPU ", device, ", this transport's is GPU ",
          device_));
    }
  }
  absl::MutexLock lock(&mu_);
  const uint64_t id = next_region_++;
  regions_[id] = Region{static_cast<char*>(base), length};
  NcclMemoryDescriptor d;
  d.owner_uid = uid_;
  d.region_id = id;
  d.length = length;
  d.device = device_;
  return std::unique_ptr<MemoryRegistration>(new NcclRegistration(
      this, id, base, length, EncodeNcclDescriptor(d), std::move(owned)));
}

void NcclTransport::ForgetRegion(uint64_t region_id) {
  absl::MutexLock lock(&mu_);
  regions_.erase(region_id);
}

NcclPeer* NcclTransport::NewPeer(uint64_t uid, uint32_t pid) {
  auto peer = std::make_unique<NcclPeer>();
  peer->id = next_peer_++;
  peer->uid = uid;
  peer->pid = pid;
  peer->label = absl::StrCat("nccl peer ", peer->id, " (uid ", absl::Hex(uid), ", pid ", pid, ")");
  NcclPeer* raw = peer.get();
  peers_.emplace(raw->id, std::move(peer));
  return raw;
}

absl::Status NcclTransport::CheckPeer(absl::string_view job_id, uint32_t nccl_version,
                                      absl::string_view device_uuid,
                                      absl::string_view who) const {
  if (job_id != options_.job_id) {
    return absl::FailedPreconditionError(absl::StrCat(
        who, " belongs to job '", absl::CHexEscape(job_id), "', this transport to job '",
        absl::CHexEscape(options_.job_id),
        "': workers of different jobs never share a communicator"));
  }
  // NCCL's bootstrap and connection formats change between minor versions.
  if (nccl_version / 100 != nccl_version_ / 100) {
    return absl::FailedPreconditionError(absl::StrCat(
        who, " runs NCCL ", NcclVersionText(nccl_version), ", this process NCCL ",
        NcclVersionText(nccl_version_), ": both ranks of a communicator need the same NCCL"));
  }
  if (device_uuid == device_uuid_) {
    return absl::FailedPreconditionError(absl::StrCat(
        who, " uses the same GPU as this transport (GPU ", device_, ", uuid ",
        UuidText(device_uuid), "): NCCL cannot put two ranks on one GPU; use the cuda_ipc "
        "transport between processes of one GPU"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<LinkGpu>> NcclTransport::NewLinkGpu() {
  auto gpu = std::make_unique<LinkGpu>();
  ASSIGN_OR_RETURN(gpu->nccl, IpcStream::Create());
  ASSIGN_OR_RETURN(gpu->copy, IpcStream::Create());
  for (CudaEvent& e : gpu->slot_free) {
    ASSIGN_OR_RETURN(e, CudaEvent::Create(/*enable_timing=*/false));
  }
  ASSIGN_OR_RETURN(gpu->step, CudaEvent::Create(/*enable_timing=*/false));
  ASSIGN_OR_RETURN(gpu->tables, StagingRing::Create(options_.table_entries));
  return gpu;
}

absl::StatusOr<CudaEvent> NcclTransport::TakeEvent() {
  if (!free_events_.empty()) {
    CudaEvent event = std::move(free_events_.back());
    free_events_.pop_back();
    return event;
  }
  return CudaEvent::Create(/*enable_timing=*/false);
}

void NcclTransport::ReturnEvent(CudaEvent event) {
  if (!event.empty()) free_events_.push_back(std::move(event));
}

absl::StatusOr<PeerId> NcclTransport::Accept(absl::string_view peer_info) {
  ASSIGN_OR_RETURN(NcclPeerInfo info, DecodeNcclPeerInfo(peer_info));
  if (info.uid == uid_) {
    return absl::InvalidArgumentError("nccl Accept: the peer info is this transport's own");
  }
  absl::MutexLock lock(&mu_);
  refused_uids_.erase(info.uid);
  for (auto& [id, p] : peers_) {
    if (p->uid == info.uid && p->status.ok()) return id;
  }
  return NewPeer(info.uid, info.pid)->id;
}

absl::StatusOr<PeerId> NcclTransport::Connect(absl::string_view peer_info) {
  ASSIGN_OR_RETURN(NcclPeerInfo info, DecodeNcclPeerInfo(peer_info));
  if (info.uid == uid_) {
    return absl::InvalidArgumentError(
        "nccl Connect: the peer info is this transport's own (a communicator needs two GPUs)");
  }
  const std::string who = absl::StrCat("the peer at ", info.host, ":", info.port, " (uid ",
                                       absl::Hex(info.uid), ", pid ", info.pid, ")");
  absl::Status refused = CheckPeer(info.job_id, info.nccl_version, info.device_uuid, who);
  if (!refused.ok()) return absl::Status(refused.code(), absl::StrCat("nccl Connect: ", refused.message()));
  absl::MutexLock lock(&mu_);
  refused_uids_.erase(info.uid);
  NcclPeer* peer = nullptr;
  for (auto& [id, p] : peers_) {
    if (p->uid != info.uid || !p->status.ok()) continue;
    if (p->send != nullptr) return id;  // one send link per peer
    peer = p.get();                     // known from its own hello: connect back
  }
  const bool fresh = peer == nullptr;
  if (fresh) peer = NewPeer(info.uid, info.pid);
  auto undo = [&](const absl::Status& status) {
    const std::string label = peer->label;
    if (fresh) peers_.erase(peer->id);
    return absl::Status(status.code(), absl::StrCat("nccl Connect to ", label, " at ", info.host,
                                                    ":", info.port, ": ", status.message()));
  };
  absl::StatusOr<ScopedFd> fd = ConnectTcp(info.host, info.port, absl::Now() + kConnectTimeout);
  if (!fd.ok()) return undo(fd.status());
  CudaDeviceScope scope(device_);
  if (!scope.status().ok()) return undo(scope.status());
  auto link = std::make_unique<SendLink>(absl::StrCat(peer->label, " send link"), "send link",
                                         options_.join_timeout, options_.op_timeout);
  absl::StatusOr<std::unique_ptr<LinkGpu>> gpu = NewLinkGpu();
  if (!gpu.ok()) return undo(gpu.status());
  link->gpu = std::move(gpu).value();
  absl::StatusOr<std::string> unique_id = NewNcclUniqueId();
  if (!unique_id.ok()) return undo(unique_id.status());
  link->conn = std::make_unique<IpcConnection>(std::move(fd).value(), link->label, kNcclFrames);
  NcclHello hello;
  hello.uid = uid_;
  hello.pid = static_cast<uint32_t>(getpid());
  hello.job_id = options_.job_id;
  hello.nccl_version = nccl_version_;
  hello.device_uuid = device_uuid_;
  hello.unique_id = *unique_id;
  link->conn->QueueFrame(static_cast<uint8_t>(NcclFrameType::kHello), EncodeNcclHello(hello));
  // A failure to write shows as the peer's failure in Progress.
  (void)link->conn->Flush();
  auto [comm, poll] = NcclComm::Init(*unique_id, /*rank=*/0, link->label);
  link->comm = std::move(comm);
  if (link->state.OnInitCalled(poll, absl::Now()) == CommAction::kAbort) {
    link->comm.Abort();
    return undo(link->state.status());
  }
  link->limits.staged_bytes = options_.staging_bytes;
  link->limits.in_place_min_bytes = options_.in_place_min_bytes;
  link->limits.max_pieces = MaxPiecesPerBatch();
  peer->send = std::move(link);
  return peer->id;
}

absl::StatusOr<std::unique_ptr<RemoteMemory>> NcclTransport::ImportRemote(
    PeerId peer_id, absl::string_view descriptor) {
  ASSIGN_OR_RETURN(NcclMemoryDescriptor d, DecodeNcclDescriptor(descriptor));
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(peer_id);
  if (it == peers_.end()) {
    return absl::NotFoundError(absl::StrCat("nccl ImportRemote: unknown peer ", peer_id));
  }
  NcclPeer& peer = *it->second;
  if (!peer.status.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("nccl ImportRemote: ", peer.status.message()));
  }
  if (d.owner_uid != peer.uid) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nccl ImportRemote: the descriptor belongs to transport uid ", absl::Hex(d.owner_uid),
        ", not to ", peer.label));
  }
  return std::unique_ptr<RemoteMemory>(new NcclRemote(this, peer_id, d.region_id, d.length));
}

absl::StatusOr<NcclPeer*> NcclTransport::UsablePeer(PeerId peer_id, absl::string_view op) {
  auto it = peers_.find(peer_id);
  if (it == peers_.end()) {
    return absl::NotFoundError(absl::StrCat("nccl ", op, ": unknown peer ", peer_id));
  }
  NcclPeer* peer = it->second.get();
  if (!peer->status.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("nccl ", op, ": ", peer->status.message()));
  }
  if (peer->send == nullptr || peer->send->state.terminal()) {
    return absl::FailedPreconditionError(
        absl::StrCat("nccl ", op, ": not connected to ", peer->label, " (call Connect)"));
  }
  return peer;
}

absl::StatusOr<TransferId> NcclTransport::PostWrite(PeerId peer_id,
                                                    const MemoryRegistration& local,
                                                    const RemoteMemory& remote,
                                                    absl::Span<const Segment> segments,
                                                    absl::string_view notification,
                                                    const WriteOrder& order) {
  RETURN_IF_ERROR(CheckWriteOrder("nccl", order, notification, kMaxIpcFramePayloadBytes));
  const auto* reg = dynamic_cast<const NcclRegistration*>(&local);
  const auto* rem = dynamic_cast<const NcclRemote*>(&remote);
  if (reg == nullptr || reg->owner() != this) {
    return absl::InvalidArgumentError(
        "nccl PostWrite: the local registration is not from this transport");
  }
  if (rem == nullptr || rem->owner() != this || rem->peer() != peer_id) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nccl PostWrite: the remote memory was not imported from peer ", peer_id,
        " by this transport"));
  }
  // Every segment is checked before anything is queued: a bad batch posts nothing.
  RETURN_IF_ERROR(CheckSegments("nccl", segments, reg->length(), rem->length()));
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(NcclPeer * peer, UsablePeer(peer_id, "PostWrite"));
  NcclWork work;
  if (order.ready_event != nullptr) {
    // The caller may re-record its event as soon as this returns: its state now is captured
    // on the ordering stream, which the batches' GPU work waits for.
    CudaDeviceScope scope(device_);
    RETURN_IF_ERROR(scope.status());
    ASSIGN_OR_RETURN(CudaEvent ready, TakeEvent());
    RETURN_IF_ERROR(CudaEventWait(order.ready_event, order_.get()));
    RETURN_IF_ERROR(ready.Record(order_.get()));
    work.ready = std::make_shared<CudaEvent>(std::move(ready));
  }
  SendWrite write;
  write.region_id = rem->region_id();
  write.local_base = static_cast<const char*>(reg->base());
  write.ready = work.ready;
  write.segments.assign(segments.begin(), segments.end());
  const TransferId id = transfers_.Add(peer_id, notification, order.notification_tail,
                                       order.notification_tail_bytes, std::move(work));
  write.transfer = id;
  SendLink& link = *peer->send;
  link.unplanned.push_back(std::move(write));
  if (link.welcomed) {
    // Work may advance inside Post*: plan now, and issue at once when the link is free.
    CudaDeviceScope scope(device_);
    absl::Status status = scope.status();
    if (status.ok()) status = PlanWrites(link);
    if (status.ok()) status = IssueSends(*peer);
    if (!status.ok()) FailPeer(*peer, status);
  }
  return id;
}

absl::StatusOr<TransferId> NcclTransport::PostNotification(PeerId peer_id,
                                                           absl::string_view payload) {
  RETURN_IF_ERROR(CheckNotificationPayload("nccl", payload, kMaxIpcFramePayloadBytes));
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(NcclPeer * peer, UsablePeer(peer_id, "PostNotification"));
  NcclWork work;
  work.planned = true;  // no batch: sent in its turn, after every earlier write's data
  return transfers_.Add(peer->id, payload, nullptr, 0, std::move(work));
}

absl::StatusOr<TransferState> NcclTransport::Test(TransferId id) {
  absl::MutexLock lock(&mu_);
  return transfers_.Test(id);
}

absl::Status NcclTransport::Cancel(TransferId id) {
  absl::MutexLock lock(&mu_);
  return transfers_.Cancel(id);
}

void NcclTransport::Release(TransferId id) {
  absl::MutexLock lock(&mu_);
  // Batches refer to it by id and skip it once it is gone.
  transfers_.Release(id);
}

std::vector<Notification> NcclTransport::PollNotifications() {
  absl::MutexLock lock(&mu_);
  return transfers_.inbox().Take();
}

absl::Status NcclTransport::Disconnect(PeerId peer_id) {
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(peer_id);
  if (it == peers_.end()) {
    return absl::NotFoundError(absl::StrCat("nccl Disconnect: unknown peer ", peer_id));
  }
  NcclPeer& peer = *it->second;
  CudaDeviceScope scope(device_);
  transfers_.FailPeer(peer_id, absl::CancelledError(absl::StrCat(
                                  "nccl transfer cancelled: disconnected from ", peer.label)));
  for (NcclLink* link : {static_cast<NcclLink*>(peer.send.get()),
                         static_cast<NcclLink*>(peer.recv.get())}) {
    if (link == nullptr) continue;
    if (link->conn != nullptr && !link->state.terminal()) {
      // A goodbye, so that the peer takes the end of the connection for a close.
      link->conn->QueueFrame(static_cast<uint8_t>(NcclFrameType::kBye), "");
      (void)link->conn->Flush();
    }
    EndLink(*link, /*fail=*/false, absl::OkStatus());
  }
  refused_uids_.insert(peer.uid);  // its hellos from now on are refused
  peers_.erase(it);
  return absl::OkStatus();
}

absl::Status NcclTransport::PeerStatus(PeerId peer_id) {
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(peer_id);
  if (it == peers_.end()) {
    return absl::NotFoundError(absl::StrCat("nccl PeerStatus: unknown peer ", peer_id));
  }
  return it->second->status;
}

void NcclTransport::SetPeerErrorCallback(PeerErrorCallback callback) {
  absl::MutexLock lock(&mu_);
  peer_errors_.SetCallback(std::move(callback));
}

uint32_t NcclTransport::MaxPiecesPerBatch() const {
  // A batch's entries: its pieces, plus one per max_piece_bytes of staged bytes at most
  // (checked at creation to leave room).
  return static_cast<uint32_t>(std::min<uint64_t>(
      kMaxNcclPiecesPerBatch,
      options_.table_entries / 2 - options_.staging_bytes / options_.max_piece_bytes - 1));
}

size_t NcclTransport::LiveCommunicatorCount() {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [id, peer] : peers_) {
    if (peer->send != nullptr && peer->send->state.has_comm()) ++n;
    if (peer->recv != nullptr && peer->recv->state.has_comm()) ++n;
  }
  return n;
}

}  // namespace internal
}  // namespace kvstream
