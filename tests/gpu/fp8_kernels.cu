// Kernels for fp8_conversion_gpu_test: CUDA's fp8 conversions applied element-wise.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "fp8_kernels.h"

namespace kvstream::gpu_test {
namespace {

__global__ void EncodeKernel(const float* in, uint8_t* out, int n, bool e5m2) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  out[i] = __nv_cvt_float_to_fp8(in[i], __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3);
}

__global__ void DecodeKernel(const uint8_t* in, float* out, int n, bool e5m2) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const __half_raw h = __nv_cvt_fp8_to_halfraw(in[i], e5m2 ? __NV_E5M2 : __NV_E4M3);
  out[i] = __half2float(__half(h));
}

template <typename In, typename Out, typename Launch>
int RoundTrip(const In* in, Out* out, int n, Launch launch) {
  In* d_in = nullptr;
  Out* d_out = nullptr;
  cudaError_t e = cudaMalloc(&d_in, sizeof(In) * n);
  if (e == cudaSuccess) e = cudaMalloc(&d_out, sizeof(Out) * n);
  if (e == cudaSuccess) e = cudaMemcpy(d_in, in, sizeof(In) * n, cudaMemcpyHostToDevice);
  if (e == cudaSuccess) {
    launch(d_in, d_out);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) e = cudaMemcpy(out, d_out, sizeof(Out) * n, cudaMemcpyDeviceToHost);
  cudaFree(d_in);
  cudaFree(d_out);
  return static_cast<int>(e);
}

}  // namespace

int DeviceFloatToFp8(const float* in, uint8_t* out, int n, bool e5m2) {
  return RoundTrip(in, out, n, [&](const float* d_in, uint8_t* d_out) {
    EncodeKernel<<<(n + 255) / 256, 256>>>(d_in, d_out, n, e5m2);
  });
}

int DeviceFp8ToFloat(const uint8_t* in, float* out, int n, bool e5m2) {
  return RoundTrip(in, out, n, [&](const uint8_t* d_in, float* d_out) {
    DecodeKernel<<<(n + 255) / 256, 256>>>(d_in, d_out, n, e5m2);
  });
}

}  // namespace kvstream::gpu_test
