// Tests of transfer/src/copy_pool.h: every byte copied to its place and nothing else
// touched, pieces cut and batched across threads, `done` called once and after the copies,
// jobs in order, abandoning a job mid-way, and destruction with jobs queued.
#include "transfer/src/copy_pool.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/unit/shuffled_slots.h"

namespace kvstream {
namespace internal {
namespace {

// Counts `done` calls; Wait blocks (with a deadline) until `count` of them happened. (A
// standard mutex, which ThreadSanitizer sees through, as in the pool.)
class DoneCounter {
 public:
  std::function<void()> Callback() {
    return [this] {
      // Notified under the lock: a waiter may destroy the counter as soon as it is released.
      std::lock_guard<std::mutex> lock(mu_);
      ++calls_;
      changed_.notify_all();
    };
  }
  bool Wait(int count) {
    std::unique_lock<std::mutex> lock(mu_);
    return changed_.wait_for(lock, std::chrono::seconds(30), [&] { return calls_ >= count; });
  }
  int calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  int calls_ = 0;  // guarded by mu_
};

// Scattered blocks of `block` bytes (plus `tail` bytes each, so lengths are not round) from
// a source pool into a destination pool, in random order on both sides.
std::vector<CopyPiece> Scattered(const std::vector<char>& src, std::vector<char>& dst,
                                 size_t block, size_t count, size_t tail, uint32_t seed) {
  const size_t slot = block + tail;
  const testing_util::SlotPermutations slots =
      testing_util::ShuffledSlots(src.size() / slot, dst.size() / slot, seed);
  std::vector<CopyPiece> pieces;
  for (size_t i = 0; i < count; ++i) {
    CopyPiece p;
    p.src = src.data() + slots.src[i] * slot;
    p.dst = dst.data() + slots.dst[i] * slot;
    p.length = slot;
    pieces.push_back(p);
  }
  return pieces;
}

std::vector<char> RandomBytes(size_t n, uint32_t seed) {
  std::vector<char> v(n);
  std::mt19937 rng(seed);
  for (char& c : v) c = static_cast<char>(1 + rng() % 255);
  return v;
}

// What `dst` must hold after the pieces (applied in order) on a zeroed destination.
std::vector<char> Expected(const std::vector<char>& dst, const std::vector<CopyPiece>& pieces) {
  std::vector<char> expected(dst.size(), 0);
  for (const CopyPiece& p : pieces) {
    std::memcpy(expected.data() + (p.dst - dst.data()), p.src, p.length);
  }
  return expected;
}

TEST(CopyPoolTest, RejectsBadThreadCounts) {
  EXPECT_EQ(CopyPool::Create(0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CopyPool::Create(-1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CopyPool::Create(257).status().code(), absl::StatusCode::kInvalidArgument);
  auto pool = CopyPool::Create(3);
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ((*pool)->threads(), 3);
}

// Small scattered blocks (many per batch), blocks of odd lengths, and pieces larger than
// kMaxPieceBytes (cut): every destination byte is the source's or untouched zero.
TEST(CopyPoolTest, CopiesEveryPieceToItsPlace) {
  for (int threads : {1, 2, 4}) {
    auto pool = CopyPool::Create(threads);
    ASSERT_TRUE(pool.ok()) << pool.status();
    struct Case {
      size_t block, count, tail;
    };
    for (const Case& c : {Case{4096, 700, 0}, Case{16384, 90, 37}, Case{3 << 20, 2, 5},
                          Case{64, 5000, 3}}) {
      const std::vector<char> src = RandomBytes(8 << 20, static_cast<uint32_t>(c.block));
      std::vector<char> dst(8 << 20, 0);
      const std::vector<CopyPiece> pieces = Scattered(src, dst, c.block, c.count, c.tail, 7);
      const std::vector<char> expected = Expected(dst, pieces);
      DoneCounter done;
      std::shared_ptr<CopyJob> job = (*pool)->Submit(pieces, done.Callback());
      ASSERT_TRUE(done.Wait(1)) << "threads " << threads << " block " << c.block;
      EXPECT_TRUE(job->finished());
      EXPECT_TRUE(dst == expected) << "threads " << threads << " block " << c.block;
    }
  }
}

// `done` runs once per job, after every byte of that job is copied (checked inside the
// callback), for jobs submitted back to back from several threads.
TEST(CopyPoolTest, DoneRunsOnceAfterTheLastByte) {
  auto pool = CopyPool::Create(4);
  ASSERT_TRUE(pool.ok()) << pool.status();
  constexpr int kJobs = 64;
  const std::vector<char> src = RandomBytes(4 << 20, 3);
  std::vector<std::vector<char>> dsts(kJobs, std::vector<char>(4 << 20, 0));
  std::vector<std::vector<CopyPiece>> pieces(kJobs);
  std::vector<std::vector<char>> expected(kJobs);
  for (int j = 0; j < kJobs; ++j) {
    pieces[j] = Scattered(src, dsts[j], 16384, 200, j % 3, static_cast<uint32_t>(j));
    expected[j] = Expected(dsts[j], pieces[j]);
  }
  std::vector<std::atomic<int>> calls(kJobs);
  std::atomic<int> complete_when_called{0};
  DoneCounter all;
  std::vector<std::shared_ptr<CopyJob>> jobs(kJobs);
  std::vector<std::thread> posters;
  for (int t = 0; t < 4; ++t) {
    posters.emplace_back([&, t] {
      for (int j = t; j < kJobs; j += 4) {
        jobs[j] = (*pool)->Submit(pieces[j], [&, j, cb = all.Callback()] {
          calls[j].fetch_add(1);
          if (dsts[j] == expected[j]) complete_when_called.fetch_add(1);
          cb();
        });
      }
    });
  }
  for (std::thread& t : posters) t.join();
  ASSERT_TRUE(all.Wait(kJobs));
  // Give a stray second call a chance to show.
  absl::SleepFor(absl::Milliseconds(20));
  for (int j = 0; j < kJobs; ++j) EXPECT_EQ(calls[j].load(), 1) << j;
  EXPECT_EQ(complete_when_called.load(), kJobs);
}

// A job with nothing to copy still calls `done` (from a pool thread).
TEST(CopyPoolTest, EmptyJobCallsDone) {
  auto pool = CopyPool::Create(2);
  ASSERT_TRUE(pool.ok()) << pool.status();
  DoneCounter done;
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<bool> on_caller{true};
  CopyPiece empty;
  (*pool)->Submit({}, [&, cb = done.Callback()] {
    on_caller = std::this_thread::get_id() == caller;
    cb();
  });
  (*pool)->Submit({empty}, done.Callback());
  ASSERT_TRUE(done.Wait(2));
  EXPECT_FALSE(on_caller.load());
}

// Abandoning a large job: when Abandon returns nothing of it is being copied, so the
// destination stops changing; its `done` is not called unless every byte was copied; the
// next job still runs.
TEST(CopyPoolTest, AbandonStopsTheCopies) {
  auto pool = CopyPool::Create(2);
  ASSERT_TRUE(pool.ok()) << pool.status();
  const std::vector<char> src = RandomBytes(64 << 20, 5);
  std::vector<char> dst(64 << 20, 0);
  const std::vector<CopyPiece> pieces = Scattered(src, dst, 16384, 4096, 0, 11);
  DoneCounter done;
  std::shared_ptr<CopyJob> job = (*pool)->Submit(pieces, done.Callback());
  CopyPool::Abandon(*job);
  const std::vector<char> after_abandon = dst;
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_TRUE(dst == after_abandon) << "bytes were still copied after Abandon returned";
  if (!job->finished()) {
    EXPECT_EQ(done.calls(), 0);
  }
  // The pool keeps working.
  std::vector<char> small_dst(1 << 20, 0);
  const std::vector<CopyPiece> small = Scattered(src, small_dst, 4096, 100, 0, 12);
  DoneCounter next;
  (*pool)->Submit(small, next.Callback());
  ASSERT_TRUE(next.Wait(1));
  EXPECT_TRUE(small_dst == Expected(small_dst, small));
}

// Destroying the pool with jobs queued returns (threads joined) and leaves no copy running.
TEST(CopyPoolTest, DestroyWithJobsQueued) {
  const std::vector<char> src = RandomBytes(16 << 20, 6);
  std::vector<char> dst(16 << 20, 0);
  const std::vector<CopyPiece> pieces = Scattered(src, dst, 16384, 1024, 0, 13);
  {
    auto pool = CopyPool::Create(2);
    ASSERT_TRUE(pool.ok()) << pool.status();
    for (int i = 0; i < 8; ++i) (*pool)->Submit(pieces, nullptr);
  }
  const std::vector<char> after = dst;
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_TRUE(dst == after);
}

// Threads that went to sleep (idle longer than their spin) wake for a new job.
TEST(CopyPoolTest, IdleThreadsWakeForNewJobs) {
  auto pool = CopyPool::Create(2);
  ASSERT_TRUE(pool.ok()) << pool.status();
  const std::vector<char> src = RandomBytes(1 << 20, 8);
  for (int round = 0; round < 3; ++round) {
    absl::SleepFor(absl::Milliseconds(30));
    std::vector<char> dst(1 << 20, 0);
    const std::vector<CopyPiece> pieces = Scattered(src, dst, 4096, 64, 0, 20 + round);
    DoneCounter done;
    (*pool)->Submit(pieces, done.Callback());
    ASSERT_TRUE(done.Wait(1)) << round;
    EXPECT_TRUE(dst == Expected(dst, pieces)) << round;
  }
}

}  // namespace
}  // namespace internal
}  // namespace kvstream
