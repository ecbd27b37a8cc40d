// Transport: how kvstream moves bytes between workers. It knows bytes, addresses and peers,
// not layers or requests (those are the connector's).
//
// A transfer is a batch of (local offset, remote offset, length) segments written from a
// registered local region into a peer's registered region, optionally followed by a small
// notification that the peer sees only after all of the batch's data is in place there.
//
//   ASSIGN_OR_RETURN(auto transport, CreateTransport(options));
//   ASSIGN_OR_RETURN(auto local, transport->RegisterMemory(buf, len, MemoryKind::kHost));
//   // (or transport->AllocateMemory(len, MemoryKind::kHost): memory peers write fastest)
//   // ... exchange transport->LocalInfo() and local->descriptor() with the peer ...
//   ASSIGN_OR_RETURN(PeerId peer, transport->Connect(peer_info));
//   ASSIGN_OR_RETURN(auto remote, transport->ImportRemote(peer, peer_descriptor));
//   ASSIGN_OR_RETURN(TransferId id, transport->PostWrite(peer, *local, *remote, segments, "n"));
//   ASSIGN_OR_RETURN(TransferState s, WaitForTransfer(*transport, id, deadline));
//   transport->Release(id);
//
// Contract shared by every implementation (as NCCL's and NIXL's backend tables):
// - Posting never blocks: PostWrite/PostNotification queue work and return an id.
// - "Not finished yet" is a value (TransferState::kInProgress), not an error.
// - Progress is explicit: work advances inside Progress() (and may advance inside Post*).
// - Ordering: a notification is delivered only after the data of its own batch and of every
//   write posted earlier to the same peer is in place at the peer (so a connector may post
//   a layer's K and V as two batches and notify with the second).
// - A peer error (the peer died, the link broke) fails every outstanding transfer to that
//   peer with an error Status naming the peer; later posts to it fail at once.
// - Every wait takes a deadline (WaitForTransfer).
// Thread safety: every method may be called from any thread; implementations serialise
// internally. Handles (registrations, remote memory) must be destroyed before the Transport.
#ifndef KVSTREAM_TRANSFER_TRANSPORT_H_
#define KVSTREAM_TRANSFER_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvstream/common/dtype.h"

namespace kvstream {

using PeerId = uint64_t;
using TransferId = uint64_t;

// Transport::AllocateMemory aligns what it returns to at least this many bytes (a cache line).
inline constexpr size_t kMinAllocationAlignment = 64;

struct TransportCapabilities {
  bool one_sided_write = false;  // PostWrite lands in remote memory without the peer posting
  bool notifications = false;    // PostWrite/PostNotification deliver notifications
  bool host_memory = false;
  bool device_memory = false;
  bool inter_process = false;
  bool inter_node = false;
  // A write's kDone (Test) means its data is in place at the peer, not merely handed to a
  // socket or a staging buffer: the peer may then reuse the memory it wrote into as soon as
  // the writer says it is done, by any channel. Otherwise only a notification posted after
  // the write (the ordering above) tells the peer that nothing of it is still on its way.
  bool delivered_at_completion = false;
};

// A registered local memory region. Deregisters on destruction. Not copyable.
class MemoryRegistration {
 public:
  virtual ~MemoryRegistration() = default;
  virtual void* base() const = 0;
  virtual size_t length() const = 0;
  virtual MemoryKind memory_kind() const = 0;
  // What a peer passes to Transport::ImportRemote to write into this region: an opaque,
  // self-describing byte string (address, length, packed remote key).
  virtual const std::string& descriptor() const = 0;
};

// A peer's region, imported from its descriptor (owns the unpacked remote key).
class RemoteMemory {
 public:
  virtual ~RemoteMemory() = default;
  virtual PeerId peer() const = 0;
  virtual size_t length() const = 0;
};

struct Segment {
  uint64_t local_offset = 0;   // from the local registration's base
  uint64_t remote_offset = 0;  // from the remote region's start
  uint64_t length = 0;
};

// How a write is ordered after the poster's own GPU work (device memory only).
struct WriteOrder {
  // A cudaEvent_t recorded on the producer's stream (for example right after a layer's cache
  // update): the transport's copy waits for it on the device; the host never blocks on it.
  // The event's state is captured during PostWrite, so the caller may record it again as
  // soon as PostWrite returns. Null: the data is ready when PostWrite is called (host
  // memory, or device memory the caller synchronised). A transport without device memory
  // refuses a non-null event (InvalidArgument).
  void* ready_event = nullptr;
  // Notification bytes the GPU produces (for example a checksum of the data, computed by a
  // kernel enqueued before ready_event was recorded): `notification_tail_bytes` bytes at
  // `notification_tail`, host memory the device writes (pinned), appended to the
  // notification when the transport sends it, which is after ready_event's work completed.
  // The memory must stay valid until the transfer is done (Test no longer kInProgress).
  // REQUIRES: ready_event is set and the notification is not empty; at most
  // kMaxNotificationTailBytes. InvalidArgument otherwise.
  const void* notification_tail = nullptr;
  size_t notification_tail_bytes = 0;
};
inline constexpr size_t kMaxNotificationTailBytes = 64;

enum class TransferState { kInProgress, kDone };

struct Notification {
  PeerId peer = 0;
  std::string payload;
};

// Called (from inside Progress or a transport thread) when a peer fails. Must not call back
// into the transport.
using PeerErrorCallback = std::function<void(PeerId, const absl::Status&)>;

class Transport {
 public:
  virtual ~Transport() = default;

