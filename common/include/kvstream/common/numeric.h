// Bit-exact conversions between float and the 16- and 8-bit floating-point formats that
// KV caches use, on the host. All conversions to a narrower format round to nearest, ties
// to even. Conversions to fp8 saturate: finite values beyond the format's largest finite
// value become that value (with the sign kept), which is what KV-cache quantisation wants;
// NaN stays NaN. Infinity saturates too (fp8 caches never hold infinities).
//
// These are plain inline functions over raw bits (uint16_t / uint8_t) so that caches can
// be stored as raw bytes and the CPU and CUDA paths agree bit for bit.
#ifndef KVSTREAM_COMMON_NUMERIC_H_
#define KVSTREAM_COMMON_NUMERIC_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvstream/common/dtype.h"

namespace kvstream {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// ---- bfloat16 ----
inline float BFloat16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }
inline uint16_t FloatToBFloat16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// ---- IEEE binary16 ----
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24.
    const float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}
inline uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {
    // Result is subnormal or zero: round abs / 2^-24 to an integer, ties to even.
    const float scaled = BitsToFloat(abs) * 16777216.0f;  // exact: power of two
    const float r = std::nearbyint(scaled);  // default rounding mode: ties to even
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(r));
  }
  // Normal: rebias and round the 13 dropped bits to nearest even.
  uint32_t h = abs - 0x38000000u;  // exponent bias 127 -> 15
  h += 0xfffu + ((h >> 13) & 1u);
  return static_cast<uint16_t>(sign | (h >> 13));
}

// ---- fp8 (OCP) ----
// Encoders work on the float's bits: saturate, then round the mantissa to nearest even by
// adding half an ulp of the target (plus the kept LSB), which carries into the exponent when
// it must. Subnormal targets round x * 2^k (exact scaling) with nearbyint (ties to even in
// the default rounding mode). Checked equal, for all 2^32 floats, to a reference built from
// frexp/nearbyint (tests/unit/numeric_test.cc keeps a brute-force comparison).

inline uint8_t FloatToFp8E4M3(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return 0x7f;  // NaN
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  if (abs >= 0x43e00000u) return static_cast<uint8_t>(sign | 0x7e);  // >= 448 (and inf)
  if (abs >= 0x3c800000u) {  // normal in e4m3: >= 2^-6
    const uint32_t r = abs + 0x7ffffu + ((abs >> 20) & 1u);
    return static_cast<uint8_t>(sign | ((r >> 20) - (120u << 3)));  // rebias 127 -> 7
  }
  const float q = std::nearbyint(BitsToFloat(abs) * 512.0f);  // quanta of 2^-9
  return static_cast<uint8_t>(sign | static_cast<uint8_t>(q));
}
inline float Fp8E4M3ToFloat(uint8_t b) {
  const bool neg = (b & 0x80) != 0;
  const int exp = (b >> 3) & 0xf;
  const int mant = b & 0x7;
  if (exp == 0xf && mant == 0x7) return std::nanf("");
  const float v = exp == 0 ? std::ldexp(static_cast<float>(mant), -9)
                           : std::ldexp(1.0f + static_cast<float>(mant) / 8.0f, exp - 7);
  return neg ? -v : v;
}

inline uint8_t FloatToFp8E5M2(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return 0x7f;  // NaN
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  if (abs >= 0x47600000u) return static_cast<uint8_t>(sign | 0x7b);  // >= 57344 (and inf)
  if (abs >= 0x38800000u) {  // normal in e5m2: >= 2^-14
    const uint32_t r = abs + 0xfffffu + ((abs >> 21) & 1u);
    return static_cast<uint8_t>(sign | ((r >> 21) - (112u << 2)));  // rebias 127 -> 15
  }
  const float q = std::nearbyint(BitsToFloat(abs) * 65536.0f);  // quanta of 2^-16
  return static_cast<uint8_t>(sign | static_cast<uint8_t>(q));
}
inline float Fp8E5M2ToFloat(uint8_t b) {
  const bool neg = (b & 0x80) != 0;
  const int exp = (b >> 2) & 0x1f;
  const int mant = b & 0x3;
  float v;
  if (exp == 0x1f) {
    v = mant == 0 ? INFINITY : std::nanf("");
  } else if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -16);
  } else {
    v = std::ldexp(1.0f + static_cast<float>(mant) / 4.0f, exp - 15);
  }
  return neg ? -v : v;
}

// Largest finite magnitude of a floating-point dtype (fp8 saturation bound).
inline float DTypeMaxFinite(DType dtype) {
  switch (dtype) {
    case DType::kFloat8E4M3: return 448.0f;
    case DType::kFloat8E5M2: return 57344.0f;
    case DType::kFloat16: return 65504.0f;
    case DType::kBFloat16: return 3.3895313892515355e38f;  // 0x7f7f: 8 mantissa bits, not 24
    default: return 3.4028234663852886e38f;
  }
}

// Reads element `i` of a floating-point buffer of `dtype` as float. REQUIRES: dtype is a
// floating-point type.
inline float LoadAsFloat(const void* data, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(data)[i];
    case DType::kFloat16: return HalfToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kBFloat16: return BFloat16ToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kFloat8E4M3: return Fp8E4M3ToFloat(static_cast<const uint8_t*>(data)[i]);
    case DType::kFloat8E5M2: return Fp8E5M2ToFloat(static_cast<const uint8_t*>(data)[i]);
    default: return std::nanf("");
  }
}

// Writes `value` rounded (fp8: saturated) into element `i`. REQUIRES: floating-point dtype.
inline void StoreFromFloat(void* data, DType dtype, int64_t i, float value) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(data)[i] = value; break;
    case DType::kFloat16: static_cast<uint16_t*>(data)[i] = FloatToHalf(value); break;
    case DType::kBFloat16: static_cast<uint16_t*>(data)[i] = FloatToBFloat16(value); break;
    case DType::kFloat8E4M3: static_cast<uint8_t*>(data)[i] = FloatToFp8E4M3(value); break;
    case DType::kFloat8E5M2: static_cast<uint8_t*>(data)[i] = FloatToFp8E5M2(value); break;
    default: break;
  }
}

}  // namespace kvstream

#endif  // KVSTREAM_COMMON_NUMERIC_H_
