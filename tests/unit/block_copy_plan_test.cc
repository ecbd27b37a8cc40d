// Tests of PlanBlockCopy: byte runs between caches of one layout.
#include "kvstream/connector/block_copy_plan.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace kvstream {
namespace {

KvCacheSpec Spec(int block_size, int heads, int head_size) {
  KvCacheSpec s;
  s.block_size = block_size;
  s.num_kv_heads = heads;
  s.head_size = head_size;
  s.head_size_v = head_size;
  s.dtype = DType::kBFloat16;
  return s;
}

TEST(BlockCopyPlanTest, NhdFullBlocksCoalesceAcrossConsecutiveIds) {
  const KvCacheSpec s = Spec(4, 2, 8);
  const CacheStrides st = MakeCacheStrides(s, KvLayout::kNHD, false);
  // Blocks 3,4 -> 7,8 are consecutive on both sides: one run; 9 -> 1 is another.
  auto runs = PlanBlockCopy(st, 4, 2, 8, 2, {3, 4, 9}, {7, 8, 1}, 12);
  ASSERT_TRUE(runs.ok()) << runs.status();
  const uint64_t block_bytes = 4 * 2 * 8 * 2;
  ASSERT_EQ(runs->size(), 2u);
  EXPECT_EQ((*runs)[0].src_offset, 3 * block_bytes);
  EXPECT_EQ((*runs)[0].dst_offset, 7 * block_bytes);
  EXPECT_EQ((*runs)[0].length, 2 * block_bytes);
  EXPECT_EQ((*runs)[1].src_offset, 9 * block_bytes);
  EXPECT_EQ((*runs)[1].dst_offset, 1 * block_bytes);
  EXPECT_EQ((*runs)[1].length, block_bytes);
}

TEST(BlockCopyPlanTest, PartialLastBlockSendsOnlyItsTokens) {
  const KvCacheSpec s = Spec(4, 2, 8);
  const CacheStrides st = MakeCacheStrides(s, KvLayout::kNHD, false);
  auto runs = PlanBlockCopy(st, 4, 2, 8, 2, {0, 5}, {2, 6}, 6);
  ASSERT_TRUE(runs.ok());
  ASSERT_EQ(runs->size(), 2u);
  EXPECT_EQ((*runs)[1].length, 2u * 2 * 8 * 2);  // 2 tokens x 2 heads x 8 x bf16
}

TEST(BlockCopyPlanTest, HndPartialBlockIsOneRunPerHead) {
  const KvCacheSpec s = Spec(4, 3, 8);
  const CacheStrides st = MakeCacheStrides(s, KvLayout::kHND, false);
  auto runs = PlanBlockCopy(st, 4, 3, 8, 2, {1}, {2}, 3);
  ASSERT_TRUE(runs.ok());
  ASSERT_EQ(runs->size(), 3u);
  for (const ByteRun& r : *runs) EXPECT_EQ(r.length, 3u * 8 * 2);
  // Full HND blocks are contiguous: one run.
  auto full = PlanBlockCopy(st, 4, 3, 8, 2, {1}, {2}, 4);
  ASSERT_EQ(full->size(), 1u);
}

// Applying the plan moves exactly the tokens' elements, for any layout.
TEST(BlockCopyPlanTest, CopyingTheRunsMovesExactlyTheTokens) {
  for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND}) {
    const KvCacheSpec s = Spec(5, 3, 4);
    const CacheStrides st = MakeCacheStrides(s, layout, false);
    const int blocks = 6;
    const size_t es = 2;
    const uint64_t bytes = TensorExtentBytes(st, blocks, 5, 3, 4, es);
    std::vector<uint8_t> src(bytes), dst(bytes, 0);
    std::mt19937 rng(3);
    for (auto& b : src) b = static_cast<uint8_t>(rng() | 1);
    const std::vector<int32_t> sb = {4, 0, 2}, db = {1, 5, 3};
    const int tokens = 12;
    auto runs = PlanBlockCopy(st, 5, 3, 4, es, sb, db, tokens);
    ASSERT_TRUE(runs.ok());
    for (const ByteRun& r : *runs) std::memcpy(&dst[r.dst_offset], &src[r.src_offset], r.length);
    for (int t = 0; t < 15; ++t) {
      for (int h = 0; h < 3; ++h) {
        for (int d = 0; d < 4; ++d) {
          const int64_t so = st.Offset(sb[t / 5], t % 5, h, d) * es;
          const int64_t dof = st.Offset(db[t / 5], t % 5, h, d) * es;
          if (t < tokens) {
            ASSERT_EQ(std::memcmp(&src[so], &dst[dof], es), 0) << t << " " << h << " " << d;
          } else {
            ASSERT_EQ(dst[dof], 0) << "token " << t << " must not be copied";
          }
        }
      }
    }
  }
}

