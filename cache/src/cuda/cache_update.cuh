// The CUDA cache-update kernel (vLLM's reshape_and_cache_flash): each new token's keys and
// values written into its slot of the paged cache, converted to the cache dtype bit for bit
// as the CPU implementation does (common/numeric.h: round to nearest even, fp8 saturating,
// fp8(x / scale) with a true division, same-dtype copies keep every bit including NaN
// payloads). Header-only templates over a params struct passed by value; the launcher is
// cache_update.cu. The division stays a true IEEE division (not a multiply by 1/scale),
// as on the host.
//
// Work split: one warp per token, eight tokens per 256-thread CTA. A warp walks the K and
// V rows of its token (all KV heads) as one index space of 8-element chunks, so each lane
// has up to kCacheUpdateUnroll independent 16-byte (or 32/8-byte) loads in flight before it
// converts and stores. A scalar variant handles strides or sizes that 8-element vectors do
// not fit (odd head sizes, misaligned or dim-strided caches).
//
// fp8 caches (kReciprocal, the default): the quotient x / scale is computed from a
// reciprocal taken once per scale plus two FMA corrections, which yields the correctly
// rounded quotient, i.e. the same float as the division (proof at FastQuotient), then
// converted two at a time with the packed cvt; a chunk holding a NaN input is redone with
// the division. kDivision keeps the per-element division, for comparison.
//
// The part above `#if defined(__CUDACC__)` is plain C++ so that tests and benchmarks
// compiled by the host compiler can pick the method.
#ifndef KVSTREAM_CACHE_CUDA_CACHE_UPDATE_CUH_
#define KVSTREAM_CACHE_CUDA_CACHE_UPDATE_CUH_

#include <cstdint>

#include "absl/status/status.h"
#include "kvstream/cache/cache_update.h"

