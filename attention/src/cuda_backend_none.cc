// The CUDA attention backend's entry points in builds without CUDA: they exist so that
// callers link in every build, and say why no CUDA backend can be had.
#include "kvstream/attention/cuda_attention.h"

namespace kvstream {

absl::StatusOr<std::unique_ptr<AttentionBackend>> CreateCudaAttentionBackend(
    const CudaBackendOptions& /*options*/) {
  return absl::FailedPreconditionError(
      "cuda attention backend: kvstream was built without CUDA (KVSTREAM_CUDA=OFF or no nvcc)");
}

CudaAttentionBackend* AsCudaAttentionBackend(AttentionBackend* /*backend*/) { return nullptr; }

}  // namespace kvstream
