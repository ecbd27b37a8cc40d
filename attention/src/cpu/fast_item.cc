// ProcessItem, one work item of the CPU attention fast path, and its three
// instruction-set variants. The design (wide and narrow items, batch invariance, the
// prefetch of the next tile) is at the top of fast.cc; the kernels it calls are in the
// fast_*.h headers beside this file, all inline, so that each variant is one function
// compiled for its instruction set.
#include "cpu/fast_item.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kvstream/attention/backend.h"
#include "kvstream/common/dtype.h"
#include "kvstream/common/numeric.h"
#include "cpu/fast_gather.h"
#include "cpu/fast_gemm.h"
#include "cpu/fast_prefetch.h"
#include "cpu/fast_problem.h"
#include "cpu/fast_softmax.h"
#include "cpu/fast_target.h"
#include "cpu/fast_variants.h"

namespace kvstream {
namespace internal {
namespace cpu_fast {
namespace {

// How many of the next tile's keys a narrow tile has asked for by the end of each phase,
// roughly in proportion to the phase's time (tuned on the decode benchmark): V
// converted, K transposed, S = Q * K^T, softmax; the rest during O += P * V.
constexpr int kPrefetchByV = 12;
constexpr int kPrefetchByK = 36;
constexpr int kPrefetchByS = 44;
constexpr int kPrefetchBySoftmax = 50;
static_assert(kPrefetchBySoftmax <= kKeyTile, "the schedule must end within the tile");

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

}  // namespace

ItemFn ItemFunction(CpuIsa isa) {
  switch (isa) {
#if KVSTREAM_X86_DISPATCH
    case CpuIsa::kAvx2: return &ProcessItemAvx2;
    case CpuIsa::kAvx512: return &ProcessItemAvx512;
#endif
    default: return &ProcessItemGeneric;
  }
}

}  // namespace cpu_fast
}  // namespace internal
}  // namespace kvstream
