// Device helpers shared by the CUDA attention and cache kernels: element types, conversions
// to and from float, and vector loads of 8 elements. Header-only; include from .cu files.
//
// Element types are CUDA's own: float, __half, __nv_bfloat16, __nv_fp8_e4m3,
// __nv_fp8_e5m2. fp8 values are raw codes here; scales are applied by the caller.
#ifndef KVSTREAM_ATTENTION_CUDA_CUDA_COMMON_CUH_
#define KVSTREAM_ATTENTION_CUDA_CUDA_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

// `#pragma unroll` for nvcc; nothing for a host compiler (the warp-emulator tests compile
// the kernels with GCC, which rejects the pragma under -Wall -Werror).
#if defined(__CUDACC__)
#define KVSTREAM_CUDA_COMMON_UNROLL _Pragma("unroll")
#else
#define KVSTREAM_CUDA_COMMON_UNROLL
#endif

namespace kvstream {
namespace internal {
namespace cuda {

// Programmatic dependent launch (compute capability 9.0 and newer; nothing elsewhere and
// in host builds). AllowDependentLaunch: the next kernel in the stream, when launched with
// cudaLaunchAttributeProgrammaticStreamSerialization, may start its CTAs once every CTA of
// this grid has called it or exited. WaitForPrerequisiteGrids: blocks until the grids this
// one depends on have completed and their memory writes are visible; everything before it
// must not read what they write.
__device__ __forceinline__ void AllowDependentLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void WaitForPrerequisiteGrids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

template <typename T>
struct IsFp8Type {
  static constexpr bool value = false;
};
template <>
struct IsFp8Type<__nv_fp8_e4m3> {
  static constexpr bool value = true;
};
template <>
struct IsFp8Type<__nv_fp8_e5m2> {
  static constexpr bool value = true;
};

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float ToFloat(__nv_fp8_e4m3 x) { return static_cast<float>(x); }
__device__ __forceinline__ float ToFloat(__nv_fp8_e5m2 x) { return static_cast<float>(x); }

// Round to nearest even; fp8 saturates to the largest finite value (as the CPU code does).
template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __nv_fp8_e4m3 FromFloat<__nv_fp8_e4m3>(float x) {
  __nv_fp8_e4m3 r;
  r.__x = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
  return r;
}
template <>
__device__ __forceinline__ __nv_fp8_e5m2 FromFloat<__nv_fp8_e5m2>(float x) {
  __nv_fp8_e5m2 r;
  r.__x = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2);
  return r;
}

// Loads 8 consecutive elements starting at `p` (which must be aligned to 8 elements) and
// converts them to float. One 16-, 8- or 32-byte access per call.
template <typename T>
__device__ __forceinline__ void Load8(const T* p, float (&out)[8]) {
  static_assert(sizeof(T) == 1 || sizeof(T) == 2, "16-bit and fp8 types here; float below");
  if constexpr (sizeof(T) == 2) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
KVSTREAM_CUDA_COMMON_UNROLL
    for (int i = 0; i < 8; ++i) out[i] = ToFloat(e[i]);
  } else {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
KVSTREAM_CUDA_COMMON_UNROLL
    for (int i = 0; i < 8; ++i) out[i] = ToFloat(e[i]);
  }
}
template <>
__device__ __forceinline__ void Load8<float>(const float* p, float (&out)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

}  // namespace cuda
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_CUDA_COMMON_CUH_