namespace kvstream {
namespace internal {

// How the CUDA cache update computes fp8(x / scale). Both write the same bytes.
enum class CacheUpdateFp8Method {
  kReciprocal,  // reciprocal + exact correction, packed conversion (default)
  kDivision,    // one IEEE division per element (the previous kernel)
};

// CacheUpdateCuda with the fp8 method chosen (CacheUpdateCuda uses kReciprocal). Same
// contract as CacheUpdateCuda. kReciprocal falls back to kDivision when a scale lies
// outside [2^-30, 2^30] (the range FastQuotient's proof covers), when offsets within a
// token's row exceed int32, or when the vector path does not apply.
absl::Status CacheUpdateCudaWithMethod(const CacheUpdateParams& params, void* cuda_stream,
                                       CacheUpdateFp8Method method);

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
inline constexpr int kUnroll = 8;  // chunks in flight per lane (vector path)
inline constexpr int kVecElems = 8;

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
  float k_scale[kMaxScales];
  float v_scale[kMaxScales];
  // kReciprocal only: 1.0f / scale (IEEE, from the host), and magic numbers dividing a
  // chunk index by head_size / 8 and head_size_v / 8.
  float k_recip[kMaxScales];
  float v_recip[kMaxScales];
  DivMagic k_chunks_per_head;
  DivMagic v_chunks_per_head;
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
  __device__ static float ToFloat(Bits b) { return __uint_as_float(b); }
  __device__ static Bits FromFloat(float x) { return __float_as_uint(x); }
};
struct ElemF16 {
  using Bits = uint16_t;
  static constexpr bool kFp8 = false;
  __device__ static float ToFloat(Bits b) { return HalfBitsToFloat(b); }
  __device__ static Bits FromFloat(float x) { return FloatToHalfBits(x); }
};
struct ElemBF16 {
  using Bits = uint16_t;
  static constexpr bool kFp8 = false;
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

// Where chunk `idx` of a token's combined K+V chunk space lives.
struct ChunkRef {
  bool is_v;
  int head;
  int first;  // first element of the chunk within the head
};

__device__ __forceinline__ ChunkRef LocateChunk(int idx, int k_total, int k_per_head,
                                                int v_per_head) {
  ChunkRef r;
  r.is_v = idx >= k_total;
  const int j = r.is_v ? idx - k_total : idx;
  const int per_head = r.is_v ? v_per_head : k_per_head;
  r.head = j / per_head;
  r.first = (j - r.head * per_head) * kVecElems;
  return r;
}

__device__ __forceinline__ float ScaleFor(const KernelParams& p, bool is_v, int head) {
  const int i = p.num_scales > 1 ? head : 0;
  return is_v ? p.v_scale[i] : p.k_scale[i];
}

// Vector path. REQUIRES (checked by the launcher): head sizes, input strides and cache
// block/token/head strides multiples of 8 elements, cache dim strides 1, base pointers
// aligned to their Vec8.
template <typename In, typename Out>
__device__ __forceinline__ void UpdateTokenVec(const KernelParams& p, int64_t token,
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
  const int k_per_head = p.head_size / kVecElems;
  const int v_per_head = p.head_size_v / kVecElems;
  const int k_total = p.num_kv_heads * k_per_head;
  const int total = k_total + p.num_kv_heads * v_per_head;
  for (int base = 0; base < total; base += 32 * kUnroll) {
    Vec8<InBits> in[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int idx = base + u * 32 + lane;
      if (idx < total) {
        const ChunkRef c = LocateChunk(idx, k_total, k_per_head, v_per_head);
        const InBits* src = c.is_v ? value + c.head * p.value_head_stride + c.first
                                   : key + c.head * p.key_head_stride + c.first;
        in[u] = *reinterpret_cast<const Vec8<InBits>*>(src);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int idx = base + u * 32 + lane;
      if (idx < total) {
        const ChunkRef c = LocateChunk(idx, k_total, k_per_head, v_per_head);
        const float scale = Out::kFp8 ? ScaleFor(p, c.is_v, c.head) : 1.0f;
        Vec8<OutBits> out;
#pragma unroll
        for (int e = 0; e < kVecElems; ++e) out.v[e] = Convert<In, Out>(in[u].v[e], scale);
        OutBits* dst = c.is_v ? v_dst + c.head * p.v_head_stride + c.first
                              : k_dst + c.head * p.k_head_stride + c.first;
        *reinterpret_cast<Vec8<OutBits>*>(dst) = out;
      }
    }
  }
}

// ---- kReciprocal: fp8 quotients without a division per element ----

// Per-scale inputs of FastQuotient: s the scale, r = RN(1 / s), hi = s * 2^18 (exact).
struct Fp8Scale {
  float s;
  float r;
  float hi;
};

// The float x / s rounded to nearest even (what `x / s` gives), for s in [2^-30, 2^30] and
// every float x that is not NaN, up to a value change that the fp8 encoders do not see.
// Let a = min(|x|, hi) and u = 2^-24.
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
// gives q2 = +0. (A NaN x gives a finite value here; callers redo NaN chunks.)
__device__ __forceinline__ float FastQuotient(float x, const Fp8Scale& c) {
  const float a = fminf(fabsf(x), c.hi);
  float q = a * c.r;
  float e = fmaf(-q, c.s, a);
  q = fmaf(e, c.r, q);
  e = fmaf(-q, c.s, a);
  q = fmaf(e, c.r, q);
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

// A chunk as the division path converts it; out of line, since UpdateTokenVecFp8 needs it
// only for chunks holding a NaN and eight inlined divisions would crowd the hot loop's code.
template <typename In, typename Out>
__device__ __noinline__ uint2 Fp8ChunkByDivision(Vec8<typename In::Bits> in, float scale) {
  Vec8<uint8_t> out;
#pragma unroll
  for (int e = 0; e < kVecElems; ++e) out.v[e] = Convert<In, Out>(in.v[e], scale);
  return *reinterpret_cast<const uint2*>(&out);
}

__device__ __forceinline__ ChunkRef LocateChunkMagic(int idx, int k_total, int k_per_head,
                                                     int v_per_head, DivMagic k_magic,
                                                     DivMagic v_magic) {
  ChunkRef r;
  r.is_v = idx >= k_total;
  const int j = r.is_v ? idx - k_total : idx;
  const int per_head = r.is_v ? v_per_head : k_per_head;
  const DivMagic m = r.is_v ? v_magic : k_magic;
  r.head = static_cast<int>((static_cast<uint64_t>(static_cast<uint32_t>(j)) * m.mul) >> m.shift);
  r.first = (j - r.head * per_head) * kVecElems;
  return r;
}

__device__ __forceinline__ Fp8Scale Fp8ScaleFor(const KernelParams& p, bool is_v, int head) {
  const int i = p.num_scales > 1 ? head : 0;
  Fp8Scale c;
  c.s = is_v ? p.v_scale[i] : p.k_scale[i];
  c.r = is_v ? p.v_recip[i] : p.k_recip[i];
  c.hi = c.s * 262144.0f;  // 2^18, exact for s <= 2^30
  return c;
}

// UpdateTokenVec for fp8 caches with FastQuotient. Same REQUIRES as UpdateTokenVec, plus
// every scale in [2^-30, 2^30] with its reciprocal in k_recip / v_recip.
template <typename In, typename Out>
__device__ __forceinline__ void UpdateTokenVecFp8(const KernelParams& p, int64_t token,
                                                  int64_t block, int64_t offset, int lane) {
  static_assert(Out::kFp8 && !In::kFp8, "fp8 caches from 16/32-bit inputs");
  using InBits = typename In::Bits;
  const InBits* __restrict__ key =
      static_cast<const InBits*>(p.key) + token * p.key_token_stride;
  const InBits* __restrict__ value =
      static_cast<const InBits*>(p.value) + token * p.value_token_stride;
  uint8_t* __restrict__ k_dst =
      static_cast<uint8_t*>(p.k_cache) + block * p.k_block_stride + offset * p.k_token_stride;
  uint8_t* __restrict__ v_dst =
      static_cast<uint8_t*>(p.v_cache) + block * p.v_block_stride + offset * p.v_token_stride;
  const int k_per_head = p.head_size / kVecElems;
  const int v_per_head = p.head_size_v / kVecElems;
  const int k_total = p.num_kv_heads * k_per_head;
  const int total = k_total + p.num_kv_heads * v_per_head;
  const DivMagic k_magic = p.k_chunks_per_head;
  const DivMagic v_magic = p.v_chunks_per_head;
  // 32-bit offsets within the token's row (the launcher checks they fit), and selects
  // instead of branches on K or V.
  const int key_hs = static_cast<int>(p.key_head_stride);
  const int value_hs = static_cast<int>(p.value_head_stride);
  const int k_hs = static_cast<int>(p.k_head_stride);
  const int v_hs = static_cast<int>(p.v_head_stride);
  for (int base = 0; base < total; base += 32 * kUnroll) {
    // Chunks are located again for the stores: keeping their destinations and scales in
    // registers costs more occupancy (bf16: 69 -> 92 registers, 3 -> 2 CTAs per SM) than
    // it saves (about 8% of the instructions).
    Vec8<InBits> in[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int idx = base + u * 32 + lane;
      if (idx < total) {
        const ChunkRef c = LocateChunkMagic(idx, k_total, k_per_head, v_per_head, k_magic, v_magic);
        const int src_off = c.head * (c.is_v ? value_hs : key_hs) + c.first;
        const InBits* src = (c.is_v ? value : key) + src_off;
        in[u] = *reinterpret_cast<const Vec8<InBits>*>(src);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int idx = base + u * 32 + lane;
      if (idx < total) {
        const ChunkRef c = LocateChunkMagic(idx, k_total, k_per_head, v_per_head, k_magic, v_magic);
        const Fp8Scale sc = Fp8ScaleFor(p, c.is_v, c.head);
        float x[kVecElems];
        if constexpr (std::is_same<In, ElemBF16>::value) {
          // A bf16 pair is one 32-bit word: the low one shifted up, the high one masked.
          const uint4 w = *reinterpret_cast<const uint4*>(&in[u]);
          const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            x[2 * i] = __uint_as_float(words[i] << 16);
            x[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
          }
        } else {
#pragma unroll
          for (int e = 0; e < kVecElems; ++e) x[e] = In::ToFloat(in[u].v[e]);
        }
        bool any_nan = false;
        uint32_t pairs[kVecElems / 2];
#pragma unroll
        for (int e = 0; e < kVecElems; e += 2) {
          // One unordered compare per pair (LLVM folds the two self-compares).
          any_nan |= (x[e] != x[e]) | (x[e + 1] != x[e + 1]);
          pairs[e / 2] = Fp8Pair<Out>(FastQuotient(x[e], sc), FastQuotient(x[e + 1], sc));
        }
        uint2 out = make_uint2(pairs[0] | (pairs[1] << 16), pairs[2] | (pairs[3] << 16));
        // Rare: the division path's NaN handling (0x7f whatever the sign) for the chunk.
        if (any_nan) out = Fp8ChunkByDivision<In, Out>(in[u], sc.s);
        uint8_t* dst = (c.is_v ? v_dst : k_dst) + (c.head * (c.is_v ? v_hs : k_hs) + c.first);
        *reinterpret_cast<uint2*>(dst) = out;
      }
    }
  }
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
// kFastFp8 (vector path, fp8 cache): UpdateTokenVecFp8 instead of UpdateTokenVec.
template <typename In, typename Out, bool kVectorized, bool kFastFp8 = false>
__global__ void __launch_bounds__(kThreadsPerCta)
    CacheUpdateKernel(const __grid_constant__ KernelParams p) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t token =
      static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + static_cast<int64_t>(threadIdx.x >> 5);
  if (token >= p.num_tokens) return;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0 || slot >= p.num_slots) return;  // padding (-1), or see KernelParams
  const int64_t block = slot / p.block_size;
  const int64_t offset = slot - block * p.block_size;
  if constexpr (kVectorized && kFastFp8) {
    UpdateTokenVecFp8<In, Out>(p, token, block, offset, lane);
  } else if constexpr (kVectorized) {
    UpdateTokenVec<In, Out>(p, token, block, offset, lane);
  } else {
    UpdateTokenScalar<In, Out>(p, token, block, offset, lane);
  }
}

}  // namespace cache_update
}  // namespace internal
}  // namespace kvstream

#endif  // defined(__CUDACC__)

#endif  // KVSTREAM_CACHE_CUDA_CACHE_UPDATE_CUH_
