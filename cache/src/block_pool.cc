// BlockPool: ids handed out from a free stack, reference counts per block. Every batch is
// checked in full (repeated ids counted) before any count changes, so a failed call leaves
// the pool as it was.
#include "kvstream/cache/block_pool.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvstream {
namespace {

// The distinct ids of a batch with how often each occurs, so that a block named twice is
// checked against two references, not one.
std::vector<std::pair<int32_t, int32_t>> CountIds(absl::Span<const int32_t> ids) {
  std::vector<int32_t> sorted(ids.begin(), ids.end());
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::pair<int32_t, int32_t>> counts;
  for (int32_t id : sorted) {
    if (!counts.empty() && counts.back().first == id) {
      ++counts.back().second;
    } else {
      counts.emplace_back(id, 1);
    }
  }
  return counts;
}

}  // namespace

absl::StatusOr<std::unique_ptr<BlockPool>> BlockPool::Create(int32_t num_blocks) {
  if (num_blocks <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("BlockPool needs num_blocks > 0, got ", num_blocks));
  }
  return std::unique_ptr<BlockPool>(new BlockPool(num_blocks));
}

BlockPool::BlockPool(int32_t num_blocks)
    : num_blocks_(num_blocks), ref_counts_(num_blocks, 0), free_list_(num_blocks) {
  // A stack whose back() is handed out next: lay it out descending so that a fresh pool
  // hands out 0, 1, 2, ...
  for (int32_t i = 0; i < num_blocks; ++i) free_list_[i] = num_blocks - 1 - i;
}

absl::Status BlockPool::CheckIds(absl::Span<const int32_t> ids, const char* operation) const {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= num_blocks_) {
      return absl::OutOfRangeError(absl::StrCat(operation, ": block id ", ids[i], " (entry ", i,
                                                ") is outside [0, ", num_blocks_, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> BlockPool::Allocate(int32_t n) {
  if (n < 0) {
    return absl::InvalidArgumentError(absl::StrCat("Allocate: negative block count ", n));
  }
  absl::MutexLock lock(&mu_);
  if (static_cast<size_t>(n) > free_list_.size()) {
    return absl::ResourceExhaustedError(absl::StrCat("Allocate: ", n, " blocks requested, ",
                                                     free_list_.size(), " of ", num_blocks_,
                                                     " free"));
  }
  std::vector<int32_t> blocks(free_list_.end() - n, free_list_.end());
  std::reverse(blocks.begin(), blocks.end());  // back() first
  free_list_.resize(free_list_.size() - n);
  for (int32_t id : blocks) ref_counts_[id] = 1;
  return blocks;
}

absl::Status BlockPool::Free(absl::Span<const int32_t> ids) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckIds(ids, "Free"); !s.ok()) return s;
  const std::vector<std::pair<int32_t, int32_t>> counts = CountIds(ids);
  for (const auto& [id, times] : counts) {
    if (ref_counts_[id] < times) {
      return absl::FailedPreconditionError(
          absl::StrCat("Free: block ", id, " has ", ref_counts_[id], " reference(s) but is freed ",
                       times, " time(s) (double free)"));
    }
  }
  for (int32_t id : ids) {
    if (--ref_counts_[id] == 0) free_list_.push_back(id);
  }
  return absl::OkStatus();
}

absl::Status BlockPool::AddRef(absl::Span<const int32_t> ids) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckIds(ids, "AddRef"); !s.ok()) return s;
  const std::vector<std::pair<int32_t, int32_t>> counts = CountIds(ids);
  for (const auto& [id, times] : counts) {
    if (ref_counts_[id] == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("AddRef: block ", id, " is free; allocate it first"));
    }
    if (ref_counts_[id] > std::numeric_limits<int32_t>::max() - times) {
      return absl::FailedPreconditionError(
          absl::StrCat("AddRef: block ", id, " reference count would overflow"));
    }
  }
  for (const auto& [id, times] : counts) ref_counts_[id] += times;
  return absl::OkStatus();
}

absl::StatusOr<int32_t> BlockPool::RefCount(int32_t id) const {
  absl::MutexLock lock(&mu_);
  const int32_t one_id[] = {id};
  if (absl::Status s = CheckIds(one_id, "RefCount"); !s.ok()) return s;
  return ref_counts_[id];
}

int32_t BlockPool::num_free() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int32_t>(free_list_.size());
}

}  // namespace kvstream
