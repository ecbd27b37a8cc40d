// The CPU fast path of paged attention, RunAttentionCpu (semantics in backend.h; the
// reference in reference.cc is what it must agree with).
//
// Work is split into items (sequence, KV head, tile of query tokens). An item gathers the
// query rows of every head of its GQA group for its tokens (rows = tokens x group), then
// walks the block table in tiles of kKeyTile keys: each K and V tile is dequantised to
// float once and used by all rows, scores go through an online softmax (running max and
// sum, earlier output rescaled), and only tiles that some row can see are visited (causal:
// none past the tile's last query; sliding window: none before its first).
//
// Layouts inside an item, all float, rows padded with zeros to kLanes so that loops sweep
// whole vectors:
//   q_rows  [rows][ldk]               q * scale
//   q_t     [head_size][rows_padded]  the same, transposed (GEMM path)
//   k_rows  [kKeyTile][ldk]           one K tile, dequantised
//   v_rows  [kKeyTile][ldv]           one V tile, dequantised
//   scores  [kKeyTile][rows_padded]   S^T: keys major, so softmax statistics of all rows
//                                      are vectors and P^T feeds the PV product directly
//   out     [rows][ldv]               unnormalised output
// S^T = K_tile * Q^T and O += P * V_tile are both "broadcast one operand, stream the other"
// register-blocked products (MicroKernel), which compilers vectorise from plain loops.
// With few rows (decode, short chunks: the "dot path") the QK product is a dot product per
// (key, row) instead, because a GEMM over a 16-row padded Q^T would waste most of its
// lanes; there K is read from the cache directly when its type allows.
//
// Decode reads every byte of K and V once, from blocks scattered over memory, so the row
// addresses of the next tile are computed ahead and prefetched while the current tile is
// computed (spread over the dot path's key loop; a burst of prefetches would only queue).
//
// The same C++ is compiled three times (generic, AVX2, AVX-512) through target attributes
// and picked at run time, because the library is built for a baseline x86-64 and these
// loops are worth 4-8x more with wide vectors. The dot path's reductions use intrinsics:
// compilers reduce each row through memory with a scalar chain.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kvstream/attention/backend.h"
#include "kvstream/attention/cpu_attention.h"
#include "kvstream/common/numeric.h"
#include "kvstream/common/status_macros.h"
#include "cpu/fast_internal.h"
#include "cpu/vec_math.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#define KVSTREAM_PRAGMA(x) _Pragma(#x)
#if defined(_OPENMP)
#define KVSTREAM_SIMD _Pragma("omp simd")
// A sum the compiler may reassociate into a vector reduction.
#define KVSTREAM_SIMD_SUM(var) KVSTREAM_PRAGMA(omp simd reduction(+ : var))
#elif defined(__GNUC__)
#define KVSTREAM_SIMD _Pragma("GCC ivdep")
#define KVSTREAM_SIMD_SUM(var)
#else
#define KVSTREAM_SIMD
#define KVSTREAM_SIMD_SUM(var)
#endif

#if defined(__GNUC__)
#define KVSTREAM_INLINE inline __attribute__((always_inline))
#else
#define KVSTREAM_INLINE inline
#endif

#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12's AVX-512 intrinsics pass an "undefined" vector that -Wuninitialized flags
// wherever they are inlined; the warning is about the header, not about this code.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#pragma GCC diagnostic pop
#define KVSTREAM_X86_DISPATCH 1
#define KVSTREAM_ISA_AVX2 "avx2,fma,f16c,bmi,bmi2"
#define KVSTREAM_ISA_AVX512 "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c,bmi,bmi2"
#define KVSTREAM_TARGET_AVX2 __attribute__((target(KVSTREAM_ISA_AVX2), flatten))
#define KVSTREAM_TARGET_AVX512 __attribute__((target(KVSTREAM_ISA_AVX512), flatten))
#define KVSTREAM_TARGET_AVX2_INLINE inline __attribute__((target(KVSTREAM_ISA_AVX2), always_inline))
#define KVSTREAM_TARGET_AVX512_INLINE \
  inline __attribute__((target(KVSTREAM_ISA_AVX512), always_inline))
#else
#define KVSTREAM_X86_DISPATCH 0
#endif