  virtual absl::string_view name() const = 0;
  virtual TransportCapabilities capabilities() const = 0;

  // What a peer needs to Connect to this transport (e.g. a UCX worker address).
  virtual absl::StatusOr<std::string> LocalInfo() = 0;

  // Registers [base, base + length). InvalidArgument for null/empty ranges or memory kinds the
  // transport cannot use (capabilities()). A range inside memory from AllocateMemory reuses
  // that allocation's registration and must not outlive it (see AllocateMemory).
  virtual absl::StatusOr<std::unique_ptr<MemoryRegistration>> RegisterMemory(
      void* base, size_t length, MemoryKind kind) = 0;

  // Allocates and registers `length` bytes of `kind` memory, zero-filled and aligned to at
  // least kMinAllocationAlignment bytes, of the kind peers can write into fastest (UCX:
  // memory that UCX allocates itself, ucp_mem_map with UCP_MEM_MAP_ALLOCATE, so that its
  // shared-memory transports can map it into the writer and puts into it are plain copies by
  // the writer; see ucx_transport.h). The registration owns the memory: destroying it
  // deregisters and frees it. InvalidArgument for length 0 or a kind the transport cannot
  // allocate (only kHost today); ResourceExhausted (or the transport's error) when the
  // memory cannot be had. Does not block on any peer.
  //
  // RegisterMemory() of a range lying inside an allocation returns a registration that reuses
  // the allocation's registration (its descriptor carries the same remote key, so peers
  // write into the sub-range as fast as into the whole). REQUIRES: such registrations are
  // destroyed before the allocation they lie in (as for any registration, the memory it
  // describes must stay valid while it lives).
  virtual absl::StatusOr<std::unique_ptr<MemoryRegistration>> AllocateMemory(
      size_t length, MemoryKind kind) = 0;

  // Opens a connection to the peer whose LocalInfo() is `peer_info`. Does not wait for the
  // peer: failures to reach it surface as errors of later transfers. InvalidArgument for
  // malformed info.
  virtual absl::StatusOr<PeerId> Connect(absl::string_view peer_info) = 0;

  // Names the peer whose LocalInfo() is `peer_info` as one that writes into this side,
  // without connecting to it: returns the id its notifications carry (Connect's id where
  // this side is connected to it too). Lifts the fence an earlier Disconnect of that peer
  // put up (see Disconnect), as Connect does. A receiver that may later give the peer up
  // calls it when it starts accepting the peer's writes (a consumer, after its handshake
  // with a producer). InvalidArgument for malformed info or this transport's own.
  virtual absl::StatusOr<PeerId> Accept(absl::string_view peer_info) = 0;

