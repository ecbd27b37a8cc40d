// The CPU fast path of paged attention, RunAttentionCpu (semantics in backend.h; the
// reference in reference.cc is what it must agree with).
//
// Work is split into items (sequence, KV head, tile of query tokens). An item gathers the
// query rows of every head of its GQA group for its tokens (rows = tokens x group), then
// walks the block table in tiles of kKeyTile keys: each K and V tile is dequantised to
// float once and used by all rows, scores go through an online softmax (running max and
// sum, earlier output rescaled), and only tiles that some row can see are visited
// (causal: none past the item's last query; sliding window: none wholly before its first).
//
// Two shapes of item, chosen by row count, with the same arithmetic per row:
//   wide (prefill: up to kTargetRows rows)       narrow (decode, short chunks: <= 16 rows)
//   q_t     [ldk][rp]       Q^T, rows padded     q_rows  [rows][ldk]     Q
//   k_rows  [kKeyTile][ldk] K tile               kt      [ldk][kKeyTile] K tile transposed
//   scores  [kKeyTile][rp]  S^T = K * Q^T        s_rows  [rows][kKeyTile] S = Q * K^T
//   v_rows  [kKeyTile][ldv] V tile; out [rows][ldv] += P * V (both shapes)
// All products are "broadcast one operand, stream the other" register-blocked loops
// (MicroKernel). Wide items stream Q^T across rows; narrow ones stream K^T across keys,
// since a padded Q^T would leave most of each vector idle. Softmax statistics run across
// rows (wide) or across keys (narrow).
//
// BATCH INVARIANCE. The bits of a query row's output depend only on that row's query, its
// sequence's keys and values, and the layer's parameters: not on which other rows (tokens
// of the same sequence, other heads, other sequences) share its call or its item, on the
// thread count, or on decode versus prefill. Disaggregated serving depends on it: the
// decode worker computes the last prompt token as a 1-token query over the transferred
// cache and must match, bit for bit, the colocated run that computed the same token as a
// row of the whole-prompt prefill. It holds because a row's numbers come from one fixed
// sequence of float operations on its own data, whichever shape of item it lands in:
//   - a score is one chain of multiply-adds over d = 0 .. head_size-1 in order, in its own
//     MicroKernel accumulator (k * q in a wide item, q * k in a narrow one: the same
//     product); MulAdd makes every instantiation, whatever its blocking, use the same
//     operation (an explicit fma where the variant has one), and a chain split into
//     chunks only stores and reloads its accumulator;
//   - KV tiles are aligned to position 0 (tile t holds keys t*kKeyTile ..), whatever the
//     item's first query, so a row meets each key in the same tile with the same others;
//   - scores are transformed (cap, ALiBi, mask) by TransformScore and exponentiated by
//     ExpNonPositive, the running max and rescale factor come from OnlineStep, and a
//     row's exponentials are summed in key order, in both shapes (the same inline code,
//     which the compiler contracts alike; the tests hold both shapes to the same bits);
//     a key the row cannot see scores -inf and adds exactly +0, so a tile that ends at
//     the row (decode) and one that goes on (prefill) sum alike;
//   - a tile a row cannot see at all changes nothing for it (alpha = exp(0) = 1 exactly,
//     p = +0), so visiting it (because other rows of the item see it) is as good as
//     skipping it;
//   - O += P * V adds a tile's keys in order per (row, column); keys beyond the row's
//     range add p * v = +-0, which can change only the sign of an exact zero, so the store
//     adds +0.0f (-0 becomes +0, nothing else changes). V must be finite: 0 * inf is NaN.
// The guarantee is per build and instruction-set variant: the variants' vector code
// differs (the generic one has no fma), so they agree with the reference, not bit for bit
// with each other. A variant is picked per machine, so the workers of one machine agree.
//
// Decode reads every byte of K and V once, from blocks scattered over memory, so the row
// addresses of the next tile are computed ahead and prefetched while the current tile is
// computed, a key at a time at points spread over the tile (TilePrefetcher).
//
// The same C++ is compiled three times (generic, AVX2, AVX-512) through target attributes
// and picked at run time, because the library is built for a baseline x86-64 and these
// loops are worth 4-8x more with wide vectors. The transposes use intrinsics (8x8 and
// 16x16 register transposes, the conversion from 16-bit K fused into the loads): as
// plain loops they compile to scalar stores.
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
// A maximum the compiler may compute in any order (a maximum has one answer in any order).
#define KVSTREAM_SIMD_MAX(var) KVSTREAM_PRAGMA(omp simd reduction(max : var))
#elif defined(__clang__)
// clang defines __GNUC__ but knows no `GCC ivdep`; it vectorizes these loops by itself.
#define KVSTREAM_SIMD
#define KVSTREAM_SIMD_MAX(var)
#elif defined(__GNUC__)
#define KVSTREAM_SIMD _Pragma("GCC ivdep")
#define KVSTREAM_SIMD_MAX(var)
#else
#define KVSTREAM_SIMD
#define KVSTREAM_SIMD_MAX(var)
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
// Items with at most this many rows are narrow (see the top of the file).
constexpr int kNarrowMaxRows = kLanes;
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
// written, so they stay zero; zero_row stands in for the keys that pad a K tile to a
// multiple of kLanes (its bytes read as 0 in every cache type).
struct Scratch {
  AlignedBuffer<float> q_rows, q_t, k_rows, kt, v_rows, s_rows, scores, out, zero_row;
  AlignedBuffer<float> m, l, alpha, tile_max, sub, sum, slope;
  AlignedBuffer<int32_t> pos, lo, hi;
  AlignedBuffer<float> k_table, v_table;
  // Row addresses of the current and the next KV tile.
  const char* k_ptrs[2][kKeyTile];
  const char* v_ptrs[2][kKeyTile];
  const char* k_row_ptrs[kKeyTile];  // rows of k_rows, for transposing converted tiles
  std::vector<const char*> q_row_ptrs;  // rows of q_rows, for transposing Q

