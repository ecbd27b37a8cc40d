// The nccl transport in builds without CUDA or without NCCL: options are still checked, and
// creation says why it cannot be done.
#include "kvstream/transfer/nccl_transport.h"

#include "kvstream/common/status_macros.h"

namespace kvstream {

absl::StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(
    const NcclTransportOptions& options) {
  RETURN_IF_ERROR(ValidateNcclTransportOptions(options));
  return absl::FailedPreconditionError(
      "nccl transport: kvstream was built without NCCL (no CUDA compiler, KVSTREAM_CUDA=OFF, "
      "or no nccl.h and libnccl when it was configured: set NCCL_ROOT)");
}

bool BuiltWithNccl() { return false; }

size_t NcclLiveCommunicatorCount(Transport& /*transport*/) { return 0; }

}  // namespace kvstream
