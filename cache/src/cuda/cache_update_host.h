// The plain C++ part of the CUDA cache update (cache_update.cuh): the fp8 method a call
// takes (CacheUpdateCudaWithMethod), the host-side checks and constants of a scale that
// pick it (Fp8ScaleIsPowerOfTwo, Fp8ReciprocalBracket, Fp8SplitReciprocalLow,
// Fp8SplitReciprocalExact), and the magic numbers of a division by a constant (DivMagic)
// that KernelParams carries. Compiled by the host compiler too, so that tests and benchmarks
// can pick the method.
#ifndef KVSTREAM_CACHE_CUDA_CACHE_UPDATE_HOST_H_
#define KVSTREAM_CACHE_CUDA_CACHE_UPDATE_HOST_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "absl/status/status.h"
#include "kvstream/cache/cache_update.h"

namespace kvstream {
namespace internal {

// How the CUDA cache update computes fp8(x / scale). All write the same bytes.
enum class CacheUpdateFp8Method {
  kReciprocal,  // the fastest exact way to the quotient (below; the default)
  kBracket,     // kReciprocal without the split reciprocal: the bracket for every input
  kDivision,    // one IEEE division per element (the first kernel)
};

// CacheUpdateCuda with the fp8 method chosen (CacheUpdateCuda uses kReciprocal). Same
// contract as CacheUpdateCuda. kReciprocal multiplies by 1 / scale alone when every scale
// is a power of two (Fp8ScaleIsPowerOfTwo); else, for 16-bit inputs, by the split
// reciprocal when Fp8SplitReciprocalExact holds for every scale; else it takes the bracket
// (cache_update.cuh). Both fall back to kDivision when a scale lies outside [2^-30, 2^30]
// (the range FastQuotient's proof and the split's argument cover). All divide, in the
// scalar kernel, where the vector path does not apply (odd sizes or strides, or a token's
// rows beyond 32-bit offsets).
absl::Status CacheUpdateCudaWithMethod(const CacheUpdateParams& params, void* cuda_stream,
                                       CacheUpdateFp8Method method);

// Whether `scale` is 2^e with e in [-126, 126]: then 1 / scale = 2^-e is a normal float,
// exactly, and x * (1 / scale) is the real number x / scale rounded once, the same float
// as the division for every x. False for everything else (NaN, infinities, zero,
// negative numbers, subnormals, other values).
inline bool Fp8ScaleIsPowerOfTwo(float scale) {
  uint32_t bits;
  std::memcpy(&bits, &scale, sizeof(bits));
  const uint32_t biased_exp = bits >> 23;  // sign bit included: negative scales fail
  return (bits & 0x7fffffu) == 0 && biased_exp >= 127 - 126 && biased_exp <= 127 + 126;
}

// The floats just below and above the real number 1 / scale: *down <= 1 / scale <= *up,
// adjacent floats, or both 1 / scale when it is a float. RN(1 / scale) is one of them: the
// residual RN(1 / scale) * scale - 1 is exact in double (24-bit times 24-bit significands)
// and says on which side of 1 / scale it lies.
// REQUIRES: scale and 1 / scale positive normal floats.
inline void Fp8ReciprocalBracket(float scale, float* down, float* up) {
  const float r = 1.0f / scale;
  const double residual = static_cast<double>(r) * static_cast<double>(scale) - 1.0;
  *down = residual > 0.0 ? std::nextafter(r, 0.0f) : r;
  *up = residual < 0.0 ? std::nextafter(r, std::numeric_limits<float>::infinity()) : r;
}

// The split reciprocal's low part, for high = the largest float <= 1 / scale
// (Fp8ReciprocalBracket's down): low > 0, a float near the rest 1 / scale - high, so that
// fma(x, high, RN(x * low)) is x / scale to about 2^-46 relative: one rounding of a
// near-exact quotient, where RN(x * RN(1 / scale)) rounds twice. 1 - high * scale is
// exact in double (a 48-bit product close to 1), so low = RN of (1 - high * scale) / scale,
// twice rounded: close enough, since Fp8SplitReciprocalExact checks the pair as it is.
// Where 1 / scale is a float (scale a power of two) the rest is 0 and low is high * 2^-64
// instead, far below half an ulp of any product: low must be positive, or an infinite x
// would give inf + inf * 0, a NaN.
// REQUIRES: scale in [2^-30, 2^30].
inline float Fp8SplitReciprocalLow(float scale, float high) {
  const double rest = 1.0 - static_cast<double>(high) * static_cast<double>(scale);
  return rest > 0.0 ? static_cast<float>(rest / static_cast<double>(scale))
                    : std::ldexp(high, -64);
}

// Whether q(x) = fma(x, high, RN(x * low)) is the float x / scale (IEEE division: what the
// CPU update encodes) for every input whose significand has at most `significand_bits`
// bits (8 for bf16, 11 for fp16): up to a difference no fp8 encoding sees. A proof by
// exhaustion over the 2^(significand_bits - 1) significands m in [1, 2), for (high, low)
// from Fp8ReciprocalBracket and Fp8SplitReciprocalLow and scale in [2^-30, 2^30] (so low >= 2^-65 / scale: 1 - high *
// scale is a nonzero multiple of 2^-47 unless scale is a power of two). For x = +-m 2^k:
//  * |x / scale| in [2^-18, 2^127): x, x * high, x * low (at least 2^-65 |x / scale|, so
//    2^-83) and the result are normal floats, so every rounding commutes with the power
//    of two: q(x) = +-2^k q(m) and RN(x / scale) = +-2^k RN(m / scale). Equal
//    where the check found them equal.
//  * |x / scale| < 2^-18: both are below 2^-17 in magnitude (q within 2^-40 relative of
//    the quotient, plus underflow's absolute 2^-149), with the sign of x or zero; both
//    encode to a zero of that sign in e4m3 and e5m2 (whose smallest subnormal is 2^-16).
//  * |x / scale| >= 2^127, and infinities: both are at least 2^126 or infinite, with the
//    sign of x (high and low are not negative, so no inf - inf); both saturate.
//  * NaN gives NaN.
inline bool Fp8SplitReciprocalExact(float scale, float high, float low, int significand_bits) {
  const int n = 1 << (significand_bits - 1);
  for (int i = 0; i < n; ++i) {
    const float m = 1.0f + static_cast<float>(i) / static_cast<float>(n);  // exact
    // m * low in double is exact (at most 11 + 24 bits); the cast rounds it once.
    const float t = static_cast<float>(static_cast<double>(m) * static_cast<double>(low));
    if (std::fma(m, high, t) != m / scale) return false;
  }
  return true;
}

// Magic numbers for n / d with a multiply and a shift, exact for 0 <= n < 2^31 and
// 1 <= d < 2^31 (Granlund-Montgomery): l = ceil(log2 d), shift = 31 + l, mul =
// ceil(2^shift / d) < 2^32; mul * d = 2^shift + err with 0 <= err < d <= 2^l, so n * mul /
// 2^shift = n / d + n * err / (d * 2^shift) with the last term < 2^31 * 2^l / (d * 2^(31+l))
// = 1 / d, which cannot carry floor(n / d) past the next integer.
struct DivMagic {
  uint32_t mul;
  uint32_t shift;
};
inline DivMagic MakeDivMagic(uint32_t d) {
  uint32_t l = 0;
  while ((uint64_t{1} << l) < d) ++l;
  const uint32_t shift = 31 + l;
  const uint64_t pow = uint64_t{1} << shift;
  return DivMagic{static_cast<uint32_t>((pow + d - 1) / d), shift};
}

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_CACHE_CUDA_CACHE_UPDATE_HOST_H_
