// Tests of PlanBlockCopy: byte runs between caches of one layout.
#include "kvstream/connector/block_copy_plan.h"

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
