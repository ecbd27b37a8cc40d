// The online softmax of the CPU attention fast path: score transforms (soft cap, ALiBi,
// mask), the running max and sum, and the rescale of the output accumulated so far, for
// the wide and the narrow item layouts (fast.cc).
#ifndef KVSTREAM_ATTENTION_CPU_FAST_SOFTMAX_H_
#define KVSTREAM_ATTENTION_CPU_FAST_SOFTMAX_H_

#include <cstdint>

#include "kvstream/attention/backend.h"
#include "cpu/fast_prefetch.h"
#include "cpu/fast_problem.h"
#include "cpu/fast_target.h"
#include "cpu/vec_math.h"

namespace kvstream {
namespace internal {
namespace cpu_fast {

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

}  // namespace cpu_fast
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CPU_FAST_SOFTMAX_H_
