// The CUDA runtime calls of the UCX transport's staged device path (private to transfer/),
// as Status-returning functions with no CUDA types, so that the engine compiles in every
// build. staged_cuda.cc implements them over the runtime; staged_cuda_none.cc, in builds
// without CUDA, returns FailedPrecondition from each. Streams are cudaStream_t as void*.
// None of them blocks, except HostRegister/HostUnregister (the driver pins or unpins pages).
#ifndef KVSTREAM_TRANSFER_SRC_UCX_STAGED_CUDA_H_
#define KVSTREAM_TRANSFER_SRC_UCX_STAGED_CUDA_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ucx/segment_copy.h"

namespace kvstream {
namespace internal {

// The CUDA device that [base, base + length) lives on. InvalidArgument when either end is
// not device memory (host, pinned or managed memory, or an unknown pointer) or the ends lie
// on different devices; FailedPrecondition without CUDA or without a usable device.
absl::StatusOr<int> DeviceOfRange(const void* base, size_t length);

// The calling thread's current device.
absl::StatusOr<int> CurrentCudaDevice();

// Page-locks [base, base + length) (cudaHostRegister, portable) so that copies to and from
// it are DMA. The error names `what`.
absl::Status HostRegister(void* base, size_t length, const char* what);
// Undoes HostRegister; logs a failure (nothing else can be done about one).
void HostUnregister(void* base);

// cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream); 0 bytes enqueues nothing.
absl::Status CopyAsync(void* dst, const void* src, size_t bytes, void* stream, const char* what);

// cudaStreamWaitEvent(stream, event): `stream` waits, on the device, for the work `event`
// (a cudaEvent_t) captured when this is called.
absl::Status CudaEventWait(void* event, void* stream);

// LaunchSegmentCopy as a Status naming `what`.
absl::Status SegmentCopyAsync(const SegmentCopyParams& params, void* stream, const char* what);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_UCX_STAGED_CUDA_H_
