// The products of the CPU attention fast path (S = Q K^T or S^T = K Q^T, O += P V):
// register-blocked "broadcast one operand, stream the other" loops, parameterised by a
// variant's config (fast_variants.h). Each output element is one multiply-add chain in
// order, whatever the blocking: what batch invariance (fast.cc) rests on.
#ifndef KVSTREAM_ATTENTION_CPU_FAST_GEMM_H_
#define KVSTREAM_ATTENTION_CPU_FAST_GEMM_H_

#include <cstdint>

#include "cpu/fast_problem.h"
#include "cpu/fast_target.h"

namespace kvstream {
namespace internal {
namespace cpu_fast {

// c + a * b, as one fused operation where the variant has fma. Written out rather than
// left to -ffp-contract: whether the compiler fuses an accumulation chain depends on
// tuning heuristics (GCC avoids fma chains for some CPUs), and a score must come out of
// the same operations in every MicroKernel instantiation.
template <bool kFma>
KVSTREAM_INLINE float MulAdd(float a, float b, float c) {
  if constexpr (kFma) {
    return __builtin_fmaf(a, b, c);
  } else {
    return a * b + c;
  }
}

// C[MR][NB] (+)= A(MR x k) * B(k x NB), A(i, kk) = a[i * a_rs + kk * a_ks] broadcast, B rows
// contiguous. The accumulators are a local array that the compiler keeps in registers.
// Each element of C is one chain over kk = 0 .. k-1 in order, whatever MR and NB are.
template <bool kFma, int MR, int NB, bool kAccumulate>
KVSTREAM_INLINE void MicroKernel(int k, const float* a, int64_t a_rs, int64_t a_ks,
                                 const float* b, int64_t ldb, float* c, int64_t ldc) {
  float acc[MR][NB];
  for (int i = 0; i < MR; ++i) {
    KVSTREAM_SIMD
    for (int j = 0; j < NB; ++j) acc[i][j] = kAccumulate ? c[i * ldc + j] : 0.0f;
  }
  for (int kk = 0; kk < k; ++kk) {
    const float* brow = b + kk * ldb;
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const float av = a[i * a_rs + kk * a_ks];
      KVSTREAM_SIMD
      for (int j = 0; j < NB; ++j) acc[i][j] = MulAdd<kFma>(av, brow[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    KVSTREAM_SIMD
    for (int j = 0; j < NB; ++j) c[i * ldc + j] = acc[i][j];
  }
}

// MR rows of C, all n columns (n a multiple of kLanes).
template <class Cfg, int MR, bool kAccumulate>
KVSTREAM_INLINE void GemmRows(int n, int k, const float* a, int64_t a_rs, int64_t a_ks,
                              const float* b, int64_t ldb, float* c, int64_t ldc) {
  int j = 0;
  for (; j + Cfg::kNB <= n; j += Cfg::kNB) {
    MicroKernel<Cfg::kFma, MR, Cfg::kNB, kAccumulate>(k, a, a_rs, a_ks, b + j, ldb, c + j, ldc);
  }
  if constexpr (Cfg::kNB > kLanes) {
    for (; j < n; j += kLanes) {
      MicroKernel<Cfg::kFma, MR, kLanes, kAccumulate>(k, a, a_rs, a_ks, b + j, ldb, c + j, ldc);
    }
  }
}

template <class Cfg, int MR, bool kAccumulate>
KVSTREAM_INLINE void GemmTail(int rows, int n, int k, const float* a, int64_t a_rs,
                              int64_t a_ks, const float* b, int64_t ldb, float* c, int64_t ldc) {
  if constexpr (MR > 0) {
    if (rows == MR) {
      GemmRows<Cfg, MR, kAccumulate>(n, k, a, a_rs, a_ks, b, ldb, c, ldc);
    } else {
      GemmTail<Cfg, MR - 1, kAccumulate>(rows, n, k, a, a_rs, a_ks, b, ldb, c, ldc);
    }
  }
}

// C (m x n) (+)= A (m x k) * B (k x n). REQUIRES: n a multiple of kLanes.
template <class Cfg, bool kAccumulate>
KVSTREAM_INLINE void Gemm(int m, int n, int k, const float* a, int64_t a_rs, int64_t a_ks,
                          const float* b, int64_t ldb, float* c, int64_t ldc) {
  int i = 0;
  for (; i + Cfg::kMR <= m; i += Cfg::kMR) {
    GemmRows<Cfg, Cfg::kMR, kAccumulate>(n, k, a + i * a_rs, a_rs, a_ks, b, ldb, c + i * ldc,
                                         ldc);
  }
  if (i < m) {
    GemmTail<Cfg, Cfg::kMR - 1, kAccumulate>(m - i, n, k, a + i * a_rs, a_rs, a_ks, b, ldb,
                                             c + i * ldc, ldc);
  }
}

}  // namespace cpu_fast
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CPU_FAST_GEMM_H_
