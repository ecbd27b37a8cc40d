// The cuda_ipc transport's copy kernel, as the host sees it (no CUDA header): one launch
// copies every segment of a write, device to device (the destination usually being another
// process's memory mapped through CUDA IPC).
//
//   segments: [num_segments] IpcCopySegment, in device memory, lengths > 0, and
//             segments[i].first_chunk = sum over j < i of ceil(length_j / chunk bytes)
//   chunk bytes = kIpcCopyThreads * vectors_per_thread * 16
//
// Work is cut into chunks (a segment's last chunk may be short); each CTA copies a
// contiguous run of about num_chunks / grid chunks, so a long segment is spread over many
// CTAs and many short ones are batched into one. Within a chunk each thread loads
// vectors_per_thread 16-byte vectors before storing them (several loads in flight per
// thread); a segment whose source and destination are not 16-byte aligned alike is copied
// byte by byte, and the unaligned head and tail of an aligned-alike one too.
#ifndef KVSTREAM_TRANSFER_CUDA_IPC_COPY_KERNEL_H_
#define KVSTREAM_TRANSFER_CUDA_IPC_COPY_KERNEL_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvstream {
namespace internal {

inline constexpr int kIpcCopyThreads = 256;

// One entry of the segment table; 32 bytes, the layout the kernel reads.
struct IpcCopySegment {
  uint64_t src = 0;  // device addresses
  uint64_t dst = 0;
  uint64_t length = 0;
  uint64_t first_chunk = 0;
};
static_assert(sizeof(IpcCopySegment) == 32, "the kernel reads 32-byte entries");

struct IpcCopyParams {
  const IpcCopySegment* segments = nullptr;  // device memory
  uint32_t num_segments = 0;
  uint64_t num_chunks = 0;
};

// Whether the kernel has a variant for `vectors_per_thread` (2, 4 or 8).
bool IpcCopyVectorsSupported(int vectors_per_thread);

inline uint64_t IpcCopyChunkBytes(int vectors_per_thread) {
  return static_cast<uint64_t>(kIpcCopyThreads) * static_cast<uint64_t>(vectors_per_thread) * 16;
}

// How many CTAs of the variant fit on one SM of the current device.
absl::StatusOr<int> IpcCopyMaxCtasPerSm(int vectors_per_thread);

// Enqueues the kernel on `stream` (a cudaStream_t) with `grid` CTAs. Never blocks.
// REQUIRES: IpcCopyVectorsSupported(vectors_per_thread), grid > 0, params as above.
absl::Status LaunchIpcCopy(const IpcCopyParams& params, int vectors_per_thread, int grid,
                           void* stream);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_CUDA_IPC_COPY_KERNEL_H_
