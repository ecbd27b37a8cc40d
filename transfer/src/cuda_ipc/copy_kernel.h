// The cuda_ipc transport's copy kernels, as the host sees them (no CUDA header): one launch
// copies every segment of a write, device to device (the destination usually being another
// process's memory mapped through CUDA IPC). Two shapes (CudaIpcKernel in
// cuda_ipc_transport.h):
//
// Chunked (LaunchIpcCopy): work is cut into chunks of kIpcCopyThreads * vectors_per_thread
// * 16 bytes (a segment's last chunk may be short); each CTA copies a contiguous run of about
// num_chunks / grid chunks, finding its first segment with a warp-wide search of the
// table's first_chunk prefix sums, so a long segment is spread over many CTAs and many
// short ones are batched into one.
//   segments: [num_segments] IpcCopySegment, lengths > 0, and
//             segments[i].first_chunk = sum over j < i of ceil(length_j / chunk bytes)
//
// Per segment (LaunchIpcSegmentCopy): each unit (a CTA, a warp, or a 1024-thread CTA) takes
// whole table entries
// in a grid-stride loop (entry u, u + units, ...), loading the next entry while it copies
// the current one; no search and no prefix sums. The host cuts segments longer than its
// piece size into several entries, so that a few long segments still spread over the GPU.
// The table is read from device memory, from mapped pinned host memory (zero-copy: read
// with cache-volatile loads, since the host rewrites ring entries between launches), or
// from the launch's own parameters (IpcParamTable, up to kIpcParamSegments entries).
//
// Within a pass each thread loads vectors_per_thread 16-byte vectors before storing them
// (several loads in flight per thread); a segment whose source and destination are not
// 16-byte aligned alike is copied byte by byte, and the unaligned head and tail of an
// aligned-alike one too.
#ifndef KVSTREAM_TRANSFER_CUDA_IPC_COPY_KERNEL_H_
#define KVSTREAM_TRANSFER_CUDA_IPC_COPY_KERNEL_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvstream {
namespace internal {

inline constexpr int kIpcCopyThreads = 256;

// One entry of the ring's segment table; 32 bytes, the layout the kernels read (first_chunk
// only by the chunked one).
struct IpcCopySegment {
  uint64_t src = 0;  // device addresses
  uint64_t dst = 0;
  uint64_t length = 0;
  uint64_t first_chunk = 0;
};
static_assert(sizeof(IpcCopySegment) == 32, "the kernel reads 32-byte entries");

struct IpcCopyParams {
  // Device memory, or (zero_copy) the device address of mapped pinned memory, read with
  // cache-volatile loads.
  const IpcCopySegment* segments = nullptr;
  uint32_t num_segments = 0;
  bool zero_copy = false;
  uint64_t num_chunks = 0;
};

// Whether the kernels have a variant for `vectors_per_thread` (2, 4 or 8).
bool IpcCopyVectorsSupported(int vectors_per_thread);

inline uint64_t IpcCopyChunkBytes(int vectors_per_thread) {
  return static_cast<uint64_t>(kIpcCopyThreads) * static_cast<uint64_t>(vectors_per_thread) * 16;
}

// How many CTAs of the chunked kernel's variant fit on one SM of the current device.
absl::StatusOr<int> IpcCopyMaxCtasPerSm(int vectors_per_thread);

// Enqueues the chunked kernel on `stream` (a cudaStream_t) with `grid` CTAs. Never blocks.
// REQUIRES: IpcCopyVectorsSupported(vectors_per_thread), grid > 0, params as above.
absl::Status LaunchIpcCopy(const IpcCopyParams& params, int vectors_per_thread, int grid,
                           void* stream);

// --- Per-segment kernels ---

// An entry of a table passed in the kernel's parameters: 24 bytes, so that a layer of
// 1024 KV blocks (8k tokens of 16-token blocks, K and V) fits in the 32764 bytes of
// parameters that CUDA 12.1+ allows on Volta and later.
struct IpcParamSegment {
  uint64_t src = 0;
  uint64_t dst = 0;
  uint64_t length = 0;
};
static_assert(sizeof(IpcParamSegment) == 24, "the kernel reads 24-byte entries");

// Tables in the parameters come in three sizes, the smallest that holds a write's entries
// (the whole struct travels with every launch, used or not).
inline constexpr uint32_t kIpcParamSegmentsSmall = 64;
inline constexpr uint32_t kIpcParamSegmentsMedium = 256;
inline constexpr uint32_t kIpcParamSegments = 1360;  // 8 + 1360 * 24 = 32648 bytes
template <uint32_t kCapacity>
struct IpcParamTable {
  uint32_t num_segments = 0;
  uint32_t unused = 0;
  IpcParamSegment segments[kCapacity];
};
static_assert(sizeof(IpcParamTable<kIpcParamSegments>) <= 32764,
              "the largest table must fit in the kernel parameter limit");

// Where a per-segment launch finds its table.
enum class IpcTableSource {
  kDevice,    // IpcCopySegment entries in device memory
  kZeroCopy,  // IpcCopySegment entries in mapped pinned host memory
  kParams,    // IpcParamTable in the parameters (see LaunchIpcSegmentCopyParams)
};

// The unit that takes whole entries: a CTA of kIpcCopyThreads threads, one warp (of such a
// CTA), or a wide CTA of kIpcWideCtaThreads threads.
enum class IpcCopyUnit { kCta, kWarp, kWideCta };
inline constexpr int kIpcWarpsPerCta = kIpcCopyThreads / 32;
inline constexpr int kIpcWideCtaThreads = 1024;

// Threads per CTA of a per-segment launch of unit kUnit.
template <IpcCopyUnit kUnit>
inline constexpr int kIpcUnitCtaThreads =
    kUnit == IpcCopyUnit::kWideCta ? kIpcWideCtaThreads : kIpcCopyThreads;

// How many CTAs of a per-segment variant fit on one SM of the current device.
absl::StatusOr<int> IpcSegmentCopyMaxCtasPerSm(IpcCopyUnit unit, int vectors_per_thread);

// Enqueues a per-segment kernel reading `num_segments` IpcCopySegment entries at
// `segments` (device memory, or the device address of mapped pinned memory for kZeroCopy)
// with `grid` CTAs. Never blocks. REQUIRES: source is not kParams, lengths > 0.
absl::Status LaunchIpcSegmentCopy(const IpcCopySegment* segments, uint32_t num_segments,
                                  IpcTableSource source, IpcCopyUnit unit,
                                  int vectors_per_thread, int grid, void* stream);

// Enqueues a per-segment kernel whose table is `table` (num_segments entries, lengths > 0)
// passed by value in the parameters, in the smallest of the three sizes that holds it; the
// first num_segments entries of `table` are read. Never blocks.
// REQUIRES: table.num_segments <= kIpcParamSegments.
absl::Status LaunchIpcSegmentCopyParams(const IpcParamTable<kIpcParamSegments>& table,
                                        IpcCopyUnit unit, int vectors_per_thread, int grid,
                                        void* stream);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_CUDA_IPC_COPY_KERNEL_H_
