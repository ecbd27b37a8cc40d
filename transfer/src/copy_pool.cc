// CopyPool (see copy_pool.h).
//
// A job's pieces are grouped into batches when it is submitted; threads take batch indices
// with one fetch_add each and count finished batches with another, and the thread that
// finishes the last batch calls `done`. Those read-modify-writes are acq_rel, so `done` runs
// after every byte of the job was copied, on whichever threads copied it.
//
// Abandon and the threads meet through two atomics, both sequentially consistent: a thread
// announces itself in `running_` before it reads `abandoned_`, and Abandon sets `abandoned_`
// before it reads `running_`; so either Abandon sees the thread and waits for it, or the
// thread sees the flag and copies nothing more.
#include "copy_pool.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvstream {
namespace internal {
namespace {

// How long a thread with nothing to do polls for a new job before it sleeps.
constexpr std::chrono::microseconds kIdleSpin(100);

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

}  // namespace

void CopyPool::SpinLock::lock() {
  int spins = 0;
  while (locked_.exchange(true, std::memory_order_acquire)) {
    while (locked_.load(std::memory_order_relaxed)) {
      // A holder preempted on a machine with fewer cores than threads needs the CPU back.
      if (++spins % 1024 == 0) {
        std::this_thread::yield();
      } else {
        CpuRelax();
      }
    }
  }
}

absl::StatusOr<std::unique_ptr<CopyPool>> CopyPool::Create(int threads) {
  if (threads < 1 || threads > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("copy threads: ", threads, " is outside 1..256"));
  }
  std::unique_ptr<CopyPool> pool(new CopyPool());
  pool->threads_.reserve(static_cast<size_t>(threads));
  try {
    for (int i = 0; i < threads; ++i) pool->threads_.emplace_back([p = pool.get()] { p->Run(); });
  } catch (const std::system_error& e) {
    // The destructor stops and joins the threads already started.
    return absl::ResourceExhaustedError(
        absl::StrCat("copy threads: could not start thread ", pool->threads_.size() + 1,
                     " of ", threads, ": ", e.what()));
  }
  return pool;
}

CopyPool::~CopyPool() {
  {
    std::lock_guard<SpinLock> lock(queue_lock_);
    for (const std::shared_ptr<CopyJob>& job : queue_) {
      job->abandoned_.store(true, std::memory_order_seq_cst);
    }
    queue_.clear();
  }
  stopping_.store(true, std::memory_order_release);
  { std::lock_guard<std::mutex> lock(sleep_mu_); }  // see Submit
  idle_.notify_all();
  for (std::thread& t : threads_) t.join();
}

std::shared_ptr<CopyJob> CopyPool::Submit(const std::vector<CopyPiece>& pieces,
                                          std::function<void()> done) {
  std::shared_ptr<CopyJob> job(new CopyJob());
  job->done_ = std::move(done);
  size_t batch_bytes = 0;
  job->batch_begin_.push_back(0);
  for (const CopyPiece& piece : pieces) {
    for (size_t offset = 0; offset < piece.length; offset += kMaxPieceBytes) {
      CopyPiece cut;
      cut.src = piece.src + offset;
      cut.dst = piece.dst + offset;
      cut.length = std::min(kMaxPieceBytes, piece.length - offset);
      job->pieces_.push_back(cut);
      batch_bytes += cut.length;
      if (batch_bytes >= kBatchBytes) {
        job->batch_begin_.push_back(job->pieces_.size());
        batch_bytes = 0;
      }
    }
  }
  // The last, partial batch; a job with nothing to copy gets one empty batch, so that a
  // thread still calls `done`.
  if (batch_bytes > 0 || job->pieces_.empty()) job->batch_begin_.push_back(job->pieces_.size());
  {
    std::lock_guard<SpinLock> lock(queue_lock_);
    queue_.push_back(job);
  }
  submitted_.fetch_add(1, std::memory_order_release);
  // A sleeper tests submitted_ under sleep_mu_ before it waits: taking the mutex here means
  // it either saw the new count or is already waiting for this notification.
  { std::lock_guard<std::mutex> lock(sleep_mu_); }
  idle_.notify_all();  // every thread may take batches of it
  return job;
}

void CopyPool::Abandon(CopyJob& job) {
  job.abandoned_.store(true, std::memory_order_seq_cst);
  while (job.running_.load(std::memory_order_seq_cst) != 0) std::this_thread::yield();
}

void CopyPool::Run() {
  while (std::shared_ptr<CopyJob> job = NextJob()) Work(*job);
}

std::shared_ptr<CopyJob> CopyPool::NextJob() {
  while (true) {
    // Read before the queue is looked at: a job queued after this read changes the count.
    const size_t seen = submitted_.load(std::memory_order_acquire);
    {
      std::lock_guard<SpinLock> lock(queue_lock_);
      while (!queue_.empty()) {
        const std::shared_ptr<CopyJob>& front = queue_.front();
        const size_t batches = front->batch_begin_.size() - 1;
        if (!front->abandoned_.load(std::memory_order_relaxed) &&
            front->next_batch_.load(std::memory_order_relaxed) < batches) {
          return front;
        }
        queue_.pop_front();  // handed out in full (threads may still be copying it)
      }
    }
    if (stopping_.load(std::memory_order_acquire)) return nullptr;
    const auto until = std::chrono::steady_clock::now() + kIdleSpin;
    while (submitted_.load(std::memory_order_acquire) == seen &&
           std::chrono::steady_clock::now() < until) {
      CpuRelax();
    }
    if (submitted_.load(std::memory_order_acquire) != seen) continue;
    std::unique_lock<std::mutex> lock(sleep_mu_);
    idle_.wait(lock, [this, seen] {
      return stopping_.load(std::memory_order_acquire) ||
             submitted_.load(std::memory_order_acquire) != seen;
    });
  }
}

void CopyPool::Work(CopyJob& job) {
  const size_t batches = job.batch_begin_.size() - 1;
  while (true) {
    job.running_.fetch_add(1, std::memory_order_seq_cst);
    if (job.abandoned_.load(std::memory_order_seq_cst)) {
      job.running_.fetch_sub(1, std::memory_order_seq_cst);
      return;
    }
    const size_t b = job.next_batch_.fetch_add(1, std::memory_order_relaxed);
    if (b >= batches) {
      job.running_.fetch_sub(1, std::memory_order_seq_cst);
      return;
    }
    for (size_t i = job.batch_begin_[b]; i < job.batch_begin_[b + 1]; ++i) {
      const CopyPiece& piece = job.pieces_[i];
      std::memcpy(piece.dst, piece.src, piece.length);
    }
    job.running_.fetch_sub(1, std::memory_order_seq_cst);
    if (job.batches_done_.fetch_add(1, std::memory_order_acq_rel) + 1 == batches) {
      job.finished_.store(true, std::memory_order_release);
      if (!job.abandoned_.load(std::memory_order_acquire) && job.done_) job.done_();
      return;
    }
  }
}

}  // namespace internal
}  // namespace kvstream
