// The cuda_ipc transport (cuda_ipc_transport.h): memory, peers, posting and the per-transfer
// calls. Creation is in cuda_ipc_create.cc, what Progress advances in cuda_ipc_progress.cc.
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <set>
#include <tuple>

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

namespace kvstream {
namespace internal {
namespace {

// Connecting to a peer's socket waits only while its accept backlog is full.
constexpr absl::Duration kConnectTimeout = absl::Seconds(2);

bool SegmentFits(uint64_t offset, uint64_t length, uint64_t region_length) {
  return length <= region_length && offset <= region_length - length;
}

absl::Status CheckOrder(const WriteOrder& order, absl::string_view notification) {
  if ((order.notification_tail == nullptr) != (order.notification_tail_bytes == 0)) {
    return absl::InvalidArgumentError(
        "cuda_ipc PostWrite: notification_tail and notification_tail_bytes must be given "
        "together");
  }
  if (order.notification_tail != nullptr) {
    if (order.ready_event == nullptr) {
      return absl::InvalidArgumentError(
          "cuda_ipc PostWrite: a notification tail needs the ready_event its GPU work is "
          "ordered before");
    }
    if (notification.empty()) {
      return absl::InvalidArgumentError(
          "cuda_ipc PostWrite: a notification tail needs a notification to append to");
    }
    if (order.notification_tail_bytes > kMaxNotificationTailBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda_ipc PostWrite: notification tail of ", order.notification_tail_bytes,
          " bytes, more than ", kMaxNotificationTailBytes));
    }
  }
  if (notification.size() + order.notification_tail_bytes > kMaxIpcFramePayloadBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_ipc PostWrite: notification of ", notification.size(), " bytes (+",
        order.notification_tail_bytes, " tail), more than ", kMaxIpcFramePayloadBytes));
  }
  return absl::OkStatus();
}

absl::Status CudaCall(cudaError_t e, absl::string_view what) {
  return CudaErrorToStatus(static_cast<int>(e), what);
}

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
      ring_(std::move(setup.ring)) {}

CudaIpcTransport::~CudaIpcTransport() { Shutdown(); }

TransportCapabilities CudaIpcTransport::capabilities() const {
  TransportCapabilities caps;
  caps.one_sided_write = true;
  caps.notifications = true;
  caps.host_memory = false;
  caps.device_memory = true;
  caps.inter_process = true;
  caps.inter_node = false;
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
  if (base == nullptr || length == 0) {
    return absl::InvalidArgumentError("cuda_ipc RegisterMemory: null or empty range");
  }
  if (kind != MemoryKind::kDevice) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_ipc RegisterMemory: ", MemoryKindName(kind),
        " memory is not supported (cuda_ipc moves device memory only; use the ucx transport "
        "for host memory)"));
  }
  return Register(base, length, DeviceBuffer());
}

absl::StatusOr<std::unique_ptr<MemoryRegistration>> CudaIpcTransport::AllocateMemory(
    size_t length, MemoryKind kind) {
  if (length == 0) return absl::InvalidArgumentError("cuda_ipc AllocateMemory: zero length");
  if (kind != MemoryKind::kDevice) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc AllocateMemory: cannot allocate ",
                                                   MemoryKindName(kind),
                                                   " memory (device memory only)"));
  }
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