  bool Allocate(const Problem& pb) {
    const int64_t rp = pb.max_rows_padded;
    q_rows = AllocZeroed<float>(pb.max_rows * pb.ldk);
    q_t = AllocZeroed<float>(pb.ldk * rp);
    k_rows = AllocZeroed<float>(kKeyTile * pb.ldk);
    kt = AllocZeroed<float>(pb.ldk * kKeyTile);
    v_rows = AllocZeroed<float>(kKeyTile * pb.ldv);
    s_rows = AllocZeroed<float>(kNarrowMaxRows * kKeyTile);
    scores = AllocZeroed<float>(kKeyTile * rp);
    out = AllocZeroed<float>(pb.max_rows * pb.ldv);
    zero_row = AllocZeroed<float>(pb.ldk);
    m = AllocZeroed<float>(rp);
    l = AllocZeroed<float>(rp);
    alpha = AllocZeroed<float>(rp);
    tile_max = AllocZeroed<float>(rp);
    sub = AllocZeroed<float>(rp);
    sum = AllocZeroed<float>(rp);
    slope = AllocZeroed<float>(rp);
    pos = AllocZeroed<int32_t>(rp);
    lo = AllocZeroed<int32_t>(rp);
    hi = AllocZeroed<int32_t>(rp);
    k_table = AllocZeroed<float>(256);
    v_table = AllocZeroed<float>(256);
    if (!(q_rows && q_t && k_rows && kt && v_rows && s_rows && scores && out && zero_row && m &&
          l && alpha && tile_max && sub && sum && slope && pos && lo && hi && k_table && v_table)) {
      return false;
    }
    for (int jj = 0; jj < kKeyTile; ++jj) {
      k_row_ptrs[jj] = reinterpret_cast<const char*>(k_rows.get() + jj * pb.ldk);
    }
    q_row_ptrs.resize(static_cast<size_t>(rp));
    return true;
  }
};

// ---- prefetching ----

KVSTREAM_INLINE void PrefetchRow(const char* row, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
}

