// The CUDA attention backend: cache update and paged attention on one GPU, for caches and
// activations in device memory. Decode batches (max_query_len <= 1) run a split-KV decode
// kernel; other batches run the varlen prefill kernel.
//
//   CudaBackendOptions options;                 // device 0, a stream of its own
//   ASSIGN_OR_RETURN(auto backend, CreateCudaAttentionBackend(options));
//   RETURN_IF_ERROR(backend->UpdateCache(update));   // enqueued
//   RETURN_IF_ERROR(backend->Forward(attention));     // enqueued after it
//   RETURN_IF_ERROR(AsCudaAttentionBackend(backend.get())->Synchronize(absl::Seconds(5)));
//
// Nothing here blocks: UpdateCache and Forward validate on the host (device batches through
// their host mirrors, PagedAttentionParams::host and CacheUpdateParams::host_slot_mapping)
// and enqueue on the backend's stream. Callers order their own work after that stream
// (Synchronize with a deadline, or an event) before reading outputs or reusing inputs.
// Each call runs with the backend's device current (CudaDeviceScope) and puts the calling
// thread's device back afterwards, unless the thread had not used CUDA before.
//
// The header needs no CUDA include, and the functions exist in every build: without CUDA
// or without a usable GPU, CreateCudaAttentionBackend says why.
#ifndef KVSTREAM_ATTENTION_CUDA_ATTENTION_H_
#define KVSTREAM_ATTENTION_CUDA_ATTENTION_H_

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvstream/attention/backend.h"

namespace kvstream {

struct CudaBackendOptions {
  // The cudaStream_t to enqueue on. null: the backend creates one on `device` and owns it.
  // A caller's stream must belong to `device` and outlive the backend.
  void* stream = nullptr;
  int device = 0;
  // Batch invariance: the bits of every output row depend only on its query and its own
  // sequence's keys, never on the other sequences of the call (what a disaggregated run
  // relies on to reproduce a colocated one). Then decode keys are always split into
  // kBatchInvariantDecodeSplits parts (instead of a count chosen from the batch's size),
  // and a call mixing one-row sequences with longer ones runs the one-row sequences through
  // the decode kernel and the rest through the prefill kernel, as calls of their own do;
  // the one-row sequences must come first (InvalidArgument otherwise, naming the first that
  // does not). Costs some decode speed where few sequences would use fewer splits.
  bool batch_invariant = false;
};

inline constexpr int kBatchInvariantDecodeSplits = 16;

// The CUDA backend's extra surface. Thread-compatible, as every AttentionBackend: one layer
// calls it at a time.
class CudaAttentionBackend : public AttentionBackend {
 public:
  // The stream all work is enqueued on (a cudaStream_t); owned by the backend unless the
  // options supplied it.
  virtual void* stream() const = 0;
  virtual int device() const = 0;
  // Waits until the work enqueued so far has finished: OK, DeadlineExceeded after
  // `timeout` (the work keeps running), or the error the work raised (e.g. a fault).
  virtual absl::Status Synchronize(absl::Duration timeout) = 0;
};

// Creates the backend on options.device. FailedPrecondition naming why in builds without
// CUDA or when no GPU can be used; InvalidArgument for a device index out of range; a CUDA
// error when the stream cannot be made. The backend runs only on device memory
// (SupportsMemory(kDevice)); Forward supports what LaunchDecodeAttention and
// LaunchPrefillAttention support (dtypes, head sizes) and names what it does not.
absl::StatusOr<std::unique_ptr<AttentionBackend>> CreateCudaAttentionBackend(
    const CudaBackendOptions& options);

// `backend` as the CUDA backend, or null when it is another backend. Ownership stays with
// the caller.
CudaAttentionBackend* AsCudaAttentionBackend(AttentionBackend* backend);

}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_ATTENTION_H_
