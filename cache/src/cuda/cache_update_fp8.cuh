// The CUDA cache update's fast fp8 paths: fp8(x / scale) without a division per element
// (cache_update.cuh says which way applies when): the correctly rounded quotient
// (FastQuotient), the packed conversion (Fp8Pair), the host's NaN code (HostNaNCodes) and
// UpdateTokenVecFp8, the vector update of fp8 caches from 16/32-bit inputs.
#ifndef KVSTREAM_CACHE_CUDA_CACHE_UPDATE_FP8_CUH_
#define KVSTREAM_CACHE_CUDA_CACHE_UPDATE_FP8_CUH_

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cache_update_params.cuh"
#include "cache_update_types.cuh"
#include "cache_update_vector.cuh"

namespace kvstream {
namespace internal {
namespace cache_update {

// ---- Fast fp8 quotients: without a division per element ----

// The float x / s rounded to nearest even (what `x / s` gives), for s = c.scale in
// [2^-30, 2^30] and every float x that is not NaN, up to a value change that the fp8
// encoders do not see. With r = c.recip = RN(1 / s), hi = s * 2^18 (exact), let
// a = min(|x|, hi) and u = 2^-24.
//  * a = hi (|x| >= s * 2^18): the result is 2^18 exactly (below), and x / s >= 2^18 too;
//    both saturate in e4m3 (>= 448) and e5m2 (>= 57344). Infinities land here.
//  * a / s < 2^-22: every step below stays finite and the result is < 2^-21 (errors are
//    relative, within a factor 1 + 8u, plus at most a few 2^-150 absolute from underflow),
//    and x / s < 2^-22 too: both encode to a zero (e5m2's smallest subnormal is 2^-16,
//    values <= 2^-17 round to zero).
//  * Otherwise a / s is in [2^-22, 2^18] and a >= s * 2^-22 >= 2^-52: nothing below
//    overflows or underflows (the residuals are multiples of ulp(q) * ulp(s) >= 2^-99).
//    r = (1/s)(1 + e) with |e| <= u. q0 = RN(a r) is within (2u + u^2) a/s of a/s. With
//    d0 = a/s - q0, e0 = RN(a - q0 s) = d0 s (1 + e1), |e1| <= u, and q0 + e0 r =
//    a/s + d0 (e + e1 + e e1), off by at most 4.1 u^2 a/s < ulp(a/s) / 2^21; q1 = RN of
//    that is within half an ulp plus that, so within one ulp of a/s (faithful). Markstein's
//    theorem (r within half an ulp of 1/s, q1 within one ulp of a/s, no underflow or
//    overflow): e1' = a - q1 s is exact and q2 = RN(q1 + e1' r) = RN(a / s).
// The sign is put back last: RN(-y) = -RN(y), and -0 / s = -0 keeps its sign since a = +0
// gives q2 = +0. A NaN x stays NaN: the minimum is min.NaN, which returns a NaN operand
// where fminf would return the other one.
__device__ __forceinline__ float FastQuotient(float x, const Fp8ScaleConsts& c) {
  const float s = c.scale;
  const float r = c.recip;
  float a;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(a) : "f"(fabsf(x)), "f"(s * 262144.0f));
  float q = a * r;
  float e = fmaf(-q, s, a);
  q = fmaf(e, r, q);
  e = fmaf(-q, s, a);
  q = fmaf(e, r, q);
  return copysignf(q, x);
}

// Two quotients to two fp8 codes (first in the low byte) with the saturating packed cvt
// (cvt.rn.satfinite.e4m3x2/e5m2x2.f32), the paired form of the single conversion that
// tests/gpu/fp8_conversion checks; the packed form itself is checked through the cache
// update tests (Fp8MethodsMatchCpuOnEveryInputBitPattern).
template <typename Out>
__device__ __forceinline__ uint32_t Fp8Pair(float q0, float q1) {
  constexpr __nv_fp8_interpretation_t kFormat =
      std::is_same<Out, ElemE4M3>::value ? __NV_E4M3 : __NV_E5M2;
  return static_cast<uint32_t>(
      __nv_cvt_float2_to_fp8x2(make_float2(q0, q1), __NV_SATFINITE, kFormat));
}

// How UpdateTokenVecFp8 forms x / scale (the launcher picks by the scales).
enum class Fp8Quotient {
  kReciprocal,  // the bracket, else FastQuotient: every scale in [2^-30, 2^30]
  kSplit,       // fma(x, high, x * low): 16-bit inputs, Fp8SplitReciprocalExact for each scale
  kPowerOfTwo,  // x * (1 / scale): every scale 2^e with e in [-126, 126]
  kUnit,        // x itself: every scale is 1 (the default)
};

// Four fp8 codes (one per byte) with every NaN code made 0x7f, the host's NaN whatever the
// sign or payload: e4m3's NaNs are the codes whose low seven bits are all ones, e5m2's
// those above 0x7c in them. Adding 1 (or 3) to the low seven bits of each byte carries
// into its bit 7 exactly for those, never into the next byte.
template <typename Out>
__device__ __forceinline__ uint32_t HostNaNCodes(uint32_t codes) {
  constexpr bool kE4M3 = std::is_same<Out, ElemE4M3>::value;
  const uint32_t carry = (codes & 0x7f7f7f7fu) + (kE4M3 ? 0x01010101u : 0x03030303u);
  if constexpr (kE4M3) {
    // codes & ~(carry & 0x80808080) as one three-input logic op (the low seven bits of a
    // NaN code are 0x7f already); left to itself the compiler spends two.
    uint32_t fixed;
    asm("lop3.b32 %0, %1, %2, 0x80808080, 0x70;" : "=r"(fixed) : "r"(codes), "r"(carry));
    return fixed;
  }
  const uint32_t nan = carry & 0x80808080u;
  const uint32_t bytes = nan | (nan - (nan >> 7));  // 0xff in each NaN byte
  return (codes & ~bytes) | (0x7f7f7f7fu & bytes);
}

// UpdateTokenVec for fp8 caches without a division per element. Same REQUIRES as
// UpdateTokenVec, plus, by kQuotient:
//  * kReciprocal: every scale in [2^-30, 2^30] (the bracket below, FastQuotient).
//  * kPowerOfTwo: every scale 2^e with e in [-126, 126] (Fp8ScaleIsPowerOfTwo). Then
//    RN(1 / s) = 2^-e exactly, so x * RN(1 / s) is the real number x / s rounded once, the
//    same float as the division for every x (subnormal, overflowing and infinite quotients
//    included): one multiply per element.
//  * kSplit: 16-bit inputs, every scale in [2^-30, 2^30] and its (recip_down, recip_low)
//    passing Fp8SplitReciprocalExact for the input's significand bits: then
//    fma(x, recip_down, RN(x * recip_low)) is x / s, up to differences no fp8 encoder
//    sees, for every x (see there): two operations per element, no bracket, no fallback.
//  * kUnit: every scale 1: x / 1 = x.
// A NaN input gives a NaN code through the quotient and the conversion, made the host's
// 0x7f by HostNaNCodes.
template <typename In, typename Out, Fp8Quotient kQuotient, bool kRegular>
__device__ __forceinline__ void UpdateTokenVecFp8(const KernelParams& p, int64_t token,
                                                  const int64_t* slot_ptr, int lane) {
  static_assert(Out::kFp8 && !In::kFp8, "fp8 caches from 16/32-bit inputs");
  using InBits = typename In::Bits;
  WalkToken<InBits, uint8_t, /*kFp8Cache=*/true, /*kHalves=*/true, kRegular>(
      p, token, slot_ptr, lane, [&](const Vec8<InBits>& in, uint8_t* dst, int scale_index) {
        // Constant loads; lanes of a step share one or a few heads' scales.
        const Fp8ScaleConsts& consts = p.fp8_scale[scale_index];
        float x[kVecElems];
        if constexpr (std::is_same<In, ElemBF16>::value) {
          // A bf16 pair is one 32-bit word: the low one shifted up, the high one masked.
          const uint4 w = *reinterpret_cast<const uint4*>(&in);
          const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            x[2 * i] = __uint_as_float(words[i] << 16);
            x[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
          }
        } else {
#pragma unroll
          for (int e = 0; e < kVecElems; ++e) x[e] = In::ToFloat(ChunkElement(in, e));
        }
        uint32_t pairs[kVecElems / 2];
        if constexpr (kQuotient == Fp8Quotient::kUnit) {
#pragma unroll
          for (int e = 0; e < kVecElems; e += 2) pairs[e / 2] = Fp8Pair<Out>(x[e], x[e + 1]);
        } else if constexpr (kQuotient == Fp8Quotient::kSplit) {
          static_assert(sizeof(InBits) == 2, "the split is checked for 16-bit inputs only");
          const float high = consts.recip_down;
          const float low = consts.recip_low;
#pragma unroll
          for (int e = 0; e < kVecElems; e += 2) {
            pairs[e / 2] = Fp8Pair<Out>(__fmaf_rn(x[e], high, __fmul_rn(x[e], low)),
                                        __fmaf_rn(x[e + 1], high, __fmul_rn(x[e + 1], low)));
          }
        } else if constexpr (kQuotient == Fp8Quotient::kPowerOfTwo) {
          const float r = consts.recip;
#pragma unroll
          for (int e = 0; e < kVecElems; e += 2) {
            pairs[e / 2] = Fp8Pair<Out>(x[e] * r, x[e + 1] * r);
          }
        } else {
          // The bracket: RZ(x * recip_down) and RN(x * recip_up) have the sign of x / s and
          // magnitudes below and above |RN(x / s)| (RZ and RN are monotone and symmetric,
          // |x| recip_down <= |x / s| <= |x| recip_up). The saturating conversion to fp8
          // is monotone too, so where both ends give the same code, so does RN(x / s): two
          // multiplies and two conversions per pair. The ends are one or two float ulps
          // apart, so they straddle one of fp8's rounding boundaries (2^20 ulps apart in
          // e4m3, 2^21 in e5m2) a few times per million elements; then the lane takes the
          // exact quotient, FastQuotient. Infinities and zeros give equal ends; a NaN x
          // gives the same NaN code at both ends.
          const float down = consts.recip_down;
          const float up = consts.recip_up;
          uint32_t differ = 0;
#pragma unroll
          for (int e = 0; e < kVecElems; e += 2) {
            pairs[e / 2] = Fp8Pair<Out>(x[e] * up, x[e + 1] * up);
            const uint32_t low = Fp8Pair<Out>(__fmul_rz(x[e], down), __fmul_rz(x[e + 1], down));
            differ |= pairs[e / 2] ^ low;
          }
          if (differ != 0) {
#pragma unroll
            for (int e = 0; e < kVecElems; e += 2) {
              pairs[e / 2] =
                  Fp8Pair<Out>(FastQuotient(x[e], consts), FastQuotient(x[e + 1], consts));
            }
          }
        }
        const uint2 out = make_uint2(HostNaNCodes<Out>(pairs[0] | (pairs[1] << 16)),
                                     HostNaNCodes<Out>(pairs[2] | (pairs[3] << 16)));
        *reinterpret_cast<uint2*>(dst) = out;
      });
}

}  // namespace cache_update
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_CACHE_CUDA_CACHE_UPDATE_FP8_CUH_
