// Tests of cache/block_pool.h: allocation order, reference counts, the all-or-nothing rule
// on every error, and concurrent use.
#include "kvstream/cache/block_pool.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvstream {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

std::unique_ptr<BlockPool> MakePool(int32_t n) {
  auto pool = BlockPool::Create(n);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return std::move(pool).value();
}

std::vector<int32_t> RefCounts(const BlockPool& pool) {
  std::vector<int32_t> counts;
  for (int32_t i = 0; i < pool.num_blocks(); ++i) counts.push_back(*pool.RefCount(i));
  return counts;
}

TEST(BlockPoolTest, CreateRejectsNonPositiveSizes) {
  for (int32_t n : {0, -1}) {
    auto pool = BlockPool::Create(n);
    ASSERT_FALSE(pool.ok());
    EXPECT_EQ(pool.status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(BlockPoolTest, FreshPoolHandsOutLowIdsFirst) {
  auto pool = MakePool(8);
  EXPECT_EQ(pool->num_blocks(), 8);
  EXPECT_EQ(pool->num_free(), 8);
  auto a = pool->Allocate(3);
  ASSERT_TRUE(a.ok());
  EXPECT_THAT(*a, ElementsAre(0, 1, 2));
  auto b = pool->Allocate(2);
  ASSERT_TRUE(b.ok());
  EXPECT_THAT(*b, ElementsAre(3, 4));
  EXPECT_EQ(pool->num_free(), 3);
  EXPECT_THAT(RefCounts(*pool), ElementsAre(1, 1, 1, 1, 1, 0, 0, 0));
}

TEST(BlockPoolTest, AllocateZeroAndNegative) {
  auto pool = MakePool(4);
  auto none = pool->Allocate(0);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
  auto neg = pool->Allocate(-1);
  ASSERT_FALSE(neg.ok());
  EXPECT_EQ(neg.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool->num_free(), 4);
}

TEST(BlockPoolTest, AllocateTooManyTakesNone) {
  auto pool = MakePool(4);
  ASSERT_TRUE(pool->Allocate(3).ok());
  auto more = pool->Allocate(2);
  ASSERT_FALSE(more.ok());
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(more.status().message(), HasSubstr("2 blocks requested"));
  EXPECT_THAT(more.status().message(), HasSubstr("1 of 4 free"));
  EXPECT_EQ(pool->num_free(), 1);
  EXPECT_THAT(RefCounts(*pool), ElementsAre(1, 1, 1, 0));
  auto last = pool->Allocate(1);
  ASSERT_TRUE(last.ok());
  EXPECT_THAT(*last, ElementsAre(3));
  EXPECT_EQ(pool->num_free(), 0);
  EXPECT_EQ(pool->Allocate(1).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(BlockPoolTest, FreeReturnsBlocksAndFreedBlocksAreReusedFirst) {
  auto pool = MakePool(6);
  auto a = pool->Allocate(4);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(pool->Free({1, 2}).ok());
  EXPECT_EQ(pool->num_free(), 4);
  EXPECT_THAT(RefCounts(*pool), ElementsAre(1, 0, 0, 1, 0, 0));
  auto again = pool->Allocate(2);
  ASSERT_TRUE(again.ok());
  EXPECT_THAT(*again, UnorderedElementsAre(1, 2));
}

TEST(BlockPoolTest, DoubleFreeFails) {
  auto pool = MakePool(4);
  auto a = pool->Allocate(2);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(pool->Free({0}).ok());
  const absl::Status s = pool->Free({0});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("block 0"));
  EXPECT_THAT(RefCounts(*pool), ElementsAre(0, 1, 0, 0));
  EXPECT_EQ(pool->num_free(), 3);
}

TEST(BlockPoolTest, RepeatedIdInOneFreeCountsTwice) {
  auto pool = MakePool(4);
  ASSERT_TRUE(pool->Allocate(2).ok());
  // Block 1 has one reference, so freeing it twice in one batch is a double free, and
  // block 0, which could be freed, must stay allocated.
  const absl::Status s = pool->Free({0, 1, 1});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("block 1"));
  EXPECT_THAT(RefCounts(*pool), ElementsAre(1, 1, 0, 0));
  EXPECT_EQ(pool->num_free(), 2);
  // With a second reference the same batch is fine.
  ASSERT_TRUE(pool->AddRef({1}).ok());
  ASSERT_TRUE(pool->Free({0, 1, 1}).ok());
  EXPECT_THAT(RefCounts(*pool), ElementsAre(0, 0, 0, 0));
  EXPECT_EQ(pool->num_free(), 4);
}

TEST(BlockPoolTest, OutOfRangeIdsChangeNothing) {
  auto pool = MakePool(4);
  ASSERT_TRUE(pool->Allocate(3).ok());
  for (int32_t bad : {-1, 4, 1000}) {
    const absl::Status f = pool->Free({0, 1, bad});
    EXPECT_EQ(f.code(), absl::StatusCode::kOutOfRange) << bad;
    EXPECT_THAT(f.message(), HasSubstr(std::to_string(bad)));
    const absl::Status r = pool->AddRef({0, bad});
    EXPECT_EQ(r.code(), absl::StatusCode::kOutOfRange) << bad;
    EXPECT_EQ(pool->RefCount(bad).status().code(), absl::StatusCode::kOutOfRange);
  }
  EXPECT_THAT(RefCounts(*pool), ElementsAre(1, 1, 1, 0));
  EXPECT_EQ(pool->num_free(), 1);
}

TEST(BlockPoolTest, AddRefKeepsBlockAliveUntilLastFree) {
  auto pool = MakePool(3);
  auto a = pool->Allocate(1);
  ASSERT_TRUE(a.ok());
  const int32_t id = (*a)[0];
  ASSERT_TRUE(pool->AddRef({id, id}).ok());
  EXPECT_EQ(*pool->RefCount(id), 3);
  ASSERT_TRUE(pool->Free({id}).ok());
  ASSERT_TRUE(pool->Free({id}).ok());
  EXPECT_EQ(*pool->RefCount(id), 1);
  EXPECT_EQ(pool->num_free(), 2);
  ASSERT_TRUE(pool->Free({id}).ok());
  EXPECT_EQ(*pool->RefCount(id), 0);
  EXPECT_EQ(pool->num_free(), 3);
}

TEST(BlockPoolTest, AddRefOnFreeBlockChangesNothing) {
  auto pool = MakePool(3);
  ASSERT_TRUE(pool->Allocate(1).ok());
  const absl::Status s = pool->AddRef({0, 2});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("block 2"));
  EXPECT_THAT(RefCounts(*pool), ElementsAre(1, 0, 0));
  EXPECT_EQ(pool->num_free(), 2);
}

TEST(BlockPoolTest, EmptyBatchesAreNoOps) {
  auto pool = MakePool(2);
  EXPECT_TRUE(pool->Free({}).ok());
  EXPECT_TRUE(pool->AddRef({}).ok());
  EXPECT_EQ(pool->num_free(), 2);
}

// Several threads allocate, share (AddRef) and free blocks at random. Each block's owner
// count is tracked outside the pool: a block handed to two owners at once, a lost block, or
// a count that disagrees with the pool fails the test.
TEST(BlockPoolTest, ConcurrentUseKeepsCountsConsistent) {
  constexpr int32_t kBlocks = 64;
  constexpr int kThreads = 4;
  constexpr int kIterations = 3000;
  auto pool = MakePool(kBlocks);
  std::vector<std::atomic<int>> holders(kBlocks);
  for (auto& h : holders) h.store(0);
  std::atomic<int> failures{0};
  std::atomic<int> exhausted{0};

  auto worker = [&](int seed) {
    std::mt19937 rng(seed);
    std::vector<int32_t> held;  // one entry per reference this thread holds
    for (int i = 0; i < kIterations; ++i) {
      const int action = static_cast<int>(rng() % 3);
      if (action == 0) {
        auto got = pool->Allocate(static_cast<int32_t>(1 + rng() % 5));
        if (!got.ok()) {
          if (got.status().code() != absl::StatusCode::kResourceExhausted) ++failures;
          ++exhausted;
          continue;
        }
        for (int32_t id : *got) {
          // A freshly allocated block must have had no holder.
          if (holders[id].fetch_add(1) != 0) ++failures;
          held.push_back(id);
        }
      } else if (action == 1 && !held.empty()) {
        const int32_t id = held[rng() % held.size()];
        if (!pool->AddRef({id}).ok()) ++failures;
        holders[id].fetch_add(1);
        held.push_back(id);
      } else if (!held.empty()) {
        const size_t k = rng() % held.size();
        const int32_t id = held[k];
        held.erase(held.begin() + static_cast<std::ptrdiff_t>(k));
        // Drop the holder first: once Free returns, another thread may get the block.
        holders[id].fetch_sub(1);
        if (!pool->Free({id}).ok()) ++failures;
      }
    }
    for (int32_t id : held) holders[id].fetch_sub(1);
    if (!pool->Free(held).ok()) ++failures;
  };

  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, 100 + t);
  for (auto& t : threads) t.join();

  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(pool->num_free(), kBlocks);
  for (int32_t id = 0; id < kBlocks; ++id) {
    EXPECT_EQ(*pool->RefCount(id), 0) << id;
    EXPECT_EQ(holders[id].load(), 0) << id;
  }
  // All ids come back: a full allocation gets each exactly once.
  auto all = pool->Allocate(kBlocks);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(std::set<int32_t>(all->begin(), all->end()).size(), static_cast<size_t>(kBlocks));
}

}  // namespace
}  // namespace kvstream