absl::StatusOr<PeerId> CudaIpcTransport::Connect(absl::string_view peer_info) {
  ASSIGN_OR_RETURN(CudaIpcPeerInfo info, DecodeCudaIpcPeerInfo(peer_info));
  if (info.uid == uid_) {
    return absl::InvalidArgumentError(
        "cuda_ipc Connect: the peer info is this transport's own (CUDA IPC cannot open an "
        "allocation in the process that made it)");
  }
  absl::MutexLock lock(&mu_);
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

TransferId CudaIpcTransport::AddTransfer(IpcPeer* peer, IpcTransfer transfer) {
  const TransferId id = next_transfer_++;
  transfer.peer = peer->id;
  transfers_.emplace(id, std::move(transfer));
  peer->queue.push_back(id);
  return id;
}

absl::StatusOr<TransferId> CudaIpcTransport::PostWrite(PeerId peer_id,
                                                       const MemoryRegistration& local,
                                                       const RemoteMemory& remote,
                                                       absl::Span<const Segment> segments,
                                                       absl::string_view notification,
                                                       const WriteOrder& order) {
  RETURN_IF_ERROR(CheckOrder(order, notification));
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
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    if (!SegmentFits(s.local_offset, s.length, reg->length()) ||
        !SegmentFits(s.remote_offset, s.length, rem->length())) {
      return absl::OutOfRangeError(absl::StrCat(
          "cuda_ipc PostWrite: segment ", i, " (local ", s.local_offset, ", remote ",
          s.remote_offset, ", length ", s.length, ") is outside the local region (",
          reg->length(), " bytes) or the remote one (", rem->length(), " bytes)"));
    }
  }
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(IpcPeer * peer, UsablePeer(peer_id, "PostWrite"));
  auto mapping = peer->mappings.find(rem->handle());
  if (mapping == peer->mappings.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda_ipc PostWrite: the remote memory's allocation is no longer mapped from ",
        peer->label));
  }
  IpcTransfer transfer;
  transfer.notification.assign(notification.data(), notification.size());
  transfer.tail = order.notification_tail;
  transfer.tail_bytes = order.notification_tail_bytes;
  bool has_bytes = false;
  for (const Segment& s : segments) has_bytes = has_bytes || s.length > 0;
  if (!has_bytes && order.ready_event == nullptr) {
    transfer.copy_done = true;  // nothing for the GPU: its turn comes after earlier writes
    return AddTransfer(peer, std::move(transfer));
  }
  CudaDeviceScope scope(device_);
  RETURN_IF_ERROR(scope.status());
  ASSIGN_OR_RETURN(InFlightCopy copy,
                   EnqueueCopy(segments, static_cast<const char*>(reg->base()),
                               mapping->second->base() + rem->offset(), order));
  copy.mapping = mapping->second;
  const TransferId id = AddTransfer(peer, std::move(transfer));
  copy.transfer = id;
  inflight_.push_back(std::move(copy));
  return id;
}

absl::StatusOr<std::pair<StagingRing*, size_t>> CudaIpcTransport::ReserveStaging(size_t n) {
  if (n > kMaxCudaIpcStagingSegments) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cuda_ipc PostWrite: ", n, " segments in one write, more than the staging limit of ",
        kMaxCudaIpcStagingSegments));
  }
  if (std::optional<size_t> begin = ring_->Reserve(n)) return std::make_pair(ring_.get(), *begin);
  PollCopies();  // completed copies give their entries back
  if (std::optional<size_t> begin = ring_->Reserve(n)) return std::make_pair(ring_.get(), *begin);
  size_t capacity = ring_->capacity();
  while (capacity < 2 * n && capacity < kMaxCudaIpcStagingSegments) capacity *= 2;
  if (capacity == ring_->capacity()) capacity *= 2;
  capacity = std::min(capacity, kMaxCudaIpcStagingSegments);
  if (capacity <= ring_->capacity() || capacity < n) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cuda_ipc PostWrite: the staging ring is full (", ring_->capacity(),
        " segments of earlier writes are still being copied, the limit is ",
        kMaxCudaIpcStagingSegments, "); call Progress and post again"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<StagingRing> grown, StagingRing::Create(capacity));
  retired_rings_.push_back(std::move(ring_));
  ring_ = std::move(grown);
  std::optional<size_t> begin = ring_->Reserve(n);
  if (!begin) return absl::InternalError("cuda_ipc: a fresh staging ring refused a reservation");
  return std::make_pair(ring_.get(), *begin);
}

