// The nccl transport's bookkeeping (nccl_transport.h says what the transport does): transfers,
// batches, links, peers and the handles it gives out. Private to transfer/src/nccl/; guarded
// by the transport's mutex.
//
// A write's life: PostWrite makes a transfer (kQueued, in its peer's `queue`, post order) and
// a SendWrite on the peer's send link. Once the link is welcomed (the receiver said what a
// batch may hold) the write is planned into SendBatches, which are issued in order, one NCCL
// group at a time, when the communicator is ready: kQueued -> kIssuing (ncclGroupEnd said
// in progress) -> kIssued (its `done` event recorded). A completed batch (done event) counts
// down its transfer's batches_left. When a transfer with none left reaches the front of its
// peer's queue its notification frame is queued on the send link's connection (kSending);
// once the socket took the last byte it is kDone (without a notification: kDone at once). A
// failure or Cancel moves it to kFailed at any point before that; its batches not yet issued
// are dropped, those issued run on.
//
// A batch's life on the receiver: its header arrives (RecvBatch kQueued, checked and
// planned against the destination region at once), is issued when the communicator is ready
// (its ncclRecv group; kIssuing; kIssued with its scatter enqueued and `landed` recorded),
// and lands when `landed` completes. A notification that arrives after n batches is held
// until n batches landed.
#ifndef KVSTREAM_TRANSFER_SRC_NCCL_NCCL_STATE_H_
#define KVSTREAM_TRANSFER_SRC_NCCL_NCCL_STATE_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "cuda_ipc/ipc_connection.h"
#include "cuda_ipc/ipc_stream.h"
#include "cuda_ipc/staging_ring.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/transfer/transport.h"
#include "nccl/nccl_api.h"
#include "nccl/nccl_comm_state.h"
#include "nccl/nccl_plan.h"
#include "nccl/nccl_wire.h"

namespace kvstream {
namespace internal {

inline constexpr int kNcclStagingSlots = 2;

enum class NcclPhase { kQueued, kSending, kDone, kFailed };

struct NcclTransfer {
  PeerId peer = 0;
  NcclPhase phase = NcclPhase::kQueued;
  size_t batches_left = 0;  // issued or not; counted down as they complete
  bool planned = false;     // its batches exist (a write is planned once its link is welcomed)
  // The write's WriteOrder::ready_event as captured at post time (null: none). Read before
  // the tail.
  std::shared_ptr<CudaEvent> ready;
  std::string notification;
  const void* tail = nullptr;  // WriteOrder::notification_tail
  size_t tail_bytes = 0;
  uint64_t send_mark = 0;  // kSending: done once the connection sent this many bytes
  absl::Status status;     // kFailed: why

