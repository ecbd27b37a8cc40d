// CopyPool: threads that copy batches of (source, destination, length) pieces with memcpy.
// The UCX transport's path for writes into a peer's memory that is mapped into this process
// (shared memory on one host): a layer's scattered blocks are copied by several cores at
// once, and PostWrite returns as soon as the job is queued.
//
//   ASSIGN_OR_RETURN(std::unique_ptr<CopyPool> pool, CopyPool::Create(4));
//   std::shared_ptr<CopyJob> job = pool->Submit(pieces, [] { /* every byte copied */ });
//   ...
//   CopyPool::Abandon(*job);  // cancel: returns once none of its pieces is being copied
//
// Jobs run in submission order: every thread takes batches of the oldest job until it has
// none left, then moves to the next, so one large job is copied by all threads together.
// Threads that run out of work spin for a short while (a layer is often followed by the
// next within microseconds) and then sleep until a job arrives.
//
// Thread safety: Submit and Abandon from any thread. `done` runs on a pool thread, holding
// none of the pool's locks; it may take the caller's own locks, which Abandon's caller may
// hold (Abandon never waits for `done`).
#ifndef KVSTREAM_TRANSFER_SRC_COPY_POOL_H_
#define KVSTREAM_TRANSFER_SRC_COPY_POOL_H_

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"

namespace kvstream {
namespace internal {

struct CopyPiece {
  const char* src = nullptr;
  char* dst = nullptr;
  size_t length = 0;
};

// One submitted batch of pieces (opaque outside the pool: hold it to Abandon the job).
class CopyJob {
 public:
  CopyJob(const CopyJob&) = delete;
  CopyJob& operator=(const CopyJob&) = delete;

  // True once every piece has been copied (and `done` has been or is being called).
  bool finished() const { return finished_.load(std::memory_order_acquire); }

 private:
  friend class CopyPool;
  CopyJob() = default;

  std::vector<CopyPiece> pieces_;
  std::vector<size_t> batch_begin_;  // batch b is pieces_[batch_begin_[b], batch_begin_[b + 1])
  std::function<void()> done_;
  std::atomic<size_t> next_batch_{0};
  std::atomic<size_t> batches_done_{0};
  std::atomic<int> running_{0};  // threads copying one of its batches right now
  std::atomic<bool> abandoned_{false};
  std::atomic<bool> finished_{false};
};

class CopyPool {
 public:
  // A piece longer than this is cut, so that Abandon waits for at most this much copying.
  static constexpr size_t kMaxPieceBytes = size_t{1} << 20;
  // A thread takes consecutive pieces of at least this many bytes at a time (one atomic
  // increment per batch rather than per small block).
  static constexpr size_t kBatchBytes = size_t{32} << 10;

  // `threads` copy threads (1 to 256, else InvalidArgument), started now.
  static absl::StatusOr<std::unique_ptr<CopyPool>> Create(int threads);

  // Abandons every job still queued (as Abandon) and joins the threads.
  ~CopyPool();
  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;

  int threads() const { return static_cast<int>(threads_.size()); }

  // Queues a job copying every piece (empty pieces skipped). `done` runs once, on a pool
  // thread, after the last byte is copied, unless the job was abandoned before that. A job
  // with nothing to copy calls `done` from a pool thread too. The caller keeps every source
  // and destination valid until `done` runs or Abandon returns.
  std::shared_ptr<CopyJob> Submit(const std::vector<CopyPiece>& pieces, std::function<void()> done);

  // Stops the job: when this returns, no piece of it is being copied and none will start.
  // Pieces already copied stay copied. If the last piece finished just before, `done` may
  // still run (after this returns). Waits only for pieces in flight (each at most
  // kMaxPieceBytes); does not take the pool's lock.
  static void Abandon(CopyJob& job);

 private:
  CopyPool() = default;
  void Run();
  // The oldest job with batches left to hand out, or null once stopping; sleeps when idle.
  std::shared_ptr<CopyJob> NextJob();
  // Copies batches of `job` until it has none left to hand out or is abandoned.
  static void Work(CopyJob& job);

  // The queue's lock: held for a few instructions, and taken by every thread at once when a
  // job arrives, so waiters spin rather than sleep in the kernel (a sleeping waiter would
  // add its wake-up to the job's latency).
  class SpinLock {
   public:
    void lock();
    void unlock() { locked_.store(false, std::memory_order_release); }

   private:
    std::atomic<bool> locked_{false};
  };

  SpinLock queue_lock_;
  std::deque<std::shared_ptr<CopyJob>> queue_;  // guarded by queue_lock_
  std::atomic<bool> stopping_{false};
  // Idle threads sleep on `idle_` (a standard mutex and condition variable, which
  // ThreadSanitizer sees through where the distribution's Abseil is not instrumented).
  std::mutex sleep_mu_;
  std::condition_variable idle_;
  std::atomic<size_t> submitted_{0};  // jobs ever queued: what idle threads spin on
  std::vector<std::thread> threads_;
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_COPY_POOL_H_