  // Imports a region the peer registered. InvalidArgument for a malformed or truncated
  // descriptor; NotFound for an unknown peer.
  virtual absl::StatusOr<std::unique_ptr<RemoteMemory>> ImportRemote(
      PeerId peer, absl::string_view descriptor) = 0;

  // Writes every segment from `local` into `remote` at `peer`, then, when `notification` is
  // not empty, delivers it to the peer after the data is in place there (for device memory:
  // after the copy has completed on the device). The copy starts after `order.ready_event`
  // (WriteOrder). Never blocks. OutOfRange for a segment outside either region (nothing is
  // posted); FailedPrecondition for a failed peer; NotFound for an unknown peer.
  virtual absl::StatusOr<TransferId> PostWrite(PeerId peer, const MemoryRegistration& local,
                                               const RemoteMemory& remote,
                                               absl::Span<const Segment> segments,
                                               absl::string_view notification,
                                               const WriteOrder& order) = 0;
  // The same with no GPU work to wait for (WriteOrder{}).
  absl::StatusOr<TransferId> PostWrite(PeerId peer, const MemoryRegistration& local,
                                       const RemoteMemory& remote,
                                       absl::Span<const Segment> segments,
                                       absl::string_view notification) {
    return PostWrite(peer, local, remote, segments, notification, WriteOrder{});
  }

  // Sends a notification alone. Never blocks.
  virtual absl::StatusOr<TransferId> PostNotification(PeerId peer, absl::string_view payload) = 0;

  // kDone once the transfer (data and notification) completed at the peer as far as this
  // side can know; kInProgress before; the transfer's error if it failed (peer error,
  // cancelled). NotFound for an unknown or released id.
  virtual absl::StatusOr<TransferState> Test(TransferId id) = 0;

  // Asks the transport to abandon the transfer; it then completes with Cancelled (or with
  // kDone if it had already finished). Data may have partly landed.
  virtual absl::Status Cancel(TransferId id) = 0;

  // Forgets a transfer. A transfer still in progress is cancelled first.
  virtual void Release(TransferId id) = 0;

  // Advances outstanding work and receives notifications. Never blocks for long.
  virtual absl::Status Progress() = 0;

  // Returns and clears the notifications received so far, in arrival order per peer.
  virtual std::vector<Notification> PollNotifications() = 0;

  // Closes the connection; outstanding transfers to the peer fail with Cancelled. It also
  // fences the peer off as a writer into this side: what it still sends afterwards, or what
  // was on its way (a partition that heals, a killed process whose kernel still sends what
  // its socket held), is dropped where this side receives it, until Accept or Connect of
  // that peer. Where the transport can tell (ucx: LocalInfo carries a fence epoch that
  // every disconnect raises, and writers stamp what they send with the epoch of the info
  // they connected with), what the peer sent before it connected again with this side's
  // LocalInfo from after the Disconnect stays dropped even after the Accept: a stream still
  // draining toward this side when it is accepted again cannot land. Where the writer
  // itself stores into this side's memory (CUDA IPC, UCX's shared-memory and emulated
  // puts) the fence covers its notifications only; such writers share a host with this
  // side and end their writes when they see the connection close. So a receiver
  // disconnects a writer it gives up before it reuses the memory the writer was writing
  // into.
  virtual absl::Status Disconnect(PeerId peer) = 0;

  // OK while the peer is healthy; its error once it failed.
  virtual absl::Status PeerStatus(PeerId peer) = 0;

  virtual void SetPeerErrorCallback(PeerErrorCallback callback) = 0;
};

// Calls transport.Progress() until Test(id) is no longer kInProgress or `deadline` passes
// (DeadlineExceeded naming the transfer). Returns the final state or the transfer's error.
absl::StatusOr<TransferState> WaitForTransfer(Transport& transport, TransferId id,
                                              absl::Time deadline);

}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_TRANSPORT_H_
