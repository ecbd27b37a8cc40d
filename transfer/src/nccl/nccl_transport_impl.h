// The nccl transport's class (nccl_transport.h says what it does; nccl_state.h how a
// transfer moves). Its methods live in four files: nccl_transport.cc (memory, peers,
// posting, the transfer calls), nccl_enqueue.cc (a batch's GPU work and NCCL group on
// either side), nccl_progress.cc (what Progress advances: connections, frames, communicator
// states, completions, notifications, deadlines, failures) and nccl_create.cc (options and
// creation).
#ifndef KVSTREAM_TRANSFER_SRC_NCCL_NCCL_TRANSPORT_IMPL_H_
#define KVSTREAM_TRANSFER_SRC_NCCL_NCCL_TRANSPORT_IMPL_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "cuda_ipc/ipc_stream.h"
#include "kvstream/transfer/nccl_transport.h"
#include "kvstream/transfer/socket.h"
#include "kvstream/transfer/transport.h"
#include "peer_error_reports.h"
#include "nccl/nccl_state.h"

namespace kvstream {
namespace internal {

// What Create() settles before the transport exists.
struct NcclSetup {
  NcclTransportOptions options;
  uint64_t uid = 0;
  uint32_t nccl_version = 0;
  std::string device_uuid;
  int copy_grid = 0;
  ScopedFd listener;
  uint16_t port = 0;
  IpcStream order;  // holds only waits for callers' ready events
};

class NcclTransport final : public Transport, public NcclTransportCore {
 public:
  using Transport::PostWrite;
  explicit NcclTransport(NcclSetup setup);
  ~NcclTransport() override;

  absl::string_view name() const override { return "nccl"; }
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

  void ForgetRegion(uint64_t region_id) override;
  size_t LiveCommunicatorCount();

 private:
  struct Region {
    char* base = nullptr;
    uint64_t length = 0;
  };

