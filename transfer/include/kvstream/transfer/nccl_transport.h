// The nccl transport: device memory between GPUs through NCCL point-to-point operations
// (NVLink, PCIe, or a network NCCL can use), behind the one-sided Transport contract.
//
//   NcclTransportOptions options;
//   options.device = 1;
//   options.job_id = "deployment-7";  // peers of another job are refused with a clear error
//   ASSIGN_OR_RETURN(auto transport, CreateNcclTransport(options));
//   ASSIGN_OR_RETURN(auto local, transport->RegisterMemory(k_cache, bytes, MemoryKind::kDevice));
//   ... exchange LocalInfo() and descriptors, Connect, ImportRemote (transport.h) ...
//   WriteOrder order;
//   order.ready_event = layer_done;  // recorded on the compute stream after the cache update
//   ASSIGN_OR_RETURN(TransferId id, transport->PostWrite(peer, *local, *remote, blocks,
//                                                        "layer 3", order));
//
// NCCL is two-sided (every ncclSend needs a matching ncclRecv of the same size), the
// contract is one-sided (the writer names the destination; nothing is posted by the
// receiver's caller). The receiver learns what to receive from the writer: every batch's
// destination table travels ahead of its data on the link's side connection, and the
// receiving transport's Progress posts the matching ncclRecv calls itself. The other choice,
// receives posted by the consumer from the request's hand-off (it knows its destination
// blocks), would put a receive call into the contract and NCCL knowledge into the connector,
// and still need the writer's cut of the data into messages; sending the table costs one
// small frame per batch on a connection that exists anyway (for the notifications) and
// keeps every transport interchangeable.
//
// How it works.
// - LocalInfo() carries this transport's uid, pid, job id, NCCL version, GPU uuid and the
//   address of its side-connection listener (a TCP socket on options.listen_host). It goes
//   to the peer inside the connector's handshake payload, so it is used only after the
//   compatibility check. Connect() (the writer) checks the peer info (same job, same NCCL
//   version, another GPU: NCCL cannot put two ranks on one GPU; errors say which), opens the
//   side connection, makes a fresh ncclUniqueId (ncclGetUniqueId: the writer is the
//   bootstrap root) and sends it in its hello, then starts a non-blocking communicator of
//   two ranks (writer rank 0, receiver rank 1). The receiver's Progress checks the hello the
//   same way (refusing, with the reason, a peer of another job or NCCL, or on its own GPU),
//   joins with rank 1 and answers a welcome with what one batch may hold on its side.
//   Joining never blocks either side: init returns ncclInProgress and Progress polls
//   ncclCommGetAsyncError.
// - One communicator per peer pair and direction of traffic: the writer's Connect makes the
//   link it writes on, and a peer that also writes back makes its own (so push mode has one
//   per pair). Two-sided operations of both directions on one communicator could deadlock
//   (NCCL runs a communicator's operations in issue order: A's "send x, receive y" against
//   B's "send y, receive x"), and agreeing on one order across both sides would cost a round
//   trip per write; on a one-direction communicator every send meets its receive in order.
// - PostWrite plans the write into batches (transfer/src/nccl/nccl_plan.h): runs of at
//   least in_place_min_bytes are messages of their own, sent from and received into the
//   regions in place; the shorter runs are packed into one message per batch of at most
//   staging_bytes. A batch is one NCCL group (ncclGroupStart, its ncclSend calls,
//   ncclGroupEnd). Its GPU work, all on the link's own non-blocking streams and ordered by
//   events only, never by the host: a wait for WriteOrder::ready_event (captured at post
//   time on an ordering stream, so the caller may re-record it at once); ONE copy kernel
//   (the cuda_ipc transport's per-segment kernel, table in pinned memory) gathering the
//   packed message into a staging slot, skipped when its bytes are one local range; the
//   group on the NCCL stream after the gather's event; an event after the group. The
//   receiver, for each batch table it reads, checks every piece against the destination
//   region, receives each message in place when its destination is one range or else into
//   its staging slot, and scatters the slot with one copy kernel after the receive's event.
//   Two staging slots per side and link alternate, each reused only after the device
//   finished with it (a stream waits for the slot's last event), so the gather of one batch
//   overlaps the send of the one before and the scatter of one the receive of the next.
// - Notifications: once every batch of a write has completed on the writer (its events,
//   polled in Progress), its notification (payload, then WriteOrder::notification_tail)
//   goes on the side connection; the receiver holds a notification until every batch that
//   came before it has landed (the scatter's event, or the receive's when in place), and
//   then returns it from PollNotifications. So a notification follows the data of its own
//   write and of every earlier write to that peer, as the contract says. Test() is kDone
//   once the notification's bytes left (or, without one, once the batches completed here).
// - Failure, so that nothing hangs: every live communicator's ncclCommGetAsyncError is
//   polled in Progress; the side connection's end without a goodbye (the peer died or was
//   killed), a malformed frame, a refusal, a CUDA error, a communicator not up within
//   join_timeout or a batch not complete op_timeout after its issue fail the peer: its
//   communicators are aborted (ncclCommAbort, which also stops NCCL kernels spinning for a
//   peer that is gone), every outstanding transfer to it fails with the error naming it,
//   later posts are FailedPrecondition, and the peer-error callback runs from Progress.
//   Staging memory and streams of an aborted link are freed once their streams are idle.
//   Disconnect and destruction abort too (never waiting for the peer), after a goodbye.
//
// Memory kinds: kDevice only (memory of options.device; any device allocation works, NCCL
// needs no registration). Posting never blocks: a batch waits in its link's queue while the
// communicator is joining, a group is being issued, or the copy-table ring is full.
//
// Needs NCCL at build time (FindNCCL); in builds without it, or without CUDA, the factory
// and CreateNcclTransport say so. Run with NCCL_NVLS_ENABLE=0 where NVLink multicast must
// stay off (the launch scripts and tests set it; this library reads no environment).
//
// Thread safety: every method may be called from any thread (one mutex).
#ifndef KVSTREAM_TRANSFER_NCCL_TRANSPORT_H_
#define KVSTREAM_TRANSFER_NCCL_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvstream/transfer/transport.h"

