// The state of one UCX transport (private to transfer/): its UCP context and worker, peers,
// transfers, and the transitions a transfer goes through (copying, flushing, notifying,
// done or failed). UcxTransport (ucx_transport.cc) is the Transport facade over it; the
// handles (ucx_memory.h) and the UCX callbacks (ucx_core.cc) work on it directly.
//
// Threading: every member marked GUARDED_BY(mu) and every UCX call is made with `mu` held
// (the worker runs in UCS_THREAD_MODE_SERIALIZED). UCX runs the callbacks only from inside
// calls made with `mu` held (ucp_worker_progress, a forced ucp_ep_close_nbx), so they touch
// the core without locking again.
//
// Lifetimes: transfers and peers live in maps owned by the core; UCX callbacks receive raw
// pointers to them. A transfer released while a UCX request still points at it moves to
// `zombies` until the request's callback; a disconnected peer is erased only once its
// endpoint has closed.
#ifndef KVSTREAM_TRANSFER_SRC_UCX_UCX_CORE_H_
#define KVSTREAM_TRANSFER_SRC_UCX_UCX_CORE_H_

#include <ucp/api/ucp.h>

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
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "copy_pool.h"
#include "kvstream/transfer/transport.h"
#include "ucx/staged_wire.h"
#include "ucx/ucx_handles.h"
#include "ucx/ucx_wire.h"

namespace kvstream {
namespace internal {

// Active-message id of notifications (any id is fine: only kvstream uses this worker).
inline constexpr unsigned kNotificationAmId = 17;
// How long the destructor waits for UCX to return every outstanding request.
inline constexpr absl::Duration kShutdownTimeout = absl::Seconds(10);
// Bound on ucp_worker_progress calls per Progress(), so Progress never spins for long.
inline constexpr int kMaxProgressCalls = 64;

struct UcxCore;
struct UcxPeer;
// The staged device path's state (ucx/staged_engine.h).
struct StagedSend;
struct StagedOut;
struct StagedIn;
struct StagedEngine;

struct StagedOptions {
  uint64_t chunk_bytes = uint64_t{4} << 20;  // a slot's size
  uint32_t slots = 4;                        // slots per sender and receiver pair
};

// A device region this transport registered, by region id.
struct DeviceRegion {
  char* base = nullptr;
  uint64_t length = 0;
};

// A message the staged handler received, processed in Progress (outside UCX callbacks).
struct StagedInbound {
  StagedHeader header;
  std::string body;
};

// A control message of the staged path in flight (owned by UcxCore::control_sends).
struct ControlSend {
  UcxCore* core = nullptr;
  std::string header, body;
  void* request = nullptr;
};

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
  // Staged device writes: the chunks' state (null for other transfers), and the
  // notification tail appended when the notification is sent (WriteOrder).
  std::unique_ptr<StagedSend> staged;
  const void* tail = nullptr;
  size_t tail_bytes = 0;
  // Staged writes posted to the peer before the notification (ucx/staged_engine.h).
  uint64_t watermark = 0;
  // Write pieces' headers (ucx/am_writes.h), which UCX reads until the flush completes.
  std::vector<WriteHeader> write_headers;

  UcxTransfer();
  ~UcxTransfer();
  bool active() const {
    return phase == Phase::kCopying || phase == Phase::kFlushing || phase == Phase::kNotifying;
  }
  // Whether bytes of its own remain to be copied (copy threads) or staged.
  bool copying() const;
};

struct UcxPeer {
  UcxCore* core = nullptr;
  PeerId id = 0;
  uint64_t uid = 0;
  std::string label;  // "peer 3 (uid 0x...)" for messages
  UcxEndpoint ep;     // empty for a peer known only from its notifications, or once closing
  bool connected = false;
  bool disconnected = false;  // Disconnect() was called: erase once the close is done
  // The fence epoch of the worker info this side connected with (ucx_wire.h), stamped on
  // everything it sends to the peer.
  uint64_t stamp = 0;
  void* close_request = nullptr;
  absl::Status status;                // OK while healthy
  std::set<UcxTransfer*> outstanding;  // active transfers to this peer
  std::deque<UcxTransfer*> waiting;    // kCopying transfers, in post order
  // Staged device path: sequence numbers given out to writes to this peer, the sending
  // side's link and slots, the receiving side's landing area and ordering.
  uint64_t staged_posted = 0;
  std::unique_ptr<StagedOut> out;
  std::unique_ptr<StagedIn> in;

  UcxPeer();
  ~UcxPeer();
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
  std::string worker_address;  // this worker's UCX address
  // LocalInfo(): the uid, the fence epoch and the address (RefreshLocalInfo).
  std::string local_info ABSL_GUARDED_BY(mu);
  // Writers this side fenced off (Disconnect) so far.
  uint64_t fence_epoch ABSL_GUARDED_BY(mu) = 0;
  bool network = false;  // the chosen transports can leave this host
  bool am_writes = false;  // host writes travel as active messages (ucx/am_writes.h)

