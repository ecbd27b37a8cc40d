// CacheUpdateCuda in builds without CUDA: the function exists so that callers link in every
// build, and says why it cannot run.
#include "kvstream/cache/cache_update.h"

namespace kvstream {

absl::Status CacheUpdateCuda(const CacheUpdateParams& /*params*/, void* /*cuda_stream*/) {
  return absl::FailedPreconditionError(
      "CacheUpdateCuda: kvstream was built without CUDA (KVSTREAM_CUDA=OFF or no nvcc)");
}

}  // namespace kvstream
