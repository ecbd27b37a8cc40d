// The cuda_ipc transport's staging ring: segment tables of posted writes, in pinned host
// memory (where the host writes them, and where a zero-copy kernel reads them through
// mapped()) mirrored by device memory (where the copy kernel reads them after one
// cudaMemcpyAsync per write). A write reserves a contiguous run of entries;
// runs are released oldest first, when the write's copy has completed (the copies run in
// post order on one stream, so completions come oldest first too).
//
// Thread-compatible: the transport calls it under its lock.
#ifndef KVSTREAM_TRANSFER_CUDA_IPC_STAGING_RING_H_
#define KVSTREAM_TRANSFER_CUDA_IPC_STAGING_RING_H_

#include <cstddef>
#include <deque>
#include <memory>
#include <optional>
#include <utility>

#include "absl/status/statusor.h"
#include "cuda_ipc/copy_kernel.h"
#include "kvstream/common/cuda_resources.h"

namespace kvstream {
namespace internal {

class StagingRing {
 public:
  // `capacity` entries of pinned host and device memory on the current device.
  // ResourceExhausted when the memory cannot be had.
  static absl::StatusOr<std::unique_ptr<StagingRing>> Create(size_t capacity);

  size_t capacity() const { return capacity_; }
  // Reserves `n` contiguous entries (n > 0): the index of the first, or nullopt when they do
  // not fit now. Never blocks.
  std::optional<size_t> Reserve(size_t n);
  // Releases the oldest reservation (no-op when there is none).
  void ReleaseOldest();
  // Takes back the newest reservation, which nothing has read yet (no-op when none).
  void ReleaseNewest();
  bool idle() const { return reserved_.empty(); }

  IpcCopySegment* host(size_t index) const { return host_.data_as<IpcCopySegment>() + index; }
  IpcCopySegment* device(size_t index) const {
    return device_.data_as<IpcCopySegment>() + index;
  }
  // The device's address of host(index) (pinned memory is mapped into the device's space).
  const IpcCopySegment* mapped(size_t index) const { return mapped_ + index; }

 private:
  StagingRing(size_t capacity, DeviceBuffer host, DeviceBuffer device,
              const IpcCopySegment* mapped)
      : capacity_(capacity), host_(std::move(host)), device_(std::move(device)),
        mapped_(mapped) {}

  size_t capacity_;
  DeviceBuffer host_;    // pinned
  DeviceBuffer device_;
  const IpcCopySegment* mapped_;
  std::deque<std::pair<size_t, size_t>> reserved_;  // [begin, end), oldest first
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_CUDA_IPC_STAGING_RING_H_