absl::StatusOr<CudaEvent> CudaIpcTransport::TakeEvent() {
  if (!free_events_.empty()) {
    CudaEvent event = std::move(free_events_.back());
    free_events_.pop_back();
    return event;
  }
  return CudaEvent::Create(/*enable_timing=*/false);
}

absl::StatusOr<InFlightCopy> CudaIpcTransport::EnqueueCopy(absl::Span<const Segment> segments,
                                                           const char* src_base, char* dst_base,
                                                           const WriteOrder& order) {
  const uint64_t engine_min = options_.copy_engine_min_bytes;
  size_t n = 0;
  for (const Segment& s : segments) {
    if (s.length > 0 && (engine_min == 0 || s.length < engine_min)) ++n;
  }
  StagingRing* ring = nullptr;
  size_t begin = 0;
  if (n > 0) {
    ASSIGN_OR_RETURN(std::tie(ring, begin), ReserveStaging(n));
  }

  // The table: the only per-segment work of a post.
  const uint64_t chunk = IpcCopyChunkBytes(options_.vectors_per_thread);
  uint64_t chunks = 0;
  engine_copies_.clear();
  IpcCopySegment* table = n > 0 ? ring->host(begin) : nullptr;
  size_t k = 0;
  for (const Segment& s : segments) {
    if (s.length == 0) continue;
    const char* src = src_base + s.local_offset;
    char* dst = dst_base + s.remote_offset;
    if (engine_min != 0 && s.length >= engine_min) {
      engine_copies_.push_back({src, dst, s.length});
      continue;
    }
    IpcCopySegment& e = table[k++];
    e.src = reinterpret_cast<uint64_t>(src);
    e.dst = reinterpret_cast<uint64_t>(dst);
    e.length = s.length;
    e.first_chunk = chunks;
    chunks += (s.length + chunk - 1) / chunk;
  }

  cudaStream_t stream = stream_.get();
  bool table_enqueued = false;
  // After a failure: the reservation is given back at once if nothing reads it yet, else
  // when the stream has passed what was enqueued (or, if even that cannot be tracked, kept
  // for good: the ring grows around it).
  auto fail = [&](absl::Status status) -> absl::Status {
    if (ring == nullptr) return status;
    if (!table_enqueued) {
      ring->ReleaseNewest();
      return status;
    }
    InFlightCopy orphan;
    orphan.ring = ring;
    absl::StatusOr<CudaEvent> event = TakeEvent();
    if (event.ok() && event->Record(stream).ok()) {
      orphan.done = std::move(event).value();
      inflight_.push_back(std::move(orphan));
    } else {
      Log(LogLevel::kError, absl::StrCat("cuda_ipc: ", n, " staging entries kept for good after ",
                                         status.message()));
    }
    return status;
  };

  if (n > 0) {
    absl::Status status = CudaCall(cudaMemcpyAsync(ring->device(begin), ring->host(begin),
                                                   n * sizeof(IpcCopySegment),
                                                   cudaMemcpyHostToDevice, stream),
                                   "cuda_ipc PostWrite: segment table copy");
    if (!status.ok()) return fail(status);
    table_enqueued = true;
  }
  // After the table copy, so that it overlaps the producer's work.
  if (order.ready_event != nullptr) {
    absl::Status status =
        CudaCall(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(order.ready_event), 0),
                 "cuda_ipc PostWrite: cudaStreamWaitEvent(ready_event)");
    if (!status.ok()) return fail(status);
  }
  for (const EngineCopy& c : engine_copies_) {
    absl::Status status =
        CudaCall(cudaMemcpyAsync(c.dst, c.src, c.length, cudaMemcpyDeviceToDevice, stream),
                 "cuda_ipc PostWrite: cudaMemcpyAsync of a long segment");
    if (!status.ok()) return fail(status);
  }
  if (n > 0) {
    IpcCopyParams params;
    params.segments = ring->device(begin);
    params.num_segments = static_cast<uint32_t>(n);
    params.num_chunks = chunks;
    const int grid = static_cast<int>(std::min<uint64_t>(chunks, static_cast<uint64_t>(grid_)));
    absl::Status status = LaunchIpcCopy(params, options_.vectors_per_thread, grid, stream);
    if (!status.ok()) return fail(status);
  }
  absl::StatusOr<CudaEvent> event = TakeEvent();
  if (!event.ok()) return fail(event.status());
  absl::Status recorded = event->Record(stream);
  if (!recorded.ok()) return fail(recorded);
  InFlightCopy copy;
  copy.done = std::move(event).value();
  copy.ring = ring;
  return copy;
}

