// The synthetic model's small CUDA kernels (model_ops.h).
#include "cuda/model_ops.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kvstream/common/cuda_status.h"
#include "random_weights.h"

namespace kvstream {
namespace internal {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float Load(const uint16_t* p) {
  return __bfloat162float(__ushort_as_bfloat16(*p));
}
__device__ __forceinline__ uint16_t Round(float v) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

__global__ void RandomBf16Kernel(uint64_t base, int64_t n, float mean, float stddev,
                                 uint16_t* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = Round(RandomTensorElement(base, static_cast<uint64_t>(i), mean, stddev));
  }
}

__global__ void EmbedKernel(const uint16_t* table, int64_t vocab, int64_t hidden,
                            const int32_t* tokens, uint16_t* out) {
  const int64_t r = blockIdx.x;
  const int32_t token = tokens[r];
  const bool valid = token >= 0 && token < vocab;
  const uint16_t* src = table + (valid ? static_cast<int64_t>(token) : 0) * hidden;
  uint16_t* dst = out + r * hidden;
  for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) dst[j] = valid ? src[j] : 0;
}

// A fixed-order sum over the CTA (kThreads threads): warp shuffles, then warp 0 over the
// per-warp sums. Every thread gets the total.
__device__ float CtaSum(float v) {
  __shared__ float partial[kThreads / 32];
  __shared__ float total;
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    float w = threadIdx.x < kThreads / 32 ? partial[threadIdx.x] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) w += __shfl_xor_sync(0xffffffffu, w, offset);
    if (threadIdx.x == 0) total = w;
  }
  __syncthreads();
  return total;
}

__global__ void __launch_bounds__(kThreads)
    RmsNormKernel(const uint16_t* in, const uint16_t* weight, int64_t hidden, float eps,
                  uint16_t* out) {
  const uint16_t* x = in + static_cast<int64_t>(blockIdx.x) * hidden;
  uint16_t* y = out + static_cast<int64_t>(blockIdx.x) * hidden;
  float ss = 0.0f;
  for (int64_t j = threadIdx.x; j < hidden; j += kThreads) {
    const float v = Load(x + j);
    ss = fmaf(v, v, ss);
  }
  const float inv = rsqrtf(CtaSum(ss) / static_cast<float>(hidden) + eps);
  // Every element is read before any is written (CtaSum synchronises), so in == out works.
  for (int64_t j = threadIdx.x; j < hidden; j += kThreads) {
    y[j] = Round(Load(x + j) * inv * Load(weight + j));
  }
}

// One CTA per row, one thread per frequency; each thread rotates its pair in every head.
__global__ void RotaryKernel(uint16_t* x, int64_t row_stride, int heads, int head_size,
                             const int32_t* positions, double theta) {
  const int half = head_size / 2;
  const int i = threadIdx.x;
  if (i >= half) return;
  const double inv_freq = pow(theta, -2.0 * i / head_size);
  const double angle = static_cast<double>(positions[blockIdx.x]) * inv_freq;
  const float c = static_cast<float>(cos(angle));
  const float s = static_cast<float>(sin(angle));
  uint16_t* row = x + static_cast<int64_t>(blockIdx.x) * row_stride;
  for (int h = 0; h < heads; ++h) {
    uint16_t* v = row + static_cast<int64_t>(h) * head_size;
    const float a = Load(v + i);
    const float b = Load(v + i + half);
    v[i] = Round(a * c - b * s);
    v[i + half] = Round(a * s + b * c);
  }
}

__global__ void SiluMulKernel(const uint16_t* gate_up, int64_t inter, uint16_t* out) {
  const uint16_t* g = gate_up + static_cast<int64_t>(blockIdx.x) * 2 * inter;
  const uint16_t* u = g + inter;
  uint16_t* o = out + static_cast<int64_t>(blockIdx.x) * inter;
  for (int64_t j = threadIdx.x; j < inter; j += blockDim.x) {
    const float gv = Load(g + j);
    o[j] = Round(gv / (1.0f + expf(-gv)) * Load(u + j));
  }
}

// Whether (v, i) beats (best, best_i): larger, or equal and earlier; NaN never beats.
__device__ __forceinline__ bool Beats(float v, int32_t i, float best, int32_t best_i) {
  if (v != v) return false;
  if (best != best) return true;
  return v > best || (v == best && i < best_i);
}

__global__ void __launch_bounds__(kThreads)
    ArgmaxKernel(const float* logits, int64_t vocab, int32_t* out) {
  const float* row = logits + static_cast<int64_t>(blockIdx.x) * vocab;
  float best = __int_as_float(0x7fc00000);  // NaN: anything beats it
  int32_t best_i = 0;
  for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
    const float v = row[j];
    if (Beats(v, static_cast<int32_t>(j), best, best_i)) {
      best = v;
      best_i = static_cast<int32_t>(j);
    }
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, best, offset);
    const int32_t i = __shfl_xor_sync(0xffffffffu, best_i, offset);
    if (Beats(v, i, best, best_i)) {
      best = v;
      best_i = i;
    }
  }
  __shared__ float warp_best[kThreads / 32];
  __shared__ int32_t warp_index[kThreads / 32];
  if ((threadIdx.x & 31) == 0) {
    warp_best[threadIdx.x / 32] = best;
    warp_index[threadIdx.x / 32] = best_i;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) {
      if (Beats(warp_best[w], warp_index[w], best, best_i)) {
        best = warp_best[w];
        best_i = warp_index[w];
      }
    }
    out[blockIdx.x] = best_i;
  }
}

cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

absl::Status Launched(const char* what) {
  return CudaErrorToStatus(static_cast<int>(cudaGetLastError()), what);
}

// Rows become the grid's x dimension (at most 2^31 - 1).
absl::Status CheckRows(int64_t rows, const char* op) {
  if (rows < 0 || rows > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": rows ", rows, " out of range"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchRandomBf16(uint32_t seed, uint64_t tensor, int64_t n, float mean,
                              float stddev, uint16_t* out, void* stream) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("LaunchRandomBf16: n ", n));
  if (n == 0) return absl::OkStatus();
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  const int grid = static_cast<int>(blocks < 65536 ? blocks : 65536);
  RandomBf16Kernel<<<grid, kThreads, 0, AsStream(stream)>>>(RandomTensorBase(seed, tensor), n,
                                                             mean, stddev, out);
  return Launched("random weights kernel launch");
}

absl::Status LaunchEmbed(const uint16_t* table, int64_t vocab, int64_t hidden,
                         const int32_t* tokens, int64_t rows, uint16_t* out, void* stream) {
  if (vocab <= 0 || hidden <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("LaunchEmbed: vocab ", vocab, " and hidden ", hidden, " must be positive"));
  }
  if (absl::Status s = CheckRows(rows, "LaunchEmbed"); !s.ok()) return s;
  if (rows == 0) return absl::OkStatus();
  EmbedKernel<<<static_cast<unsigned>(rows), kThreads, 0, AsStream(stream)>>>(table, vocab,
                                                                              hidden, tokens, out);
  return Launched("embedding kernel launch");
}

absl::Status LaunchRmsNorm(const uint16_t* in, const uint16_t* weight, int64_t rows,
                           int64_t hidden, float eps, uint16_t* out, void* stream) {
  if (hidden <= 0 || hidden % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("LaunchRmsNorm: hidden ", hidden, " must be a positive multiple of 8"));
  }
  if (!(eps >= 0.0f)) return absl::InvalidArgumentError("LaunchRmsNorm: eps must be >= 0");
  if (absl::Status s = CheckRows(rows, "LaunchRmsNorm"); !s.ok()) return s;
  if (rows == 0) return absl::OkStatus();
  RmsNormKernel<<<static_cast<unsigned>(rows), kThreads, 0, AsStream(stream)>>>(in, weight,
                                                                                hidden, eps, out);
  return Launched("RMSNorm kernel launch");
}

absl::Status LaunchRotary(uint16_t* x, int64_t rows, int64_t row_stride, int heads,
                          int head_size, const int32_t* positions, double theta, void* stream) {
  if (head_size <= 0 || head_size % 2 != 0 || head_size > 2048) {
    return absl::InvalidArgumentError(
        absl::StrCat("LaunchRotary: head_size ", head_size, " must be even, 2..2048"));
  }
  if (heads < 0 || static_cast<int64_t>(heads) * head_size > row_stride) {
    return absl::InvalidArgumentError(absl::StrCat("LaunchRotary: ", heads, " heads of ",
                                                   head_size, " exceed the row stride ",
                                                   row_stride));
  }
  if (!(theta > 1.0)) return absl::InvalidArgumentError("LaunchRotary: theta must be above 1");
  if (absl::Status s = CheckRows(rows, "LaunchRotary"); !s.ok()) return s;
  if (rows == 0 || heads == 0) return absl::OkStatus();
  const int threads = ((head_size / 2 + 31) / 32) * 32;
  RotaryKernel<<<static_cast<unsigned>(rows), threads, 0, AsStream(stream)>>>(
      x, row_stride, heads, head_size, positions, theta);
  return Launched("rotary embedding kernel launch");
}

absl::Status LaunchSiluMul(const uint16_t* gate_up, int64_t rows, int64_t inter, uint16_t* out,
                           void* stream) {
  if (inter <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("LaunchSiluMul: inter ", inter));
  }
  if (absl::Status s = CheckRows(rows, "LaunchSiluMul"); !s.ok()) return s;
  if (rows == 0) return absl::OkStatus();
  SiluMulKernel<<<static_cast<unsigned>(rows), kThreads, 0, AsStream(stream)>>>(gate_up, inter,
                                                                                out);
  return Launched("SwiGLU kernel launch");
}

absl::Status LaunchArgmax(const float* logits, int64_t rows, int64_t vocab, int32_t* out,
                          void* stream) {
  if (vocab <= 0 || vocab > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("LaunchArgmax: vocab ", vocab));
  }
  if (absl::Status s = CheckRows(rows, "LaunchArgmax"); !s.ok()) return s;
  if (rows == 0) return absl::OkStatus();
  ArgmaxKernel<<<static_cast<unsigned>(rows), kThreads, 0, AsStream(stream)>>>(logits, vocab,
                                                                               out);
  return Launched("argmax kernel launch");
}

}  // namespace internal
}  // namespace kvstream
