// The staged path's one copy kernel (private to transfer/): copies a table of pieces from
// one device buffer to another in one launch, the gather on the sender (region -> staging)
// and the scatter on the receiver (staging -> region). Declared without CUDA headers so the
// engine's host code calls it through a plain params struct; defined in segment_copy.cu
// (builds with CUDA only).
#ifndef KVSTREAM_TRANSFER_SRC_UCX_SEGMENT_COPY_H_
#define KVSTREAM_TRANSFER_SRC_UCX_SEGMENT_COPY_H_

#include <cstdint>

namespace kvstream {
namespace internal {

// One piece: `length` bytes from src + src_offset to dst + dst_offset.
struct SegmentCopyEntry {
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t length = 0;
};

// entries: [count] in device memory. src, dst: device pointers. Pieces must not overlap in
// dst (the kernel copies them concurrently, in no particular order).
struct SegmentCopyParams {
  const char* src = nullptr;
  char* dst = nullptr;
  const SegmentCopyEntry* entries = nullptr;
  uint32_t count = 0;
  // Grid size; 0: min(count, kSegmentCopyMaxCtas).
  uint32_t ctas = 0;
};

inline constexpr uint32_t kSegmentCopyMaxCtas = 1024;
inline constexpr uint32_t kSegmentCopyThreads = 256;

// Enqueues the copy on `stream` (a cudaStream_t). Returns the launch's cudaError_t as an
// int (0: success); count 0 enqueues nothing and returns 0. Never blocks.
int LaunchSegmentCopy(const SegmentCopyParams& params, void* stream);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_UCX_SEGMENT_COPY_H_
