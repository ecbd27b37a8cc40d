// The CUDA cache-update kernel (vLLM's reshape_and_cache_flash): each new token's keys and
// values written into its slot of the paged cache, converted to the cache dtype bit for bit
// as the CPU implementation does (common/numeric.h: round to nearest even, fp8 saturating,
// fp8(x / scale) with a true division, same-dtype copies keep every bit including NaN
// payloads). Header-only templates over a params struct passed by value; the launcher is
// cache_update.cu. The quotient x / scale is always the float the host's division gives:
// computed by a division, or by a way proven to give the same float (below).
//
// Work split: one warp per token, eight tokens per 256-thread CTA. A warp walks the K and
// V rows of its token (all KV heads) as one index space of 8-element chunks, 32 chunks per
// step (lane l takes chunk 32 s + l in step s), in batches of kUnroll steps: a lane issues
// a batch's loads (64 bytes: four 16-byte or two 32-byte chunks) before it converts and
// stores any (the fp8 fast paths: two half batches, each loaded again once stored), and
// the token's slot is read while the first batch's loads are in flight.
// A lane locates its chunk with a magic-number multiply at the start of a batch and then
// moves it by fixed steps (LaneWalk), so that a chunk's index math is a few adds, with
// its destination kept from load to store. Where K and V rows are regular (one head size,
// the same strides, a power-of-two number of chunks per head), the regular walk
// (WalkTokenRegular) finds every chunk from the lane's first with one multiply-add and no
// tests, lanes taking runs of two adjacent chunks on the fp8 paths. A scalar variant
// handles strides or sizes that 8-element vectors do not fit (odd head sizes, misaligned
// or dim-strided caches, rows beyond 32-bit offsets).
//
// fp8 caches (kReciprocal, the default) get fp8(x / scale) without a division per element.
// When every scale is 1 (the default) it is fp8(x); when every scale is a power of two,
// x * (1 / scale): 1 / scale is exact, so the product is x / scale rounded once. For
// 16-bit inputs and scales in [2^-30, 2^30] it is fma(x, high, RN(x * low)) with
// high + low a split of 1 / scale, which the launcher proves equal to the division for
// every such input, scale by scale, by exhaustion over the input's significands
// (Fp8SplitReciprocalExact). Otherwise (f32 inputs, a scale whose split fails the check,
// or kBracket), for scales in [2^-30, 2^30], x is multiplied by the floats just below and
// above 1 / scale (rounding toward zero and to nearest): the two products bracket the
// quotient the host's division gives, so where they convert to the same code, that is its
// code; where they do not (rounding boundaries in between, a few per million elements),
// the lane computes the quotient itself: a reciprocal plus two FMA corrections, the
// correctly rounded quotient (proof at FastQuotient). Quotients are converted two at a
// time with the packed cvt, and NaN codes made the host's on the packed bytes
// (HostNaNCodes). kDivision keeps the per-element division, for comparison.
//
// The part above `#if defined(__CUDACC__)` is plain C++ so that tests and benchmarks
// compiled by the host compiler can pick the method.
#ifndef KVSTREAM_CACHE_CUDA_CACHE_UPDATE_CUH_
#define KVSTREAM_CACHE_CUDA_CACHE_UPDATE_CUH_

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

#if defined(__CUDACC__)

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <type_traits>

