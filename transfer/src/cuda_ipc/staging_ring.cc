// The cuda_ipc staging ring (staging_ring.h).
#include "cuda_ipc/staging_ring.h"

#include <cuda_runtime.h>

#include "kvstream/common/cuda_status.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {

absl::StatusOr<std::unique_ptr<StagingRing>> StagingRing::Create(size_t capacity) {
  const size_t bytes = capacity * sizeof(IpcCopySegment);
  ASSIGN_OR_RETURN(DeviceBuffer host, DeviceBuffer::Create(bytes, MemoryKind::kPinned));
  ASSIGN_OR_RETURN(DeviceBuffer device, DeviceBuffer::Create(bytes, MemoryKind::kDevice));
  // cudaMallocHost memory is mapped (unified addressing, which the transport requires);
  // asked rather than assumed.
  void* mapped = nullptr;
  const cudaError_t e = cudaHostGetDevicePointer(&mapped, host.data(), 0);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return CudaErrorToStatus(static_cast<int>(e),
                             "cuda_ipc staging ring: cudaHostGetDevicePointer");
  }
  return std::unique_ptr<StagingRing>(new StagingRing(
      capacity, std::move(host), std::move(device), static_cast<const IpcCopySegment*>(mapped)));
}

std::optional<size_t> StagingRing::Reserve(size_t n) {
  if (n == 0 || n > capacity_) return std::nullopt;
  size_t begin = 0;
  if (!reserved_.empty()) {
    const size_t tail = reserved_.front().first;  // oldest reservation still in use
    const size_t head = reserved_.back().second;  // just past the newest
    // Wrapped when the newest run starts before the oldest one.
    const bool wrapped = reserved_.back().first < reserved_.front().first;
    if (!wrapped) {
      // In use: [tail, head). Free: [head, capacity) and [0, tail).
      if (capacity_ - head >= n) {
        begin = head;
      } else if (tail >= n) {
        begin = 0;
      } else {
        return std::nullopt;
      }
    } else {
      // Wrapped: in use [tail, capacity) and [0, head). Free: [head, tail).
      if (tail - head >= n) {
        begin = head;
      } else {
        return std::nullopt;
      }
    }
  }
  reserved_.emplace_back(begin, begin + n);
  return begin;
}

void StagingRing::ReleaseOldest() {
  if (!reserved_.empty()) reserved_.pop_front();
}

void StagingRing::ReleaseNewest() {
  if (!reserved_.empty()) reserved_.pop_back();
}

}  // namespace internal
}  // namespace kvstream
