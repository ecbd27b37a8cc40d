// The CUDA attention kernels' launchers: one per kernel family, each taking the flattened
// params (kernel_params.h), enqueuing on `stream` without waiting, and returning the launch
// error as a Status. Callers validate first (MakePagedKernelParams); launchers only check
// the limits of their kernel (head sizes, dtypes) and name what they do not support.
#ifndef KVSTREAM_ATTENTION_CUDA_LAUNCHERS_H_
#define KVSTREAM_ATTENTION_CUDA_LAUNCHERS_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "cuda/kernel_params.h"
#include "kvstream/common/dtype.h"

namespace kvstream {
namespace internal {

// Varlen prefill / chunked prefill (and any query length, decode included) over the paged
// cache: flash attention on tensor cores. q and out dtypes: float16 or bfloat16 (q_dtype ==
// out_dtype); cache: the same 16-bit dtype as q, or fp8 e4m3 / e5m2.
absl::Status LaunchPrefillAttention(const PagedKernelParams& params, DType q_dtype,
                                    DType out_dtype, DType cache_dtype, cudaStream_t stream);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_LAUNCHERS_H_