// The next tile's rows, asked for while this one is computed: they sit in blocks scattered
// over memory, which the hardware prefetchers do not guess, and decode is bound by them.
// The narrow path asks a key (its K and V rows) at a time at points spread over the whole
// tile, because the core has few miss buffers: a burst fills them, stalls, and then leaves
// the memory system idle for the rest of the tile.
struct TilePrefetcher {
  const char* const* k = nullptr;
  const char* const* v = nullptr;
  int n = 0;       // keys in the next tile; 0: nothing to prefetch
  int issued = 0;  // keys asked for so far
  int64_t k_bytes = 0;
  int64_t v_bytes = 0;

  // Asks for the keys before `end` not yet asked for.
  KVSTREAM_INLINE void Upto(int end) {
    end = std::min(end, n);
    for (; issued < end; ++issued) {
      PrefetchRow(k[issued], k_bytes);
      PrefetchRow(v[issued], v_bytes);
    }
  }
  // Step `step` of `steps` of a phase that owns the keys [from, to).
  KVSTREAM_INLINE void Spread(int step, int steps, int from, int to) {
    Upto(from + (to - from) * (step + 1) / steps);
  }
};

// How many of the next tile's keys a narrow tile has asked for by the end of each phase,
// roughly in proportion to the phase's time (tuned on the decode benchmark): V
// converted, K transposed, S = Q * K^T, softmax; the rest during O += P * V.
constexpr int kPrefetchByV = 12;
constexpr int kPrefetchByK = 36;
constexpr int kPrefetchByS = 44;
constexpr int kPrefetchBySoftmax = 50;
static_assert(kPrefetchBySoftmax <= kKeyTile, "the schedule must end within the tile");

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

