// Kernels for the cuda_ipc transport's GPU tests: a slow producer (spins, then writes a
// pattern the host can recompute) standing in for a layer's cache update, and a tail writer
// standing in for a checksum kernel that writes into pinned host memory.
#ifndef KVSTREAM_TESTS_GPU_CUDA_IPC_TEST_KERNELS_H_
#define KVSTREAM_TESTS_GPU_CUDA_IPC_TEST_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace kvstream {
namespace gpu_test {

// The byte SlowFill writes at index i for `seed`; never zero.
inline uint8_t IpcPatternByte(size_t i, uint32_t seed) {
  const uint32_t x = static_cast<uint32_t>(i) * 2654435761u + seed * 40503u;
  return static_cast<uint8_t>(1 + (x >> 24) % 255);
}

// Enqueues on `stream`: spin for about `spin_ms` milliseconds, then write
// IpcPatternByte(i, seed) to dst[i] for i < bytes (dst: device memory).
absl::Status LaunchSlowFill(void* dst, size_t bytes, uint32_t seed, int spin_ms, void* stream);

// Enqueues on `stream`: write IpcPatternByte(i, seed) to tail[i] for i < bytes, where `tail`
// is pinned host memory the device can write (cudaHostAlloc with cudaHostAllocMapped, or any
// pinned memory on a system with unified addressing).
absl::Status LaunchWriteTail(void* tail, size_t bytes, uint32_t seed, void* stream);

}  // namespace gpu_test
}  // namespace kvstream

#endif  // KVSTREAM_TESTS_GPU_CUDA_IPC_TEST_KERNELS_H_
