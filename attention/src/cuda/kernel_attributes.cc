// AllowDynamicSharedMemory (launchers.h): the kernels' shared-memory attributes, changed
// only when a launch needs more than any before it on the device.
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cuda/launchers.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {

absl::Status AllowDynamicSharedMemory(const void* kernel, int bytes, bool max_carveout,
                                      absl::string_view what) {
  if (bytes <= 48 * 1024) return absl::OkStatus();  // the default allows it
  static std::mutex mu;
  // (device, kernel) -> the bytes allowed so far.
  static auto* allowed = new std::map<std::pair<int, const void*>, int>();
  int device = 0;
  RETURN_IF_ERROR(CudaErrorToStatus(static_cast<int>(cudaGetDevice(&device)),
                                    absl::StrCat(what, ": cudaGetDevice")));
  std::lock_guard<std::mutex> lock(mu);
  auto it = allowed->find({device, kernel});
  if (it != allowed->end() && it->second >= bytes) return absl::OkStatus();
  RETURN_IF_ERROR(CudaErrorToStatus(
      static_cast<int>(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes)),
      absl::StrCat(what, ": cudaFuncSetAttribute(max dynamic shared memory ", bytes, ")")));
  if (max_carveout && it == allowed->end()) {
    RETURN_IF_ERROR(CudaErrorToStatus(
        static_cast<int>(cudaFuncSetAttribute(kernel,
                                              cudaFuncAttributePreferredSharedMemoryCarveout,
                                              static_cast<int>(cudaSharedmemCarveoutMaxShared))),
        absl::StrCat(what, ": cudaFuncSetAttribute(shared memory carveout)")));
  }
  (*allowed)[{device, kernel}] = bytes;
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace kvstream
