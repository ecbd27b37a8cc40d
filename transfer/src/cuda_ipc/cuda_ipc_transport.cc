// The cuda_ipc transport (cuda_ipc_transport.h): memory, peers, posting and the per-transfer
// calls. Creation is in cuda_ipc_create.cc, a write's table and GPU work in
// cuda_ipc_enqueue.cc, what Progress advances in cuda_ipc_progress.cc.
#include <cuda_runtime.h>
#include <unistd.h>

#include <set>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cuda_ipc/copy_kernel.h"
#include "cuda_ipc/cuda_ipc_memory.h"
#include "cuda_ipc/cuda_ipc_transport_impl.h"
#include "cuda_ipc/cuda_ipc_wire.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/logging.h"
#include "kvstream/common/status_macros.h"
#include "device_argument_checks.h"
#include "segment_check.h"

namespace kvstream {
namespace internal {
namespace {

// Connecting to a peer's socket waits only while its accept backlog is full.
constexpr absl::Duration kConnectTimeout = absl::Seconds(2);

}  // namespace

CudaIpcTransport::CudaIpcTransport(CudaIpcSetup setup)
    : options_(setup.options),
      device_(setup.options.device),
      grid_(setup.grid),
      uid_(setup.uid),
      device_uuid_(std::move(setup.device_uuid)),
      socket_name_(std::move(setup.socket_name)),
      socket_label_(UnixSocketLabel(socket_name_)),
      listener_(std::move(setup.listener)),
      stream_(std::move(setup.stream)),
      ring_(std::move(setup.ring)),
      side_stream_(std::move(setup.side_stream)),
      table_ready_(std::move(setup.table_ready)) {}

CudaIpcTransport::~CudaIpcTransport() { Shutdown(); }

TransportCapabilities CudaIpcTransport::capabilities() const {
  TransportCapabilities caps;
  caps.one_sided_write = true;
  caps.notifications = true;
  caps.host_memory = false;
  caps.device_memory = true;
  caps.inter_process = true;
  caps.inter_node = false;
  caps.delivered_at_completion = true;  // the copy kernel completed in the peer's memory
  return caps;
}

absl::StatusOr<std::string> CudaIpcTransport::LocalInfo() {
  CudaIpcPeerInfo info;
  info.uid = uid_;
  info.pid = static_cast<uint32_t>(getpid());
  info.socket_name = socket_name_;
  return EncodeCudaIpcPeerInfo(info);
}

absl::StatusOr<std::unique_ptr<MemoryRegistration>> CudaIpcTransport::RegisterMemory(
    void* base, size_t length, MemoryKind kind) {
  RETURN_IF_ERROR(CheckDeviceRegistration("cuda_ipc", base, length, kind));
  return Register(base, length, DeviceBuffer());
}

absl::StatusOr<std::unique_ptr<MemoryRegistration>> CudaIpcTransport::AllocateMemory(
    size_t length, MemoryKind kind) {
  RETURN_IF_ERROR(CheckDeviceAllocation("cuda_ipc", length, kind));
  CudaDeviceScope scope(device_);
  RETURN_IF_ERROR(scope.status());
  // cudaMalloc memory (256-byte aligned), zeroed: exportable with cudaIpcGetMemHandle.
  ASSIGN_OR_RETURN(DeviceBuffer memory, DeviceBuffer::CreateZeroed(length, MemoryKind::kDevice));
  void* base = memory.data();
  return Register(base, length, std::move(memory));
}

absl::StatusOr<std::unique_ptr<MemoryRegistration>> CudaIpcTransport::Register(
    void* base, size_t length, DeviceBuffer owned) {
  CudaDeviceScope scope(device_);
  RETURN_IF_ERROR(scope.status());
  ASSIGN_OR_RETURN(ExportedRange range, ExportDeviceRange(base, length, device_));
  CudaIpcMemoryDescriptor d;
  d.owner_uid = uid_;
  d.device = device_;
  d.device_uuid = device_uuid_;
  d.ipc_handle = range.ipc_handle;
  d.allocation_size = range.allocation_size;
  d.offset = range.offset;
  d.length = length;
  return std::unique_ptr<MemoryRegistration>(
      new IpcRegistration(this, base, length, EncodeCudaIpcDescriptor(d), std::move(owned)));
}

IpcPeer* CudaIpcTransport::NewPeer(uint64_t uid, uint32_t pid) {
  auto peer = std::make_unique<IpcPeer>();
  peer->id = next_peer_++;
  peer->uid = uid;
  peer->pid = pid;
  peer->label = absl::StrCat("cuda_ipc peer ", peer->id, " (uid ", absl::Hex(uid), ", pid ", pid,
                             ")");
  IpcPeer* raw = peer.get();
  peers_.emplace(raw->id, std::move(peer));
  return raw;
}

absl::StatusOr<PeerId> CudaIpcTransport::Accept(absl::string_view peer_info) {
  ASSIGN_OR_RETURN(CudaIpcPeerInfo info, DecodeCudaIpcPeerInfo(peer_info));
  if (info.uid == uid_) {
    return absl::InvalidArgumentError("cuda_ipc Accept: the peer info is this transport's own");
  }
  absl::MutexLock lock(&mu_);
  refused_uids_.erase(info.uid);
  return PeerForUid(info.uid, info.pid)->id;
}

absl::StatusOr<PeerId> CudaIpcTransport::Connect(absl::string_view peer_info) {
  ASSIGN_OR_RETURN(CudaIpcPeerInfo info, DecodeCudaIpcPeerInfo(peer_info));
  if (info.uid == uid_) {
    return absl::InvalidArgumentError(
        "cuda_ipc Connect: the peer info is this transport's own (CUDA IPC cannot open an "
        "allocation in the process that made it)");
  }
  absl::MutexLock lock(&mu_);
  refused_uids_.erase(info.uid);
  IpcPeer* peer = nullptr;
  for (auto& [id, p] : peers_) {
    if (p->uid != info.uid || !p->status.ok()) continue;
    if (p->connected) return id;  // one connection per peer transport
    peer = p.get();               // known from its notifications: connect back
  }
  const bool fresh = peer == nullptr;
  if (fresh) peer = NewPeer(info.uid, info.pid);
  absl::StatusOr<ScopedFd> fd = ConnectUnix(info.socket_name, absl::Now() + kConnectTimeout);
  if (!fd.ok()) {
    const std::string label = peer->label;
    if (fresh) peers_.erase(peer->id);
    return absl::Status(fd.status().code(),
                        absl::StrCat("cuda_ipc Connect to ", label, ": ", fd.status().message()));
  }
  peer->out = std::make_unique<IpcConnection>(std::move(fd).value(), peer->label);
  IpcHello hello;
  hello.uid = uid_;
  hello.pid = static_cast<uint32_t>(getpid());
  peer->out->Queue(IpcFrameType::kHello, EncodeIpcHello(hello));
  // A failure to write shows as the peer's failure in Progress.
  (void)peer->out->Flush();
  peer->connected = true;
  return peer->id;
}

absl::StatusOr<std::unique_ptr<RemoteMemory>> CudaIpcTransport::ImportRemote(
    PeerId peer_id, absl::string_view descriptor) {
  ASSIGN_OR_RETURN(CudaIpcMemoryDescriptor d, DecodeCudaIpcDescriptor(descriptor));
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(peer_id);
  if (it == peers_.end()) {
    return absl::NotFoundError(absl::StrCat("cuda_ipc ImportRemote: unknown peer ", peer_id));
  }
  IpcPeer* peer = it->second.get();
  if (!peer->status.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda_ipc ImportRemote: ", peer->status.message()));
  }
  if (d.owner_uid != peer->uid) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_ipc ImportRemote: the descriptor belongs to transport uid ", absl::Hex(d.owner_uid),
        ", not to ", peer->label));
  }
  auto mapping = peer->mappings.find(d.ipc_handle);
  if (mapping == peer->mappings.end()) {
    ASSIGN_OR_RETURN(std::unique_ptr<IpcMapping> opened,
                     IpcMapping::Open(d.ipc_handle, device_, peer->label));
    mapping = peer->mappings.emplace(d.ipc_handle, std::move(opened)).first;
  }
  // What was mapped decides, not what the descriptor claims.
  const uint64_t mapped = mapping->second->size();
  if (!SegmentFits(d.offset, d.length, mapped)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_ipc ImportRemote: region at offset ", d.offset, " of ", d.length,
        " bytes is outside the allocation of ", peer->label, " as mapped here (", mapped,
        " bytes; the descriptor claims ", d.allocation_size, ")"));
  }
  return std::unique_ptr<RemoteMemory>(
      new IpcRemote(this, peer_id, d.ipc_handle, d.offset, d.length));
}

