// Kernels for wgmma_gpu_test (wgmma_kernels.h): one CTA of one warpgroup.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/wgmma_ptx.cuh"
#include "wgmma_kernels.h"

namespace kvstream::gpu_test {
namespace {

namespace w = internal::wgmma;

constexpr int kPanelBytes = 64 * 128;  // [64 rows][64 columns] of 16-bit values
constexpr int kSmemBytes = 6 * kPanelBytes + 1024;

// Rounds the dynamic shared memory's start up to 1024 bytes (the swizzle atom).
__device__ uint8_t* AlignedSmem(uint8_t* raw) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(raw));
  return raw + ((1024 - (address & 1023)) & 1023);
}

// Stores a [64][cols] row-major tile into cols / 64 swizzled panels at `panels`.
__device__ void StorePanels(const uint16_t* src, int cols, uint8_t* panels) {
  for (int i = threadIdx.x; i < 64 * cols; i += blockDim.x) {
    const int row = i / cols, col = i % cols;
    *reinterpret_cast<uint16_t*>(panels + (col / 64) * kPanelBytes +
                                 w::SwizzledOffset128(row, col % 64)) = src[i];
  }
}

__device__ uint32_t Shared(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <typename T>
__device__ void QkT(const uint8_t* q, const uint8_t* k, float (&s)[32]) {
  w::Fence();
#pragma unroll
  for (int step = 0; step < 8; ++step) {
    w::WgmmaSS<64, T>(s, w::KMajorStep(Shared(q), kPanelBytes, step),
                            w::KMajorStep(Shared(k), kPanelBytes, step), step > 0);
  }
  w::Commit();
  w::Wait<0>();
  w::FenceOperands(s);
}

template <typename T>
__device__ void Pv(const float (&p)[32], const uint8_t* v, float (&o)[64]) {
  uint32_t a[4][4];
#pragma unroll
  for (int step = 0; step < 4; ++step) w::PackA<T>(p, step, a[step]);
  w::Fence();
#pragma unroll
  for (int step = 0; step < 4; ++step) {
    w::WgmmaRS<128, T, true>(o, a[step], w::MnMajorStep(Shared(v), kPanelBytes, step),
                                   step > 0);
  }
  w::Commit();
  w::Wait<0>();
  w::FenceOperands(o);
}

template <int N>
__device__ void StoreAccumulators(const float (&d)[N], int cols, float* out) {
  const int t = threadIdx.x;
#pragma unroll
  for (int j = 0; j < N; ++j) out[w::AccumulatorRow(t, j) * cols + w::AccumulatorCol(t, j)] = d[j];
}

// mode 0: s = q k^T; 1: o = p v; 2: both, p from s.
template <typename T>
__global__ void __launch_bounds__(128) WgmmaKernel(int mode, const uint16_t* q, const uint16_t* k,
                                                   const uint16_t* p, const uint16_t* v, float* s,
                                                   float* o) {
  extern __shared__ __align__(1024) uint8_t raw[];
  uint8_t* smem = AlignedSmem(raw);
  uint8_t* q_panels = smem;
  uint8_t* k_panels = smem + 2 * kPanelBytes;
  uint8_t* v_panels = smem + 4 * kPanelBytes;
  if (mode != 1) {
    StorePanels(q, 128, q_panels);
    StorePanels(k, 128, k_panels);
  }
  if (mode != 0) StorePanels(v, 128, v_panels);
  w::FenceSharedForAsyncProxy();
  __syncthreads();
  float sd[32];
  if (mode == 1) {
    const int t = threadIdx.x;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const uint16_t bits = p[w::AccumulatorRow(t, j) * 64 + w::AccumulatorCol(t, j)];
      if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        sd[j] = __uint_as_float(static_cast<uint32_t>(bits) << 16);
      } else {
        sd[j] = __half2float(__ushort_as_half(bits));
      }
    }
  } else {
    QkT<T>(q_panels, k_panels, sd);
    StoreAccumulators(sd, 64, s);
  }
  if (mode == 0) return;
  float od[64];
#pragma unroll
  for (int j = 0; j < 64; ++j) od[j] = 0;
  Pv<T>(sd, v_panels, od);
  StoreAccumulators(od, 128, o);
}

int Run(int mode, const uint16_t* q, const uint16_t* k, const uint16_t* p, const uint16_t* v,
        float* s, float* o, bool bf16) {
  int device = 0, major = 0, minor = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (e != cudaSuccess) return static_cast<int>(e);
  if (major != 9 || minor != 0) return static_cast<int>(cudaErrorNotSupported);
  uint16_t* d_in = nullptr;
  float* d_out = nullptr;
  constexpr size_t kIn = 64 * 128;  // elements per input slot
  e = cudaMalloc(&d_in, 4 * kIn * sizeof(uint16_t));
  if (e == cudaSuccess) e = cudaMalloc(&d_out, (64 * 64 + 64 * 128) * sizeof(float));
  const uint16_t* host_in[4] = {q, k, p, v};
  const size_t counts[4] = {64 * 128, 64 * 128, 64 * 64, 64 * 128};
  for (int i = 0; i < 4 && e == cudaSuccess; ++i) {
    if (host_in[i] != nullptr) {
      e = cudaMemcpy(d_in + i * kIn, host_in[i], counts[i] * sizeof(uint16_t),
                     cudaMemcpyHostToDevice);
    }
  }
  if (e == cudaSuccess) e = cudaMemset(d_out, 0xFF, (64 * 64 + 64 * 128) * sizeof(float));
  if (e == cudaSuccess) {
    auto* kernel = bf16 ? &WgmmaKernel<__nv_bfloat16> : &WgmmaKernel<__half>;
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (e == cudaSuccess) {
      kernel<<<1, 128, kSmemBytes>>>(mode, d_in, d_in + kIn, d_in + 2 * kIn, d_in + 3 * kIn,
                                     d_out, d_out + 64 * 64);
      e = cudaGetLastError();
    }
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
  }
  if (e == cudaSuccess && s != nullptr) {
    e = cudaMemcpy(s, d_out, 64 * 64 * sizeof(float), cudaMemcpyDeviceToHost);
  }
  if (e == cudaSuccess && o != nullptr) {
    e = cudaMemcpy(o, d_out + 64 * 64, 64 * 128 * sizeof(float), cudaMemcpyDeviceToHost);
  }
  cudaFree(d_in);
  cudaFree(d_out);
  return static_cast<int>(e);
}

}  // namespace

int WgmmaQkT(const uint16_t* q, const uint16_t* k, float* s, bool bf16) {
  return Run(0, q, k, nullptr, nullptr, s, nullptr, bf16);
}
int WgmmaPv(const uint16_t* p, const uint16_t* v, float* o, bool bf16) {
  return Run(1, nullptr, nullptr, p, v, nullptr, o, bf16);
}
int WgmmaQkPv(const uint16_t* q, const uint16_t* k, const uint16_t* v, float* s, float* o,
              bool bf16) {
  return Run(2, q, k, nullptr, v, s, o, bf16);
}

}  // namespace kvstream::gpu_test
