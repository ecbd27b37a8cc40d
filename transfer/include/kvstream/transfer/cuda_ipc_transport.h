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
// (one pass over the segments: range checks, then the entries) and enqueues, on the
// transport's own stream (a non-blocking stream: it never serialises with the legacy default
// stream), a wait for order.ready_event, ONE copy kernel for all segments and a completion
// event: no host synchronisation, and no CUDA call per segment. By default the kernel takes
// whole segments per CTA (cut into pieces of at most CudaIpcTransportOptions::
// max_piece_bytes, 16-byte vector copies where aligned); a short table is read straight
// from the pinned staging ring (zero-copy: the post is then cheapest on the host), a long
// one is first copied to device memory on a side stream (CudaIpcTableMode::kAuto); the
// other variants (CudaIpcTableMode, CudaIpcKernel) are there to be measured
// (bench/cuda_ipc_bench.cc --sweep). Progress polls
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
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvstream/transfer/transport.h"

namespace kvstream {

// Bound on the staging ring's growth: segments of posted writes whose copies have not
// completed.
inline constexpr size_t kMaxCudaIpcStagingSegments = size_t{1} << 22;

// Where a write's segment table goes on its way to the copy kernel.
enum class CudaIpcTableMode {
  // Copied from the pinned staging ring to device memory by a cudaMemcpyAsync on the copy
  // stream, before the kernel.
  kStreamCopy,
  // The same copy on a second stream, which the copy stream waits for with an event (the
  // table copy of one write may then overlap the kernel of the one before).
  kSideStreamCopy,
  // No copy: the kernel reads the pinned staging ring in place, over the bus (each entry
  // once per unit, the next one while it copies the current one). The ring entries stay
  // reserved until the copy's completion event.
  kZeroCopy,
  // In the kernel's launch parameters when the write has at most kIpcMaxParamSegments
  // entries (CUDA 12.1+ on Volta and later allow 32764 bytes of parameters), else as
  // kZeroCopy. Only for the per-segment kernels (the chunked one searches its table).
  kParams,
  // By the write's size: below auto_side_copy_min_entries entries kZeroCopy (a small
  // table's copy would cost more than the bus reads it saves), from there kSideStreamCopy
  // with one unit per entry (reading a long table from device memory made the copy kernel
  // 4-7% faster at 256-4096 entries on the H200, docs/benchmarks.md).
  kAuto,
};

// Entries a table in the launch parameters holds (24 bytes each).
inline constexpr size_t kIpcMaxParamSegments = 1360;

// The copy kernel's shape.
enum class CudaIpcKernel {
  // Chunks of 256 threads x vectors_per_thread x 16 bytes spread evenly over the grid; each
  // CTA searches the table for its first chunk (needs the first_chunk prefix sums).
  kChunked,
  // Each CTA (256 threads) takes whole table entries in a grid-stride loop.
  kCtaPerSegment,
  // Each warp takes whole table entries in a grid-stride loop.
  kWarpPerSegment,
  // Each CTA of 1024 threads takes whole table entries in a grid-stride loop.
  kWideCtaPerSegment,
};

struct CudaIpcTransportOptions {
  // The GPU whose memory this transport registers and on which its copies run.
  int device = 0;
  // Segments the staging ring holds at first (it grows on demand).
  size_t staging_segments = size_t{1} << 16;
  // How the copy runs. The defaults are the fastest measured shape; the rest exist to be
  // compared (bench/cuda_ipc_bench.cc --sweep) and are all tested for correctness.
  CudaIpcKernel kernel = CudaIpcKernel::kCtaPerSegment;
  CudaIpcTableMode table = CudaIpcTableMode::kAuto;
  // kAuto: the entries from which a write's table is copied to device memory.
  size_t auto_side_copy_min_entries = 256;
  // CTAs per SM (0: as many as fit), and 16-byte vectors each thread moves per pass (2, 4
  // or 8).
  int ctas_per_sm = 0;
  int vectors_per_thread = 8;
  // Per-segment kernels: segments longer than this are cut into entries of at most this
  // many bytes, so that a few long segments still spread over every SM. A power of two,
  // 4 KiB to 1 GiB.
  size_t max_piece_bytes = size_t{256} << 10;
  // Per-segment kernels: false, a persistent grid (as many units as fit, each looping over
  // entries and loading the next while copying); true, one unit per entry, the hardware
  // scheduling units as others finish.
  bool unit_per_entry = false;
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

// Diagnostics (benchmarks): device time of a write's GPU work, from timing events the
// transport records on its copy stream around it while timing is on (off at creation; the
// extra events cost a little, so measure throughput with it off).
struct CudaIpcCopyTiming {
  // From the write's first operation on the copy stream (table copy, or the wait for
  // ready_event) to its completion event; excludes time the stream spent on earlier writes.
  double stream_us = 0;
  // The copy kernel (and copy-engine segments) alone.
  double kernel_us = 0;
};
// Turns timing on or off for writes posted from now on; no-op for other transports.
void CudaIpcSetCopyTiming(Transport& transport, bool on);
// The timings of writes whose copies completed since the last call (Progress retires them),
// in post order; empty for other transports.
std::vector<CudaIpcCopyTiming> CudaIpcTakeCopyTimings(Transport& transport);

}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_CUDA_IPC_TRANSPORT_H_
