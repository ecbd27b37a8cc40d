// The cuda_ipc transport: device memory between processes of one host, through CUDA IPC.
// One GPU shared by several processes, or several GPUs of one host (the copy then writes
// over the peer link into the other GPU's memory).
//
//   CudaIpcTransportOptions options;
//   options.device = 0;
//   ASSIGN_OR_RETURN(auto transport, CreateCudaIpcTransport(options));
//   ASSIGN_OR_RETURN(auto local, transport->RegisterMemory(k_cache, bytes, MemoryKind::kDevice));
//   ... exchange LocalInfo() and descriptors, Connect, ImportRemote (transport.h) ...
//   WriteOrder order;
//   order.ready_event = layer_done;  // recorded on the compute stream after the cache update
//   ASSIGN_OR_RETURN(TransferId id, transport->PostWrite(peer, *local, *remote, blocks,
//                                                        "layer 3", order));
//
// How it works. RegisterMemory finds the cudaMalloc allocation a range lies in
// (cuMemGetAddressRange: PyTorch's caching allocator hands out sub-ranges of large
// allocations), takes cudaIpcGetMemHandle of the allocation's base, and the descriptor
// carries that handle with the range's offset, length, the allocation's size, the device and
// this transport's uid. ImportRemote opens a peer allocation once (cudaIpcOpenMemHandle) and
// caches the mapping per (peer, allocation); every region of that allocation shares it, and
// range checks use the size of what was really mapped. PostWrite writes its segment table
// into a pinned staging ring, copies it to the device on the transport's own stream (a
// non-blocking stream: it never serialises with the legacy default stream), makes the stream
// wait for order.ready_event, launches ONE copy kernel for all segments (16-byte vector
// copies where aligned, segments cut into chunks spread over every SM) and records a
// completion event: no host synchronisation, and no CUDA call per segment. Progress polls
// the completion events in post order and only then sends the notification (payload, then
// order.notification_tail's bytes) over a Unix-domain socket in the abstract namespace,
// whose name (with a random uid) is in LocalInfo(). The receiver's PollNotifications
// returns it after the data is in place, since the copy had completed before it was sent.
//
// The staging ring grows (doubling, up to kMaxCudaIpcStagingSegments segments in flight)
// when a post does not fit; past that limit PostWrite is ResourceExhausted. Posting never
// blocks.
//
// Failure: a peer whose socket reaches end of stream without a goodbye, or errors, or sends
// a malformed frame, fails: its outstanding transfers fail naming it, later posts to it are
// FailedPrecondition, and the peer-error callback runs from Progress (no lock held). Its
// mappings are closed once no copy writes into them any more. Disconnect does the same with
// Cancelled and no callback. The destructor waits (at most
// CudaIpcTransportOptions::shutdown_timeout) for copies still in flight, then closes the
// mappings; copies that do not finish in time leave their mappings open (logged) rather than
// pulling memory from under a running kernel.
//
// Memory kinds: kDevice only (capabilities().host_memory is false); memory from
// cudaMallocHost, malloc, cudaMallocAsync pools or cuMemCreate (virtual memory management)
// cannot be exported with cudaIpcGetMemHandle and is refused with the reason.
//
// Thread safety: every method may be called from any thread (one mutex).
#ifndef KVSTREAM_TRANSFER_CUDA_IPC_TRANSPORT_H_
#define KVSTREAM_TRANSFER_CUDA_IPC_TRANSPORT_H_

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvstream/transfer/transport.h"

namespace kvstream {

// Bound on the staging ring's growth: segments of posted writes whose copies have not
// completed.
inline constexpr size_t kMaxCudaIpcStagingSegments = size_t{1} << 22;

struct CudaIpcTransportOptions {
  // The GPU whose memory this transport registers and on which its copies run.
  int device = 0;
  // Segments the staging ring holds at first (it grows on demand).
  size_t staging_segments = size_t{1} << 16;
  // Copy kernel shape: CTAs per SM (0: as many as fit), and 16-byte vectors each thread
  // moves per pass (2, 4 or 8).
  int ctas_per_sm = 0;
  int vectors_per_thread = 4;
  // Segments at least this long go through the copy engine (one cudaMemcpyAsync each)
  // instead of the kernel; 0: every segment through the kernel.
  size_t copy_engine_min_bytes = 0;
  // How long the destructor waits for copies still in flight.
  absl::Duration shutdown_timeout = absl::Seconds(10);
};

// FailedPrecondition when there is no usable GPU (the message says why) or the device
// cannot do CUDA IPC; InvalidArgument for options out of range.
absl::StatusOr<std::unique_ptr<Transport>> CreateCudaIpcTransport(
    const CudaIpcTransportOptions& options);

// Diagnostics (tests): how many peer allocations `transport` (a cuda_ipc transport) has
// open through cudaIpcOpenMemHandle right now, counting those kept open for copies still in
// flight; 0 for any other transport.
size_t CudaIpcOpenMappingCount(Transport& transport);

}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_CUDA_IPC_TRANSPORT_H_