absl::StatusOr<TransferId> CudaIpcTransport::PostNotification(PeerId peer_id,
                                                              absl::string_view payload) {
  if (payload.empty()) {
    return absl::InvalidArgumentError("cuda_ipc PostNotification: empty payload");
  }
  if (payload.size() > kMaxIpcFramePayloadBytes) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc PostNotification: ",
                                                   payload.size(), " bytes, more than ",
                                                   kMaxIpcFramePayloadBytes));
  }
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(IpcPeer * peer, UsablePeer(peer_id, "PostNotification"));
  IpcTransfer transfer;
  transfer.notification.assign(payload.data(), payload.size());
  transfer.copy_done = true;  // sent in its turn, after every earlier write's data
  return AddTransfer(peer, std::move(transfer));
}

absl::StatusOr<TransferState> CudaIpcTransport::Test(TransferId id) {
  absl::MutexLock lock(&mu_);
  auto it = transfers_.find(id);
  if (it == transfers_.end()) {
    return absl::NotFoundError(absl::StrCat("cuda_ipc: unknown transfer ", id));
  }
  switch (it->second.phase) {
    case IpcPhase::kQueued:
    case IpcPhase::kSending:
      return TransferState::kInProgress;
    case IpcPhase::kDone:
      return TransferState::kDone;
    case IpcPhase::kFailed:
      break;
  }
  return it->second.status;
}

absl::Status CudaIpcTransport::Cancel(TransferId id) {
  absl::MutexLock lock(&mu_);
  auto it = transfers_.find(id);
  if (it == transfers_.end()) {
    return absl::NotFoundError(absl::StrCat("cuda_ipc: unknown transfer ", id));
  }
  // A notification already handed to the socket cannot be taken back: that transfer
  // completes kDone.
  if (it->second.phase == IpcPhase::kQueued) {
    FailTransfer(id, absl::CancelledError(absl::StrCat("cuda_ipc transfer ", id, " cancelled")));
  }
  return absl::OkStatus();
}

void CudaIpcTransport::Release(TransferId id) {
  absl::MutexLock lock(&mu_);
  // Queues and copies in flight refer to it by id and skip it once it is gone.
  transfers_.erase(id);
}

std::vector<Notification> CudaIpcTransport::PollNotifications() {
  absl::MutexLock lock(&mu_);
  std::vector<Notification> out;
  out.swap(inbox_);
  return out;
}

absl::Status CudaIpcTransport::Disconnect(PeerId peer_id) {
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(peer_id);
  if (it == peers_.end()) {
    return absl::NotFoundError(absl::StrCat("cuda_ipc Disconnect: unknown peer ", peer_id));
  }
  IpcPeer* peer = it->second.get();
  const absl::Status cancelled = absl::CancelledError(
      absl::StrCat("cuda_ipc transfer cancelled: disconnected from ", peer->label));
  for (TransferId id : peer->queue) FailTransfer(id, cancelled);
  for (TransferId id : peer->sending) FailTransfer(id, cancelled);
  if (peer->out != nullptr && peer->status.ok()) {
    // A goodbye, so that the peer takes the end of stream for a close, not a death.
    peer->out->Queue(IpcFrameType::kBye, "");
    (void)peer->out->Flush();
  }
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
  callback_ = std::move(callback);
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
