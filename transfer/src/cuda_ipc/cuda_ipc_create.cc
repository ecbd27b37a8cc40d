// Creating the cuda_ipc transport (cuda_ipc_transport.h): options checked, the device's
// shape read, the copy stream(s), the staging ring and the notification socket set up.
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cuda_ipc/copy_kernel.h"
#include "cuda_ipc/cuda_ipc_memory.h"
#include "cuda_ipc/cuda_ipc_transport_impl.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/status_macros.h"
#include "transport_uid.h"

namespace kvstream {
namespace {

absl::Status CudaCall(cudaError_t e, absl::string_view what) {
  return CudaErrorToStatus(static_cast<int>(e), what);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateCudaIpcTransport(
    const CudaIpcTransportOptions& options) {
  using internal::CudaIpcSetup;
  if (options.device < 0) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc: device ", options.device));
  }
  if (options.staging_segments == 0 ||
      options.staging_segments > kMaxCudaIpcStagingSegments) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc: staging_segments ",
                                                   options.staging_segments, " outside 1..",
                                                   kMaxCudaIpcStagingSegments));
  }
  if (options.ctas_per_sm < 0 || options.ctas_per_sm > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda_ipc: ctas_per_sm ", options.ctas_per_sm, " outside 0..64"));
  }
  if (!internal::IpcCopyVectorsSupported(options.vectors_per_thread)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_ipc: vectors_per_thread ", options.vectors_per_thread, " (2, 4 or 8)"));
  }
  if (options.kernel != CudaIpcKernel::kChunked &&
      options.kernel != CudaIpcKernel::kCtaPerSegment &&
      options.kernel != CudaIpcKernel::kWarpPerSegment &&
      options.kernel != CudaIpcKernel::kWideCtaPerSegment) {
    return absl::InvalidArgumentError("cuda_ipc: unknown kernel");
  }
  if (options.table != CudaIpcTableMode::kStreamCopy &&
      options.table != CudaIpcTableMode::kSideStreamCopy &&
      options.table != CudaIpcTableMode::kZeroCopy && options.table != CudaIpcTableMode::kParams &&
      options.table != CudaIpcTableMode::kAuto) {
    return absl::InvalidArgumentError("cuda_ipc: unknown table mode");
  }
  if (options.kernel == CudaIpcKernel::kChunked && options.table == CudaIpcTableMode::kParams) {
    return absl::InvalidArgumentError(
        "cuda_ipc: the chunked kernel searches its table and cannot take it in its parameters "
        "(table kParams needs a per-segment kernel)");
  }
  const size_t piece = options.max_piece_bytes;
  if (piece < (size_t{4} << 10) || piece > (size_t{1} << 30) || (piece & (piece - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_ipc: max_piece_bytes ", options.max_piece_bytes,
        " is not a power of two from 4 KiB to 1 GiB"));
  }
  if (options.shutdown_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("cuda_ipc: negative shutdown_timeout");
  }
  absl::Status available = CudaAvailability();
  if (!available.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda_ipc transport: ", available.message()));
  }
  const int count = GpuCount();
  if (options.device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc transport: device ",
                                                   options.device, " of ", count, " GPUs"));
  }
  CudaDeviceScope scope(options.device);
  RETURN_IF_ERROR(scope.status());
  int unified = 0;
  int sms = 0;
  RETURN_IF_ERROR(CudaCall(
      cudaDeviceGetAttribute(&unified, cudaDevAttrUnifiedAddressing, options.device),
      "cudaDeviceGetAttribute(unified addressing)"));
  RETURN_IF_ERROR(CudaCall(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, options.device),
      "cudaDeviceGetAttribute(multiprocessors)"));
  if (unified == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda_ipc transport: device ", options.device,
        " has no unified addressing, which CUDA IPC requires"));
  }
  CudaIpcSetup setup;
  setup.options = options;
  int fit = 0;
  if (options.kernel == CudaIpcKernel::kChunked) {
    ASSIGN_OR_RETURN(fit, internal::IpcCopyMaxCtasPerSm(options.vectors_per_thread));
  } else {
    ASSIGN_OR_RETURN(fit, internal::IpcSegmentCopyMaxCtasPerSm(
                              internal::IpcUnitOf(options.kernel), options.vectors_per_thread));
  }
  const int per_sm = options.ctas_per_sm == 0 ? fit : std::min(options.ctas_per_sm, fit);
  setup.grid = std::max(1, sms * std::max(1, per_sm));
  ASSIGN_OR_RETURN(setup.device_uuid, internal::DeviceUuid(options.device));
  ASSIGN_OR_RETURN(setup.stream, internal::IpcStream::Create());
  if (options.table == CudaIpcTableMode::kSideStreamCopy ||
      options.table == CudaIpcTableMode::kAuto) {
    ASSIGN_OR_RETURN(setup.side_stream, internal::IpcStream::Create());
    ASSIGN_OR_RETURN(setup.table_ready, CudaEvent::Create(/*enable_timing=*/false));
  }
  ASSIGN_OR_RETURN(setup.ring, internal::StagingRing::Create(options.staging_segments));
  setup.uid = internal::NewTransportUid();
  setup.socket_name = absl::StrCat("kvstream-cuda-ipc-", absl::Hex(setup.uid, absl::kZeroPad16));
  ASSIGN_OR_RETURN(setup.listener, ListenUnix(setup.socket_name));
  return std::unique_ptr<Transport>(new internal::CudaIpcTransport(std::move(setup)));
}

size_t CudaIpcOpenMappingCount(Transport& transport) {
  auto* ipc = dynamic_cast<internal::CudaIpcTransport*>(&transport);
  return ipc == nullptr ? 0 : ipc->OpenMappingCount();
}

void CudaIpcSetCopyTiming(Transport& transport, bool on) {
  auto* ipc = dynamic_cast<internal::CudaIpcTransport*>(&transport);
  if (ipc != nullptr) ipc->SetCopyTiming(on);
}

std::vector<CudaIpcCopyTiming> CudaIpcTakeCopyTimings(Transport& transport) {
  auto* ipc = dynamic_cast<internal::CudaIpcTransport*>(&transport);
  return ipc == nullptr ? std::vector<CudaIpcCopyTiming>() : ipc->TakeCopyTimings();
}

}  // namespace kvstream