  // Memory from AllocateMemory, by base address, so that RegisterMemory of a range inside
  // one reuses its memory handle (and so its shared-memory remote key).
  std::map<uintptr_t, UcxAllocation> allocations ABSL_GUARDED_BY(mu);
  // Every host registration's range (base -> length), where write pieces may land; and the
  // pieces dropped because they did not (ucx/am_writes.h).
  std::multimap<uintptr_t, size_t> host_regions ABSL_GUARDED_BY(mu);
  uint64_t dropped_write_pieces ABSL_GUARDED_BY(mu) = 0;
  // Senders (by uid) this side disconnected from: their write pieces and notifications are
  // dropped until Accept or Connect of them again (ucx_transport.h: Disconnect).
  std::set<uint64_t> refused_uids ABSL_GUARDED_BY(mu);
  // Senders (by uid) this side disconnected from, and the fence epoch from which their
  // stamps are accepted again: whatever they sent stamped below it is dropped for good.
  std::map<uint64_t, uint64_t> stamps_from ABSL_GUARDED_BY(mu);
  // Headers of write pieces whose transfer could not be posted, kept until Shutdown because
  // UCX may still read them.
  std::vector<std::vector<WriteHeader>> orphan_headers ABSL_GUARDED_BY(mu);
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

  // Staged device path (ucx/staged_engine.h): the engine (from the first device
  // registration), device regions by id, received messages, control messages in flight.
  StagedOptions staged_options;
  std::unique_ptr<StagedEngine> staged ABSL_GUARDED_BY(mu);
  std::map<uint64_t, DeviceRegion> device_regions ABSL_GUARDED_BY(mu);
  uint64_t next_region_id ABSL_GUARDED_BY(mu) = 1;
  std::deque<StagedInbound> staged_inbox ABSL_GUARDED_BY(mu);
  std::map<ControlSend*, std::unique_ptr<ControlSend>> control_sends ABSL_GUARDED_BY(mu);

  UcxCore();
  ~UcxCore();

  // Installs the handlers of notifications, write pieces and staged messages on the worker
  // (once, at creation).
  absl::Status InstallHandlers();

  UcxPeer* NewPeer(uint64_t peer_uid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Gives `peer` an endpoint to the worker `address` (error mode PEER).
  absl::Status ConnectPeer(UcxPeer* peer, const std::string& address)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Sends a staged control message to the peer (eager active message); a failure to send
  // fails the peer.
  void SendControl(UcxPeer* peer, StagedType type, std::string body)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // The peer under which notifications from `sender_uid` are reported: the connected one
  // if any, else one created for it.
  UcxPeer* PeerForUid(uint64_t sender_uid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Whether what `sender_uid` sent stamped `stamp` is to be dropped: this side disconnected
  // from it and has not accepted it since (refused_uids), or the stamp is from before a
  // fence (stamps_from).
  bool Fenced(uint64_t sender_uid, uint64_t stamp) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Fences `sender_uid` off: refused until accepted, and its stamps from before now for
  // good (a new fence epoch, which local_info carries from now on).
  void Fence(uint64_t sender_uid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Re-encodes local_info from uid, fence_epoch and worker_address.
  void RefreshLocalInfo() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  void FailTransfer(UcxTransfer* t, absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Moves the peer's waiting transfers on to their flush, in post order, as far as their
  // copies are done.
  void Pump(UcxPeer* peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // A copy job's `done`: every byte of transfer `id` is in the peer's memory.
  void CopiesDone(TransferId id) ABSL_LOCKS_EXCLUDED(mu);
  // Fails the transfers still copying from or into `handle` (a registration or remote
  // memory being destroyed): when this returns, none of their pieces is being copied.
  void FailCopiesThrough(const void* handle, absl::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Flushes the endpoint, then sends the notification (OnFlushed).
  absl::Status StartFlush(UcxTransfer* t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  void SendNotification(UcxTransfer* t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  void CompleteTransfer(UcxTransfer* t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Marks the peer failed (first error wins), fails its outstanding transfers with the
  // error, and schedules the forced close UCX requires after an endpoint error.
  void FailPeer(UcxPeer* peer, const absl::Status& error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // A UCX request finished: forget it, and delete the transfer if it was released.
  // Returns false when the transfer no longer exists.
  bool RequestDone(UcxTransfer* t, void* request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Closes endpoints of failed peers, finishes closes, and erases disconnected peers whose
  // endpoint has closed.
  void Maintain() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Fails every transfer, force-closes every endpoint and waits (bounded) until UCX has
  // returned every request, so that no callback can run on freed memory later.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu);
};

// The endpoint-error callback for an endpoint to `peer` (passed to ucp_ep_create).
void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_UCX_UCX_CORE_H_