  // --- nccl_transport.cc ---
  absl::StatusOr<std::unique_ptr<MemoryRegistration>> Register(void* base, size_t length,
                                                               DeviceBuffer owned);
  NcclPeer* NewPeer(uint64_t uid, uint32_t pid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The peer if it can take new work: NotFound (unknown), FailedPrecondition (failed, or no
  // send link: never connected to, or closed).
  absl::StatusOr<NcclPeer*> UsablePeer(PeerId peer, absl::string_view op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The peer info's reasons to refuse it (another job, another NCCL, this GPU); OK if none.
  absl::Status CheckPeer(absl::string_view job_id, uint32_t nccl_version,
                         absl::string_view device_uuid, absl::string_view who) const;
  // Streams, events and the table ring of a new link.
  absl::StatusOr<std::unique_ptr<LinkGpu>> NewLinkGpu();
  absl::StatusOr<CudaEvent> TakeEvent() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReturnEvent(CudaEvent event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // --- nccl_enqueue.cc ---
  // Plans the welcomed link's unplanned writes into batches.
  absl::Status PlanWrites(SendLink& link) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Issues the send link's queued batches in order while its communicator is ready: header
  // frame, gather, group, events. An error fails the peer (the caller's to do).
  absl::Status IssueSends(NcclPeer& peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status IssueReceives(NcclPeer& peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ncclGroupEnd of `ops` with the link's other rank `peer`: true when the group is on its
  // stream now, false when NCCL enqueues it in the background (the batch is then kIssuing,
  // finished when the communicator says so); the link's failure otherwise.
  absl::StatusOr<bool> IssueGroup(NcclLink& link, int peer, const std::vector<NcclOp>& ops)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What follows a group once it is on its stream (kIssued).
  absl::Status FinishSend(SendLink& link, SendBatch& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status FinishReceive(RecvLink& link, RecvBatch& batch)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Allocates staging slot `slot` of `gpu` on first use.
  absl::Status EnsureSlot(LinkGpu& gpu, int slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes the copy kernel's table for `segments` (src_base + local offset -> dst_base +
  // remote offset) into the next run of the link's table ring: true and the run, or false
  // when the ring has no room now (entries come back as earlier batches complete).
  // ResourceExhausted when the table could never fit.
  absl::StatusOr<bool> ReserveTable(LinkGpu& gpu, absl::Span<const Segment> segments,
                                    const char* src_base, char* dst_base, size_t* begin,
                                    size_t* entries) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The staging slot a batch that stages takes next (allocated on first use) and its copy
  // table's run of the ring: segments from `base` into the slot (`gather`, the writer) or
  // from the slot into `base` (the receiver's scatter). Nullopt when the ring has no room
  // now (nothing is taken; entries come back as earlier batches complete).
  absl::StatusOr<std::optional<SlotRun>> TakeSlot(LinkGpu& gpu,
                                                  absl::Span<const Segment> segments,
                                                  bool gather, char* base)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Launches the copy kernel over a reserved run on gpu.copy. Never blocks.
  absl::Status LaunchCopy(LinkGpu& gpu, size_t begin, size_t entries)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The most pieces a batch may hold here, so that two batches' tables fit the ring however
  // their pieces are cut.
  uint32_t MaxPiecesPerBatch() const;

  // --- nccl_progress.cc ---
  void AcceptConnections() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReadPending() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A writer's hello on an accepted connection: the receive link, or a refusal.
  void AcceptHello(std::unique_ptr<IpcConnection> conn, const NcclHello& hello)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reads what the link's connection holds and hands each whole frame to `on_frame(type,
  // payload)`: true reads on, false stops (the link ended), an error fails the peer. The
  // peer fails too on a read error, a malformed frame, or an end without a goodbye.
  template <typename OnFrame>
  void ReadFrames(NcclPeer& peer, NcclLink& link, OnFrame on_frame)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReadSendLink(NcclPeer& peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReadRecvLink(NcclPeer& peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Polls the peer's send (or receive) link's communicator and acts on what it says; false
  // when the peer failed.
  bool PollComm(NcclPeer& peer, bool send) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Retires completed batches, oldest first; never blocks.
  void PollSends(NcclPeer& peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PollReceives(NcclPeer& peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CheckDeadlines(NcclPeer& peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SendReady(NcclPeer& peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the peer failed (first error wins), aborts its communicators, fails its transfers,
  // closes its connections and retires its links' GPU resources; the callback is told from
  // Progress. `notify`: false for Disconnect (no callback, status stays for PeerStatus).
  void FailPeer(NcclPeer& peer, const absl::Status& cause, bool notify = true)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends a link: aborts its communicator, drops its connection, retires its GPU resources.
  void EndLink(NcclLink& link, bool fail, const absl::Status& cause)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees retired GPU resources whose streams are idle.
  void FreeIdleRetired() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The destructor's part: fail everything, say goodbye, abort, wait (bounded) for the GPU.
  void Shutdown();

  const NcclTransportOptions options_;
  const int device_;
  const uint64_t uid_;
  const uint32_t nccl_version_;
  const std::string device_uuid_;
  const int copy_grid_;
  const uint16_t port_;
  const std::string listener_label_;

  absl::Mutex mu_;
  ScopedFd listener_ ABSL_GUARDED_BY(mu_);
  IpcStream order_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Region> regions_ ABSL_GUARDED_BY(mu_);
  uint64_t next_region_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<PeerId, std::unique_ptr<NcclPeer>> peers_ ABSL_GUARDED_BY(mu_);
  // Accepted connections that have not said hello yet.
  std::vector<std::unique_ptr<IpcConnection>> pending_ ABSL_GUARDED_BY(mu_);
  NcclTransfers transfers_ ABSL_GUARDED_BY(mu_){"nccl"};
  PeerErrorReports peer_errors_ ABSL_GUARDED_BY(mu_);
  std::vector<CudaEvent> free_events_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<LinkGpu>> retired_ ABSL_GUARDED_BY(mu_);
  PeerId next_peer_ ABSL_GUARDED_BY(mu_) = 1;
  // Transports (by uid) this side disconnected from: their hellos are refused until Accept
  // or Connect of them again (transport.h: Disconnect).
  std::set<uint64_t> refused_uids_ ABSL_GUARDED_BY(mu_);
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_NCCL_NCCL_TRANSPORT_IMPL_H_