  bool active() const { return phase == NcclPhase::kQueued || phase == NcclPhase::kSending; }
};

// A write waiting for its link's welcome, to be planned with the limits it gives.
struct SendWrite {
  TransferId transfer = 0;
  std::vector<Segment> segments;
  uint64_t region_id = 0;
  const char* local_base = nullptr;
  std::shared_ptr<CudaEvent> ready;
};

enum class BatchPhase { kQueued, kIssuing, kIssued };

struct SendBatch {
  TransferId transfer = 0;
  NcclSendBatch plan;
  const char* local_base = nullptr;
  std::shared_ptr<CudaEvent> ready;
  BatchPhase phase = BatchPhase::kQueued;
  int slot = -1;  // staging slot of its gather (-1: nothing gathered)
  size_t table_entries = 0;  // its run of the link's table ring (0: none)
  CudaEvent done;      // after its group on the link's NCCL stream
  absl::Time issued_at = absl::InfiniteFuture();
};

struct RecvBatch {
  NcclBatchHeader header;
  NcclRecvBatch plan;
  char* region_base = nullptr;
  BatchPhase phase = BatchPhase::kQueued;
  int slot = -1;
  size_t table_begin = 0;    // its scatter's run of the link's table ring,
  size_t table_entries = 0;  // written at issue (0: nothing to scatter)
  CudaEvent landed;  // after its scatter (or its receive, all in place)
  absl::Time issued_at = absl::InfiniteFuture();
};

// A link's GPU resources, on the transport's device. They outlive the link while GPU work
// may still use them (the transport retires them until both streams are idle).
struct LinkGpu {
  IpcStream nccl;  // the communicator's operations
  IpcStream copy;  // the gathers (send link) or scatters (receive link)
  DeviceBuffer staging[kNcclStagingSlots];  // allocated on first use
  // The last device use of each slot (a send, or a scatter); `recorded` once it has one.
  CudaEvent slot_free[kNcclStagingSlots];
  bool recorded[kNcclStagingSlots] = {false, false};
  int next_slot = 0;
  CudaEvent step;  // re-recorded: the gather (or the receive) a stream waits for
  std::unique_ptr<StagingRing> tables;
};

// One direction of a peer pair: the writer's send link (made by Connect, rank 0), or the
// receiver's receive link (made by the writer's hello, rank 1).
struct NcclLink {
  // `role` ("send link", "receive link") prefixes the state's errors, which the peer's own
  // label prefixes in turn; `link_label` names the link alone (NCCL errors, the connection).
  NcclLink(std::string link_label, const char* role, absl::Duration join_timeout,
           absl::Duration op_timeout)
      : state(role, join_timeout, op_timeout), label(std::move(link_label)) {}
  NcclCommState state;
  std::string label;
  NcclComm comm;
  std::unique_ptr<IpcConnection> conn;
  std::unique_ptr<LinkGpu> gpu;
  uint64_t next_serial = 0;  // batches issued (send) or announced (receive) so far
};

struct SendLink : NcclLink {
  using NcclLink::NcclLink;
  bool welcomed = false;
  NcclPlanLimits limits;  // ours, narrowed by the welcome
  std::deque<SendWrite> unplanned;
  std::deque<SendBatch> batches;  // post order; issued ones first
};

struct RecvLink : NcclLink {
  using NcclLink::NcclLink;
  uint64_t landed = 0;            // batches landed so far
  std::deque<RecvBatch> batches;  // announced and not landed, in order
  struct Held {
    uint64_t after = 0;  // delivered once this many batches landed
    Notification note;
  };
  std::deque<Held> held;
};

struct NcclPeer {
  PeerId id = 0;
  uint64_t uid = 0;
  uint32_t pid = 0;
  std::string label;     // "nccl peer 3 (uid ..., pid 1234)"
  absl::Status status;   // OK while healthy
  std::unique_ptr<SendLink> send;  // from Connect; null before
  std::unique_ptr<RecvLink> recv;  // from its hello; null before, and after its goodbye
  std::deque<TransferId> queue;    // kQueued transfers, post order
  std::deque<TransferId> sending;  // kSending transfers, post order
};

// A registered local range; from AllocateMemory it owns the memory. Destroying it forgets
// its region id (batches naming it fail their peer afterwards).
class NcclTransportCore;
class NcclRegistration final : public MemoryRegistration {
 public:
  NcclRegistration(NcclTransportCore* owner, uint64_t region_id, void* base, size_t length,
                   std::string descriptor, DeviceBuffer owned)
      : owned_(std::move(owned)), owner_(owner), region_id_(region_id), base_(base),
        length_(length), descriptor_(std::move(descriptor)) {}
  ~NcclRegistration() override;

  void* base() const override { return base_; }
  size_t length() const override { return length_; }
  MemoryKind memory_kind() const override { return MemoryKind::kDevice; }
  const std::string& descriptor() const override { return descriptor_; }
  const NcclTransportCore* owner() const { return owner_; }
  uint64_t region_id() const { return region_id_; }

 private:
  DeviceBuffer owned_;  // empty unless from AllocateMemory
  NcclTransportCore* owner_;
  uint64_t region_id_;
  void* base_;
  size_t length_;
  std::string descriptor_;
};

// A peer's region: its id there and its length.
class NcclRemote final : public RemoteMemory {
 public:
  NcclRemote(const void* owner, PeerId peer, uint64_t region_id, uint64_t length)
      : owner_(owner), peer_(peer), region_id_(region_id), length_(length) {}
  PeerId peer() const override { return peer_; }
  size_t length() const override { return length_; }
  const void* owner() const { return owner_; }
  uint64_t region_id() const { return region_id_; }

 private:
  const void* owner_;
  PeerId peer_;
  uint64_t region_id_;
  uint64_t length_;
};

// What registrations call back into (the transport).
class NcclTransportCore {
 public:
  virtual ~NcclTransportCore() = default;
  virtual void ForgetRegion(uint64_t region_id) = 0;
};

inline NcclRegistration::~NcclRegistration() { owner_->ForgetRegion(region_id_); }

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_NCCL_NCCL_STATE_H_