absl::StatusOr<IpcPeer*> CudaIpcTransport::UsablePeer(PeerId peer_id, absl::string_view op) {
  auto it = peers_.find(peer_id);
  if (it == peers_.end()) {
    return absl::NotFoundError(absl::StrCat("cuda_ipc ", op, ": unknown peer ", peer_id));
  }
  IpcPeer* peer = it->second.get();
  if (!peer->status.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda_ipc ", op, ": ", peer->status.message()));
  }
  if (!peer->connected || peer->out == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda_ipc ", op, ": not connected to ", peer->label, " (call Connect)"));
  }
  return peer;
}

absl::StatusOr<TransferId> CudaIpcTransport::PostWrite(PeerId peer_id,
                                                       const MemoryRegistration& local,
                                                       const RemoteMemory& remote,
                                                       absl::Span<const Segment> segments,
                                                       absl::string_view notification,
                                                       const WriteOrder& order) {
  RETURN_IF_ERROR(CheckWriteOrder("cuda_ipc", order, notification, kMaxIpcFramePayloadBytes));
  const auto* reg = dynamic_cast<const IpcRegistration*>(&local);
  const auto* rem = dynamic_cast<const IpcRemote*>(&remote);
  if (reg == nullptr || reg->owner() != this) {
    return absl::InvalidArgumentError(
        "cuda_ipc PostWrite: the local registration is not from this transport");
  }
  if (rem == nullptr || rem->owner() != this || rem->peer() != peer_id) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_ipc PostWrite: the remote memory was not imported from peer ", peer_id,
        " by this transport"));
  }
  // Every segment is checked before anything is enqueued: a bad batch posts nothing.
  ASSIGN_OR_RETURN(const WritePlan plan,
                   PlanWrite(segments, reg->length(), rem->length(), options_));
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(IpcPeer * peer, UsablePeer(peer_id, "PostWrite"));
  auto mapping = peer->mappings.find(rem->handle());
  if (mapping == peer->mappings.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda_ipc PostWrite: the remote memory's allocation is no longer mapped from ",
        peer->label));
  }
  auto add = [&](bool copy_done) {
    mu_.AssertHeld();
    return transfers_.Add(peer->id, notification, order.notification_tail,
                          order.notification_tail_bytes, IpcCopyWork{copy_done});
  };
  if (plan.entries == 0 && plan.engine == 0 && order.ready_event == nullptr) {
    return add(true);  // nothing for the GPU: its turn comes after earlier writes
  }
  CudaDeviceScope scope(device_);
  RETURN_IF_ERROR(scope.status());
  ASSIGN_OR_RETURN(InFlightCopy copy,
                   EnqueueCopy(segments, plan, static_cast<const char*>(reg->base()),
                               mapping->second->base() + rem->offset(), order));
  copy.mapping = mapping->second;
  const TransferId id = add(false);
  copy.transfer = id;
  inflight_.push_back(std::move(copy));
  return id;
}

