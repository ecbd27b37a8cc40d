// BlockPool: the allocator of one worker's KV-cache block ids.
//
// Ids run over [0, num_blocks). A block is free when its reference count is 0. Allocate()
// hands out blocks with count 1, AddRef() lets a second owner (a prefix cache, a transfer
// in flight) keep a block alive, Free() drops one reference per id and returns the block to
// the pool when the count reaches 0. Every call is all-or-nothing: on error nothing changed.
//
//   ASSIGN_OR_RETURN(std::unique_ptr<BlockPool> pool, BlockPool::Create(1024));
//   ASSIGN_OR_RETURN(std::vector<int32_t> blocks, pool->Allocate(3));
//   RETURN_IF_ERROR(pool->Free(blocks));
//
// Thread-safe.
#ifndef KVSTREAM_CACHE_BLOCK_POOL_H_
#define KVSTREAM_CACHE_BLOCK_POOL_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

namespace kvstream {

class BlockPool {
 public:
  // REQUIRES num_blocks > 0 (else InvalidArgument).
  static absl::StatusOr<std::unique_ptr<BlockPool>> Create(int32_t num_blocks);

  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // Takes `n` free blocks (n >= 0), each with reference count 1. When fewer than n are free,
  // returns ResourceExhausted and takes none. Lower ids are handed out first after a fresh
  // Create; afterwards the order is unspecified (freed blocks are reused first).
  absl::StatusOr<std::vector<int32_t>> Allocate(int32_t n);

  // Drops one reference from each id (an id may repeat, dropping one reference per
  // occurrence). OutOfRange for an id outside [0, num_blocks); FailedPrecondition for a
  // block that would drop below zero references (a double free). On error nothing changes.
  absl::Status Free(absl::Span<const int32_t> ids);

  // Adds one reference to each id. Errors as Free (a free block cannot gain a reference:
  // FailedPrecondition). On error nothing changes.
  absl::Status AddRef(absl::Span<const int32_t> ids);

  // Reference count of `id`, OutOfRange for a bad id.
  absl::StatusOr<int32_t> RefCount(int32_t id) const;

  int32_t num_blocks() const { return num_blocks_; }
  int32_t num_free() const;

 private:
  explicit BlockPool(int32_t num_blocks);
  absl::Status CheckIds(absl::Span<const int32_t> ids, const char* operation) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int32_t num_blocks_;
  mutable absl::Mutex mu_;
  std::vector<int32_t> ref_counts_ ABSL_GUARDED_BY(mu_);
  std::vector<int32_t> free_list_ ABSL_GUARDED_BY(mu_);  // a stack; back() is handed out next
};

}  // namespace kvstream

#endif  // KVSTREAM_CACHE_BLOCK_POOL_H_
