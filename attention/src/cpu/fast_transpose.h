// Transposes of the CPU attention fast path (K tiles of narrow items, Q of wide ones):
// a plain loop for the generic variant, 8x8 (AVX2) and 16x16 (AVX-512) register
// transposes with the conversion from 16-bit K fused into the loads. As plain loops they
// compile to scalar stores.
#ifndef KVSTREAM_ATTENTION_CPU_FAST_TRANSPOSE_H_
#define KVSTREAM_ATTENTION_CPU_FAST_TRANSPOSE_H_

#include <cstdint>

#include "kvstream/attention/backend.h"
#include "cpu/fast_prefetch.h"
#include "cpu/fast_problem.h"
#include "cpu/fast_target.h"

namespace kvstream {
namespace internal {
namespace cpu_fast {

// dst[d * ldt + jj] = element d of row jj, for d < dims and jj < n (n a multiple of
// kLanes), rows[jj] pointing at `dims` elements of type `src`. Data movement and exact
// conversion only, so they decide nothing about the result. The prefetcher's keys
// [pf_from, pf_to) are spread over the blocks.

KVSTREAM_INLINE void TransposeRowsGeneric(const char* const* rows, int n, int dims, float* dst,
                                          int64_t ldt, TilePrefetcher& pf, int pf_from,
                                          int pf_to) {
  const int steps = n / kLanes;
  for (int jg = 0; jg < n; jg += kLanes) {
    pf.Spread(jg / kLanes, steps, pf_from, pf_to);
    for (int jj = jg; jj < jg + kLanes; ++jj) {
      const float* r = reinterpret_cast<const float*>(rows[jj]);
      for (int d = 0; d < dims; ++d) dst[d * ldt + jj] = r[d];
    }
  }
}

#if KVSTREAM_X86_DISPATCH
template <DType kSrc>
KVSTREAM_TARGET_AVX512_INLINE __m512 Load16(const char* row, int64_t d) {
  if constexpr (kSrc == DType::kBFloat16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * d));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else if constexpr (kSrc == DType::kFloat16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * d)));
  } else {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + d);
  }
}

// r[i] = row i of a 16 x 16 block on entry, column i on return.
KVSTREAM_TARGET_AVX512_INLINE void Transpose16x16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  // Per 128-bit lane L: r[4q + c] holds element 4L + c of rows 4q .. 4q+3.
  for (int q = 0; q < 16; q += 4) {
    r[q] = _mm512_shuffle_ps(t[q], t[q + 2], 0x44);
    r[q + 1] = _mm512_shuffle_ps(t[q], t[q + 2], 0xee);
    r[q + 2] = _mm512_shuffle_ps(t[q + 1], t[q + 3], 0x44);
    r[q + 3] = _mm512_shuffle_ps(t[q + 1], t[q + 3], 0xee);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 even01 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);    // lanes 0, 2
    const __m512 even23 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
    const __m512 odd01 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);     // lanes 1, 3
    const __m512 odd23 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
    t[c] = _mm512_shuffle_f32x4(even01, even23, 0x88);
    t[8 + c] = _mm512_shuffle_f32x4(even01, even23, 0xdd);
    t[4 + c] = _mm512_shuffle_f32x4(odd01, odd23, 0x88);
    t[12 + c] = _mm512_shuffle_f32x4(odd01, odd23, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// REQUIRES: dims a multiple of 16.
template <DType kSrc>
KVSTREAM_TARGET_AVX512_INLINE void TransposeRowsAvx512(const char* const* rows, int n, int dims,
                                                       float* dst, int64_t ldt,
                                                       TilePrefetcher& pf, int pf_from,
                                                       int pf_to) {
  const int blocks = dims / 16;
  const int steps = n / 16 * blocks;
  for (int jg = 0; jg < n; jg += 16) {
    for (int b = 0; b < blocks; ++b) {
      pf.Spread(jg / 16 * blocks + b, steps, pf_from, pf_to);
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = Load16<kSrc>(rows[jg + i], b * 16);
      Transpose16x16(r);
      float* block = dst + b * 16 * ldt + jg;
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(block + i * ldt, r[i]);
    }
  }
}

template <DType kSrc>
KVSTREAM_TARGET_AVX2_INLINE __m256 Load8(const char* row, int64_t d) {
  if constexpr (kSrc == DType::kBFloat16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * d));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else if constexpr (kSrc == DType::kFloat16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * d)));
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + d);
  }
}

// r[i] = row i of an 8 x 8 block on entry, column i on return.
KVSTREAM_TARGET_AVX2_INLINE void Transpose8x8(__m256* r) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  __m256 s[8];
  for (int q = 0; q < 8; q += 4) {
    s[q] = _mm256_shuffle_ps(t[q], t[q + 2], 0x44);
    s[q + 1] = _mm256_shuffle_ps(t[q], t[q + 2], 0xee);
    s[q + 2] = _mm256_shuffle_ps(t[q + 1], t[q + 3], 0x44);
    s[q + 3] = _mm256_shuffle_ps(t[q + 1], t[q + 3], 0xee);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x31);
  }
}

// REQUIRES: dims a multiple of 8.
template <DType kSrc>
KVSTREAM_TARGET_AVX2_INLINE void TransposeRowsAvx2(const char* const* rows, int n, int dims,
                                                   float* dst, int64_t ldt, TilePrefetcher& pf,
                                                   int pf_from, int pf_to) {
  const int blocks = dims / 8;
  const int steps = n / 8 * blocks;
  for (int jg = 0; jg < n; jg += 8) {
    for (int b = 0; b < blocks; ++b) {
      pf.Spread(jg / 8 * blocks + b, steps, pf_from, pf_to);
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = Load8<kSrc>(rows[jg + i], b * 8);
      Transpose8x8(r);
      float* block = dst + b * 8 * ldt + jg;
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(block + i * ldt, r[i]);
    }
  }
}
#endif

}  // namespace cpu_fast
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CPU_FAST_TRANSPOSE_H_
