// The staged path's CUDA runtime calls (staged_cuda.h). Builds with CUDA only.
#include "ucx/staged_cuda.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/logging.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {
namespace {

// `e` as a Status; a failure also clears the runtime's last-error slot, so that it does not
// surface later in an unrelated check.
absl::Status Check(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return CudaErrorToStatus(static_cast<int>(e), what);
}

absl::StatusOr<int> DeviceOf(const void* p) {
  cudaPointerAttributes attributes{};
  RETURN_IF_ERROR(Check(cudaPointerGetAttributes(&attributes, p), "cudaPointerGetAttributes"));
  if (attributes.type != cudaMemoryTypeDevice) {
    return absl::InvalidArgumentError(absl::StrCat(
        "UCX RegisterMemory: ", absl::Hex(reinterpret_cast<uintptr_t>(p)),
        " is not device memory (cudaPointerGetAttributes type ",
        static_cast<int>(attributes.type), ")"));
  }
  return attributes.device;
}

}  // namespace

absl::StatusOr<int> DeviceOfRange(const void* base, size_t length) {
  RETURN_IF_ERROR(CudaAvailability());
  ASSIGN_OR_RETURN(int first, DeviceOf(base));
  ASSIGN_OR_RETURN(int last, DeviceOf(static_cast<const char*>(base) + length - 1));
  if (first != last) {
    return absl::InvalidArgumentError(absl::StrCat("UCX RegisterMemory: the range starts on "
                                                   "device ", first, " and ends on device ",
                                                   last));
  }
  return first;
}

absl::StatusOr<int> CurrentCudaDevice() {
  RETURN_IF_ERROR(CudaAvailability());
  int device = 0;
  RETURN_IF_ERROR(Check(cudaGetDevice(&device), "cudaGetDevice"));
  return device;
}

absl::Status HostRegister(void* base, size_t length, const char* what) {
  return Check(cudaHostRegister(base, length, cudaHostRegisterPortable),
               absl::StrCat("cudaHostRegister (", what, ", ", length, " bytes)"));
}

void HostUnregister(void* base) {
  absl::Status status = Check(cudaHostUnregister(base), "cudaHostUnregister");
  if (!status.ok()) Log(LogLevel::kWarning, std::string(status.message()));
}

absl::Status CopyAsync(void* dst, const void* src, size_t bytes, void* stream, const char* what) {
  if (bytes == 0) return absl::OkStatus();
  return Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault,
                               static_cast<cudaStream_t>(stream)),
               what);
}

absl::Status CudaEventWait(void* event, void* stream) {
  return Check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream),
                                   static_cast<cudaEvent_t>(event), 0),
               "cudaStreamWaitEvent (the write's ready event)");
}

absl::Status SegmentCopyAsync(const SegmentCopyParams& params, void* stream, const char* what) {
  return Check(static_cast<cudaError_t>(LaunchSegmentCopy(params, stream)), what);
}

}  // namespace internal
}  // namespace kvstream
