// CUDA status helpers for builds without CUDA.
#include "kvstream/common/cuda_status.h"

#include "absl/strings/str_cat.h"

namespace kvstream {

bool BuiltWithCuda() { return false; }

absl::Status CudaAvailability() {
  return absl::FailedPreconditionError("kvstream was built without CUDA (KVSTREAM_CUDA=OFF or no nvcc)");
}

int GpuCount() { return 0; }

absl::Status CudaErrorToStatus(int cuda_error, absl::string_view operation) {
  if (cuda_error == 0) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(operation, ": CUDA error ", cuda_error,
                                          " in a build without CUDA"));
}

}  // namespace kvstream
