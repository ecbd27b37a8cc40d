// The segment copy kernel (segment_copy.h): CTA b copies entries b, b + gridDim.x, ...;
// its threads stride through an entry with the widest access every byte of it allows:
// 16-byte vectors when source, destination and length are all 16-byte aligned (blocks of a
// KV cache always are: the planner keeps staging offsets aligned), else 8, 4 or 1 bytes.
//
//   entries: [count] {src_offset, dst_offset, length}, length <= kStagedPieceBytes
//   src, dst: flat byte buffers
#ifndef KVSTREAM_TRANSFER_SRC_UCX_SEGMENT_COPY_CUH_
#define KVSTREAM_TRANSFER_SRC_UCX_SEGMENT_COPY_CUH_

#include <cstdint>

#include "ucx/segment_copy.h"

namespace kvstream {
namespace internal {

template <typename Word>
__device__ __forceinline__ void CopyWords(const char* __restrict__ src, char* __restrict__ dst,
                                          uint64_t length) {
  const Word* s = reinterpret_cast<const Word*>(src);
  Word* d = reinterpret_cast<Word*>(dst);
  const uint64_t words = length / sizeof(Word);
  for (uint64_t i = threadIdx.x; i < words; i += blockDim.x) d[i] = s[i];
}

__global__ void SegmentCopyKernel(SegmentCopyParams p) {
  for (uint32_t e = blockIdx.x; e < p.count; e += gridDim.x) {
    const SegmentCopyEntry entry = p.entries[e];
    const char* src = p.src + entry.src_offset;
    char* dst = p.dst + entry.dst_offset;
    const uint64_t bits = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
                          entry.length;
    if ((bits & 15) == 0) {
      CopyWords<int4>(src, dst, entry.length);
    } else if ((bits & 7) == 0) {
      CopyWords<uint64_t>(src, dst, entry.length);
    } else if ((bits & 3) == 0) {
      CopyWords<uint32_t>(src, dst, entry.length);
    } else {
      CopyWords<unsigned char>(src, dst, entry.length);
    }
  }
}

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_UCX_SEGMENT_COPY_CUH_
