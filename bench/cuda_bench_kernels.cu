// Helper kernels for kvstream_bench_cuda_kernels (see cuda_bench_kernels.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "bench/cuda_bench_kernels.h"

namespace kvstream {
namespace bench {
namespace {

__device__ __forceinline__ unsigned long long GlobalTimerNs() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void HoldStreamKernel(const volatile int* flag, unsigned long long timeout_ns) {
  const unsigned long long start = GlobalTimerNs();
  while (*flag == 0 && GlobalTimerNs() - start < timeout_ns) __nanosleep(2000);
}

__global__ void StreamingReadKernel(const uint4* __restrict__ data, size_t n, uint32_t* sink) {
  uint32_t acc = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  // Four independent loads in flight per thread per step.
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = __ldcs(data + i);
    const uint4 b = __ldcs(data + i + stride);
    const uint4 c = __ldcs(data + i + 2 * stride);
    const uint4 d = __ldcs(data + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^
           d.z ^ d.w;
  }
  for (; i < n; i += stride) {
    const uint4 a = __ldcs(data + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  // One word per CTA: the XOR of its threads' words (a block-wide reduction is not needed;
  // any dependence on every load keeps them).
  __shared__ uint32_t block_acc;
  if (threadIdx.x == 0) block_acc = 0;
  __syncthreads();
  atomicXor(&block_acc, acc);
  __syncthreads();
  if (threadIdx.x == 0) sink[blockIdx.x] = block_acc;
}

// LaunchPagedRead's kernel: stage st of a CTA holds keys [st * 32, st * 32 + 32) of its
// split, K rows then V rows (16 chunks of 16 bytes each); two stages are in flight while
// the third is read back (one word per thread, for the sink).
constexpr int kPagedReadThreads = 128;
constexpr int kPagedReadStageKeys = 32;
constexpr int kPagedReadRing = 3;
constexpr int kPagedReadStageBytes = 2 * kPagedReadStageKeys * 256;

__global__ void __launch_bounds__(kPagedReadThreads) PagedReadKernel(const PagedReadArgs a) {
  __shared__ __align__(16) uint8_t ring[kPagedReadRing * kPagedReadStageBytes];
  const int head = static_cast<int>(blockIdx.x);
  const int seq = static_cast<int>(blockIdx.y);
  const int split = static_cast<int>(blockIdx.z);
  const int per_split = (a.seq_len + a.splits - 1) / a.splits;
  const int begin = min(a.seq_len, split * per_split);
  const int end = min(a.seq_len, begin + per_split);
  const int stages = (end - begin + kPagedReadStageKeys - 1) / kPagedReadStageKeys;
  const int32_t* const row_table =
      a.table == nullptr ? nullptr : a.table + static_cast<int64_t>(seq) * a.blocks_per_seq;
  const int block_mask = (1 << a.block_shift) - 1;
  const uint32_t ring_base = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  const uint8_t* const k = static_cast<const uint8_t*>(a.k);
  const uint8_t* const v = static_cast<const uint8_t*>(a.v);
  auto issue = [&](int st) {
    if (st < stages) {
      const uint32_t slot = ring_base + (st % kPagedReadRing) * kPagedReadStageBytes;
      for (int c = static_cast<int>(threadIdx.x); c < kPagedReadStageKeys * 16;
           c += kPagedReadThreads) {
        const int row = c >> 4;
        const int j = min(begin + st * kPagedReadStageKeys + row, end - 1);
        const int64_t offset =
            row_table == nullptr
                ? ((static_cast<int64_t>(seq) * a.heads + head) * a.seq_len + j) * 256
                : row_table[j >> a.block_shift] * a.block_stride +
                      (j & block_mask) * a.token_stride + head * a.head_stride;
        const int64_t chunk = offset + (c & 15) * 16;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(slot + c * 16),
                     "l"(k + chunk));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(
                         slot + kPagedReadStageBytes / 2 + c * 16),
                     "l"(v + chunk));
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  for (int st = 0; st < kPagedReadRing - 1; ++st) issue(st);
  uint32_t acc = 0;
  for (int st = 0; st < stages; ++st) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPagedReadRing - 2));
    __syncthreads();  // stage st landed for every thread; stage st - 1 is read back
    issue(st + kPagedReadRing - 1);
    acc ^= reinterpret_cast<const uint32_t*>(ring + (st % kPagedReadRing) *
                                                        kPagedReadStageBytes)[threadIdx.x];
  }
  asm volatile("cp.async.wait_group 0;\n" ::);
  const int cta = (seq * a.heads + head) * a.splits + split;
  if (threadIdx.x == 0) a.sink[cta] = 0;
  __syncthreads();
  atomicXor(a.sink + cta, acc);
}

__device__ __forceinline__ uint32_t Hash(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

__global__ void FillRandomKernel(void* data, size_t count, int dtype_code, uint32_t seed) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const uint32_t h = Hash(static_cast<uint32_t>(i) ^ Hash(seed ^ static_cast<uint32_t>(i >> 32)));
    const float x = static_cast<float>(h >> 8) * (2.0f / 16777216.0f) - 1.0f;
    switch (dtype_code) {
      case 0: static_cast<float*>(data)[i] = x; break;
      case 1: static_cast<__half*>(data)[i] = __float2half_rn(x); break;
      case 2: static_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16_rn(x); break;
      case 3: static_cast<__nv_fp8_e4m3*>(data)[i] = __nv_fp8_e4m3(x * 16.0f); break;
      default: static_cast<__nv_fp8_e5m2*>(data)[i] = __nv_fp8_e5m2(x * 16.0f); break;
    }
  }
}

}  // namespace

int LaunchHoldStream(const volatile int* flag, int timeout_ms, void* stream) {
  HoldStreamKernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(
      flag, static_cast<unsigned long long>(timeout_ms) * 1000000ull);
  return static_cast<int>(cudaGetLastError());
}

int LaunchStreamingRead(const void* data, size_t bytes, uint32_t* sink, int num_sms,
                        void* stream) {
  StreamingReadKernel<<<num_sms * 8, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint4*>(data), bytes / 16, sink);
  return static_cast<int>(cudaGetLastError());
}

int LaunchPagedRead(const PagedReadArgs& args, void* stream) {
  if (args.seqs <= 0 || args.heads <= 0 || args.splits <= 0 || args.seq_len <= 0 ||
      args.block_shift < 0 || args.block_shift > 30) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const dim3 grid(static_cast<unsigned>(args.heads), static_cast<unsigned>(args.seqs),
                  static_cast<unsigned>(args.splits));
  PagedReadKernel<<<grid, kPagedReadThreads, 0, static_cast<cudaStream_t>(stream)>>>(args);
  return static_cast<int>(cudaGetLastError());
}

int LaunchFillRandom(void* data, size_t count, int dtype_code, uint32_t seed, void* stream) {
  FillRandomKernel<<<1024, 256, 0, static_cast<cudaStream_t>(stream)>>>(data, count, dtype_code,
                                                                       seed);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace bench
}  // namespace kvstream
