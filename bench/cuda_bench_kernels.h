// Helper kernels for kvstream_bench_cuda_kernels: a kernel that holds a stream until the
// host releases it (so that many launches queue up and run back to back, timed without
// host gaps), a streaming-read kernel (the bandwidth ceiling of a read-only kernel), and a
// fill of random values. Plain functions over void* so the benchmark needs no CUDA
// compiler; each returns the cudaError_t of its launch as an int.
#ifndef KVSTREAM_BENCH_CUDA_BENCH_KERNELS_H_
#define KVSTREAM_BENCH_CUDA_BENCH_KERNELS_H_

#include <cstddef>
#include <cstdint>

namespace kvstream {
namespace bench {

// Enqueues a one-thread kernel that spins until *flag (pinned host memory, written by the
// host) is non-zero, or `timeout_ms` passes.
int LaunchHoldStream(const volatile int* flag, int timeout_ms, void* stream);

// Reads `bytes` (a multiple of 16) at `data` once with 16-byte loads over `num_sms` * 8
// CTAs, and writes one word per CTA to `sink` (num_sms * 8 uint32 of device memory) so
// that the loads are not removed.
int LaunchStreamingRead(const void* data, size_t bytes, uint32_t* sink, int num_sms,
                        void* stream);

// Fills `count` elements at `data` with values in [-1, 1) drawn from `seed`: dtype_code 0
// float32, 1 float16, 2 bfloat16, 3 fp8 e4m3, 4 fp8 e5m2 (codes of values in range).
int LaunchFillRandom(void* data, size_t count, int dtype_code, uint32_t seed, void* stream);

}  // namespace bench
}  // namespace kvstream

#endif  // KVSTREAM_BENCH_CUDA_BENCH_KERNELS_H_