namespace kvstream {
namespace internal {
namespace {

constexpr int kKeyTile = 64;     // keys per tile: a K and a V tile stay in L1/L2
constexpr int kTargetRows = 64;  // query rows per item (tokens x group) in prefill
constexpr int kLanes = 16;       // padding unit of every vector-swept row
constexpr int kDotPathMaxRows = 8;
// Below this many multiply-adds a call runs on the calling thread: waking a team costs
// more than it saves.
constexpr int64_t kMinParallelWork = int64_t{1} << 21;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// What every item of one call shares.
struct Problem {
  const PagedAttentionParams* p = nullptr;
  int head_size = 0;
  int head_size_v = 0;
  int64_t ldk = 0;  // head_size rounded up to kLanes
  int64_t ldv = 0;  // head_size_v rounded up to kLanes
  int group = 0;    // query heads per KV head
  int64_t block_size = 0;
  int tile_tokens = 0;  // query tokens per item (prefill)
  int max_rows = 0;
  int64_t max_rows_padded = 0;
  float cap = 0;
  float inv_cap = 0;
  const float* fp8_table = nullptr;  // unscaled fp8 -> float, 256 entries; null if not fp8
  int64_t cache_elem = 0;            // bytes per cache element
};

struct WorkItem {
  int32_t seq = 0;
  int32_t kv_head = 0;
  int32_t t_begin = 0;  // first query token of the item, relative to the sequence
  int32_t t_count = 0;
  int64_t cost = 0;     // multiply-adds, for scheduling
};

struct FreeDeleter {
  void operator()(void* ptr) const { std::free(ptr); }
};
template <typename T>
using AlignedBuffer = std::unique_ptr<T[], FreeDeleter>;

template <typename T>
AlignedBuffer<T> AllocZeroed(int64_t n) {
  const size_t bytes = static_cast<size_t>(RoundUp(std::max<int64_t>(n, 1) * sizeof(T), 64));
  void* ptr = std::aligned_alloc(64, bytes);
  if (ptr != nullptr) std::memset(ptr, 0, bytes);
  return AlignedBuffer<T>(static_cast<T*>(ptr));
}

// Per-thread buffers, sized once per call. Padding columns of q_rows and k_rows are never
// written, so they stay zero and the dot path may sweep whole kLanes chunks.
struct Scratch {
  AlignedBuffer<float> q_rows, q_t, k_rows, v_rows, scores, out;
  AlignedBuffer<float> m, l, alpha, tile_max, sum, slope;
  AlignedBuffer<int32_t> pos, lo, hi;
  AlignedBuffer<float> k_table, v_table;
  // Row addresses of the current and the next KV tile.
  const char* k_ptrs[2][kKeyTile];
  const char* v_ptrs[2][kKeyTile];
  const char* k_row_ptrs[kKeyTile];  // rows of k_rows, for DotScores on converted tiles