absl::StatusOr<TransferId> CudaIpcTransport::PostNotification(PeerId peer_id,
                                                              absl::string_view payload) {
  RETURN_IF_ERROR(CheckNotificationPayload("cuda_ipc", payload, kMaxIpcFramePayloadBytes));
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(IpcPeer * peer, UsablePeer(peer_id, "PostNotification"));
  // Sent in its turn, after every earlier write's data.
  return transfers_.Add(peer->id, payload, nullptr, 0, IpcCopyWork{/*copy_done=*/true});
}

absl::StatusOr<TransferState> CudaIpcTransport::Test(TransferId id) {
  absl::MutexLock lock(&mu_);
  return transfers_.Test(id);
}

absl::Status CudaIpcTransport::Cancel(TransferId id) {
  absl::MutexLock lock(&mu_);
  return transfers_.Cancel(id);
}

void CudaIpcTransport::Release(TransferId id) {
  absl::MutexLock lock(&mu_);
  // Copies in flight refer to it by id and skip it once it is gone.
  transfers_.Release(id);
}

std::vector<Notification> CudaIpcTransport::PollNotifications() {
  absl::MutexLock lock(&mu_);
  return transfers_.inbox().Take();
}

absl::Status CudaIpcTransport::Disconnect(PeerId peer_id) {
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(peer_id);
  if (it == peers_.end()) {
    return absl::NotFoundError(absl::StrCat("cuda_ipc Disconnect: unknown peer ", peer_id));
  }
  IpcPeer* peer = it->second.get();
  transfers_.FailPeer(peer_id, absl::CancelledError(absl::StrCat(
                                  "cuda_ipc transfer cancelled: disconnected from ",
                                  peer->label)));
  if (peer->out != nullptr && peer->status.ok()) {
    // A goodbye, so that the peer takes the end of stream for a close, not a death.
    peer->out->Queue(IpcFrameType::kBye, "");
    (void)peer->out->Flush();
  }
  // Its notifications still on their way are dropped with the connections; a connection
  // it opens from now on is refused at its hello.
  refused_uids_.insert(peer->uid);
  // Closes both connections; each mapping closes once no copy in flight holds it.
  peers_.erase(it);
  return absl::OkStatus();
}

absl::Status CudaIpcTransport::PeerStatus(PeerId peer_id) {
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(peer_id);
  if (it == peers_.end()) {
    return absl::NotFoundError(absl::StrCat("cuda_ipc PeerStatus: unknown peer ", peer_id));
  }
  return it->second->status;
}

void CudaIpcTransport::SetPeerErrorCallback(PeerErrorCallback callback) {
  absl::MutexLock lock(&mu_);
  peer_errors_.SetCallback(std::move(callback));
}

void CudaIpcTransport::SetCopyTiming(bool on) {
  absl::MutexLock lock(&mu_);
  timing_ = on;
}

std::vector<CudaIpcCopyTiming> CudaIpcTransport::TakeCopyTimings() {
  absl::MutexLock lock(&mu_);
  std::vector<CudaIpcCopyTiming> out;
  out.swap(timings_);
  return out;
}

size_t CudaIpcTransport::OpenMappingCount() {
  absl::MutexLock lock(&mu_);
  std::set<const IpcMapping*> open;
  for (const auto& [id, peer] : peers_) {
    for (const auto& [handle, mapping] : peer->mappings) open.insert(mapping.get());
  }
  for (const InFlightCopy& copy : inflight_) {
    if (copy.mapping != nullptr) open.insert(copy.mapping.get());
  }
  return open.size();
}

}  // namespace internal
}  // namespace kvstream
