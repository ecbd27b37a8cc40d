// Kernels for the UCX staged-path GPU tests (ucx_staged_kernels.h).
#include <cuda_runtime.h>

#include "ucx_staged_kernels.h"

namespace kvstream::gpu_test {
namespace {

__device__ uint8_t DevicePatternByte(uint32_t seed, uint64_t i) {
  uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull ^ (uint64_t{seed} << 32 | seed);
  x ^= x >> 29;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 32;
  return static_cast<uint8_t>(1 + x % 255);
}

__global__ void FillKernel(uint8_t* dst, size_t bytes, uint32_t seed, uint64_t spin_ns) {
  if (spin_ns > 0) {
    const uint64_t start = clock64();
    // clock64 counts SM cycles; ~1.5 GHz on the H200 is close enough for "a while".
    while (static_cast<uint64_t>(clock64() - start) < spin_ns * 3 / 2) {
    }
  }
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < bytes; i += stride) {
    dst[i] = DevicePatternByte(seed, i);
  }
}

__global__ void TailKernel(uint64_t* host_tail, uint64_t value) { *host_tail = value; }

}  // namespace

int LaunchFillPattern(void* dst, size_t bytes, uint32_t seed, void* stream) {
  return LaunchSlowFillPattern(dst, bytes, seed, 0, stream);
}

int LaunchSlowFillPattern(void* dst, size_t bytes, uint32_t seed, uint32_t spin_ms,
                          void* stream) {
  if (bytes == 0) return static_cast<int>(cudaSuccess);
  FillKernel<<<1024, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<uint8_t*>(dst), bytes, seed, uint64_t{spin_ms} * 1000000);
  return static_cast<int>(cudaGetLastError());
}

int LaunchWriteTail(uint64_t* host_tail, uint64_t value, void* stream) {
  TailKernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(host_tail, value);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace kvstream::gpu_test