  bool Allocate(const Problem& pb) {
    const int64_t rp = pb.max_rows_padded;
    q_rows = AllocZeroed<float>(pb.max_rows * pb.ldk);
    q_t = AllocZeroed<float>(pb.head_size * rp);
    k_rows = AllocZeroed<float>(kKeyTile * pb.ldk);
    v_rows = AllocZeroed<float>(kKeyTile * pb.ldv);
    scores = AllocZeroed<float>(kKeyTile * rp);
    out = AllocZeroed<float>(pb.max_rows * pb.ldv);
    m = AllocZeroed<float>(rp);
    l = AllocZeroed<float>(rp);
    alpha = AllocZeroed<float>(rp);
    tile_max = AllocZeroed<float>(rp);
    sum = AllocZeroed<float>(rp);
    slope = AllocZeroed<float>(rp);
    pos = AllocZeroed<int32_t>(rp);
    lo = AllocZeroed<int32_t>(rp);
    hi = AllocZeroed<int32_t>(rp);
    k_table = AllocZeroed<float>(256);
    v_table = AllocZeroed<float>(256);
    return q_rows && q_t && k_rows && v_rows && scores && out && m && l && alpha && tile_max &&
           sum && slope && pos && lo && hi && k_table && v_table;
  }
};

// ---- conversions into float rows ----

template <DType kDType>
KVSTREAM_INLINE void ConvertContiguous(const void* src, int n, const float* table, float* dst) {
  if constexpr (kDType == DType::kFloat32) {
    const float* s = static_cast<const float*>(src);
    KVSTREAM_SIMD
    for (int i = 0; i < n; ++i) dst[i] = s[i];
  } else if constexpr (kDType == DType::kBFloat16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    KVSTREAM_SIMD
    for (int i = 0; i < n; ++i) dst[i] = BFloat16BitsToFloatVec(s[i]);
  } else if constexpr (kDType == DType::kFloat16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    KVSTREAM_SIMD
    for (int i = 0; i < n; ++i) dst[i] = HalfBitsToFloatVec(s[i]);
  } else {
    // fp8: the table already holds fp8 value * scale.
    const uint8_t* s = static_cast<const uint8_t*>(src);
    KVSTREAM_SIMD
    for (int i = 0; i < n; ++i) dst[i] = table[s[i]];
  }
}

// Addresses of rows j0 .. j0+n-1 of KV head g of one cache tensor: one division per tile,
// then a walk along the block table (a division per key costs as much as converting it).
KVSTREAM_INLINE void TileRows(const Problem& pb, const void* base, const CacheStrides& st,
                              const int32_t* block_row, int g, int64_t j0, int n,
                              const char** rows) {
  const char* bytes = static_cast<const char*>(base);
  const int64_t elem = pb.cache_elem;
  int64_t b = j0 / pb.block_size;
  int64_t t = j0 - b * pb.block_size;
  const int64_t head_offset = g * st.head;
  int64_t block_offset = block_row[b] * st.block + head_offset;
  for (int i = 0; i < n; ++i) {
    rows[i] = bytes + (block_offset + t * st.token) * elem;
    if (++t == pb.block_size && i + 1 < n) {
      t = 0;
      block_offset = block_row[++b] * st.block + head_offset;
    }
  }
}

// Converts n rows of `width` elements into dst (row stride ld).
template <DType kDType>
KVSTREAM_INLINE void GatherRowsAs(const char* const* rows, int n, int width, int64_t dim_stride,
                                  const float* table, float* dst, int64_t ld) {
  for (int i = 0; i < n; ++i) {
    if (dim_stride == 1) {
      ConvertContiguous<kDType>(rows[i], width, table, dst + i * ld);
    } else {
      // Strided head dimension (a borrowed tensor): correct, not fast.
      const int64_t elem = static_cast<int64_t>(DTypeSize(kDType));
      for (int d = 0; d < width; ++d) {
        const char* e = rows[i] + d * dim_stride * elem;
        if constexpr (kDType == DType::kFloat8E4M3 || kDType == DType::kFloat8E5M2) {
          dst[i * ld + d] = table[static_cast<uint8_t>(*e)];
        } else {
          dst[i * ld + d] = LoadAsFloat(e, kDType, 0);
        }
      }
    }
  }
}

KVSTREAM_INLINE void GatherRows(DType dtype, const char* const* rows, int n, int width,
                                int64_t dim_stride, const float* table, float* dst, int64_t ld) {
  switch (dtype) {
    case DType::kFloat32:
      GatherRowsAs<DType::kFloat32>(rows, n, width, dim_stride, table, dst, ld);
      break;
    case DType::kFloat16:
      GatherRowsAs<DType::kFloat16>(rows, n, width, dim_stride, table, dst, ld);
      break;
    case DType::kBFloat16:
      GatherRowsAs<DType::kBFloat16>(rows, n, width, dim_stride, table, dst, ld);
      break;
    case DType::kFloat8E4M3:
      GatherRowsAs<DType::kFloat8E4M3>(rows, n, width, dim_stride, table, dst, ld);
      break;
    case DType::kFloat8E5M2:
      GatherRowsAs<DType::kFloat8E5M2>(rows, n, width, dim_stride, table, dst, ld);
      break;
    default:
      break;  // rejected by validation
  }
}

// The next tile's rows, asked for while this one is computed: they sit in blocks scattered
// over memory, which the hardware prefetchers do not guess, and decode is bound by them.
struct NextTile {
  const char* const* k = nullptr;
  const char* const* v = nullptr;
  int n = 0;  // 0: nothing to prefetch
  int64_t k_bytes = 0;
  int64_t v_bytes = 0;
};

KVSTREAM_INLINE void PrefetchRow(const char* row, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
}

// All of it at once: right for the compute-bound GEMM path. The decode path spreads the
// same requests over its key loop instead, because a burst of hundreds of prefetches only
// waits for the few line-fill buffers and overlaps nothing.
KVSTREAM_INLINE void PrefetchTile(const NextTile& next) {
  for (int i = 0; i < next.n; ++i) {
    PrefetchRow(next.k[i], next.k_bytes);
    PrefetchRow(next.v[i], next.v_bytes);
  }
}

KVSTREAM_INLINE void LoadQueryRow(const void* src, DType dtype, int n, float scale, float* dst) {
  switch (dtype) {
    case DType::kFloat32: ConvertContiguous<DType::kFloat32>(src, n, nullptr, dst); break;
    case DType::kFloat16: ConvertContiguous<DType::kFloat16>(src, n, nullptr, dst); break;
    case DType::kBFloat16: ConvertContiguous<DType::kBFloat16>(src, n, nullptr, dst); break;
    default: break;  // rejected by validation
  }
  KVSTREAM_SIMD
  for (int i = 0; i < n; ++i) dst[i] *= scale;
}

// ---- products ----

// C[MR][NB] (+)= A(MR x k) * B(k x NB), A(i, kk) = a[i * a_rs + kk * a_ks] broadcast, B rows
// contiguous. The accumulators are a local array that the compiler keeps in registers.
template <int MR, int NB, bool kAccumulate>
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
      for (int j = 0; j < NB; ++j) acc[i][j] += av * brow[j];
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
    MicroKernel<MR, Cfg::kNB, kAccumulate>(k, a, a_rs, a_ks, b + j, ldb, c + j, ldc);
  }
  if constexpr (Cfg::kNB > kLanes) {
    for (; j < n; j += kLanes) {
      MicroKernel<MR, kLanes, kAccumulate>(k, a, a_rs, a_ks, b + j, ldb, c + j, ldc);
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

// ---- the decode path's dot products ----
//
// With few query rows (decode, short chunks) each score is a dot product over the head
// dimension; each K load is shared by up to four rows. The AVX2 and AVX-512 versions read
// 32- and 16-bit K straight from the cache (no tile conversion: it was a fifth of decode's
// time) and reduce four rows' lane sums together in registers (compilers reduce each row
// through memory with a scalar chain, which was another quarter).

// scores[jj * rp + r] = dot(q_rows[r], k[jj]) for jj < n, r < rows; k[jj] points to len
// floats (the converted tile, len = ldk with zero padding).
KVSTREAM_INLINE void DotScoresGeneric(int n, int rows, int64_t len, const float* q_rows,
                                      int64_t ldq, const char* const* k, float* scores,
                                      int64_t rp, const NextTile& next) {
  for (int jj = 0; jj < n; ++jj) {
    if (jj < next.n) {
      PrefetchRow(next.k[jj], next.k_bytes);
      PrefetchRow(next.v[jj], next.v_bytes);
    }
    const float* k_row = reinterpret_cast<const float*>(k[jj]);
    float* s = scores + jj * rp;
    for (int r = 0; r < rows; ++r) {
      float acc[kLanes] = {};
      for (int64_t d = 0; d < len; d += kLanes) {
        KVSTREAM_SIMD
        for (int e = 0; e < kLanes; ++e) acc[e] += q_rows[r * ldq + d + e] * k_row[d + e];
      }
      float sum = 0;
      KVSTREAM_SIMD_SUM(sum)
      for (int e = 0; e < kLanes; ++e) sum += acc[e];
      s[r] = sum;
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

// out[i] = dot(q[i * ldq ..], k[0 .. len)) for i < MR <= 4; len a multiple of 16.
template <int MR, DType kSrc>
KVSTREAM_TARGET_AVX512_INLINE void DotRowsAvx512(int64_t len, const float* q, int64_t ldq,
                                                 const char* k, float* out) {
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                 _mm512_setzero_ps()};
  for (int64_t d = 0; d < len; d += 16) {
    const __m512 kv = Load16<kSrc>(k, d);
    for (int i = 0; i < MR; ++i) a[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + i * ldq + d), kv, a[i]);
  }
  // 128-bit lanes: rows 0,1 (then 2,3) folded to two lanes each, then the four rows to one
  // lane each, then each lane to its sum.
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i hi =
      _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const __m512i even =
      _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i odd =
      _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const __m512i swap1 = _mm512_setr_epi32(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  const __m512i swap2 = _mm512_setr_epi32(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512 t01 = _mm512_add_ps(_mm512_permutex2var_ps(a[0], lo, a[1]),
                                   _mm512_permutex2var_ps(a[0], hi, a[1]));
  const __m512 t23 = _mm512_add_ps(_mm512_permutex2var_ps(a[2], lo, a[3]),
                                   _mm512_permutex2var_ps(a[2], hi, a[3]));
  __m512 t = _mm512_add_ps(_mm512_permutex2var_ps(t01, even, t23),
                           _mm512_permutex2var_ps(t01, odd, t23));
  t = _mm512_add_ps(t, _mm512_permutex2var_ps(t, swap1, t));
  t = _mm512_add_ps(t, _mm512_permutex2var_ps(t, swap2, t));
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << MR) - 1),
                        _mm512_permutex2var_ps(t, firsts, t));
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

template <int MR, DType kSrc>
KVSTREAM_TARGET_AVX2_INLINE void DotRowsAvx2(int64_t len, const float* q, int64_t ldq,
                                             const char* k, float* out) {
  __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                 _mm256_setzero_ps()};
  for (int64_t d = 0; d < len; d += 8) {
    const __m256 kv = Load8<kSrc>(k, d);
    for (int i = 0; i < MR; ++i) a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * ldq + d), kv, a[i]);
  }
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  if constexpr (MR == 4) {
    _mm_storeu_ps(out, sums);
  } else {
    float tmp[4];
    _mm_storeu_ps(tmp, sums);
    for (int i = 0; i < MR; ++i) out[i] = tmp[i];
  }
}

// The loop over a tile's keys, for one instruction set and one K source type. A macro: a
// template without the target attribute could not inline the intrinsics.
#define KVSTREAM_DOT_SCORES(dot_rows, src)                                             \
  for (int jj = 0; jj < n; ++jj) {                                                   \
    if (jj < next.n) {                                                               \
      PrefetchRow(next.k[jj], next.k_bytes);                                         \
      PrefetchRow(next.v[jj], next.v_bytes);                                         \
    }                                                                                \
    float* s = scores + jj * rp;                                                     \
    int r = 0;                                                                       \
    for (; r + 4 <= rows; r += 4) dot_rows<4, src>(len, q_rows + r * ldq, ldq, k[jj], s + r); \
    switch (rows - r) {                                                              \
      case 3: dot_rows<3, src>(len, q_rows + r * ldq, ldq, k[jj], s + r); break;     \
      case 2: dot_rows<2, src>(len, q_rows + r * ldq, ldq, k[jj], s + r); break;     \
      case 1: dot_rows<1, src>(len, q_rows + r * ldq, ldq, k[jj], s + r); break;     \
      default: break;                                                                \
    }                                                                                \
  }

#define KVSTREAM_DOT_SCORES_BY_DTYPE(dot_rows)                                         \
  switch (src) {                                                                     \
    case DType::kBFloat16: KVSTREAM_DOT_SCORES(dot_rows, DType::kBFloat16) break;    \
    case DType::kFloat16: KVSTREAM_DOT_SCORES(dot_rows, DType::kFloat16) break;      \
    default: KVSTREAM_DOT_SCORES(dot_rows, DType::kFloat32) break;                   \
  }
#endif

// Register blocking per instruction set: kMR rows of broadcast operand by kNB columns of
// streamed operand stay in registers (AVX-512: 4 x 4 zmm; AVX2: 6 x 2 ymm; SSE2: 4 x 2 xmm).
// kRawK: DotScores reads float32, float16 and bfloat16 K rows from the cache itself.
// DotScores runs once per KV tile; `src` is the type k[] points to, len a multiple of 16.
struct GenericConfig {
  static constexpr int kMR = 4;
  static constexpr int kNB = 8;
  static constexpr bool kRawK = false;
  static void DotScores(DType src, int n, int rows, int64_t len, const float* q_rows,
                        int64_t ldq, const char* const* k, float* scores, int64_t rp,
                        const NextTile& next) {
    DotScoresGeneric(n, rows, len, q_rows, ldq, k, scores, rp, next);
  }
};
#if KVSTREAM_X86_DISPATCH
struct Avx2Config {
  static constexpr int kMR = 6;
  static constexpr int kNB = 16;
  static constexpr bool kRawK = true;
  KVSTREAM_TARGET_AVX2 static void DotScores(DType src, int n, int rows, int64_t len,
                                             const float* q_rows, int64_t ldq,
                                             const char* const* k, float* scores, int64_t rp,
                                             const NextTile& next) {
    KVSTREAM_DOT_SCORES_BY_DTYPE(DotRowsAvx2)
  }
};
struct Avx512Config {
  static constexpr int kMR = 4;
  static constexpr int kNB = 64;
  static constexpr bool kRawK = true;
  KVSTREAM_TARGET_AVX512 static void DotScores(DType src, int n, int rows, int64_t len,
                                               const float* q_rows, int64_t ldq,
                                               const char* const* k, float* scores,
                                               int64_t rp, const NextTile& next) {
    KVSTREAM_DOT_SCORES_BY_DTYPE(DotRowsAvx512)
  }
};
#endif

// ---- softmax ----

// Soft cap, ALiBi and mask on scores[jj][r] for jj < n, all rp rows; tile_max gets each
// row's maximum over this tile.
template <bool kCap, bool kAlibi, bool kMask>
KVSTREAM_INLINE void TransformScores(int n, int64_t rp, int32_t j0, float cap, float inv_cap,
                                     const float* slope, const int32_t* pos, const int32_t* lo,
                                     const int32_t* hi, float* scores, float* tile_max) {
  for (int jj = 0; jj < n; ++jj) {
    float* row = scores + jj * rp;
    const int32_t j = j0 + jj;
    KVSTREAM_SIMD
    for (int64_t r = 0; r < rp; ++r) {
      float s = row[r];
      if constexpr (kCap) s = cap * TanhVec(s * inv_cap);
      if constexpr (kAlibi) s += slope[r] * static_cast<float>(j - pos[r]);
      if constexpr (kMask) s = (j >= lo[r] && j <= hi[r]) ? s : kNegInf;
      if constexpr (kCap || kAlibi || kMask) row[r] = s;
      tile_max[r] = tile_max[r] < s ? s : tile_max[r];
    }
  }
}

template <bool kCap, bool kAlibi>
KVSTREAM_INLINE void TransformScoresMasked(bool mask, int n, int64_t rp, int32_t j0, float cap,
                                           float inv_cap, const float* slope,
                                           const int32_t* pos, const int32_t* lo,
                                           const int32_t* hi, float* scores, float* tile_max) {
  if (mask) {
    TransformScores<kCap, kAlibi, true>(n, rp, j0, cap, inv_cap, slope, pos, lo, hi, scores,
                                        tile_max);
  } else {
    TransformScores<kCap, kAlibi, false>(n, rp, j0, cap, inv_cap, slope, pos, lo, hi, scores,
                                         tile_max);
  }
}

// ---- one work item ----

template <class Cfg>
KVSTREAM_INLINE void ProcessItem(const Problem& pb, const WorkItem& item, Scratch& sc) {
  const PagedAttentionParams& p = *pb.p;
  const KvCacheView& cache = p.cache;
  const int group = pb.group;
  const int g = item.kv_head;
  const int64_t seq_len = p.seq_lens[item.seq];
  const int64_t first_row = p.query_start_loc[item.seq];
  const int64_t query_len = p.query_start_loc[item.seq + 1] - first_row;
  const int32_t* block_row = p.block_table + item.seq * p.block_table_stride;
  const int rows = item.t_count * group;
  const int64_t rp = RoundUp(rows, kLanes);
  const bool dot_path = rows <= kDotPathMaxRows;
  const int64_t ldk = pb.ldk;
  const int64_t ldv = pb.ldv;
  const int32_t pos_first = static_cast<int32_t>(seq_len - query_len + item.t_begin);
  const int32_t pos_last = pos_first + item.t_count - 1;
  const int32_t window = p.sliding_window;

  // Per-row constants; padding rows copy the last real row so that they stay finite.
  for (int64_t r = 0; r < rp; ++r) {
    const int rr = static_cast<int>(std::min<int64_t>(r, rows - 1));
    const int32_t qp = pos_first + rr / group;
    const int h = g * group + rr % group;
    sc.pos[r] = qp;
    sc.slope[r] = p.alibi_slopes != nullptr ? p.alibi_slopes[h] : 0.0f;
    // Bounds in 64 bits first: qp + window - 1 may not fit in 32.
    const int64_t hi = p.causal ? qp : (window > 0 ? int64_t{qp} + window - 1 : kInt32Max);
    sc.lo[r] = window > 0 ? qp - window + 1 : std::numeric_limits<int32_t>::min();
    sc.hi[r] = static_cast<int32_t>(std::min<int64_t>(hi, kInt32Max));
    sc.m[r] = kNegInf;
    sc.l[r] = 0.0f;
  }

  // Queries, pre-multiplied by the softmax scale.
  const size_t q_elem = DTypeSize(p.q_dtype);
  for (int r = 0; r < rows; ++r) {
    const int64_t token = first_row + item.t_begin + r / group;
    const int h = g * group + r % group;
    const char* src = static_cast<const char*>(p.q) +
                      (token * p.q_token_stride + h * p.q_head_stride) * q_elem;
    LoadQueryRow(src, p.q_dtype, pb.head_size, p.scale, sc.q_rows.get() + r * ldk);
  }
  if (!dot_path) {
    for (int d = 0; d < pb.head_size; ++d) {
      float* dst = sc.q_t.get() + d * rp;
      for (int r = 0; r < rows; ++r) dst[r] = sc.q_rows[r * ldk + d];
      for (int64_t r = rows; r < rp; ++r) dst[r] = 0.0f;
    }
  }
  std::memset(sc.out.get(), 0, sizeof(float) * static_cast<size_t>(rows * ldv));

  if (pb.fp8_table != nullptr) {
    const float ks = cache.k_scale[cache.num_scales == 1 ? 0 : g];
    const float vs = cache.v_scale[cache.num_scales == 1 ? 0 : g];
    for (int b = 0; b < 256; ++b) {
      sc.k_table[b] = pb.fp8_table[b] * ks;
      sc.v_table[b] = pb.fp8_table[b] * vs;
    }
  }

  // Keys any row of the item can see.
  int64_t key_lo = 0;
  int64_t key_hi = seq_len - 1;
  if (p.causal) key_hi = std::min<int64_t>(key_hi, pos_last);
  if (window > 0) {
    key_lo = std::max<int64_t>(0, pos_first - window + 1);
    if (!p.causal) key_hi = std::min<int64_t>(key_hi, int64_t{pos_last} + window - 1);
  }

  const bool has_cap = pb.cap > 0;
  const bool has_alibi = p.alibi_slopes != nullptr;
  float* scores = sc.scores.get();
  const int64_t k_row_bytes = pb.head_size * pb.cache_elem;
  const int64_t v_row_bytes = pb.head_size_v * pb.cache_elem;
  const bool prefetch = cache.k_strides.dim == 1 && cache.v_strides.dim == 1;
  const DType cache_dtype = cache.spec.dtype;
  const bool raw_k = Cfg::kRawK && dot_path && cache.k_strides.dim == 1 &&
                     pb.head_size % kLanes == 0 &&
                     (cache_dtype == DType::kFloat32 || cache_dtype == DType::kFloat16 ||
                      cache_dtype == DType::kBFloat16);
  if (dot_path && !raw_k) {
    for (int jj = 0; jj < kKeyTile; ++jj) {
      sc.k_row_ptrs[jj] = reinterpret_cast<const char*>(sc.k_rows.get() + jj * ldk);
    }
  }
  int cur = 0;
  if (key_lo <= key_hi) {
    const int first_n = static_cast<int>(std::min<int64_t>(kKeyTile, key_hi - key_lo + 1));
    TileRows(pb, cache.k, cache.k_strides, block_row, g, key_lo, first_n, sc.k_ptrs[0]);
    TileRows(pb, cache.v, cache.v_strides, block_row, g, key_lo, first_n, sc.v_ptrs[0]);
  }
  for (int64_t j0 = key_lo; j0 <= key_hi; j0 += kKeyTile) {
    const int n = static_cast<int>(std::min<int64_t>(kKeyTile, key_hi - j0 + 1));
    const int64_t j_last = j0 + n - 1;
    const char** k_ptrs = sc.k_ptrs[cur];
    const char** v_ptrs = sc.v_ptrs[cur];
    NextTile next;
    if (j0 + kKeyTile <= key_hi) {
      const int64_t next_j0 = j0 + kKeyTile;
      const int next_n = static_cast<int>(std::min<int64_t>(kKeyTile, key_hi - next_j0 + 1));
      TileRows(pb, cache.k, cache.k_strides, block_row, g, next_j0, next_n, sc.k_ptrs[cur ^ 1]);
      TileRows(pb, cache.v, cache.v_strides, block_row, g, next_j0, next_n, sc.v_ptrs[cur ^ 1]);
      if (prefetch) {
        next = NextTile{sc.k_ptrs[cur ^ 1], sc.v_ptrs[cur ^ 1], next_n, k_row_bytes, v_row_bytes};
      }
    }
    cur ^= 1;
    if (!dot_path) PrefetchTile(next);
    if (!raw_k) {
      GatherRows(cache.spec.dtype, k_ptrs, n, pb.head_size, cache.k_strides.dim,
                 sc.k_table.get(), sc.k_rows.get(), ldk);
    }
    GatherRows(cache.spec.dtype, v_ptrs, n, pb.head_size_v, cache.v_strides.dim,
               sc.v_table.get(), sc.v_rows.get(), ldv);

    if (dot_path) {
      if (raw_k) {
        Cfg::DotScores(cache.spec.dtype, n, rows, pb.head_size, sc.q_rows.get(), ldk, k_ptrs,
                       scores, rp, next);
      } else {
        Cfg::DotScores(DType::kFloat32, n, rows, ldk, sc.q_rows.get(), ldk, sc.k_row_ptrs,
                       scores, rp, next);
      }
    } else {
      Gemm<Cfg, false>(n, static_cast<int>(rp), pb.head_size, sc.k_rows.get(), ldk, 1,
                       sc.q_t.get(), rp, scores, rp);
    }

    // The mask is needed only where some row sees part of the tile.
    bool fully_visible = true;
    if (p.causal && j_last > pos_first) fully_visible = false;
    if (window > 0) {
      if (j0 < int64_t{pos_last} - window + 1) fully_visible = false;
      if (!p.causal && j_last > int64_t{pos_first} + window - 1) fully_visible = false;
    }
    const bool mask = !fully_visible;
    float* tile_max = sc.tile_max.get();
    for (int64_t r = 0; r < rp; ++r) tile_max[r] = kNegInf;
    const int32_t j0i = static_cast<int32_t>(j0);
    if (has_cap) {
      if (has_alibi) {
        TransformScoresMasked<true, true>(mask, n, rp, j0i, pb.cap, pb.inv_cap, sc.slope.get(),
                                          sc.pos.get(), sc.lo.get(), sc.hi.get(), scores,
                                          tile_max);
      } else {
        TransformScoresMasked<true, false>(mask, n, rp, j0i, pb.cap, pb.inv_cap, sc.slope.get(),
                                           sc.pos.get(), sc.lo.get(), sc.hi.get(), scores,
                                           tile_max);
      }
    } else if (has_alibi) {
      TransformScoresMasked<false, true>(mask, n, rp, j0i, pb.cap, pb.inv_cap, sc.slope.get(),
                                         sc.pos.get(), sc.lo.get(), sc.hi.get(), scores,
                                         tile_max);
    } else {
      TransformScoresMasked<false, false>(mask, n, rp, j0i, pb.cap, pb.inv_cap, sc.slope.get(),
                                          sc.pos.get(), sc.lo.get(), sc.hi.get(), scores,
                                          tile_max);
    }

    // Online softmax: new running max, factor for what was accumulated so far, and the
    // subtrahend (0 for a row that has seen nothing yet, so that -inf - -inf never occurs).
    float* m = sc.m.get();
    float* l = sc.l.get();
    float* alpha = sc.alpha.get();
    float* sum = sc.sum.get();
    KVSTREAM_SIMD
    for (int64_t r = 0; r < rp; ++r) {
      const float m_new = m[r] < tile_max[r] ? tile_max[r] : m[r];
      alpha[r] = m_new == kNegInf ? 1.0f : ExpNonPositive(m[r] - m_new);
      tile_max[r] = m_new == kNegInf ? 0.0f : m_new;
      m[r] = m_new;
      sum[r] = 0.0f;
    }
    for (int jj = 0; jj < n; ++jj) {
      float* row = scores + jj * rp;
      KVSTREAM_SIMD
      for (int64_t r = 0; r < rp; ++r) {
        const float e = ExpNonPositive(row[r] - tile_max[r]);
        row[r] = e;
        sum[r] += e;
      }
    }
    KVSTREAM_SIMD
    for (int64_t r = 0; r < rp; ++r) l[r] = l[r] * alpha[r] + sum[r];
    for (int r = 0; r < rows; ++r) {
      if (alpha[r] == 1.0f) continue;
      float* o = sc.out.get() + r * ldv;
      const float a = alpha[r];
      KVSTREAM_SIMD
      for (int64_t d = 0; d < ldv; ++d) o[d] *= a;
    }

    // O += P * V with P(r, jj) = scores[jj][r].
    Gemm<Cfg, true>(rows, static_cast<int>(ldv), n, scores, 1, rp, sc.v_rows.get(), ldv,
                    sc.out.get(), ldv);
  }

  // Normalise and store; a row that saw no key (l == 0) gets zeros.
  const size_t o_elem = DTypeSize(p.out_dtype);
  for (int r = 0; r < rows; ++r) {
    const int64_t token = first_row + item.t_begin + r / group;
    const int h = g * group + r % group;
    char* dst =
        static_cast<char*>(p.out) + (token * p.o_token_stride + h * p.o_head_stride) * o_elem;
    const float inv = sc.l[r] > 0 ? 1.0f / sc.l[r] : 0.0f;
    const float* o = sc.out.get() + r * ldv;
    switch (p.out_dtype) {
      case DType::kFloat32: {
        float* d32 = reinterpret_cast<float*>(dst);
        KVSTREAM_SIMD
        for (int d = 0; d < pb.head_size_v; ++d) d32[d] = o[d] * inv;
        break;
      }
      case DType::kBFloat16: {
        uint16_t* d16 = reinterpret_cast<uint16_t*>(dst);
        for (int d = 0; d < pb.head_size_v; ++d) d16[d] = FloatToBFloat16(o[d] * inv);
        break;
      }
      case DType::kFloat16: {
        uint16_t* d16 = reinterpret_cast<uint16_t*>(dst);
        for (int d = 0; d < pb.head_size_v; ++d) d16[d] = FloatToHalf(o[d] * inv);
        break;
      }
      default:
        break;  // rejected by validation
    }
  }
}

using ItemFn = void (*)(const Problem&, const WorkItem&, Scratch&);

__attribute__((flatten)) void ProcessItemGeneric(const Problem& pb, const WorkItem& item,
                                                 Scratch& sc) {
  ProcessItem<GenericConfig>(pb, item, sc);
}
#if KVSTREAM_X86_DISPATCH
KVSTREAM_TARGET_AVX2 void ProcessItemAvx2(const Problem& pb, const WorkItem& item,
                                          Scratch& sc) {
  ProcessItem<Avx2Config>(pb, item, sc);
}
KVSTREAM_TARGET_AVX512 void ProcessItemAvx512(const Problem& pb, const WorkItem& item,
                                              Scratch& sc) {
  ProcessItem<Avx512Config>(pb, item, sc);
}
#endif

bool CpuSupports(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kGeneric:
      return true;
#if KVSTREAM_X86_DISPATCH
    case CpuIsa::kAvx2:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("bmi2");
    case CpuIsa::kAvx512:
      __builtin_cpu_init();
      return CpuSupports(CpuIsa::kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq");
#endif
    default:
      return false;
  }
}

ItemFn ItemFunction(CpuIsa isa) {
  switch (isa) {
#if KVSTREAM_X86_DISPATCH
    case CpuIsa::kAvx2: return &ProcessItemAvx2;
    case CpuIsa::kAvx512: return &ProcessItemAvx512;
#endif
    default: return &ProcessItemGeneric;
  }
}

const float* Fp8Table(DType dtype) {
  struct Tables {
    float e4m3[256];
    float e5m2[256];
    Tables() {
      for (int b = 0; b < 256; ++b) {
        e4m3[b] = Fp8E4M3ToFloat(static_cast<uint8_t>(b));
        e5m2[b] = Fp8E5M2ToFloat(static_cast<uint8_t>(b));
      }
    }
  };
  static const Tables* const tables = new Tables();
  if (dtype == DType::kFloat8E4M3) return tables->e4m3;
  if (dtype == DType::kFloat8E5M2) return tables->e5m2;
  return nullptr;
}

}  // namespace

const char* CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kGeneric: return "generic";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
  }
  return "unknown";
}

