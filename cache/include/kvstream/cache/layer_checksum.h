// kvsum64: the checksum of one transferred layer, computed by the producer over the bytes it
// sends and by the consumer over the bytes that landed, on the host (Kvsum64Host) or on the
// GPU (DeviceChecksummer), with bit-identical results, so that a host-cache producer and a
// device-cache consumer agree and tests can check the GPU against the host.
//
// Definition. The input is the concatenation B of a list of byte spans (a layer: its K runs
// then its V runs). Let N = |B| and w_j, j = 0 .. ceil(N / 8) - 1, the 8-byte little-endian
// words of B, the last one zero-padded. Then
//
//   kvsum64(B) = Mix((sum_j Mix(w_j + (j + 1) * 0x9E3779B97F4A7C15) mod 2^64) XOR N)
//
// where Mix is the splitmix64 finaliser: z ^= z >> 30; z *= 0xBF58476D1CE4E5B9;
// z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31 (arithmetic mod 2^64).
// Word indices are positions in the concatenation, not in a span: a span that follows one
// whose length is not a multiple of 8 starts in the middle of a word, and the sum depends
// only on B, never on where it was cut into spans. So kvsum64 of the empty input is
// Mix(0) = 0, of the one byte 0x01 it is Mix(Mix(0x9E3779B97F4A7C16) ^ 1).
//
// Why this function: the host path hashes with XXH3, which is sequential; a sum of
// independently mixed words parallelises freely on a GPU (per-thread partial sums, a CTA
// reduction, one pass), reads each byte once, and costs a few integer operations per 8
// bytes, so the device checksum runs at the speed of a plain read of the same memory.
// Mixing each word with its position makes the sum sensitive to every bit and to the order
// of words (w_j + (j + 1) * golden ratio, then a bijective finaliser); the final Mix with N
// separates inputs that differ only in trailing zero bytes. It is an integrity check
// against corruption and misplaced blocks, not a cryptographic hash.
//
//   ChecksumSpan spans[] = {{k_run, k_bytes}, {v_run, v_bytes}};
//   uint64_t sum = Kvsum64Host(spans);                       // host memory
//
//   DeviceChecksummer::Options options;
//   options.device = 0;
//   ASSIGN_OR_RETURN(std::unique_ptr<DeviceChecksummer> summer,
//                    DeviceChecksummer::Create(options));
//   RETURN_IF_ERROR(summer->Enqueue(device_spans, stream, pinned_result));
//   RETURN_IF_ERROR(done.Record(stream));  // *pinned_result is valid once `done` completed
#ifndef KVSTREAM_CACHE_LAYER_CHECKSUM_H_
#define KVSTREAM_CACHE_LAYER_CHECKSUM_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kvstream/common/cuda_resources.h"

namespace kvstream {

// `length` bytes at `data`. Host memory for Kvsum64Host, device memory for
// DeviceChecksummer. `data` may be null (or anything) when `length` is 0.
struct ChecksumSpan {
  const void* data = nullptr;
  uint64_t length = 0;
};

// kvsum64 of the concatenation of `spans` (host memory), as defined above. Reads 8 bytes at
// a time wherever a span's bytes line up with B's words (any address alignment), so it runs
// at several GB/s on one core. REQUIRES: every span with length > 0 points at that many
// readable bytes. Never fails; thread-safe (no shared state).
uint64_t Kvsum64Host(absl::Span<const ChecksumSpan> spans);

// Computes kvsum64 over spans of device memory on the GPU, enqueued on the caller's stream:
// one cudaMemcpyAsync of the span table from a pinned staging ring into device memory and
// one kernel for any number of spans, which writes the 64-bit result to pinned host memory
// or device memory. Nothing here waits for the GPU: staging space is reused only once the
// kernel that read it has completed, which Enqueue learns by querying events it recorded
// (cudaEventQuery, never a synchronisation); when the ring or the in-flight limit is
// exhausted, Enqueue returns ResourceExhausted at once instead of waiting.
//
// Thread safety: thread-safe; concurrent Enqueue calls are serialised by a mutex (each holds
// it for the host-side work of one call, a few microseconds; no GPU wait under it).
class DeviceChecksummer {
 public:
  // Where the span table is copied to the device.
  enum class TableCopy {
    // On an internal stream of the checksummer; the caller's stream waits for that copy (an
    // event) just before the kernel. The copy then overlaps the work already queued on the
    // caller's stream (a layer's cache update or attention), so that the kernel does not
    // sit behind a host-to-device copy's latency (microseconds: comparable to the kernel's
    // own time on a layer of a few tens of MiB). The default.
    kInternalStream,
    // On the caller's stream, right before the kernel: one stream and no cross-stream
    // event, for callers that need all of the work on their stream (CUDA graph capture).
    kCallerStream,
  };

  struct Options {
    int device = 0;  // the CUDA device the spans, the stream and a device result live on
    // Enqueue calls whose kernels may be pending at once (each holds one or two events).
    int max_in_flight = 64;
    // Bytes of the staging ring: one pinned host buffer and one device buffer of this
    // size. A call takes 16 bytes, plus 16 per non-empty span and 4 per 32 KiB of input,
    // rounded up to 16 (StagingBytesFor); the default holds, for example, the tables of 64
    // in-flight layers of 4096 spans over 128 MiB each (80 KiB a table).
    size_t staging_bytes = size_t{8} << 20;
    TableCopy table_copy = TableCopy::kInternalStream;
  };

