// The CUDA cache update's element types (ElemF32, ElemF16, ElemBF16, ElemE4M3, ElemE5M2:
// storage bits and conversions) and Convert, one element from the input type to the cache
// type, on device conversions that give the bits common/numeric.h gives on the host
// (NaN payloads kept for 16-bit formats, fp8 saturating with the host's NaN code).
#ifndef KVSTREAM_CACHE_CUDA_CACHE_UPDATE_TYPES_CUH_
#define KVSTREAM_CACHE_CUDA_CACHE_UPDATE_TYPES_CUH_

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace kvstream {
namespace internal {
namespace cache_update {

// ---- Bit-exact conversions: device versions of common/numeric.h ----
// 16-bit formats: ports of the host code, integer and exactly-rounded float operations only
// (CUDA's own conversions canonicalise NaN payloads, the host code keeps them).

__device__ __forceinline__ float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return __uint_as_float(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    // mant * 2^-24, exact (as the host's ldexp).
    const float v = static_cast<float>(mant) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return __uint_as_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

__device__ __forceinline__ uint16_t FloatToHalfBits(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (abs < 0x38800000u) {
    const float scaled = __uint_as_float(abs) * 16777216.0f;  // exact: power of two
    const float r = rintf(scaled);                            // ties to even
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(static_cast<uint32_t>(r)));
  }
  uint32_t h = abs - 0x38000000u;
  h += 0xfffu + ((h >> 13) & 1u);
  return static_cast<uint16_t>(sign | (h >> 13));
}

__device__ __forceinline__ float BFloat16BitsToFloat(uint16_t h) {
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
}

__device__ __forceinline__ uint16_t FloatToBFloat16Bits(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// fp8 through the hardware's saturating round-to-nearest-even conversion (one instruction
// on sm_89+), which tests/gpu/fp8_conversion_gpu_test checks against common/numeric.h bit
// for bit; NaN is the one input where formats may differ (the sign of the NaN code), so it
// is mapped to 0x7f here as the host does.
__device__ __forceinline__ uint8_t FloatToE4M3Bits(float f) {
  if (isnan(f)) return 0x7f;
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ uint8_t FloatToE5M2Bits(float f) {
  if (isnan(f)) return 0x7f;
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E5M2));
}

// ---- Element types: storage bits and conversions ----

struct ElemF32 {
  using Bits = uint32_t;
  static constexpr bool kFp8 = false;
  static constexpr int kSignificandBits = 24;  // the hidden bit included
  __device__ static float ToFloat(Bits b) { return __uint_as_float(b); }
  __device__ static Bits FromFloat(float x) { return __float_as_uint(x); }
};
struct ElemF16 {
  using Bits = uint16_t;
  static constexpr bool kFp8 = false;
  static constexpr int kSignificandBits = 11;  // the hidden bit included
  __device__ static float ToFloat(Bits b) { return HalfBitsToFloat(b); }
  __device__ static Bits FromFloat(float x) { return FloatToHalfBits(x); }
};
struct ElemBF16 {
  using Bits = uint16_t;
  static constexpr bool kFp8 = false;
  static constexpr int kSignificandBits = 8;  // the hidden bit included
  __device__ static float ToFloat(Bits b) { return BFloat16BitsToFloat(b); }
  __device__ static Bits FromFloat(float x) { return FloatToBFloat16Bits(x); }
};
struct ElemE4M3 {
  using Bits = uint8_t;
  static constexpr bool kFp8 = true;
  __device__ static Bits FromFloat(float x) { return FloatToE4M3Bits(x); }
};
struct ElemE5M2 {
  using Bits = uint8_t;
  static constexpr bool kFp8 = true;
  __device__ static Bits FromFloat(float x) { return FloatToE5M2Bits(x); }
};

// One element from the input type to the cache type. Same type: the bits, untouched.
template <typename In, typename Out>
__device__ __forceinline__ typename Out::Bits Convert(typename In::Bits x, float scale) {
  if constexpr (std::is_same<In, Out>::value) {
    return x;
  } else {
    float f = In::ToFloat(x);
    if constexpr (Out::kFp8) f = f / scale;  // a true division, as the CPU path
    return Out::FromFloat(f);
  }
}

}  // namespace cache_update
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_CACHE_CUDA_CACHE_UPDATE_TYPES_CUH_