std::vector<CpuIsa> SupportedCpuIsas() {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : {CpuIsa::kGeneric, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (CpuSupports(isa)) isas.push_back(isa);
  }
  return isas;
}

absl::Status RunAttentionCpuWith(const PagedAttentionParams& p, CpuIsa isa, int num_threads) {
  RETURN_IF_ERROR(ValidatePagedAttention(p));
  if (p.cache.memory == MemoryKind::kDevice) {
    return absl::InvalidArgumentError("paged attention: the cpu backend needs a host cache");
  }
  if (!CpuSupports(isa)) {
    return absl::InvalidArgumentError(
        absl::StrCat("paged attention: this CPU cannot run the ", CpuIsaName(isa), " variant"));
  }

  Problem pb;
  pb.p = &p;
  pb.head_size = p.cache.spec.head_size;
  pb.head_size_v = p.cache.spec.head_size_v;
  pb.ldk = RoundUp(pb.head_size, kLanes);
  pb.ldv = RoundUp(pb.head_size_v, kLanes);
  pb.group = p.num_heads / p.cache.spec.num_kv_heads;
  pb.block_size = p.cache.spec.block_size;
  pb.tile_tokens = std::max(1, kTargetRows / pb.group);
  pb.cap = p.logits_soft_cap > 0 ? p.logits_soft_cap : 0.0f;
  pb.inv_cap = pb.cap > 0 ? 1.0f / pb.cap : 0.0f;
  pb.fp8_table = Fp8Table(p.cache.spec.dtype);
  pb.cache_elem = static_cast<int64_t>(DTypeSize(p.cache.spec.dtype));

  // Work items, the most expensive first so that dynamic scheduling ends evenly.
  std::vector<WorkItem> items;
  int64_t total_cost = 0;
  int max_tokens = 1;
  for (int32_t s = 0; s < p.num_seqs; ++s) {
    const int32_t query_len = p.query_start_loc[s + 1] - p.query_start_loc[s];
    const int64_t seq_len = p.seq_lens[s];
    for (int32_t t = 0; t < query_len; t += pb.tile_tokens) {
      const int32_t count = std::min(pb.tile_tokens, query_len - t);
      max_tokens = std::max(max_tokens, count);
      const int64_t last_pos = seq_len - query_len + t + count - 1;
      int64_t keys = p.causal ? last_pos + 1 : seq_len;
      if (p.sliding_window > 0) keys = std::min<int64_t>(keys, int64_t{p.sliding_window} + count);
      const int64_t cost = int64_t{count} * pb.group * keys * (pb.head_size + pb.head_size_v);
      for (int32_t g = 0; g < p.cache.spec.num_kv_heads; ++g) {
        items.push_back(WorkItem{s, g, t, count, cost});
        total_cost += cost;
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  pb.max_rows = max_tokens * pb.group;
  pb.max_rows_padded = RoundUp(pb.max_rows, kLanes);

  int threads = 1;
#ifdef _OPENMP
  threads = num_threads > 0 ? num_threads : omp_get_max_threads();
#endif
  if (total_cost < kMinParallelWork) threads = 1;
  threads = static_cast<int>(std::min<int64_t>(threads, static_cast<int64_t>(items.size())));
  threads = std::max(threads, 1);

  std::vector<Scratch> scratch(static_cast<size_t>(threads));
  for (Scratch& sc : scratch) {
    if (!sc.Allocate(pb)) {
      return absl::ResourceExhaustedError("paged attention: cannot allocate cpu scratch buffers");
    }
  }
  const ItemFn fn = ItemFunction(isa);
  const int64_t num_items = static_cast<int64_t>(items.size());
#ifdef _OPENMP
  if (threads > 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < num_items; ++i) {
      fn(pb, items[static_cast<size_t>(i)], scratch[static_cast<size_t>(omp_get_thread_num())]);
    }
    return absl::OkStatus();
  }
#endif
  for (int64_t i = 0; i < num_items; ++i) fn(pb, items[static_cast<size_t>(i)], scratch[0]);
  return absl::OkStatus();
}

}  // namespace internal

absl::Status RunAttentionCpu(const PagedAttentionParams& params) {
  const std::vector<internal::CpuIsa> isas = internal::SupportedCpuIsas();
  return internal::RunAttentionCpuWith(params, isas.back(), /*num_threads=*/0);
}

}  // namespace kvstream
