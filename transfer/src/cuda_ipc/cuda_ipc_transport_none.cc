// The cuda_ipc transport in builds without CUDA: it cannot be created.
#include "absl/status/status.h"
#include "kvstream/transfer/cuda_ipc_transport.h"

namespace kvstream {

absl::StatusOr<std::unique_ptr<Transport>> CreateCudaIpcTransport(
    const CudaIpcTransportOptions& /*options*/) {
  return absl::FailedPreconditionError(
      "cuda_ipc transport: kvstream was built without CUDA (no nvcc when it was configured, "
      "or KVSTREAM_CUDA=OFF)");
}

size_t CudaIpcOpenMappingCount(Transport& /*transport*/) { return 0; }

}  // namespace kvstream
