// The cuda_ipc transport's class (cuda_ipc_transport.h says what it does; cuda_ipc_state.h
// how a transfer moves). Its methods live in three files: cuda_ipc_transport.cc (memory,
// peers, posting, the transfer calls), cuda_ipc_enqueue.cc (a write's table and GPU work)
// and cuda_ipc_progress.cc (what Progress advances: connections, copy completions,
// notifications, peer failures); CreateCudaIpcTransport is in cuda_ipc_create.cc.
#ifndef KVSTREAM_TRANSFER_CUDA_IPC_CUDA_IPC_TRANSPORT_IMPL_H_
#define KVSTREAM_TRANSFER_CUDA_IPC_CUDA_IPC_TRANSPORT_IMPL_H_

#include <cstddef>
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
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "cuda_ipc/copy_kernel.h"
#include "cuda_ipc/cuda_ipc_state.h"
#include "cuda_ipc/ipc_stream.h"
#include "cuda_ipc/staging_ring.h"
#include "kvstream/transfer/cuda_ipc_transport.h"
#include "kvstream/transfer/socket.h"
#include "kvstream/transfer/transport.h"
#include "peer_error_reports.h"

namespace kvstream {
namespace internal {

// The unit of a per-segment kernel (kCta for kChunked, which has none).
inline IpcCopyUnit IpcUnitOf(CudaIpcKernel kernel) {
  switch (kernel) {
    case CudaIpcKernel::kWarpPerSegment: return IpcCopyUnit::kWarp;
    case CudaIpcKernel::kWideCtaPerSegment: return IpcCopyUnit::kWideCta;
    default: return IpcCopyUnit::kCta;
  }
}

// What Create() settles before the transport exists.
struct CudaIpcSetup {
  CudaIpcTransportOptions options;
  int grid = 0;  // CTAs of a full copy launch
  uint64_t uid = 0;
  std::string device_uuid;
  std::string socket_name;
  ScopedFd listener;
  IpcStream stream;
  // CudaIpcTableMode::kSideStreamCopy and kAuto: the table copies' stream and the event the copy
  // stream waits for (re-recorded by every write: a wait captures the state at its call).
  IpcStream side_stream;
  CudaEvent table_ready;
  std::unique_ptr<StagingRing> ring;
};

// What PostWrite's checking pass learnt about a write's segments.
struct WritePlan {
  size_t entries = 0;  // kernel table entries (pieces of the segments the kernel copies)
  size_t engine = 0;   // segments for the copy engine
};

// Checks every segment against the regions (OutOfRange naming the first that does not fit)
// and counts what the write needs; the only pass over the segments before the one that
// writes the table.
absl::StatusOr<WritePlan> PlanWrite(absl::Span<const Segment> segments, uint64_t local_length,
                                    uint64_t remote_length,
                                    const CudaIpcTransportOptions& options);

class CudaIpcTransport final : public Transport {
 public:
  using Transport::PostWrite;
  explicit CudaIpcTransport(CudaIpcSetup setup);
  ~CudaIpcTransport() override;

  absl::string_view name() const override { return "cuda_ipc"; }
  TransportCapabilities capabilities() const override;
  absl::StatusOr<std::string> LocalInfo() override;
  absl::StatusOr<std::unique_ptr<MemoryRegistration>> RegisterMemory(void* base, size_t length,
                                                                     MemoryKind kind) override;
  absl::StatusOr<std::unique_ptr<MemoryRegistration>> AllocateMemory(size_t length,
                                                                      MemoryKind kind) override;
  absl::StatusOr<PeerId> Connect(absl::string_view peer_info) override;
  absl::StatusOr<PeerId> Accept(absl::string_view peer_info) override;
  absl::StatusOr<std::unique_ptr<RemoteMemory>> ImportRemote(
      PeerId peer, absl::string_view descriptor) override;
  absl::StatusOr<TransferId> PostWrite(PeerId peer, const MemoryRegistration& local,
                                       const RemoteMemory& remote,
                                       absl::Span<const Segment> segments,
                                       absl::string_view notification,
                                       const WriteOrder& order) override;
  absl::StatusOr<TransferId> PostNotification(PeerId peer, absl::string_view payload) override;
  absl::StatusOr<TransferState> Test(TransferId id) override;
  absl::Status Cancel(TransferId id) override;
  void Release(TransferId id) override;
  absl::Status Progress() override;
  std::vector<Notification> PollNotifications() override;
  absl::Status Disconnect(PeerId peer) override;
  absl::Status PeerStatus(PeerId peer) override;
  void SetPeerErrorCallback(PeerErrorCallback callback) override;

  size_t OpenMappingCount();
  void SetCopyTiming(bool on);
  std::vector<CudaIpcCopyTiming> TakeCopyTimings();