namespace kvstream {
namespace internal {
namespace cache_update {

// Per-head fp8 scales travel by value; caches with more KV heads are rejected.
inline constexpr int kMaxScales = 128;
inline constexpr int kWarpsPerCta = 8;
inline constexpr int kThreadsPerCta = kWarpsPerCta * 32;
inline constexpr int kVecElems = 8;

// One fp8 scale and what the quotient paths need of its reciprocal, from the host (see
// Fp8ReciprocalBracket, Fp8SplitReciprocalLow); the split is one 8-byte load.
struct alignas(16) Fp8ScaleConsts {
  float scale;
  float recip;       // RN(1 / scale), IEEE division
  float recip_down;  // the largest float <= the real 1 / scale; the split's high part
  float recip_low;   // the split's low part (Fp8SplitReciprocalLow)
  float recip_up;    // the smallest float >= the real 1 / scale
};

struct KernelParams {
  // key:   [num_tokens, num_kv_heads, head_size]    (key_token_stride, key_head_stride; dim 1)
  // value: [num_tokens, num_kv_heads, head_size_v]  (value_token_stride, value_head_stride)
  const void* key;
  const void* value;
  int64_t key_token_stride;
  int64_t key_head_stride;
  int64_t value_token_stride;
  int64_t value_head_stride;
  // slot_mapping: [num_tokens] device memory; slot = block * block_size + offset, -1 skipped.
  // Slots outside [0, num_slots) are skipped too (validation has rejected them on the host;
  // this only keeps a device copy that disagrees with its host mirror from writing wild).
  const int64_t* slot_mapping;
  int64_t num_tokens;
  int64_t num_slots;
  // k_cache: [num_blocks, block_size, num_kv_heads, head_size]    (k_* strides, elements)
  // v_cache: [num_blocks, block_size, num_kv_heads, head_size_v]  (v_* strides, elements)
  void* k_cache;
  void* v_cache;
  int64_t k_block_stride;
  int64_t k_token_stride;
  int64_t k_head_stride;
  int64_t k_dim_stride;
  int64_t v_block_stride;
  int64_t v_token_stride;
  int64_t v_head_stride;
  int64_t v_dim_stride;
  int32_t block_size;
  int32_t num_kv_heads;
  int32_t head_size;
  int32_t head_size_v;
  // fp8 caches: stored = fp8(x / scale); 1 scale (per tensor) or num_kv_heads (per head).
  // Unused (num_scales = 0) for 16/32-bit caches.
  int32_t num_scales;
  // Per scale: K's at [0, kMaxScales), V's at [kMaxScales, 2 * kMaxScales), so that one
  // index (ScaleIndex) finds a chunk's.
  Fp8ScaleConsts fp8_scale[2 * kMaxScales];
  // Vector paths (LaneWalk): a step of 32 chunks moves a lane's chunk by *_step_head heads
  // and *_step_first elements (< the head size), plus a carry; chunks per head (head size
  // / 8) as magic numbers, to locate a lane's first chunk in K and in V.
  int32_t k_step_first;
  int32_t k_step_head;
  int32_t v_step_first;
  int32_t v_step_head;
  DivMagic k_chunks_per_head;
  DivMagic v_chunks_per_head;
  // The regular walk (WalkTokenRegular), where the launcher takes it: log2 of the runs per
  // head R, K's groups of kRegularGroup steps, and what a step of 32 runs moves a lane's
  // offsets by (32 / R heads).
  int32_t run_shift;
  int32_t regular_k_groups;
  uint32_t step_in;   // 32 / R heads of an input row (K's and V's head strides are equal)
  uint32_t step_out;  // ... of a cache row (K's and V's equal too)
};

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

// 8 elements as one aligned access: 32 bytes (two 16-byte accesses) for 32-bit types, 16
// for 16-bit, 8 for fp8.
template <typename B>
struct alignas(sizeof(B) * kVecElems >= 16 ? 16 : sizeof(B) * kVecElems) Vec8 {
  B v[kVecElems];
};

// Element e of a chunk, read out of the chunk's 32-bit words for 16-bit types: indexing
// the 16-bit elements makes the compiler split a chunk into eight registers as soon as it
// is loaded, twice the four it needs while the other loads are in flight.
template <typename B>
__device__ __forceinline__ B ChunkElement(const Vec8<B>& chunk, int e) {
  if constexpr (sizeof(B) == 2) {
    const uint32_t word = reinterpret_cast<const uint32_t*>(&chunk)[e / 2];
    return static_cast<B>(e % 2 != 0 ? word >> 16 : word & 0xffffu);
  } else {
    return chunk.v[e];
  }
}

// Chunks a lane has in flight (vector paths): 64 bytes of input, four 16-byte chunks of
// 16-bit inputs or two 32-byte chunks of 32-bit inputs. On the H200 this beat 128 bytes
// (8 KV heads x 128, 4k / 16k / 64k tokens: bf16 copy 0.90 / 0.92 / 0.93 of a D2D copy
// against 0.85 / 0.91 / 0.92; fp8 at scale 0.05 0.60 / 0.85 / 0.88 against 0.56 / 0.79 /
// 0.84): fewer registers let four CTAs per SM run, and a warp's second batch of loads
// overlaps other warps' stores.
template <typename InBits>
inline constexpr int kUnroll = 64 / static_cast<int>(sizeof(Vec8<InBits>));

// The fp8 scale of (K or V, head): its index into fp8_scale, and the scale.
__device__ __forceinline__ int ScaleIndex(const KernelParams& p, bool is_v, int head) {
  return (is_v ? kMaxScales : 0) + (p.num_scales > 1 ? head : 0);
}

__device__ __forceinline__ float ScaleFor(const KernelParams& p, bool is_v, int head) {
  return p.fp8_scale[ScaleIndex(p, is_v, head)].scale;
}

// The cache rows of slot `slot`: false for padding (-1) and for slots outside
// [0, num_slots) (see KernelParams), which are skipped. Called after a warp's first input
// loads are issued, so that the slot's load and the inputs' loads overlap instead of adding
// up (a warp's whole life is a few dependent memory round trips).
template <typename OutBits>
__device__ __forceinline__ bool ResolveSlot(const KernelParams& p, int64_t slot,
                                            OutBits** k_dst, OutBits** v_dst) {
  if (slot < 0 || slot >= p.num_slots) return false;
  const int64_t block = slot / p.block_size;
  const int64_t offset = slot - block * p.block_size;
  *k_dst =
      static_cast<OutBits*>(p.k_cache) + block * p.k_block_stride + offset * p.k_token_stride;
  *v_dst =
      static_cast<OutBits*>(p.v_cache) + block * p.v_block_stride + offset * p.v_token_stride;
  return true;
}

// ---- Vector paths: a lane's walk through its token's chunks ----
//
// A warp's token is one space of 8-element chunks, K's heads then V's; in step s of the
// walk, lane l handles chunk 32 s + l. With k_total K chunks, steps s < k_steps =
// k_total / 32 lie wholly in K and steps s > k_steps wholly in V; step k_steps is split
// when k_rem = k_total % 32 is not 0 (lanes < k_rem in K, the others in V). Which of these
// a step is depends on s alone, the same for the whole warp: K steps take K's sizes and
// strides straight from the params, V steps V's, and only the split step chooses per lane.
// A lane's head and first element are found by a magic-number division (LocateChunk) at
// the start of each batch of steps (once per token unless a token has more than 32 *
// kUnroll chunks) and when the lane starts V (at V's chunk (l - k_rem) mod 32: in the split
// step, or for a lane still in K there, the step after); in between, a step moves them by
// a fixed number of heads and elements (StepChunk), so that no chunk pays for a division.

__device__ __forceinline__ int MagicDivide(int n, DivMagic m) {
  return static_cast<int>((static_cast<uint64_t>(static_cast<uint32_t>(n)) * m.mul) >> m.shift);
}

// A chunk's place within K or within V.
struct ChunkPos {
  int head;
  int first;  // first element within the head: a multiple of kVecElems, < the head size
};

// Chunk j of K or V, whose heads are `chunks_per_head` chunks (magic numbers m).
__device__ __forceinline__ ChunkPos LocateChunk(int j, int chunks_per_head, DivMagic m) {
  ChunkPos c;
  c.head = MagicDivide(j, m);
  c.first = (j - c.head * chunks_per_head) * kVecElems;
  return c;
}

// 32 chunks on: 32 * 8 elements are step_head heads and step_first elements, plus a carry
// into the next head when first passes the head size. Past the end the head keeps
// growing; callers check the chunk index before touching memory.
__device__ __forceinline__ void StepChunk(ChunkPos& c, int step_head, int step_first,
                                          int head_size) {
  c.first += step_first;
  const bool carry = c.first >= head_size;
  c.first -= carry ? head_size : 0;
  c.head += step_head + (carry ? 1 : 0);
}

// The chunk's offset in a row whose heads are `head_stride` apart: 32-bit (the launcher
// checks that a token's rows fit), unsigned so that the unused offsets of chunks past the
// end cannot overflow.
__device__ __forceinline__ uint32_t ChunkOffset(ChunkPos c, int64_t head_stride) {
  return static_cast<uint32_t>(c.head) * static_cast<uint32_t>(head_stride) +
         static_cast<uint32_t>(c.first);
}

// One lane's walk through its token.
struct LaneWalk {
  ChunkPos pos;  // the lane's chunk at the current step: in K, then (from step k_steps) in V
  int k_steps;   // steps wholly in K
  int k_rem;     // K chunks in step k_steps
  int lane;