  // A checksummer on options.device, holding its staging ring, events and (kInternalStream)
  // its copy stream. Blocks while allocating them (pinned and device memory, not for the
  // hot path). InvalidArgument for options out of range (max_in_flight < 1, staging_bytes
  // below 4 KiB, a device index out of range); FailedPrecondition in builds without CUDA
  // ("built without CUDA") or without a usable GPU; ResourceExhausted when the memory
  // cannot be had; other CUDA errors mapped by CudaErrorToStatus.
  static absl::StatusOr<std::unique_ptr<DeviceChecksummer>> Create(const Options& options);

  DeviceChecksummer(const DeviceChecksummer&) = delete;
  DeviceChecksummer& operator=(const DeviceChecksummer&) = delete;
  // Waits, with a deadline of 10 s, for the kernels and copies still pending to finish
  // before freeing the staging memory; if some are still running then, the memory is
  // leaked (and a warning logged) rather than freed under the GPU. Call it only once the
  // caller's own completion events have completed to never wait here.
  ~DeviceChecksummer();

  // Enqueues kvsum64 of the concatenation of `spans` on `stream` (a cudaStream_t of
  // options.device; null: that device's legacy default stream) and returns without
  // waiting. The kernel writes the result to `*result`, 8-byte aligned pinned host memory
  // mapped into the device's address space (cudaMallocHost, cudaHostAlloc, cudaHostRegister
  // with cudaHostRegisterMapped), managed memory, or device memory of
  // options.device; the caller learns it is there by an event it records on `stream` after
  // this call (or any later synchronisation with `stream`). The spans are read by the
  // kernel when it runs, so they must hold the bytes to check by then (work that writes
  // them enqueued earlier on `stream`, or ordered before it by events), and stay valid
  // until it has finished. spans[i].data are device pointers usable on options.device:
  // cudaMalloc'ed memory, sub-ranges of it, memory of another process mapped by
  // cudaIpcOpenMemHandle, or a peer device's memory with peer access enabled. The table
  // `spans` itself is copied into the staging ring before the call returns.
  //
  // Errors (nothing is enqueued unless said otherwise): InvalidArgument for a null or
  // misaligned `result`, a result in pageable host memory or on another device, a span with
  // a null pointer and length > 0 (naming its index), a total length over 2^62 bytes, more
  // than 2^32 - 2 non-empty spans, a stream of another device, or a table larger than the
  // whole staging ring (naming both sizes); ResourceExhausted when options.max_in_flight
  // calls are pending or the ring has no room for this call's table now (try again once
  // earlier work completed); FailedPrecondition from the call whose completion event could
  // not be recorded and every call after it (the staging range that call used can no
  // longer be known to be free; create a new checksummer); FailedPrecondition in builds
  // without CUDA; CUDA errors mapped by CudaErrorToStatus (a failed kernel launch after
  // the table copy was enqueued keeps its range until the copy is done, and the
  // checksummer stays usable). Pointers in `spans` that are not device memory of options.device
  // (or mapped to it) make the kernel fault, which CUDA reports on `stream` (a sticky
  // error): they cannot be checked without a driver call per span.
  //
  // Never blocks on the GPU.
  absl::Status Enqueue(absl::Span<const ChecksumSpan> spans, void* stream, uint64_t* result);

  // Bytes of the ring a call over `num_spans` non-empty spans of `total_bytes` in all takes
  // until its kernel completed (what Options::staging_bytes is sized by). Every build.
  static size_t StagingBytesFor(size_t num_spans, uint64_t total_bytes);

  const Options& options() const { return options_; }

 private:
  // One enqueued call whose staging range [begin, end) is in use until `event` completes.
  struct InFlight {
    size_t begin = 0;
    size_t end = 0;
    int slot = 0;  // index into done_events_ / copied_events_
  };

  explicit DeviceChecksummer(const Options& options) : options_(options) {}

  // Drops completed calls from the front of in_flight_ (FIFO: a completed call behind a
  // pending one keeps its space until the pending one completes). Never blocks.
  absl::Status ReclaimLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The offset of `bytes` of free ring space (16-byte aligned), or ResourceExhausted.
  absl::StatusOr<size_t> AllocateLocked(size_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  int ctas_per_launch_ = 1;  // resident CTAs of the kernel on the device: the largest grid
  DeviceBuffer staging_;     // pinned host, options_.staging_bytes
  DeviceBuffer mirror_;      // device, options_.staging_bytes
  CudaStream copy_stream_;   // kInternalStream only
  std::vector<CudaEvent> done_events_;    // recorded on the caller's stream after a kernel
  std::vector<CudaEvent> copied_events_;  // kInternalStream: recorded after a table copy

  absl::Mutex mu_;
  std::deque<InFlight> in_flight_ ABSL_GUARDED_BY(mu_);
  std::vector<int> free_slots_ ABSL_GUARDED_BY(mu_);
  size_t head_ ABSL_GUARDED_BY(mu_) = 0;      // where the next allocation starts looking
  absl::Status broken_ ABSL_GUARDED_BY(mu_);  // set when staging space may be lost
};

}  // namespace kvstream

#endif  // KVSTREAM_CACHE_LAYER_CHECKSUM_H_
