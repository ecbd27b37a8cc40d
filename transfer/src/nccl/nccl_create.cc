// Creating the nccl transport (nccl_transport.h): options checked, the GPU, NCCL and the
// copy kernel's shape read, the ordering stream and the side-connection listener set up.
#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "cuda_ipc/copy_kernel.h"
#include "cuda_ipc/cuda_ipc_memory.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/status_macros.h"
#include "nccl/nccl_api.h"
#include "nccl/nccl_transport_impl.h"
#include "transport_uid.h"

namespace kvstream {

absl::StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(
    const NcclTransportOptions& options) {
  RETURN_IF_ERROR(ValidateNcclTransportOptions(options));
  absl::Status available = CudaAvailability();
  if (!available.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("nccl transport: ", available.message()));
  }
  const int count = GpuCount();
  if (options.device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("nccl transport: device ", options.device,
                                                   " of ", count, " GPUs"));
  }
  CudaDeviceScope scope(options.device);
  RETURN_IF_ERROR(scope.status());
  internal::NcclSetup setup;
  setup.options = options;
  ASSIGN_OR_RETURN(setup.nccl_version, internal::NcclLibraryVersion());
  ASSIGN_OR_RETURN(setup.device_uuid, internal::DeviceUuid(options.device));
  int sms = 0;
  RETURN_IF_ERROR(CudaErrorToStatus(
      static_cast<int>(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, options.device)),
      "cudaDeviceGetAttribute(multiprocessors)"));
  ASSIGN_OR_RETURN(const int fit,
                   internal::IpcSegmentCopyMaxCtasPerSm(internal::IpcCopyUnit::kCta, 8));
  setup.copy_grid = options.copy_ctas > 0 ? options.copy_ctas
                                          : std::max(1, sms * std::max(1, std::min(2, fit)));
  ASSIGN_OR_RETURN(setup.order, internal::IpcStream::Create());
  ASSIGN_OR_RETURN(setup.listener, ListenTcp(options.listen_host, options.listen_port));
  ASSIGN_OR_RETURN(setup.port, BoundTcpPort(setup.listener.get()));
  setup.uid = internal::NewTransportUid();
  return std::unique_ptr<Transport>(new internal::NcclTransport(std::move(setup)));
}

bool BuiltWithNccl() { return true; }

size_t NcclLiveCommunicatorCount(Transport& transport) {
  auto* nccl = dynamic_cast<internal::NcclTransport*>(&transport);
  return nccl == nullptr ? 0 : nccl->LiveCommunicatorCount();
}

}  // namespace kvstream
