// Kernels for the cuda_ipc transport's GPU tests (cuda_ipc_test_kernels.h).
#include <cuda_runtime.h>

#include "cuda_ipc_test_kernels.h"
#include "kvstream/common/cuda_status.h"

namespace kvstream {
namespace gpu_test {
namespace {

__device__ inline uint8_t PatternByte(size_t i, uint32_t seed) {
  const uint32_t x = static_cast<uint32_t>(i) * 2654435761u + seed * 40503u;
  return static_cast<uint8_t>(1 + (x >> 24) % 255);
}

__global__ void SlowFillKernel(uint8_t* dst, size_t bytes, uint32_t seed, long long spin_ns) {
  if (threadIdx.x == 0) {
    // %globaltimer counts nanoseconds (clock64 counts cycles of a varying clock).
    unsigned long long t0 = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    for (;;) {
      unsigned long long t = 0;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      if (static_cast<long long>(t - t0) >= spin_ns) break;
      __nanosleep(1000);
    }
  }
  __syncthreads();
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < bytes;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = PatternByte(i, seed);
  }
}

__global__ void WriteTailKernel(uint8_t* tail, size_t bytes, uint32_t seed) {
  for (size_t i = threadIdx.x; i < bytes; i += blockDim.x) tail[i] = PatternByte(i, seed);
  __threadfence_system();
}

}  // namespace

absl::Status LaunchSlowFill(void* dst, size_t bytes, uint32_t seed, int spin_ms, void* stream) {
  SlowFillKernel<<<264, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<uint8_t*>(dst), bytes, seed, static_cast<long long>(spin_ms) * 1000000);
  return CudaErrorToStatus(static_cast<int>(cudaGetLastError()), "SlowFillKernel launch");
}

absl::Status LaunchWriteTail(void* tail, size_t bytes, uint32_t seed, void* stream) {
  uint8_t* device_view = nullptr;
  const cudaError_t e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_view), tail, 0);
  if (e != cudaSuccess) return CudaErrorToStatus(static_cast<int>(e), "cudaHostGetDevicePointer");
  WriteTailKernel<<<1, 64, 0, static_cast<cudaStream_t>(stream)>>>(device_view, bytes, seed);
  return CudaErrorToStatus(static_cast<int>(cudaGetLastError()), "WriteTailKernel launch");
}

}  // namespace gpu_test
}  // namespace kvstream
