// The staged path's CUDA calls in builds without CUDA (staged_cuda.h): each reports that
// this build has no CUDA.
#include "ucx/staged_cuda.h"

namespace kvstream {
namespace internal {
namespace {

absl::Status NoCuda() {
  return absl::FailedPreconditionError("kvstream was built without CUDA");
}

}  // namespace

absl::StatusOr<int> DeviceOfRange(const void*, size_t) { return NoCuda(); }
absl::StatusOr<int> CurrentCudaDevice() { return NoCuda(); }
absl::Status HostRegister(void*, size_t, const char*) { return NoCuda(); }
void HostUnregister(void*) {}
absl::Status CopyAsync(void*, const void*, size_t, void*, const char*) { return NoCuda(); }
absl::Status CudaEventWait(void*, void*) { return NoCuda(); }
absl::Status SegmentCopyAsync(const SegmentCopyParams&, void*, const char*) { return NoCuda(); }

}  // namespace internal
}  // namespace kvstream
