// The launcher of the segment copy kernel (segment_copy.h, segment_copy.cuh).
#include <cuda_runtime.h>

#include <algorithm>

#include "ucx/segment_copy.cuh"

namespace kvstream {
namespace internal {

int LaunchSegmentCopy(const SegmentCopyParams& params, void* stream) {
  if (params.count == 0) return static_cast<int>(cudaSuccess);
  if (params.src == nullptr || params.dst == nullptr || params.entries == nullptr) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const uint32_t ctas =
      params.ctas != 0 ? params.ctas : std::min(params.count, kSegmentCopyMaxCtas);
  SegmentCopyKernel<<<ctas, kSegmentCopyThreads, 0, static_cast<cudaStream_t>(stream)>>>(params);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace internal
}  // namespace kvstream