// The plan row by row, merged as PlanBlockCopy merges: what its per-block paths must equal.
std::vector<ByteRun> RowByRow(const CacheStrides& s, int block_size, int heads, int head_size,
                              size_t es, const std::vector<int32_t>& sb,
                              const std::vector<int32_t>& db, int64_t tokens) {
  std::vector<ByteRun> runs;
  const uint64_t row = static_cast<uint64_t>(head_size) * es;
  const bool token_major = s.token >= s.head;
  for (size_t i = 0; static_cast<int64_t>(i * block_size) < tokens; ++i) {
    const int64_t n = std::min<int64_t>(block_size, tokens - static_cast<int64_t>(i) * block_size);
    for (int64_t a = 0; a < (token_major ? n : heads); ++a) {
      for (int64_t b = 0; b < (token_major ? heads : n); ++b) {
        const int64_t t = token_major ? a : b, h = token_major ? b : a;
        const uint64_t src = static_cast<uint64_t>(s.Offset(sb[i], t, h, 0)) * es;
        const uint64_t dst = static_cast<uint64_t>(s.Offset(db[i], t, h, 0)) * es;
        if (!runs.empty() && runs.back().src_offset + runs.back().length == src &&
            runs.back().dst_offset + runs.back().length == dst) {
          runs.back().length += row;
        } else {
          runs.push_back({src, dst, row});
        }
      }
    }
  }
  return runs;
}

TEST(BlockCopyPlanTest, EqualsTheRowByRowPlanForDenseAndPaddedLayouts) {
  std::mt19937 rng(17);
  for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND}) {
    for (bool padded : {false, true}) {
      const KvCacheSpec spec = Spec(16, 8, 128);
      CacheStrides st = MakeCacheStrides(spec, layout, false);
      if (padded) {  // rows 16 elements apart from the next: no dense fast path
        if (layout == KvLayout::kNHD) {
          st.head = 144;
          st.token = 8 * 144;
          st.block = 16 * st.token;
        } else {
          st.token = 144;
          st.head = 16 * 144;
          st.block = 8 * st.head;
        }
      }
      std::vector<int32_t> sb(64), db(64);
      for (int i = 0; i < 64; ++i) sb[i] = db[i] = i;
      std::shuffle(sb.begin(), sb.end(), rng);
      std::shuffle(db.begin(), db.end(), rng);
      sb[1] = sb[0] + 1;  // one pair consecutive on both sides: merged across blocks
      db[1] = db[0] + 1;
      for (int64_t tokens : {int64_t{0}, int64_t{1}, int64_t{16}, int64_t{500}, int64_t{1024}}) {
        auto runs = PlanBlockCopy(st, 16, 8, 128, 2, sb, db, tokens);
        ASSERT_TRUE(runs.ok()) << runs.status();
        const std::vector<ByteRun> want = RowByRow(st, 16, 8, 128, 2, sb, db, tokens);
        ASSERT_EQ(runs->size(), want.size()) << static_cast<int>(layout) << padded << tokens;
        for (size_t i = 0; i < want.size(); ++i) {
          EXPECT_EQ((*runs)[i].src_offset, want[i].src_offset) << i;
          EXPECT_EQ((*runs)[i].dst_offset, want[i].dst_offset) << i;
          EXPECT_EQ((*runs)[i].length, want[i].length) << i;
        }
      }
    }
  }
}

TEST(BlockCopyPlanTest, Errors) {
  const KvCacheSpec s = Spec(4, 2, 8);
  const CacheStrides st = MakeCacheStrides(s, KvLayout::kNHD, false);
  EXPECT_EQ(PlanBlockCopy(st, 4, 2, 8, 2, {1}, {2}, 5).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(PlanBlockCopy(st, 4, 2, 8, 2, {-1}, {2}, 3).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanBlockCopy(st, 0, 2, 8, 2, {1}, {2}, 3).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto empty = PlanBlockCopy(st, 4, 2, 8, 2, {}, {}, 0);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
}

}  // namespace
}  // namespace kvstream
