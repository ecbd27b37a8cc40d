// Launcher of the cuda_ipc copy kernel (copy_kernel.h): dispatch on vectors per thread.
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "cuda_ipc/copy_kernel.cuh"
#include "kvstream/common/cuda_status.h"

namespace kvstream {
namespace internal {
namespace {

template <int kVectors>
absl::StatusOr<int> MaxCtas() {
  int ctas = 0;
  const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &ctas, IpcCopyKernel<kVectors>, kIpcCopyThreads, 0);
  if (e != cudaSuccess) {
    return CudaErrorToStatus(static_cast<int>(e), "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  }
  return ctas;
}

}  // namespace

bool IpcCopyVectorsSupported(int vectors_per_thread) {
  return vectors_per_thread == 2 || vectors_per_thread == 4 || vectors_per_thread == 8;
}

absl::StatusOr<int> IpcCopyMaxCtasPerSm(int vectors_per_thread) {
  switch (vectors_per_thread) {
    case 2: return MaxCtas<2>();
    case 4: return MaxCtas<4>();
    case 8: return MaxCtas<8>();
    default: break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("cuda_ipc copy kernel: no variant for ", vectors_per_thread,
                   " vectors per thread (2, 4 or 8)"));
}

absl::Status LaunchIpcCopy(const IpcCopyParams& params, int vectors_per_thread, int grid,
                           void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (vectors_per_thread) {
    case 2: IpcCopyKernel<2><<<grid, kIpcCopyThreads, 0, s>>>(params); break;
    case 4: IpcCopyKernel<4><<<grid, kIpcCopyThreads, 0, s>>>(params); break;
    case 8: IpcCopyKernel<8><<<grid, kIpcCopyThreads, 0, s>>>(params); break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda_ipc copy kernel: no variant for ", vectors_per_thread, " vectors per thread"));
  }
  return CudaErrorToStatus(static_cast<int>(cudaGetLastError()), "cuda_ipc copy kernel launch");
}

}  // namespace internal
}  // namespace kvstream
