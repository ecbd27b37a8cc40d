// CUDA status helpers: the one place where cudaError_t becomes absl::Status. Plain C++
// over the CUDA runtime API (compiled by the host compiler); kernels live in .cu files.
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "kvstream/common/cuda_status.h"

namespace kvstream {

bool BuiltWithCuda() { return true; }

absl::Status CudaErrorToStatus(int cuda_error, absl::string_view operation) {
  if (cuda_error == cudaSuccess) return absl::OkStatus();
  const cudaError_t e = static_cast<cudaError_t>(cuda_error);
  const std::string message =
      absl::StrCat(operation, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
  switch (e) {
    case cudaErrorMemoryAllocation: return absl::ResourceExhaustedError(message);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer: return absl::InvalidArgumentError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice: return absl::FailedPreconditionError(message);
    default: return absl::InternalError(message);
  }
}

absl::Status CudaAvailability() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error for later callers
    return absl::FailedPreconditionError(
        absl::StrCat("no usable CUDA device: ", cudaGetErrorString(e)));
  }
  if (count == 0) return absl::FailedPreconditionError("no CUDA device on this machine");
  return absl::OkStatus();
}

int GpuCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

}  // namespace kvstream