  // The walk at step s0: one magic-number division, at the start of each batch (so that
  // nothing of the walk stays live while a batch converts and stores).
  __device__ __forceinline__ void Start(const KernelParams& p, int lane_index, int s0) {
    const int k_per_head = p.head_size / kVecElems;
    const int k_total = p.num_kv_heads * k_per_head;
    const int idx = 32 * s0 + lane_index;
    pos = idx < k_total ? LocateChunk(idx, k_per_head, p.k_chunks_per_head)
                        : LocateChunk(idx - k_total, p.head_size_v / kVecElems,
                                      p.v_chunks_per_head);
    k_steps = k_total / 32;
    k_rem = k_total % 32;
    lane = lane_index;
  }
};

// Where a loaded chunk goes, kept from its load to its store: its offset in the token's K
// or V cache row, with V marked in bit 31 (offsets are below 2^31: HeadOffsetsFitInt32 in
// the launcher), so that the store needs no other record; for fp8 caches its ScaleIndex.
struct ChunkDst {
  uint32_t off;
  int scale_index = 0;

  __device__ __forceinline__ bool InV() const { return (off >> 31) != 0; }
  template <typename OutBits>
  __device__ __forceinline__ OutBits* Address(OutBits* k_row, OutBits* v_row) const {
    return (InV() ? v_row : k_row) + (off & 0x7fffffffu);
  }
};

// One chunk of a token's input row, through the read-only path (ld.global.nc): the rows
// are global memory, read-only for the kernel, but reach here through TokenRow, which
// hides where the pointer came from.
template <typename InBits>
__device__ __forceinline__ Vec8<InBits> LoadInputChunk(const InBits* src) {
  static_assert(sizeof(Vec8<InBits>) % sizeof(uint4) == 0, "16- or 32-byte chunks");
  Vec8<InBits> v;
  uint4* words = reinterpret_cast<uint4*>(&v);
#pragma unroll
  for (size_t i = 0; i < sizeof(v) / sizeof(uint4); ++i) {
    words[i] = __ldg(reinterpret_cast<const uint4*>(src) + i);
  }
  return v;
}

// A chunk at `c` in K (in_v false) or V: its destination, and its input address in `row`
// (the token's K or V input row); a chunk that does not exist reads the row's first chunk
// instead (in bounds, never stored), so that the loads need no branch.
template <typename InBits, bool kFp8Cache>
__device__ __forceinline__ const InBits* PlaceChunk(const KernelParams& p, ChunkPos c,
                                                    bool in_v, const InBits* row,
                                                    int64_t row_head_stride,
                                                    int64_t cache_head_stride, bool exists,
                                                    ChunkDst& dst) {
  dst.off = ChunkOffset(c, cache_head_stride) | (in_v ? 0x80000000u : 0u);
  if constexpr (kFp8Cache) dst.scale_index = ScaleIndex(p, in_v, c.head);
  return row + (exists ? ChunkOffset(c, row_head_stride) : 0u);
}

// Step s of the walk: the chunk's input address and destination (as PlaceChunk), with the
// walk moved on to step s + 1.
template <typename InBits, bool kFp8Cache>
__device__ __forceinline__ const InBits* NextChunk(const KernelParams& p, const InBits* key,
                                                   const InBits* value, int s, bool exists,
                                                   LaneWalk& w, ChunkDst& dst) {
  const ChunkPos c = w.pos;
  if (s < w.k_steps) {  // the whole warp in K
    StepChunk(w.pos, p.k_step_head, p.k_step_first, p.head_size);
    return PlaceChunk<InBits, kFp8Cache>(p, c, false, key, p.key_head_stride, p.k_head_stride,
                                         exists, dst);
  }
  if (s > w.k_steps) {  // the whole warp in V
    StepChunk(w.pos, p.v_step_head, p.v_step_first, p.head_size_v);
    return PlaceChunk<InBits, kFp8Cache>(p, c, true, value, p.value_head_stride,
                                         p.v_head_stride, exists, dst);
  }
  // Into V: the lane's first V chunk is V's chunk (lane - k_rem) mod 32, in this step for
  // lanes >= k_rem, in the next for the others (here at their last K chunk).
  w.pos = LocateChunk((w.lane - w.k_rem) & 31, p.head_size_v / kVecElems, p.v_chunks_per_head);
  if (w.lane < w.k_rem) {
    return PlaceChunk<InBits, kFp8Cache>(p, c, false, key, p.key_head_stride, p.k_head_stride,
                                         exists, dst);
  }
  const ChunkPos v = w.pos;
  StepChunk(w.pos, p.v_step_head, p.v_step_first, p.head_size_v);
  return PlaceChunk<InBits, kFp8Cache>(p, v, true, value, p.value_head_stride, p.v_head_stride,
                                       exists, dst);
}

// The loads of a batch: steps s0 .. s0 + kSteps - 1 (chunks 32 * s0 + u * 32 + lane), all
// issued before any is used; the walk `w` moves on past them.
template <typename InBits, bool kFp8Cache, int kSteps>
__device__ __forceinline__ void LoadChunks(const KernelParams& p, const InBits* key,
                                           const InBits* value, int s0, int total,
                                           LaneWalk& w, Vec8<InBits> (&in)[kSteps],
                                           ChunkDst (&dst)[kSteps]) {
  const int warp_left = total - 32 * s0;  // step u has chunks when u * 32 < warp_left
  const int left = warp_left - w.lane;    // chunk u exists when u * 32 < left
#pragma unroll
  for (int u = 0; u < kSteps; ++u) {
    if (u * 32 < warp_left) {  // else the whole warp is past the end (small tokens)
      const InBits* src =
          NextChunk<InBits, kFp8Cache>(p, key, value, s0 + u, u * 32 < left, w, dst[u]);
      in[u] = LoadInputChunk(src);
    }
  }
}

// A token's input row for the vector paths, computed once and kept as a pointer: hidden
// from the optimizer, which would otherwise fold token * stride into every chunk's
// address and, short of registers, recompute it per chunk (six instructions).
template <typename T>
__device__ __forceinline__ const T* TokenRow(const void* base, int64_t token, int64_t stride) {
  const T* row = static_cast<const T*>(base) + token * stride;
  asm("" : "+l"(row));
  return row;
}

// Vector paths. REQUIRES (checked by the launcher): head sizes, input strides and cache
// block/token/head strides multiples of 8 elements, cache dim strides 1, base pointers
// aligned to their Vec8, a token's K and V rows (input and cache) within int32 offsets,
// the walk's fields of KernelParams set (k_step_first ... v_chunks_per_head).
//
// The walk both vector paths share: batches of loads (LoadChunks), the slot resolved while
// the first batch is in flight, then store_chunk(in, out, scale_index) for every chunk
// that exists, which converts `in` and writes it at `out` (its dst.Address(k_row, v_row)).
// kHalves: the 64 bytes a lane has in flight are two half batches instead of one batch,
// and each half is loaded again as soon as it is stored, so that a lane's conversions
// overlap its next loads (one walk for the whole token). On the H200 (8 KV heads x 128,
// 4k / 16k / 64k tokens, fractions of a D2D copy) this helps the fp8 fast paths (scale
// 0.05: 0.68 / 0.90 / 0.93 -> 0.69 / 0.94 / 0.97; scale 1: 0.88 / 0.93 / 0.97 -> 0.88 /
// 0.95 / 0.97) and hurts the 16-bit copy (0.85-0.88 / 0.92 / 0.93 -> 0.76-0.78 / 0.84 /
// 0.89), whose stores are twice as large: UpdateTokenVecFp8 takes it, UpdateTokenVec not.
template <typename InBits, typename OutBits, bool kFp8Cache, bool kHalves = false,
          typename StoreChunk>
__device__ __forceinline__ void WalkTokenVec(const KernelParams& p, int64_t token,
                                             const int64_t* slot_ptr, int lane,
                                             StoreChunk&& store_chunk) {
  const InBits* __restrict__ key = TokenRow<InBits>(p.key, token, p.key_token_stride);
  const InBits* __restrict__ value = TokenRow<InBits>(p.value, token, p.value_token_stride);
  const int64_t slot = *slot_ptr;  // consumed after the first loads are on their way
  OutBits* k_dst = nullptr;
  OutBits* v_dst = nullptr;
  const int total = p.num_kv_heads * (p.head_size / kVecElems + p.head_size_v / kVecElems);
  if constexpr (kHalves) {
    constexpr int kHalf = kUnroll<InBits> / 2;  // steps per half batch
    static_assert(kHalf >= 1, "two half batches");
    Vec8<InBits> in[2][kHalf];
    ChunkDst dst[2][kHalf];
    LaneWalk walk;
    walk.Start(p, lane, 0);
    LoadChunks<InBits, kFp8Cache, kHalf>(p, key, value, 0, total, walk, in[0], dst[0]);
    if (32 * kHalf < total) {
      LoadChunks<InBits, kFp8Cache, kHalf>(p, key, value, kHalf, total, walk, in[1], dst[1]);
    }
    if (!ResolveSlot(p, slot, &k_dst, &v_dst)) return;
    // Half h of round s0 holds steps s0 + h kHalf ...; the walk moves on in step order.
    for (int s0 = 0; 32 * s0 < total; s0 += 2 * kHalf) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int s = s0 + h * kHalf;
        if (32 * s >= total) break;
        const int left = total - 32 * s - lane;  // chunk u exists when u * 32 < left
#pragma unroll
        for (int u = 0; u < kHalf; ++u) {
          if (u * 32 < left) {
            store_chunk(in[h][u], dst[h][u].Address(k_dst, v_dst), dst[h][u].scale_index);
          }
        }
        if (32 * (s + 2 * kHalf) < total) {
          LoadChunks<InBits, kFp8Cache, kHalf>(p, key, value, s + 2 * kHalf, total, walk,
                                               in[h], dst[h]);
        }
      }
    }
  } else {
    for (int s0 = 0; 32 * s0 < total; s0 += kUnroll<InBits>) {
      LaneWalk walk;
      walk.Start(p, lane, s0);
      Vec8<InBits> in[kUnroll<InBits>];
      ChunkDst dst[kUnroll<InBits>];
      LoadChunks<InBits, kFp8Cache, kUnroll<InBits>>(p, key, value, s0, total, walk, in, dst);
      if (s0 == 0) {
        if (!ResolveSlot(p, slot, &k_dst, &v_dst)) return;
      }
      const int left = total - 32 * s0 - lane;  // chunk u exists when u * 32 < left
#pragma unroll
      for (int u = 0; u < kUnroll<InBits>; ++u) {
        if (u * 32 < left) store_chunk(in[u], dst[u].Address(k_dst, v_dst), dst[u].scale_index);
      }
    }
  }
}

// ---- Vector paths, regular rows: a walk without bookkeeping per chunk ----
//
// Where K and V heads have one size and the same head strides (input and cache), a lane can
// take kAdj adjacent chunks (one address, the next chunk at an immediate offset) and, where
// a head's C = head size / 8 chunks are a power of two of such runs, R = C / kAdj <= 32,
// lane l's run sits, in every step of 32 runs, at the same element (l mod R) * kAdj * 8 of
// a head 32 / R heads further on: its place is one multiply-add from the lane's first head.
// Where K's steps are also a whole number of groups of kGroup steps, a group is all K or
// all V, the same for the whole warp, and every lane has a run in every step: no compare,
// carry or existence test per chunk (WalkTokenVec spends about 20 instructions per chunk
// on them). The launcher sets run_shift = log2 R, regular_k_groups (K's groups) and the
// steps' strides where a shape qualifies (8 KV heads x 128 from 16-bit inputs: into fp8,
// runs of 2 chunks and 2 K steps; into 16 bits, single chunks and 4 K steps).
//
// kSlots groups are in flight per lane: 1 (load a group, store it, load the next: the 16-bit
// copy) or 2 (each slot loaded again as soon as it is stored: the fp8 paths, as
// WalkTokenVec's kHalves). The slot is resolved while the first loads are in flight, and
// store_chunk(in, out, scale_index) converts a chunk and writes it at `out`.
template <typename InBits, typename OutBits, bool kFp8Cache, int kAdj, int kGroup, int kSlots,
          typename StoreChunk>
__device__ __forceinline__ void WalkTokenRegular(const KernelParams& p, int64_t token,
                                                 const int64_t* slot_ptr, int lane,
                                                 StoreChunk&& store_chunk) {
  static_assert(kSlots == 1 || kSlots == 2, "groups come in K / V pairs: kSlots divides them");
  const InBits* __restrict__ key = TokenRow<InBits>(p.key, token, p.key_token_stride);
  const InBits* __restrict__ value = TokenRow<InBits>(p.value, token, p.value_token_stride);
  const int64_t slot = *slot_ptr;  // consumed after the first loads are on their way
  // The lane's run in step 0 of K (and of V: same strides): input and cache offsets. A step
  // moves both by 32 / R heads (step_in, step_out).
  const int lane_head = lane >> p.run_shift;
  const uint32_t first =
      static_cast<uint32_t>(lane & ((1 << p.run_shift) - 1)) * (kAdj * kVecElems);
  uint32_t lane_in = static_cast<uint32_t>(lane_head * p.key_head_stride) + first;
  uint32_t lane_out = static_cast<uint32_t>(lane_head * p.k_head_stride) + first;
  // Kept in registers: the compiler would otherwise recompute them for every group.
  asm("" : "+r"(lane_in), "+r"(lane_out));
  const int k_groups = p.regular_k_groups;
  const int groups = 2 * k_groups;  // K's, then as many of V's
  Vec8<InBits> in[kSlots][kGroup][kAdj];
  // Group g's loads into slot sl (a compile-time index once the callers' loops unroll).
  auto load_group = [&](int g, int sl) {
    const bool in_v = g >= k_groups;
    const uint32_t step0 = static_cast<uint32_t>((in_v ? g - k_groups : g) * kGroup);
    const InBits* row = in_v ? value : key;
#pragma unroll
    for (int u = 0; u < kGroup; ++u) {
      const InBits* src = row + (lane_in + (step0 + u) * p.step_in);
#pragma unroll
      for (int a = 0; a < kAdj; ++a) in[sl][u][a] = LoadInputChunk(src + a * kVecElems);
    }
  };
#pragma unroll
  for (int sl = 0; sl < kSlots; ++sl) load_group(sl, sl);  // groups >= 2
  OutBits* k_dst = nullptr;
  OutBits* v_dst = nullptr;
  if (!ResolveSlot(p, slot, &k_dst, &v_dst)) return;
  for (int g0 = 0; g0 < groups; g0 += kSlots) {
#pragma unroll
    for (int sl = 0; sl < kSlots; ++sl) {
      const int g = g0 + sl;
      const bool in_v = g >= k_groups;
      // Group g's first step within K or V, as in load_group (a shared helper measured 3
      // more instructions per 4 chunks in the fp8 loop).
      const uint32_t step0 = static_cast<uint32_t>((in_v ? g - k_groups : g) * kGroup);
      OutBits* const row = in_v ? v_dst : k_dst;
#pragma unroll
      for (int u = 0; u < kGroup; ++u) {
        OutBits* const out = row + (lane_out + (step0 + u) * p.step_out);
        const int head = lane_head + static_cast<int>(step0 + u) * (32 >> p.run_shift);
        const int scale_index = kFp8Cache ? ScaleIndex(p, in_v, head) : 0;
#pragma unroll
        for (int a = 0; a < kAdj; ++a) store_chunk(in[sl][u][a], out + a * kVecElems, scale_index);
      }
      if (g + kSlots < groups) load_group(g + kSlots, sl);
    }
  }
}

// The regular walk's shape per input type: a lane's batch (64 bytes of input, kUnroll
// chunks) is kSlots groups (2 with kHalves) of kRegularGroup steps of runs of
// kRegularAdjacent chunks: runs of 2 on the fp8 paths from 16-bit inputs (8-byte stores),
// single chunks elsewhere (on the 16-bit copy, whose stores are 16 bytes, runs of 2
// measured 0.54 / 0.80 / 0.85 of a D2D copy at 4k / 16k / 64k tokens against 0.91-0.95 /
// 0.92 / 0.93 for single chunks).
template <typename InBits, bool kHalves>
inline constexpr int kRegularAdjacent = kHalves && kUnroll<InBits> >= 4 ? 2 : 1;
template <typename InBits, bool kHalves>
inline constexpr int kRegularGroup =
    kUnroll<InBits> / (kHalves ? 2 : 1) / kRegularAdjacent<InBits, kHalves>;

// A token's walk: the regular one where the launcher picked it (kRegular), else the
// general one. store_chunk(in, out, scale_index) as WalkTokenRegular's.
template <typename InBits, typename OutBits, bool kFp8Cache, bool kHalves, bool kRegular,
          typename StoreChunk>
__device__ __forceinline__ void WalkToken(const KernelParams& p, int64_t token,
                                          const int64_t* slot_ptr, int lane,
                                          StoreChunk&& store_chunk) {
  if constexpr (kRegular) {
    WalkTokenRegular<InBits, OutBits, kFp8Cache, kRegularAdjacent<InBits, kHalves>,
                     kRegularGroup<InBits, kHalves>, kHalves ? 2 : 1>(p, token, slot_ptr, lane,
                                                                      store_chunk);
  } else {
    WalkTokenVec<InBits, OutBits, kFp8Cache, kHalves>(p, token, slot_ptr, lane, store_chunk);
  }
}

// Same-dtype copies and 16/32-bit conversions (Convert), and fp8 through the division.
template <typename In, typename Out, bool kRegular>
__device__ __forceinline__ void UpdateTokenVec(const KernelParams& p, int64_t token,
                                               const int64_t* slot_ptr, int lane) {
  using InBits = typename In::Bits;
  using OutBits = typename Out::Bits;
  WalkToken<InBits, OutBits, Out::kFp8, /*kHalves=*/false, kRegular>(
      p, token, slot_ptr, lane, [&](const Vec8<InBits>& in, OutBits* dst, int scale_index) {
        const float scale = Out::kFp8 ? p.fp8_scale[scale_index].scale : 1.0f;
        Vec8<OutBits> out;
        if constexpr (std::is_same<In, Out>::value) {
          out = in;  // the bits, untouched (Convert)
        } else {
#pragma unroll
          for (int e = 0; e < kVecElems; ++e) {
            out.v[e] = Convert<In, Out>(ChunkElement(in, e), scale);
          }
        }
        *reinterpret_cast<Vec8<OutBits>*>(dst) = out;
      });
}

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

// Scalar path: any sizes and strides (dim strides included), one element per lane step.
template <typename In, typename Out>
__device__ __forceinline__ void UpdateTokenScalar(const KernelParams& p, int64_t token,
                                                  int64_t block, int64_t offset, int lane) {
  using InBits = typename In::Bits;
  using OutBits = typename Out::Bits;
  const InBits* __restrict__ key =
      static_cast<const InBits*>(p.key) + token * p.key_token_stride;
  const InBits* __restrict__ value =
      static_cast<const InBits*>(p.value) + token * p.value_token_stride;
  OutBits* __restrict__ k_dst =
      static_cast<OutBits*>(p.k_cache) + block * p.k_block_stride + offset * p.k_token_stride;
  OutBits* __restrict__ v_dst =
      static_cast<OutBits*>(p.v_cache) + block * p.v_block_stride + offset * p.v_token_stride;
  const int k_total = p.num_kv_heads * p.head_size;
  const int total = k_total + p.num_kv_heads * p.head_size_v;
#pragma unroll 4
  for (int idx = lane; idx < total; idx += 32) {
    const bool is_v = idx >= k_total;
    const int j = is_v ? idx - k_total : idx;
    const int per_head = is_v ? p.head_size_v : p.head_size;
    const int head = j / per_head;
    const int d = j - head * per_head;
    const float scale = Out::kFp8 ? ScaleFor(p, is_v, head) : 1.0f;
    if (is_v) {
      v_dst[head * p.v_head_stride + d * p.v_dim_stride] =
          Convert<In, Out>(value[head * p.value_head_stride + d], scale);
    } else {
      k_dst[head * p.k_head_stride + d * p.k_dim_stride] =
          Convert<In, Out>(key[head * p.key_head_stride + d], scale);
    }
  }
}

// Grid: ceil(num_tokens / kWarpsPerCta) CTAs of kThreadsPerCta threads; warp w of CTA b
// writes token b * kWarpsPerCta + w.
// kRegular (vector path): the regular walk, WalkTokenRegular (the launcher checked the
// shape and set its params). kFastFp8 (vector path, fp8 cache): UpdateTokenVecFp8 instead
// of UpdateTokenVec, with kQuotient as there.
// CTAs per SM the register budget is sized for: four (32 warps, 64 registers), so that at a
// few thousand tokens (one warp per token) a whole call runs in one wave instead of one and
// a fraction.
template <typename In, typename Out>
inline constexpr int kMinCtasPerSm = 4;

template <typename In, typename Out, bool kVectorized, bool kRegular = false,
          bool kFastFp8 = false, Fp8Quotient kQuotient = Fp8Quotient::kReciprocal>
__global__ void __launch_bounds__(kThreadsPerCta, (kMinCtasPerSm<In, Out>))
    CacheUpdateKernel(const __grid_constant__ KernelParams p) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t token =
      static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + static_cast<int64_t>(threadIdx.x >> 5);
  if (token >= p.num_tokens) return;
  if constexpr (kVectorized && kFastFp8) {
    UpdateTokenVecFp8<In, Out, kQuotient, kRegular>(p, token, p.slot_mapping + token, lane);
  } else if constexpr (kVectorized) {
    UpdateTokenVec<In, Out, kRegular>(p, token, p.slot_mapping + token, lane);
  } else {
    const int64_t slot = p.slot_mapping[token];
    if (slot < 0 || slot >= p.num_slots) return;  // padding (-1), or see KernelParams
    const int64_t block = slot / p.block_size;
    const int64_t offset = slot - block * p.block_size;
    UpdateTokenScalar<In, Out>(p, token, block, offset, lane);
  }
}

}  // namespace cache_update
}  // namespace internal
}  // namespace kvstream

#endif  // defined(__CUDACC__)

#endif  // KVSTREAM_CACHE_CUDA_CACHE_UPDATE_CUH_