 private:
  // --- cuda_ipc_transport.cc ---
  absl::StatusOr<std::unique_ptr<MemoryRegistration>> Register(void* base, size_t length,
                                                               DeviceBuffer owned);
  // The peer if it can take new work: NotFound (unknown), FailedPrecondition (failed, or
  // never connected to).
  absl::StatusOr<IpcPeer*> UsablePeer(PeerId peer, absl::string_view op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  IpcPeer* NewPeer(uint64_t uid, uint32_t pid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // --- cuda_ipc_enqueue.cc ---
  // Writes the table and enqueues its copy (if the mode has one), the wait for
  // `order.ready_event`, the copy and its completion event.
  absl::StatusOr<InFlightCopy> EnqueueCopy(absl::Span<const Segment> segments,
                                           const WritePlan& plan, const char* src_base,
                                           char* dst_base, const WriteOrder& order)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::pair<StagingRing*, size_t>> ReserveStaging(size_t n)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<CudaEvent> TakeEvent(bool timing) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives a completed event back to its pool.
  void ReturnEvent(CudaEvent event, bool timing) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The pieces of the kernel's segments, as table entries (IpcCopySegment or
  // IpcParamSegment) at `out`; segments for the copy engine go to engine_copies_. Returns
  // how many entries were written.
  template <typename Entry>
  size_t WriteEntries(absl::Span<const Segment> segments, const char* src_base,
                      char* dst_base, Entry* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // --- cuda_ipc_progress.cc ---
  void AcceptConnections() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReadPending() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The peer that connection frames from `uid` belong to (created if new).
  IpcPeer* PeerForUid(uint64_t uid, uint32_t pid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReadInbound(IpcPeer* peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WatchOutbound(IpcPeer* peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Retires completed copies, oldest first; never blocks.
  void PollCopies() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SendReady(IpcPeer* peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the peer failed (first error wins), fails its transfers, closes its connections
  // and drops its mappings; the callback is told from Progress.
  void FailPeer(IpcPeer* peer, const absl::Status& cause) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The destructor's part: fail everything, close peers, wait (bounded) for copies.
  void Shutdown();

  const CudaIpcTransportOptions options_;
  const int device_;
  const int grid_;
  const uint64_t uid_;
  const std::string device_uuid_;
  const std::string socket_name_;
  const std::string socket_label_;

  absl::Mutex mu_;
  ScopedFd listener_ ABSL_GUARDED_BY(mu_);
  IpcStream stream_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<StagingRing> ring_ ABSL_GUARDED_BY(mu_);
  // Outgrown rings, kept (their last copies may still read them) and freed at destruction.
  std::vector<std::unique_ptr<StagingRing>> retired_rings_ ABSL_GUARDED_BY(mu_);
  IpcStream side_stream_ ABSL_GUARDED_BY(mu_);
  CudaEvent table_ready_ ABSL_GUARDED_BY(mu_);
  std::vector<CudaEvent> free_events_ ABSL_GUARDED_BY(mu_);
  std::vector<CudaEvent> free_timing_events_ ABSL_GUARDED_BY(mu_);
  bool timing_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<CudaIpcCopyTiming> timings_ ABSL_GUARDED_BY(mu_);
  std::deque<InFlightCopy> inflight_ ABSL_GUARDED_BY(mu_);  // stream order
  std::map<PeerId, std::unique_ptr<IpcPeer>> peers_ ABSL_GUARDED_BY(mu_);
  // Accepted connections that have not said hello yet.
  std::vector<std::unique_ptr<IpcConnection>> pending_ ABSL_GUARDED_BY(mu_);
  IpcTransfers transfers_ ABSL_GUARDED_BY(mu_){"cuda_ipc"};
  PeerErrorReports peer_errors_ ABSL_GUARDED_BY(mu_);
  PeerId next_peer_ ABSL_GUARDED_BY(mu_) = 1;
  // Transports (by uid) this side disconnected from: a connection they open is dropped at
  // its hello, until Accept or Connect of them again (transport.h: Disconnect).
  std::set<uint64_t> refused_uids_ ABSL_GUARDED_BY(mu_);
  // Scratch of EnqueueCopy: segments for the copy engine (src, dst, length).
  struct EngineCopy {
    const char* src;
    char* dst;
    uint64_t length;
  };
  std::vector<EngineCopy> engine_copies_ ABSL_GUARDED_BY(mu_);
  // Scratch of EnqueueCopy: a table passed in the kernel's parameters (32 KiB, kept here
  // rather than on the stack).
  std::unique_ptr<IpcParamTable<kIpcParamSegments>> param_table_ ABSL_GUARDED_BY(mu_);
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_CUDA_IPC_CUDA_IPC_TRANSPORT_IMPL_H_
