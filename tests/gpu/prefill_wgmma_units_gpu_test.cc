// The wgmma prefill kernel's work split (attention/src/cuda/prefill_wgmma_units.cuh),
// compiled by the host compiler: which units each CTA of a grid takes, one per CTA or
// persistent, and which rows and key tiles a unit gives each CTA of it. Needs no GPU: the
// kernel's GPU tests check the outputs; these check, over many more grid sizes and batches
// than a GPU run can afford, that every packed row of every (sequence, KV head) is computed
// exactly once, by a CTA that walks every key tile its rows see.
#define KVSTREAM_CUDA_EMULATION 1

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "cuda/kernel_params.h"
#include "cuda/prefill_wgmma_config.cuh"
#include "warp_emulator.h"
// The kernel's headers after the emulator's definitions.
#include "cuda/prefill_wgmma_units.cuh"

namespace kvstream {
namespace {

namespace pw = internal::prefill_wgmma;

// Every unit a persistent grid of `clusters` CTAs (pairs) takes, per CTA, in its order.
std::vector<std::vector<int>> PersistentUnits(int total, int clusters) {
  internal::PagedKernelParams p{};
  p.num_kv_heads = 1;
  p.num_seqs = 1;
  pw::PrefillWgmmaArgs a{};
  a.num_m_tiles = total;
  a.persistent = 1;
  std::vector<std::vector<int>> taken(clusters);
  for (int c = 0; c < clusters; ++c) {
    const pw::UnitWalk walk = pw::MakeUnitWalk<false>(p, a, c, clusters, 0);
    int u = 0;
    for (int r = 0; walk.At(r, &u); ++r) {
      EXPECT_LT(r, total + 1) << "the walk does not end";
      if (r > total) break;
      if (u >= 0) taken[c].push_back(u);
    }
  }
  return taken;
}

TEST(PrefillWgmmaUnitsTest, PersistentGridTakesEveryUnitOnce) {
  for (int total : {1, 2, 5, 64, 131, 132, 133, 263, 264, 1000, 2049}) {
    for (int clusters : {1, 2, 3, 7, 66, 132, 3000}) {
      SCOPED_TRACE(absl::StrCat(total, " units, ", clusters, " CTAs"));
      const std::vector<std::vector<int>> taken = PersistentUnits(total, clusters);
      std::vector<int> count(total, 0);
      for (int c = 0; c < clusters; ++c) {
        for (size_t r = 0; r < taken[c].size(); ++r) {
          const int u = taken[c][r];
          ASSERT_GE(u, 0);
          ASSERT_LT(u, total);
          ++count[u];
          // Round r of the serpentine: the c-th unit of the round forwards, then backwards.
          const int offset = u % clusters;
          EXPECT_EQ(u / clusters, static_cast<int>(r)) << "CTA " << c << " skipped a round";
          EXPECT_EQ(offset, (r & 1) != 0 ? clusters - 1 - c : c) << "CTA " << c;
        }
      }
      for (int u = 0; u < total; ++u) EXPECT_EQ(count[u], 1) << "unit " << u;
    }
  }
}

// Units of non-increasing length (the order a causal sequence's row tiles come in): the
// serpentine leaves any two CTAs' total work at most one unit's length apart.
TEST(PrefillWgmmaUnitsTest, SerpentineBalancesDecreasingUnits) {
  for (int total : {10, 133, 256, 2048}) {
    for (int clusters : {3, 7, 132}) {
      SCOPED_TRACE(absl::StrCat(total, " units, ", clusters, " CTAs"));
      std::vector<int64_t> length(total);
      for (int u = 0; u < total; ++u) length[u] = total - u;  // the causal staircase
      const std::vector<std::vector<int>> taken = PersistentUnits(total, clusters);
      int64_t most = 0;
      int64_t least = INT64_MAX;
      for (const std::vector<int>& units : taken) {
        int64_t work = 0;
        for (int u : units) work += length[u];
        most = std::max(most, work);
        least = std::min(least, work);
      }
      EXPECT_LE(most - least, length[0]);
    }
  }
}

TEST(PrefillWgmmaUnitsTest, OnePerCtaGridTakesItsOwnUnit) {
  internal::PagedKernelParams p{};
  p.num_kv_heads = 3;
  p.num_seqs = 4;
  pw::PrefillWgmmaArgs a{};
  a.num_m_tiles = 6;
  for (bool pair : {false, true}) {
    const int grid_x = p.num_kv_heads * a.num_m_tiles;
    std::vector<int> count(static_cast<size_t>(grid_x / (pair ? 2 : 1)) * p.num_seqs, 0);
    for (int y = 0; y < p.num_seqs; ++y) {
      for (int x = 0; x < grid_x; ++x) {
        const pw::UnitWalk walk = pair ? pw::MakeUnitWalk<true>(p, a, x, grid_x, y)
                                       : pw::MakeUnitWalk<false>(p, a, x, grid_x, y);
        int u = -1;
        ASSERT_TRUE(walk.At(0, &u));
        ASSERT_GE(u, 0);
        ASSERT_LT(u, static_cast<int>(count.size()));
        ++count[u];
        EXPECT_FALSE(walk.At(1, &u)) << "a CTA of a per-unit grid takes one unit";
      }
    }
    // Pairs: both CTAs of a cluster take the unit.
    for (int c : count) EXPECT_EQ(c, pair ? 2 : 1);
  }
}

// A varlen batch: (cached keys, query rows) per sequence.
struct Batch {
  std::vector<int32_t> query_start_loc;
  std::vector<int32_t> seq_lens;
  int max_query_len = 0;
  int max_seq_len = 0;
};

Batch MakeBatch(const std::vector<std::pair<int, int>>& seqs) {
  Batch b;
  b.query_start_loc.push_back(0);
  for (const auto& [context, query_len] : seqs) {
    b.query_start_loc.push_back(b.query_start_loc.back() + query_len);
    b.seq_lens.push_back(context + query_len);
    b.max_query_len = std::max(b.max_query_len, query_len);
    b.max_seq_len = std::max(b.max_seq_len, context + query_len);
  }
  return b;
}

// Every unit of a grid (one per CTA and persistent, single CTAs and pairs, both orders) over
// a ragged batch: each packed row of each (sequence, KV head) belongs to exactly one CTA,
// the key tiles that CTA walks hold every key its rows see, the two CTAs of a pair walk the
// same tiles, and a unit with no rows walks none.
template <bool kPair>
void ExpectUnitsCoverBatch(bool causal, int window, bool heads_outer) {
  constexpr int kBlockM = 128;
  constexpr int kBlockN = 128;
  const Batch b = MakeBatch({{0, 1},     {0, 200},  {127, 1},  {128, 130}, {3, 300},
                             {5, 0},     {0, 129},  {1000, 64}, {31, 7},   {0, 1024}});
  internal::PagedKernelParams p{};
  p.num_seqs = static_cast<int32_t>(b.seq_lens.size());
  p.num_kv_heads = 2;
  p.num_heads = 6;  // 3 query heads per KV head: row tiles end inside a token's heads
  p.query_start_loc = b.query_start_loc.data();
  p.seq_lens = b.seq_lens.data();
  p.num_tokens = b.query_start_loc.back();
  p.max_query_len = b.max_query_len;
  p.max_seq_len = b.max_seq_len;
  p.block_size = 16;
  p.block_table_stride = (b.max_seq_len + 15) / 16;
  p.causal = causal ? 1 : 0;
  p.sliding_window = window;
  const int group = p.num_heads / p.num_kv_heads;
  const int m_tiles = (b.max_query_len * group + kBlockM - 1) / kBlockM;
  pw::PrefillWgmmaArgs a{};
  a.num_m_tiles = kPair ? m_tiles + (m_tiles & 1) : m_tiles;
  a.heads_outer = heads_outer ? 1 : 0;
  constexpr int kCtas = kPair ? 2 : 1;

  for (int persistent : {0, 1}) {
    SCOPED_TRACE(persistent != 0 ? "persistent, 5 CTAs (pairs)" : "a CTA (pair) per unit");
    a.persistent = persistent;
    // (sequence, KV head) -> how often each packed row was computed.
    std::map<std::pair<int, int>, std::vector<int>> rows_done;
    for (int s = 0; s < p.num_seqs; ++s) {
      const int rows = (b.query_start_loc[s + 1] - b.query_start_loc[s]) * group;
      for (int h = 0; h < p.num_kv_heads; ++h) rows_done[{s, h}].assign(rows, 0);
    }
    const int grid_x = persistent != 0 ? 5 * kCtas : p.num_kv_heads * a.num_m_tiles;
    const int grid_y = persistent != 0 ? 1 : p.num_seqs;
    for (int y = 0; y < grid_y; ++y) {
      for (int x = 0; x < grid_x; x += kCtas) {
        const pw::UnitWalk walk = pw::MakeUnitWalk<kPair>(p, a, x, grid_x, y);
        int u = 0;
        for (int r = 0; walk.At(r, &u); ++r) {
          if (u < 0) continue;
          pw::Unit ranks[kCtas];
          for (int rank = 0; rank < kCtas; ++rank) {
            ranks[rank] = pw::LoadUnit<kBlockM, kBlockN, kPair>(p, a, walk, u,
                                                               static_cast<uint32_t>(rank));
          }
          bool unit_has_rows = false;
          for (int rank = 0; rank < kCtas; ++rank) {
            unit_has_rows = unit_has_rows || ranks[rank].row0 < ranks[rank].rows_total;
          }
          EXPECT_EQ(ranks[0].loads, unit_has_rows) << "unit " << u;
          for (int rank = 0; rank < kCtas; ++rank) {
            const pw::Unit& t = ranks[rank];
            SCOPED_TRACE(absl::StrCat("unit ", u, " rank ", rank, ": sequence ", t.seq,
                                      ", KV head ", t.kv_head, ", row tile ", t.m_tile));
            EXPECT_EQ(t.loads, ranks[0].loads) << "a pair's CTAs disagree";
            EXPECT_EQ(t.n_begin, ranks[0].n_begin) << "a pair's CTAs disagree";
            EXPECT_EQ(t.n_end, ranks[0].n_end) << "a pair's CTAs disagree";
            const int seq_len = t.bounds.seq_len;
            const int context = seq_len - t.bounds.query_len;
            bool has_rows = false;
            for (int row = t.row0; row < std::min(t.rows_total, t.row0 + kBlockM); ++row) {
              has_rows = true;
              ++rows_done[{t.seq, t.kv_head}][row];
              const int qp = context + row / group;
              const int lo = window > 0 ? std::max(0, qp - window + 1) : 0;
              const int hi = causal ? qp
                             : window > 0 ? std::min(seq_len - 1, qp + window - 1)
                                          : seq_len - 1;
              EXPECT_LE(t.n_begin * kBlockN, lo) << "row " << row;
              EXPECT_GE(t.n_end * kBlockN - 1, hi) << "row " << row;
            }
            if (has_rows) {
              EXPECT_TRUE(t.loads);
            }
            if (!t.loads) {
              EXPECT_EQ(t.n_begin, t.n_end) << "a unit without rows walks tiles";
            }
          }
        }
      }
    }
    for (const auto& [key, counts] : rows_done) {
      for (size_t row = 0; row < counts.size(); ++row) {
        EXPECT_EQ(counts[row], 1) << "sequence " << key.first << ", KV head " << key.second
                                  << ", packed row " << row;
      }
    }
  }
}

TEST(PrefillWgmmaUnitsTest, UnitsCoverRaggedBatch) {
  for (bool heads_outer : {false, true}) {
    for (const auto& [causal, window] :
         std::vector<std::pair<bool, int>>{{true, 0}, {false, 0}, {true, 100}, {false, 50}}) {
      SCOPED_TRACE(absl::StrCat(heads_outer ? "KV heads outer, " : "KV heads inner, ",
                                causal ? "causal" : "bidirectional", ", window ", window));
      {
        SCOPED_TRACE("single CTAs");
        ExpectUnitsCoverBatch<false>(causal, window, heads_outer);
      }
      {
        SCOPED_TRACE("CTA pairs");
        ExpectUnitsCoverBatch<true>(causal, window, heads_outer);
      }
    }
  }
}

}  // namespace
}  // namespace kvstream
