// Scalar building blocks of the CPU attention fast path, written so that GCC and Clang
// vectorise loops that call them: no branches (selects only), no calls into libm, bit
// casts through memcpy. std::exp and the branchy converters in numeric.h keep a loop
// scalar, which costs the fast path most of its speed.
//
// Private to attention/; tests include it to check the conversions bit for bit against
// numeric.h and the exponential against std::exp.
#ifndef KVSTREAM_ATTENTION_CPU_VEC_MATH_H_
#define KVSTREAM_ATTENTION_CPU_VEC_MATH_H_

#include <cstdint>
#include <cstring>

namespace kvstream {
namespace internal {

inline float VecBitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline uint32_t VecFloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// IEEE binary16 bits to float, bit-identical to HalfToFloat() (numeric.h) for all 65536
// inputs, NaN payloads included. Subnormals come out of one exact float subtraction.
inline float HalfBitsToFloatVec(uint16_t h) {
  const uint32_t magnitude = static_cast<uint32_t>(h & 0x7fffu) << 13;
  const uint32_t exp = magnitude & 0x0f800000u;
  uint32_t bits = magnitude + 0x38000000u;                   // rebias 15 -> 127
  bits = exp == 0x0f800000u ? bits + 0x38000000u : bits;     // inf / NaN: exponent 255
  const float subnormal = VecBitsToFloat(bits + 0x00800000u) - VecBitsToFloat(0x38800000u);
  bits = exp == 0 ? VecFloatBits(subnormal) : bits;          // zero / subnormal: m * 2^-24
  return VecBitsToFloat(bits | (static_cast<uint32_t>(h & 0x8000u) << 16));
}

inline float BFloat16BitsToFloatVec(uint16_t h) {
  return VecBitsToFloat(static_cast<uint32_t>(h) << 16);
}

// e^x for x <= 0 (the only arguments softmax and tanh pass here), relative error about
// 2 ulp; x < -87 (including -inf) gives exactly 0. Cephes' expf: x = n ln2 + r,
// |r| <= ln2 / 2, e^r by a degree-6 polynomial, 2^n assembled in the exponent bits.
inline float ExpNonPositive(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  // Round x / ln2 to an integer without a call: adding 1.5 * 2^23 leaves the integer in
  // the low mantissa bits.
  const float kRound = 12582912.0f;
  const float shifted = xc * 1.44269504088896341f + kRound;
  const float n = shifted - kRound;
  const int32_t ni = static_cast<int32_t>(VecFloatBits(shifted) - VecFloatBits(kRound));
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float poly = 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  const float er = poly * r * r + r + 1.0f;
  const float two_n = VecBitsToFloat(static_cast<uint32_t>(ni + 127) << 23);
  return x < -87.0f ? 0.0f : er * two_n;
}

// tanh(x) for any finite x, absolute error below 1e-7: odd symmetry around
// (1 - e^{-2|x|}) / (1 + e^{-2|x|}), with the first terms of the series near 0 where that
// quotient cancels.
inline float TanhVec(float x) {
  const float ax = x < 0 ? -x : x;
  const float e = ExpNonPositive(-2.0f * ax);
  const float big = (1.0f - e) / (1.0f + e);
  const float x2 = ax * ax;
  const float small = ax * (1.0f - x2 * (1.0f / 3.0f - x2 * (2.0f / 15.0f)));
  const float t = ax < 0.0625f ? small : big;
  return x < 0 ? -t : t;
}

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CPU_VEC_MATH_H_
