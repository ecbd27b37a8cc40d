// Kernels for the UCX staged-path GPU tests and benchmark (ucx_staged_gpu_test.cc,
// ucx_staged_gpu_peer_main.cc, bench/ucx_staged_bench.cc): a deterministic byte pattern
// written by the GPU (the same function on the host gives the expected bytes), a pattern
// written only after the GPU has spun for a while (a producer the transport must wait
// for), and an 8-byte tail written by the GPU into pinned host memory.
#ifndef KVSTREAM_TESTS_GPU_UCX_STAGED_KERNELS_H_
#define KVSTREAM_TESTS_GPU_UCX_STAGED_KERNELS_H_

#include <cstddef>
#include <cstdint>

namespace kvstream::gpu_test {

// Byte i of the pattern for `seed` (never 0, so that untouched zeroed bytes stand out).
inline uint8_t PatternByte(uint32_t seed, uint64_t i) {
  uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull ^ (uint64_t{seed} << 32 | seed);
  x ^= x >> 29;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 32;
  return static_cast<uint8_t>(1 + x % 255);
}

// All return cudaError_t as int and enqueue on `stream` (a cudaStream_t) without blocking.
// dst[i] = PatternByte(seed, i) for i < bytes.
int LaunchFillPattern(void* dst, size_t bytes, uint32_t seed, void* stream);
// As LaunchFillPattern, after spinning on the GPU for about `spin_ms` milliseconds.
int LaunchSlowFillPattern(void* dst, size_t bytes, uint32_t seed, uint32_t spin_ms, void* stream);
// *host_tail (pinned host memory) = value, written by the GPU.
int LaunchWriteTail(uint64_t* host_tail, uint64_t value, void* stream);

}  // namespace kvstream::gpu_test

#endif  // KVSTREAM_TESTS_GPU_UCX_STAGED_KERNELS_H_