// Converts n rows of `width` elements into dst (row stride ld); with a prefetcher, spreads
// the keys [0, pf_to) of the next tile over the rows.
template <DType kDType>
KVSTREAM_INLINE void GatherRowsAs(const char* const* rows, int n, int width, int64_t dim_stride,
                                  const float* table, float* dst, int64_t ld,
                                  TilePrefetcher* pf, int pf_to) {
  for (int i = 0; i < n; ++i) {
    if (pf != nullptr) pf->Spread(i, n, 0, pf_to);
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
                                int64_t dim_stride, const float* table, float* dst, int64_t ld,
                                TilePrefetcher* pf = nullptr, int pf_to = 0) {
  switch (dtype) {
    case DType::kFloat32:
      GatherRowsAs<DType::kFloat32>(rows, n, width, dim_stride, table, dst, ld, pf, pf_to);
      break;
    case DType::kFloat16:
      GatherRowsAs<DType::kFloat16>(rows, n, width, dim_stride, table, dst, ld, pf, pf_to);
      break;
    case DType::kBFloat16:
      GatherRowsAs<DType::kBFloat16>(rows, n, width, dim_stride, table, dst, ld, pf, pf_to);
      break;
    case DType::kFloat8E4M3:
      GatherRowsAs<DType::kFloat8E4M3>(rows, n, width, dim_stride, table, dst, ld, pf, pf_to);
      break;
    case DType::kFloat8E5M2:
      GatherRowsAs<DType::kFloat8E5M2>(rows, n, width, dim_stride, table, dst, ld, pf, pf_to);
      break;
    default:
      break;  // rejected by validation
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

// ---- transposes (K tiles of narrow items, Q of wide ones) ----
//
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

// Register blocking per instruction set: kMR rows of broadcast operand by kNB columns of
// streamed operand stay in registers (AVX-512: 4 x 4 zmm; AVX2: 6 x 2 ymm; SSE2: 4 x 2 xmm).
// kFma: MicroKernel accumulates with fma. kRawK: TransposeRows reads float32, float16 and
// bfloat16 K rows from the cache itself (with head_size a multiple of kLanes); other tiles
// are converted into k_rows first and transposed from there as float32.
struct GenericConfig {
  static constexpr int kMR = 4;
  static constexpr int kNB = 8;
  static constexpr bool kFma = false;
  static constexpr bool kRawK = false;
  static void TransposeRows(DType /*src: always float32*/, const char* const* rows, int n,
                            int dims, float* dst, int64_t ldt, TilePrefetcher& pf, int pf_from,
                            int pf_to) {
    TransposeRowsGeneric(rows, n, dims, dst, ldt, pf, pf_from, pf_to);
  }
};
#if KVSTREAM_X86_DISPATCH
struct Avx2Config {
  static constexpr int kMR = 6;
  static constexpr int kNB = 16;
  static constexpr bool kFma = true;
  static constexpr bool kRawK = true;
  KVSTREAM_TARGET_AVX2 static void TransposeRows(DType src, const char* const* rows, int n,
                                                 int dims, float* dst, int64_t ldt,
                                                 TilePrefetcher& pf, int pf_from, int pf_to) {
    switch (src) {
      case DType::kBFloat16:
        TransposeRowsAvx2<DType::kBFloat16>(rows, n, dims, dst, ldt, pf, pf_from, pf_to);
        break;
      case DType::kFloat16:
        TransposeRowsAvx2<DType::kFloat16>(rows, n, dims, dst, ldt, pf, pf_from, pf_to);
        break;
      default:
        TransposeRowsAvx2<DType::kFloat32>(rows, n, dims, dst, ldt, pf, pf_from, pf_to);
        break;
    }
  }
};
struct Avx512Config {
  static constexpr int kMR = 4;
  static constexpr int kNB = 64;
  static constexpr bool kFma = true;
  static constexpr bool kRawK = true;
  KVSTREAM_TARGET_AVX512 static void TransposeRows(DType src, const char* const* rows, int n,
                                                   int dims, float* dst, int64_t ldt,
                                                   TilePrefetcher& pf, int pf_from, int pf_to) {
    switch (src) {
      case DType::kBFloat16:
        TransposeRowsAvx512<DType::kBFloat16>(rows, n, dims, dst, ldt, pf, pf_from, pf_to);
        break;
      case DType::kFloat16:
        TransposeRowsAvx512<DType::kFloat16>(rows, n, dims, dst, ldt, pf, pf_from, pf_to);
        break;
      default:
        TransposeRowsAvx512<DType::kFloat32>(rows, n, dims, dst, ldt, pf, pf_from, pf_to);
        break;
    }
  }
};
#endif

// ---- softmax ----
//
// Two layouts, one arithmetic. Wide items keep S^T (keys major) and run the statistics
// of all rows as vectors; narrow items keep S (rows major) and run each row's keys as
// vectors. Both compute a score through TransformScore and ExpNonPositive and a row's
// statistics through OnlineStep, and both sum a row's exponentials over the keys in
// position order (the wide layout per lane, the narrow one as a scalar chain), so a row
// gets the same bits in either. A key beyond what the row may see scores -inf and adds
// exactly +0 at the end of that chain, so an item whose tile ends earlier (fewer keys)
// gets the same sums as one that goes further.

// Soft cap, ALiBi and mask of the score s of key j for a query at qp that sees keys
// [lo, hi]. The mask is applied even where every row sees the whole tile: one
// instantiation per feature set, so one sequence of operations per score.
template <bool kCap, bool kAlibi>
KVSTREAM_INLINE float TransformScore(float s, int32_t j, float cap, float inv_cap, float slope,
                                     int32_t qp, int32_t lo, int32_t hi) {
  if constexpr (kCap) s = cap * TanhVec(s * inv_cap);
  if constexpr (kAlibi) s += slope * static_cast<float>(j - qp);
  return (j >= lo && j <= hi) ? s : kNegInf;
}

// One row's online softmax step: the new running max from the old one and the tile's,
// the factor alpha for what was accumulated so far, and the subtrahend of this tile's
// exponentials (0 for a row that has seen nothing yet, so that -inf - -inf never occurs).
// A row that sees none of the tile keeps its max, gets alpha = exp(0) = 1 exactly and
// p = exp(-inf) = +0 for every key: the tile changes nothing for it, as if skipped.
KVSTREAM_INLINE void OnlineStep(float m, float tile_max, float* m_new, float* alpha,
                                float* sub) {
  const float mx = m < tile_max ? tile_max : m;
  *alpha = mx == kNegInf ? 1.0f : ExpNonPositive(m - mx);
  *sub = mx == kNegInf ? 0.0f : mx;
  *m_new = mx;
}

// Wide layout: scores[jj][r] for jj < n, all rp rows (padding rows included: they copy a
// real row's constants and are never stored). P replaces S; m, l and alpha move on.
template <bool kCap, bool kAlibi>
KVSTREAM_INLINE void SoftmaxWide(const Problem& pb, int n, int64_t rp, int32_t j0,
                                 Scratch& sc) {
  float* scores = sc.scores.get();
  float* tile_max = sc.tile_max.get();
  float* sub = sc.sub.get();
  float* sum = sc.sum.get();
  const float* slope = sc.slope.get();
  const int32_t* pos = sc.pos.get();
  const int32_t* lo = sc.lo.get();
  const int32_t* hi = sc.hi.get();
  for (int64_t r = 0; r < rp; ++r) tile_max[r] = kNegInf;
  for (int jj = 0; jj < n; ++jj) {
    float* row = scores + jj * rp;
    const int32_t j = j0 + jj;
    KVSTREAM_SIMD
    for (int64_t r = 0; r < rp; ++r) {
      const float s =
          TransformScore<kCap, kAlibi>(row[r], j, pb.cap, pb.inv_cap, slope[r], pos[r], lo[r],
                                       hi[r]);
      row[r] = s;
      tile_max[r] = tile_max[r] < s ? s : tile_max[r];
    }
  }
  float* m = sc.m.get();
  float* l = sc.l.get();
  float* alpha = sc.alpha.get();
  KVSTREAM_SIMD
  for (int64_t r = 0; r < rp; ++r) {
    OnlineStep(m[r], tile_max[r], &m[r], &alpha[r], &sub[r]);
    sum[r] = 0.0f;
  }
  for (int jj = 0; jj < n; ++jj) {
    float* row = scores + jj * rp;
    KVSTREAM_SIMD
    for (int64_t r = 0; r < rp; ++r) {
      const float e = ExpNonPositive(row[r] - sub[r]);
      row[r] = e;
      sum[r] += e;
    }
  }
  KVSTREAM_SIMD
  for (int64_t r = 0; r < rp; ++r) l[r] = l[r] * alpha[r] + sum[r];
}

// Narrow layout: s_rows[r][jj] for r < rows, jj < n. Same results per row as SoftmaxWide.
// Spreads the prefetcher's keys [pf_from, pf_to) over the rows.
template <bool kCap, bool kAlibi>
KVSTREAM_INLINE void SoftmaxNarrow(const Problem& pb, int rows, int n, int32_t j0,
                                   Scratch& sc, TilePrefetcher& pf, int pf_from, int pf_to) {
  for (int r = 0; r < rows; ++r) {
    pf.Spread(r, rows, pf_from, pf_to);
    float* s = sc.s_rows.get() + r * kKeyTile;
    const float slope = sc.slope[r];
    const int32_t qp = sc.pos[r];
    const int32_t lo = sc.lo[r];
    const int32_t hi = sc.hi[r];
    float tile_max = kNegInf;
    KVSTREAM_SIMD_MAX(tile_max)
    for (int jj = 0; jj < n; ++jj) {
      const float x =
          TransformScore<kCap, kAlibi>(s[jj], j0 + jj, pb.cap, pb.inv_cap, slope, qp, lo, hi);
      s[jj] = x;
      tile_max = tile_max < x ? x : tile_max;
    }
    float m_new, alpha, sub;
    OnlineStep(sc.m[r], tile_max, &m_new, &alpha, &sub);
    KVSTREAM_SIMD
    for (int jj = 0; jj < n; ++jj) s[jj] = ExpNonPositive(s[jj] - sub);
    // In key order, as each lane of SoftmaxWide adds them: no reduction clause.
    float sum = 0.0f;
    for (int jj = 0; jj < n; ++jj) sum += s[jj];
    sc.l[r] = sc.l[r] * alpha + sum;
    sc.m[r] = m_new;
    sc.alpha[r] = alpha;
  }
}

// Dispatch on the features, which are per call.
template <bool kNarrow>
KVSTREAM_INLINE void SoftmaxTile(const Problem& pb, int rows, int n, int64_t rp, int32_t j0,
                                 Scratch& sc, TilePrefetcher* pf = nullptr, int pf_from = 0,
                                 int pf_to = 0) {
  const bool has_cap = pb.cap > 0;
  const bool has_alibi = pb.p->alibi_slopes != nullptr;
  if constexpr (kNarrow) {
    if (has_cap) {
      if (has_alibi) {
        SoftmaxNarrow<true, true>(pb, rows, n, j0, sc, *pf, pf_from, pf_to);
      } else {
        SoftmaxNarrow<true, false>(pb, rows, n, j0, sc, *pf, pf_from, pf_to);
      }
    } else if (has_alibi) {
      SoftmaxNarrow<false, true>(pb, rows, n, j0, sc, *pf, pf_from, pf_to);
    } else {
      SoftmaxNarrow<false, false>(pb, rows, n, j0, sc, *pf, pf_from, pf_to);
    }
  } else {
    if (has_cap) {
      if (has_alibi) {
        SoftmaxWide<true, true>(pb, n, rp, j0, sc);
      } else {
        SoftmaxWide<true, false>(pb, n, rp, j0, sc);
      }
    } else if (has_alibi) {
      SoftmaxWide<false, true>(pb, n, rp, j0, sc);
    } else {
      SoftmaxWide<false, false>(pb, n, rp, j0, sc);
    }
  }
}

// out[r] *= alpha[r] for the item's rows; alpha == 1 leaves a row as it is.
KVSTREAM_INLINE void RescaleOutput(int rows, int64_t ldv, Scratch& sc) {
  for (int r = 0; r < rows; ++r) {
    if (sc.alpha[r] == 1.0f) continue;
    float* o = sc.out.get() + r * ldv;
    const float a = sc.alpha[r];
    KVSTREAM_SIMD
    for (int64_t d = 0; d < ldv; ++d) o[d] *= a;
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
  const bool narrow = rows <= kNarrowMaxRows;
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
  const char* const zero_row = reinterpret_cast<const char*>(sc.zero_row.get());
  if (!narrow) {
    // Q^T, padding rows zero.
    for (int64_t r = 0; r < rp; ++r) {
      sc.q_row_ptrs[r] =
          r < rows ? reinterpret_cast<const char*>(sc.q_rows.get() + r * ldk) : zero_row;
    }
    TilePrefetcher none;
    Cfg::TransposeRows(DType::kFloat32, sc.q_row_ptrs.data(), static_cast<int>(rp),
                       static_cast<int>(ldk), sc.q_t.get(), rp, none, 0, 0);
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

  // Keys any row of the item can see, and the first tile: tiles are aligned to position 0
  // whatever the item's first query, so that every item meets a key in the same tile.
  int64_t key_lo = 0;
  int64_t key_hi = seq_len - 1;
  if (p.causal) key_hi = std::min<int64_t>(key_hi, pos_last);
  if (window > 0) {
    key_lo = std::max<int64_t>(0, pos_first - window + 1);
    if (!p.causal) key_hi = std::min<int64_t>(key_hi, int64_t{pos_last} + window - 1);
  }
  const int64_t tile_lo = key_lo / kKeyTile * kKeyTile;

  const int64_t k_row_bytes = pb.head_size * pb.cache_elem;
  const int64_t v_row_bytes = pb.head_size_v * pb.cache_elem;
  const bool prefetch = cache.k_strides.dim == 1 && cache.v_strides.dim == 1;
  const DType cache_dtype = cache.spec.dtype;
  const bool raw_k = Cfg::kRawK && narrow && cache.k_strides.dim == 1 &&
                     pb.head_size % kLanes == 0 &&
                     (cache_dtype == DType::kFloat32 || cache_dtype == DType::kFloat16 ||
                      cache_dtype == DType::kBFloat16);
  int cur = 0;
  if (tile_lo <= key_hi) {
    const int first_n = static_cast<int>(std::min<int64_t>(kKeyTile, key_hi - tile_lo + 1));
    TileRows(pb, cache.k, cache.k_strides, block_row, g, tile_lo, first_n, sc.k_ptrs[0]);
    TileRows(pb, cache.v, cache.v_strides, block_row, g, tile_lo, first_n, sc.v_ptrs[0]);
  }
  for (int64_t j0 = tile_lo; j0 <= key_hi; j0 += kKeyTile) {
    const int n = static_cast<int>(std::min<int64_t>(kKeyTile, key_hi - j0 + 1));
    const char** k_ptrs = sc.k_ptrs[cur];
    const char** v_ptrs = sc.v_ptrs[cur];
    TilePrefetcher pf;
    if (j0 + kKeyTile <= key_hi) {
      const int64_t next_j0 = j0 + kKeyTile;
      const int next_n = static_cast<int>(std::min<int64_t>(kKeyTile, key_hi - next_j0 + 1));
      TileRows(pb, cache.k, cache.k_strides, block_row, g, next_j0, next_n, sc.k_ptrs[cur ^ 1]);
      TileRows(pb, cache.v, cache.v_strides, block_row, g, next_j0, next_n, sc.v_ptrs[cur ^ 1]);
      if (prefetch) {
        pf.k = sc.k_ptrs[cur ^ 1];
        pf.v = sc.v_ptrs[cur ^ 1];
        pf.n = next_n;
        pf.k_bytes = k_row_bytes;
        pf.v_bytes = v_row_bytes;
      }
    }
    cur ^= 1;
    const int32_t j0i = static_cast<int32_t>(j0);

    if (narrow) {
      // V first: its rows were asked for during the previous tile.
      GatherRows(cache_dtype, v_ptrs, n, pb.head_size_v, cache.v_strides.dim,
                 sc.v_table.get(), sc.v_rows.get(), ldv, &pf, kPrefetchByV);
      // K^T. Keys n .. n_padded-1 pad the tile to whole vectors: zeros (raw) or an earlier
      // tile's rows (converted); their scores are computed and never read.
      const int n_padded = static_cast<int>(RoundUp(n, kLanes));
      if (raw_k) {
        for (int jj = n; jj < n_padded; ++jj) k_ptrs[jj] = zero_row;
        Cfg::TransposeRows(cache_dtype, k_ptrs, n_padded, pb.head_size, sc.kt.get(), kKeyTile,
                           pf, kPrefetchByV, kPrefetchByK);
      } else {
        GatherRows(cache_dtype, k_ptrs, n, pb.head_size, cache.k_strides.dim,
                   sc.k_table.get(), sc.k_rows.get(), ldk);
        Cfg::TransposeRows(DType::kFloat32, sc.k_row_ptrs, n_padded, static_cast<int>(ldk),
                           sc.kt.get(), kKeyTile, pf, kPrefetchByV, kPrefetchByK);
      }
      // S = Q * K^T, vectorised across keys, in chunks of dimensions with prefetches
      // between them: each score still accumulates over d in order (a chunk stores the
      // accumulator, the next reloads it).
      constexpr int kDimChunk = 32;
      const int d_chunks = (pb.head_size + kDimChunk - 1) / kDimChunk;
      for (int c = 0; c < d_chunks; ++c) {
        pf.Spread(c, d_chunks, kPrefetchByK, kPrefetchByS);
        const int d0 = c * kDimChunk;
        const int dn = std::min(kDimChunk, pb.head_size - d0);
        if (c == 0) {
          Gemm<Cfg, false>(rows, n_padded, dn, sc.q_rows.get(), ldk, 1, sc.kt.get(), kKeyTile,
                           sc.s_rows.get(), kKeyTile);
        } else {
          Gemm<Cfg, true>(rows, n_padded, dn, sc.q_rows.get() + d0, ldk, 1,
                          sc.kt.get() + d0 * kKeyTile, kKeyTile, sc.s_rows.get(), kKeyTile);
        }
      }
      SoftmaxTile<true>(pb, rows, n, rp, j0i, sc, &pf, kPrefetchByS, kPrefetchBySoftmax);
      RescaleOutput(rows, ldv, sc);
      // O += P * V in chunks of kLanes keys, with the rest of the prefetches between them.
      // Each (row, column) still accumulates over the keys in order: splitting the key
      // loop only stores and reloads the accumulator.
      const int chunks = n_padded / kLanes;
      for (int c = 0; c < chunks; ++c) {
        pf.Spread(c, chunks, kPrefetchBySoftmax, kKeyTile);
        const int c0 = c * kLanes;
        Gemm<Cfg, true>(rows, static_cast<int>(ldv), std::min(kLanes, n - c0),
                        sc.s_rows.get() + c0, kKeyTile, 1, sc.v_rows.get() + c0 * ldv, ldv,
                        sc.out.get(), ldv);
      }
      pf.Upto(kKeyTile);
    } else {
      // S^T = K * Q^T, vectorised across rows; compute-bound, so the prefetches go at once.
      pf.Upto(kKeyTile);
      GatherRows(cache_dtype, v_ptrs, n, pb.head_size_v, cache.v_strides.dim,
                 sc.v_table.get(), sc.v_rows.get(), ldv);
      GatherRows(cache_dtype, k_ptrs, n, pb.head_size, cache.k_strides.dim, sc.k_table.get(),
                 sc.k_rows.get(), ldk);
      Gemm<Cfg, false>(n, static_cast<int>(rp), pb.head_size, sc.k_rows.get(), ldk, 1,
                       sc.q_t.get(), rp, sc.scores.get(), rp);
      SoftmaxTile<false>(pb, rows, n, rp, j0i, sc);
      RescaleOutput(rows, ldv, sc);
      // O += P * V with P(r, jj) = scores[jj][r].
      Gemm<Cfg, true>(rows, static_cast<int>(ldv), n, sc.scores.get(), 1, rp,
                      sc.v_rows.get(), ldv, sc.out.get(), ldv);
    }
  }

  // Normalise and store; a row that saw no key (l == 0) gets zeros. "+ 0.0f" turns -0 into
  // +0 and changes nothing else: the sign of an exact zero is the one thing that the
  // p = +0 terms of keys beyond a row's range (present in some items, not in others) can
  // change.
  const size_t o_elem = DTypeSize(p.out_dtype);
  for (int r = 0; r < rows; ++r) {
    const int64_t token = first_row + item.t_begin + r / group;
    const int h = g * group + r % group;
    char* dst =
        static_cast<char*>(p.out) + (token * p.o_token_stride + h * p.o_head_stride) * o_elem;
    const float inv = sc.l[r] > 0 ? 1.0f / sc.l[r] : 0.0f;
    float* o = sc.out.get() + r * ldv;
    KVSTREAM_SIMD
    for (int d = 0; d < pb.head_size_v; ++d) o[d] = o[d] * inv + 0.0f;
    switch (p.out_dtype) {
      case DType::kFloat32:
        std::memcpy(dst, o, sizeof(float) * static_cast<size_t>(pb.head_size_v));
        break;
      case DType::kBFloat16: {
        uint16_t* d16 = reinterpret_cast<uint16_t*>(dst);
        for (int d = 0; d < pb.head_size_v; ++d) d16[d] = FloatToBFloat16(o[d]);
        break;
      }
      case DType::kFloat16: {
        uint16_t* d16 = reinterpret_cast<uint16_t*>(dst);
        for (int d = 0; d < pb.head_size_v; ++d) d16[d] = FloatToHalf(o[d]);
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

  // An explicit thread count is taken as given (tests use it to put small calls on a team).
  int threads = 1;
#ifdef _OPENMP
  threads = num_threads > 0 ? num_threads : omp_get_max_threads();
#endif
  if (num_threads <= 0 && total_cost < kMinParallelWork) threads = 1;
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