namespace kvstream {

struct NcclTransportOptions {
  // The GPU whose memory this transport moves and on which its communicators live.
  int device = 0;
  // Names the deployment: peers whose job id differs are refused (clear FailedPrecondition
  // at Connect, a refusal at the receiver), so that workers of two jobs that find each other
  // never share a communicator. At most 256 bytes; empty is a job id like any other.
  std::string job_id;
  // Where the side connection listens: a numeric IPv4 address peers can reach (the
  // loopback address only serves peers on this host), and its port (0: any free port).
  std::string listen_host = "127.0.0.1";
  uint16_t listen_port = 0;
  // One staging slot: the most bytes one batch gathers (writer) or scatters (receiver). Each
  // link has two slots on each side. 1 MiB to 1 GiB.
  uint64_t staging_bytes = uint64_t{64} << 20;
  // Runs (contiguous on both sides) at least this long move in place, as messages of their
  // own. 4 KiB to staging_bytes.
  uint64_t in_place_min_bytes = uint64_t{1} << 20;
  // Entries of each link's copy-table ring (32 bytes of pinned and of device memory each);
  // a batch uses at most half. 4096 to 1 << 22.
  size_t table_entries = size_t{1} << 16;
  // The copy kernel's longest table entry (longer pieces are cut): a power of two, 4 KiB to
  // 1 GiB; and its grid (0: two CTAs per SM at most, leaving room for NCCL's kernels).
  uint64_t max_piece_bytes = uint64_t{256} << 10;
  int copy_ctas = 0;
  // Deadlines (see the header comment): a communicator must be up join_timeout after its
  // init; an issued batch must complete within op_timeout. Both > 0.
  absl::Duration join_timeout = absl::Seconds(60);
  absl::Duration op_timeout = absl::Seconds(60);
  // How long the destructor waits for GPU work still in flight before it leaks the memory
  // that work uses rather than free it under the GPU. >= 0.
  absl::Duration shutdown_timeout = absl::Seconds(10);
};

// InvalidArgument for options out of range (checked before any GPU is touched);
// FailedPrecondition when there is no usable GPU or kvstream was built without NCCL (the
// message says why); Unavailable when the listener cannot be bound.
absl::StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(
    const NcclTransportOptions& options);

// The options' own check, without creating anything: OK or the InvalidArgument
// CreateNcclTransport would return.
absl::Status ValidateNcclTransportOptions(const NcclTransportOptions& options);

// Whether this build has the nccl transport (CUDA and NCCL found when configured).
bool BuiltWithNccl();

// Diagnostics (tests): how many communicators `transport` (an nccl transport) holds that are
// not aborted or closed; 0 for any other transport.
size_t NcclLiveCommunicatorCount(Transport& transport);

}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_NCCL_TRANSPORT_H_
